"""Work a render worker leaves for the device thread: a JPEG to decode on the GPU (`GpuJob`), its bytes
in the batch's one staging buffer (`JpegStaging`), or a chunk of a batch's GPU rows prepared in one
call (`GpuRows`: crop windows planned over the chunk in NumPy, JPEG bytes gathered into the staging
buffer by one native call). Plain records, so the loading stage can make them without importing the
device wing."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from .. import native
from .._torch import torch
from ..transforms.geometry import CropWindow


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

    def reserve(self, n: int) -> int | None:
        """The offset of `n` bytes reserved for one chunk's JPEGs, or None (counted in `overflow`) when
        they do not fit."""
        with self._lock:
            start = self.used
            if start + n <= self.capacity:
                self.used = start + n
                return start
            self.overflow += n
            return None

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


class PlannedJob(GpuJob):
    """A `GpuJob` made from a `GpuRows` record on the device thread: its key (for error messages only)
    is read from the dataset when asked for."""

    def __init__(self, row: int, data: torch.Tensor, box: tuple, flip: bool, height: int, width: int,
                 window: CropWindow, dataset: Any, index: int) -> None:
        self.row, self.data, self.box, self.flip = row, data, box, flip
        self.height, self.width, self.window = height, width, window
        self._dataset, self._index = dataset, index

    @property  # type: ignore[override]
    def key(self) -> str:
        try:
            return self._dataset.sample(self._index).key
        except Exception:  # noqa: BLE001 - the message still names the sample
            return f"sample {self._index}"


@dataclass(eq=False)
class GpuRows:
    """A chunk of a batch's GPU rows, prepared by a worker thread in one call (`render.Filler.queue_gpu_rows`):
    the rows' JPEGs back to back in `data` (a view of the slot's staging buffer where they fit, else one
    private buffer) at `offsets`, and each row's crop plan and window as arrays. The device thread
    makes the `GpuJob`s it decodes from it (`jobs`)."""

    rows: np.ndarray  # int64 [k]: batch rows
    indices: np.ndarray  # int64 [k]: dataset indices (for error messages)
    data: torch.Tensor  # 1-D uint8: the rows' JPEG bytes
    offsets: np.ndarray  # int64 [k + 1]: row i's bytes are data[offsets[i]:offsets[i + 1]]
    box: np.ndarray  # float64 [k, 4]: crop (top, left, height, width), the plan's box
    flip: np.ndarray  # bool [k]
    heights: np.ndarray  # int64 [k]: stored sizes
    widths: np.ndarray
    src: np.ndarray  # int64 [k, 4]: the crop windows (`transforms.crop_window`), source
    dst: np.ndarray  # int64 [k, 4]: and target
    padded: np.ndarray  # bool [k]
    dataset: Any

    def jobs(self) -> list[GpuJob]:
        """One `GpuJob` per row (views of `data`), as `Filler.queue_gpu` makes them one at a time."""
        data, off = self.data, self.offsets.tolist()
        return [PlannedJob(row, data[off[i]:off[i + 1]], tuple(box), flip, h, w,
                           CropWindow(tuple(src), tuple(dst), padded), self.dataset, index)
                for i, (row, box, flip, h, w, src, dst, padded, index) in enumerate(zip(
                    self.rows.tolist(), self.box.tolist(), self.flip.tolist(), self.heights.tolist(),
                    self.widths.tolist(), self.src.tolist(), self.dst.tolist(), self.padded.tolist(),
                    self.indices.tolist()))]


_ROW = attrgetter("row")


def slot_jobs(slot: Any, n: int) -> list[GpuJob]:
    """The GPU jobs of the slot's first `n` rows in row order: those made one row at a time
    (`slot.jobs`) and those of its `GpuRows` chunks."""
    jobs = [j for j in slot.jobs[:n] if j is not None]
    for chunk in slot.gpu_rows:
        jobs += chunk.jobs()
    if slot.gpu_rows:
        jobs = [j for j in jobs if j.row < n]
        jobs.sort(key=_ROW)
    return jobs


def cpu_rows(n: int, jobs: list[GpuJob]) -> list[int]:
    """The rows of a batch of `n` that no GPU job writes (`jobs` in row order): rendered on the CPU."""
    taken = {j.row for j in jobs}
    return [r for r in range(n) if r not in taken]


def crop_windows(box: np.ndarray, heights: np.ndarray, widths: np.ndarray, out_h: int, out_w: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`transforms.crop_window(box[i], h[i], w[i], h[i], w[i], out_h, out_w)` for every row at once
    (src and dst int64 [k, 4], padded bool [k]): the same double-precision steps in the same order, and
    np.rint rounds halves to even as round() does, so the same integers. Sizes must be positive."""
    h, w = heights.astype(np.float64), widths.astype(np.float64)
    fy, fx = h / h, w / w
    y0, x0 = box[:, 0] * fy, box[:, 1] * fx
    y1, x1 = y0 + box[:, 2] * fy, x0 + box[:, 3] * fx
    ry0, rx0, ry1, rx1 = np.rint(y0), np.rint(x0), np.rint(y1), np.rint(x1)
    iy0, ix0 = np.minimum(h - 1, np.maximum(0, ry0)), np.minimum(w - 1, np.maximum(0, rx0))
    iy1, ix1 = np.minimum(h, np.maximum(iy0 + 1, ry1)), np.minimum(w, np.maximum(ix0 + 1, rx1))
    padded = (ry0 < 0) | (rx0 < 0) | (ry1 > h) | (rx1 > w)
    src = np.stack([iy0, iy1, ix0, ix1], 1).astype(np.int64)
    dst = np.zeros_like(src)
    dst[:, 1], dst[:, 3] = out_h, out_w
    if padded.any():
        p = padded
        bh, bw = np.maximum(y1[p] - y0[p], 1e-9), np.maximum(x1[p] - x0[p], 1e-9)
        ty0 = np.minimum(out_h - 1, np.maximum(0, np.rint((iy0[p] - y0[p]) * out_h / bh)))
        tx0 = np.minimum(out_w - 1, np.maximum(0, np.rint((ix0[p] - x0[p]) * out_w / bw)))
        ty1 = np.maximum(ty0 + 1, np.minimum(out_h, np.rint((iy1[p] - y0[p]) * out_h / bh)))
        tx1 = np.maximum(tx0 + 1, np.minimum(out_w, np.rint((ix1[p] - x0[p]) * out_w / bw)))
        dst[p] = np.stack([ty0, ty1, tx0, tx1], 1).astype(np.int64)
    return src, dst, padded


