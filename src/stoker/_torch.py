"""PyTorch, loaded by the modules that use it (the Loader's torch output, the device stage, `prefetch`).

`pip install stoker` alone packs, inspects, verifies and loads NumPy batches (`Loader(device="numpy")`)
without torch, and a user's existing torch (CPU, CUDA or Apple build) is never replaced. Without
torch, `torch` here is a stand-in: the modules that mention it still import, attribute chains such as
`torch.cuda.is_available` resolve to further stand-ins, `isinstance(x, torch.Tensor)` is False (nothing
is a tensor where torch is absent), and the first call (`torch.empty(...)`, `torch.device("cuda")`)
raises `MissingDependencyError` with the install command for each platform. `HAVE_TORCH` says which.
"""

from __future__ import annotations

from typing import Any, NoReturn

from .errors import MissingDependencyError

TORCH_INSTALL_HINT = (
    "install the PyTorch build for your machine, then import again: "
    "CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu ; "
    "NVIDIA CUDA (Linux, Windows): pip install torch (or the command pytorch.org gives for your CUDA version) ; "
    "Apple silicon (macOS): pip install torch ; "
    "or pip install 'stoker[torch]' to let pip choose"
)


def missing_torch(what: str, instead: str = "") -> MissingDependencyError:
    """The error for `what` needing torch where it is not installed (`instead`: a way without it)."""
    other = f"{instead}, or " if instead else ""
    return MissingDependencyError(f"{what} needs PyTorch, which is not installed; {other}{TORCH_INSTALL_HINT}",
                                  package="torch")


class _Absent:
    """torch (or one of its attributes) where torch is not installed: calling it raises
    `MissingDependencyError`; no object is an instance of it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Absent":
        if attr.startswith("__"):   # copy, pickle and friends probing for protocols
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise missing_torch(f"{self._name}() (a torch tensor output, a device or DeviceOptions, prefetch)")

    def __instancecheck__(self, obj: Any) -> bool:
        return False

    def __subclasscheck__(self, cls: Any) -> bool:
        return False

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{self._name}: PyTorch is not installed>"


try:
    import torch
    HAVE_TORCH = True
except ModuleNotFoundError as exc:
    if exc.name != "torch":  # torch is there but one of its own dependencies is missing: show that
        raise
    torch = _Absent("torch")  # type: ignore[assignment]
    HAVE_TORCH = False

__all__ = ["HAVE_TORCH", "TORCH_INSTALL_HINT", "missing_torch", "torch"]
