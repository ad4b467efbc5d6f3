"""Work a render worker leaves for the device thread: a JPEG to decode on the GPU (`GpuJob`), its bytes
in the batch's one staging buffer (`JpegStaging`). Plain records, so the loading stage can make them
without importing the device wing."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .._torch import torch


@dataclass
class GpuJob:
    """One JPEG for the GPU: where it goes and how it is cropped (a row of the CPU crop plan)."""

    row: int  # row of the batch this sample goes to
    data: torch.Tensor  # 1-D uint8 CPU tensor, writable: the JPEG file bytes
    box: tuple[float, float, float, float]  # crop (top, left, height, width) in full-image pixels (Plan.box row)
    flip: bool  # mirror left-right after resizing
    height: int  # stored full-image size, pixels
    width: int
    key: str  # names the sample in error messages
    # the crop's integer windows (a `transforms.CropWindow`), planned by the worker thread that made the
    # job; None: planned on the device side
    window: Any = None


class JpegStaging:
    """One buffer holding a batch's JPEG bytes back to back (pinned on a CUDA host): the worker threads
    copy each JPEG in at an offset they reserve, and its job's `data` is a view of it, so the decoder
    reads one block of host memory rather than a pageable copy per image.

    The buffer is made by the device thread (pinning is a CUDA call, which worker threads never make)
    and kept with its slot; a JPEG that does not fit gets a private copy (`overflow` counts its bytes)
    and the device thread makes a larger buffer for the slot's next batch. The slot's guard keeps the
    buffer from being refilled while the decoder may still read it."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # 1-D uint8
        self.capacity = buffer.numel()
        self._lock = threading.Lock()
        self.used = 0  # bytes reserved in this batch
        self.overflow = 0  # bytes of this batch's JPEGs that did not fit

    def reset(self) -> None:
        """A new batch (the worker that plans it, before any row is claimed)."""
        self.used = self.overflow = 0

    def put(self, data: Any) -> torch.Tensor:
        """`data` (bytes-like) copied in at the next free offset, as a view of the buffer; a private
        copy when it does not fit."""
        n = len(data)
        with self._lock:
            start = self.used
            fits = start + n <= self.capacity
            if fits:
                self.used = start + n
            else:
                self.overflow += n
        if not fits:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        view = self.buffer[start:start + n]
        view.numpy()[:] = memoryview(data).cast("B")
        return view