def gpu_rows(dataset: Any, indices: np.ndarray, r0: int, geometry: Any, heights: np.ndarray, widths: np.ndarray,
             staging: JpegStaging | None, out_size: tuple[int, int]) -> tuple[GpuRows | None, np.ndarray]:
    """Batch rows r0.. (dataset `indices`) for the GPU in a few NumPy calls and one native one: which
    are JPEGs of a stored size (`dataset.jpeg_spans`; it may raise), their bytes gathered back to back
    into `staging` (a private buffer when there is none or they do not fit), their crop windows from
    the batch's plan `geometry` (`crop_windows`). Returns the record (None when no row is taken) and
    which rows it took (bool [k]); the others are the caller's, one at a time."""
    idx = np.asarray(indices, np.int64)
    blocks, spans = dataset.jpeg_spans(idx)
    h, w = heights[idx].astype(np.int64), widths[idx].astype(np.int64)
    took = (spans[:, 0] >= 0) & (h > 0) & (w > 0)
    take = np.flatnonzero(took)
    if not len(take):
        return None, took
    spans = np.ascontiguousarray(spans[take])
    offsets = np.zeros(len(take) + 1, np.int64)
    np.cumsum(spans[:, 2] - spans[:, 1], out=offsets[1:])
    total = int(offsets[-1])
    start = staging.reserve(total) if staging is not None else None
    if start is None:   # no staging buffer yet, or it is full: one private buffer for the chunk
        data, start = torch.empty(max(total, 1), dtype=torch.uint8), 0
    else:
        data = staging.buffer
    native.gather_spans(blocks, spans, data.numpy(), offsets[:-1] + start)
    rows = take + r0
    box = np.ascontiguousarray(geometry.box[rows], np.float64)
    src, dst, padded = crop_windows(box, h[take], w[take], *out_size)
    return GpuRows(rows.astype(np.int64), idx[take], data[start:start + total], offsets, box,
                   geometry.flip[rows].astype(bool), h[take], w[take], src, dst, padded, dataset), took
