"""Work a render worker leaves for the device thread: a JPEG to decode on the GPU (`GpuJob`). A plain
record, so the loading stage can make it without importing the device wing."""

from __future__ import annotations

from dataclasses import dataclass

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
