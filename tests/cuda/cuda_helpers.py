"""What the CUDA tests share: whether an optional backend really imports, a GPU-side sleep standing in
for a training step, and a guard that turns every host synchronization into an error."""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

import torch

_cycles_per_ms: list[float] = []


def importable(module: str) -> bool:
    """Whether `module` imports here. A torchvision built for another torch raises RuntimeError
    ("operator torchvision::nms does not exist"), not ImportError, and find_spec says it is there:
    only trying the import tells a test to skip rather than error."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def gpu_decoders() -> list[str]:
    """The GPU JPEG decoder libraries that import here."""
    return [name for name, module in (("torchcodec", "torchcodec.decoders"), ("nvimgcodec", "nvidia.nvimgcodec"))
            if importable(module)]


def gpu_sleep(ms: float) -> None:
    """Queue a kernel that spins for about `ms` milliseconds on the current stream (a stand-in training step)."""
    if not _cycles_per_ms:
        torch.cuda._sleep(1000)  # first launch loads the kernel; keep that out of the measurement
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms.append(10_000_000 / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(max(1, int(ms * _cycles_per_ms[0])))


@contextlib.contextmanager
def no_host_syncs() -> Iterator[None]:
    """Inside: any call that blocks the host on the GPU raises, the implicit ones too (a copy from
    pageable memory, `.item()`, a stream or device synchronize), in every thread (the mode is
    process-wide, so the loader's device thread is covered as well)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)
