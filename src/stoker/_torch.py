"""PyTorch, loaded by the modules that need it (the Loader, the device stage, `prefetch`).

`pip install stoker` alone packs, inspects and verifies datasets without torch; the Loader needs it,
and a user's existing torch (CPU, CUDA or Apple build) is never replaced. Without torch, importing
a module that needs it raises `MissingDependencyError` with the install command for each platform.
"""

from __future__ import annotations

from .errors import MissingDependencyError

TORCH_INSTALL_HINT = (
    "install the PyTorch build for your machine, then import again: "
    "CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu ; "
    "NVIDIA CUDA (Linux, Windows): pip install torch (or the command pytorch.org gives for your CUDA version) ; "
    "Apple silicon (macOS): pip install torch ; "
    "or pip install 'stoker[torch]' to let pip choose"
)

try:
    import torch
except ModuleNotFoundError as exc:
    if exc.name != "torch":  # torch is there but one of its own dependencies is missing: show that
        raise
    raise MissingDependencyError(
        f"the stoker Loader, DeviceOptions and prefetch need PyTorch, which is not installed; {TORCH_INSTALL_HINT}",
        package="torch") from None

__all__ = ["TORCH_INSTALL_HINT", "torch"]
