"""A CPU stand-in for torch.cuda.set_sync_debug_mode("error"): run code on the "meta" device (shapes
only, no data) and record every call that, on a GPU, would block the host until the GPU catches up."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose CUDA kernels read data back to the host: .item()/int()/bool(), data-dependent output sizes
_READ_BACK = ("_local_scalar_dense", "bincount", "nonzero", "masked_select", "unique", "_unique")


def _blocking_upload(name: str, args: tuple, kwargs: dict, out: Any) -> bool:
    """A copy from host memory to a device without non_blocking=True (on CUDA: a copy and a stream sync)."""
    if name.startswith("copy_"):
        src, dst = args[1], args[0]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    elif name.startswith("_to_copy"):
        src, dst, non_blocking = args[0], out, kwargs.get("non_blocking", False)
    else:
        return False
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type == "cpu"
            and dst.device.type != "cpu" and not non_blocking)


class HostSyncs(TorchDispatchMode):
    """Inside: `seen` lists the ops that would synchronize the host with a GPU (run the code on "meta")."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.__name__
        if name.split(".")[0] in _READ_BACK:
            self.seen.append(name)
            raise RuntimeError(f"{name} reads device data back to the host")
        out = func(*args, **kwargs)
        if _blocking_upload(name, args, kwargs, out):
            self.seen.append(f"{name} (a blocking copy from host memory)")
        return out
