"""Work a render worker leaves for the device thread, on the route's GPU columns: a chunk of a batch's
GPU rows prepared in one call (`GpuRows`: each row planned and its crop windows computed by the native
planner, `RowPlanner`, or from the batch's NumPy plan, `crop_windows`; JPEG bytes gathered into the
batch's staging buffer, `JpegStaging`, by one native call), and a batch's GPU rows as
columns for the device side (`GpuBatch`). A `GpuJob` is the record of one row, made only where one is
needed (a row that fails names its sample through it; the decoder also takes a list of them). Plain
records, so the loading stage can make them without importing the device wing."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import native
from ..dataset import JPEG_ROW
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
    gather each chunk's JPEGs in at an offset they reserve, and its rows' bytes are views of it, so the
    decoder reads one block of host memory rather than a pageable copy per image.

    The buffer is made by the device thread (pinning is a CUDA call, which worker threads never make)
    and kept with its slot; a JPEG that does not fit gets a private copy (`overflow` counts its bytes)
    and the device thread makes a larger buffer for the slot's next batch. The slot's guard keeps the
    buffer from being refilled while the decoder may still read it."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # 1-D uint8
        self.array = buffer.numpy()  # the same memory, as the native gather writes it
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


#: columns of `GpuBatch.geo` (int64): batch row, flip, stored height and width, the crop window's source
#: (y0, y1, x0, x1) and target (y0, y1, x0, x1), padded, planned (the window is known), dataset index
ROW, FLIP, HEIGHT, WIDTH, SRC, DST, PADDED, PLANNED, INDEX = 0, 1, 2, 3, slice(4, 8), slice(8, 12), 12, 13, 14
GEO_COLUMNS = 15
_OUT_COLUMNS = GEO_COLUMNS + 4 + 2 + 3   # int64 words per row that `gpu_rows` plans: geo, box, at, src


@dataclass(eq=False)
class GpuRows:
    """A chunk of a batch's GPU rows, prepared by a worker thread in one call (`render.Filler.queue_gpu_rows`):
    the rows' JPEGs back to back in `data` (the slot's staging buffer where they fit, else one private
    buffer) at `spans`, and each row's crop plan and window as columns (`geo`, `box`), in row order (never
    empty). The device side decodes it as columns (`batch`); a `GpuJob` is made only for a row that needs
    one (`GpuBatch.job`)."""

    data: torch.Tensor  # 1-D uint8: holds the rows' JPEG bytes
    spans: np.ndarray  # int64 [k, 2]: row i's bytes are data[spans[i, 0]:spans[i, 1]]
    geo: np.ndarray  # int64 [k, GEO_COLUMNS]: rows, flips, sizes, crop windows, dataset indices
    box: np.ndarray  # float64 [k, 4]: crop (top, left, height, width), the plan's box
    dataset: Any

    def batch(self) -> "GpuBatch":
        """The chunk as columns (no per-row object)."""
        k = self.geo.shape[0]
        return GpuBatch(self.geo, self.box, self.data, self.spans, [None] * k, [self.dataset] * k)


class GpuBatch:
    """A batch's (or a chunk's) GPU rows as columns, in the order they are decoded: the device side
    passes these around rather than one `GpuJob` per row. The numbers are one int64 matrix (`geo`,
    columns ROW ... INDEX, viewed as `rows`, `flip`, `heights`, `widths`, `src`, `dst`, `padded`,
    `planned`) and the boxes (float64 [k, 4]); the JPEG bytes one 1-D uint8 buffer (`data`) and each
    row's (start, end) in it (`spans`, int64 [k, 2]): what `GpuDecoder.decode_columns` takes. Rows made
    one at a time (a list of `GpuJob`s handed to the decoder) keep their own tensors instead (`data`
    None, `datas`), checked one by one; rows of `GpuRows` chunks are columns throughout. `job(i)` makes
    (once) the `GpuJob` of row i, only where one is needed: a sample that fails (its error names it) or
    needs checking. Iterating yields the jobs."""

    __slots__ = ("geo", "box", "data", "spans", "_datas", "rows", "flip", "heights", "widths", "src", "dst",
                 "padded", "planned", "_jobs", "_datasets")

    def __init__(self, geo: np.ndarray, box: np.ndarray, data: torch.Tensor | None, spans: np.ndarray | list,
                 jobs: list, datasets: list) -> None:
        """`data` and `spans` int64 [k, 2] (the columns), or `data` None and `spans` a list of the rows' own
        tensors (rows made one at a time)."""
        self.geo, self.box, self.data = geo, box, data
        if data is None:
            self.spans, self._datas = None, spans
        else:
            self.spans, self._datas = spans, None
        self.rows, self.flip, self.heights, self.widths = geo[:, ROW], geo[:, FLIP], geo[:, HEIGHT], geo[:, WIDTH]
        self.src, self.dst, self.padded, self.planned = geo[:, SRC], geo[:, DST], geo[:, PADDED], geo[:, PLANNED]
        self._jobs = jobs  # per row: its GpuJob once made (or the one it came from), else None
        self._datasets = datasets  # per row: where its key is read from (None: from its job)

    @classmethod
    def of_jobs(cls, jobs: "Sequence[GpuJob] | GpuBatch") -> "GpuBatch":
        """`jobs` (GpuJobs made one at a time) as columns; a GpuBatch as it is."""
        if isinstance(jobs, GpuBatch):
            return jobs
        jobs = list(jobs)
        k = len(jobs)
        geo = np.zeros((k, GEO_COLUMNS), np.int64)
        if k:
            wins = [j.window for j in jobs]
            geo[:, ROW] = [j.row for j in jobs]
            geo[:, FLIP] = [bool(j.flip) for j in jobs]
            geo[:, HEIGHT] = [j.height for j in jobs]
            geo[:, WIDTH] = [j.width for j in jobs]
            geo[:, SRC] = [(0, 0, 0, 0) if w is None else w.src for w in wins]
            geo[:, DST] = [(0, 0, 0, 0) if w is None else w.dst for w in wins]
            geo[:, PADDED] = [w is not None and bool(w.padded) for w in wins]
            geo[:, PLANNED] = [w is not None for w in wins]
        geo[:, INDEX] = -1
        return cls(geo, np.array([j.box for j in jobs], np.float64).reshape(k, 4), None, [j.data for j in jobs],
                   jobs, [None] * k)

    @property
    def datas(self) -> list:
        """Each row's JPEG bytes as a tensor of its own (views of `data`), for the decoders' list API."""
        if self._datas is not None:
            return self._datas
        data = self.data
        return [data[a:b] for a, b in self.spans.tolist()]

    @classmethod
    def join(cls, parts: "list[GpuBatch]") -> "GpuBatch":
        """`parts` one after the other. Columns stay columns: parts in one buffer (a slot's staging buffer)
        share it; parts in buffers of their own (a chunk that did not fit) are copied into one."""
        if len(parts) == 1:
            return parts[0]
        geo, box = np.concatenate([p.geo for p in parts]), np.concatenate([p.box for p in parts])
        jobs, sets = [j for p in parts for j in p._jobs], [d for p in parts for d in p._datasets]
        if any([p.data is None for p in parts]):
            return cls(geo, box, None, [d for p in parts for d in p.datas], jobs, sets)
        first = parts[0].data
        if all([p.data is first for p in parts]):
            return cls(geo, box, first, np.concatenate([p.spans for p in parts]), jobs, sets)
        shift = np.cumsum([0] + [p.data.shape[0] for p in parts[:-1]])
        spans = np.concatenate([p.spans + s for p, s in zip(parts, shift.tolist())])
        return cls(geo, box, torch.cat([p.data for p in parts]), spans, jobs, sets)

    def take(self, sel: Any) -> "GpuBatch":
        """The rows `sel` (a slice, or int64 positions), in that order."""
        if type(sel) is slice:
            if not sel.start and sel.step is None and (sel.stop is None or sel.stop >= self.rows.shape[0]):
                return self   # every row (a batch decoded as one chunk): the same columns
            rows = self.spans[sel] if self.data is not None else self._datas[sel]
            return GpuBatch(self.geo[sel], self.box[sel], self.data, rows, self._jobs[sel], self._datasets[sel])
        order = sel.tolist()
        jobs, sets = self._jobs, self._datasets
        if self.data is not None:
            rows = self.spans[sel]
        else:
            datas = self._datas
            rows = [datas[i] for i in order]
        return GpuBatch(self.geo[sel], self.box[sel], self.data, rows, [jobs[i] for i in order],
                        [sets[i] for i in order])

    def copy(self) -> "GpuBatch":
        """The same rows with columns of their own (to plan windows into)."""
        return GpuBatch(self.geo.copy(), self.box, self.data, self.spans if self.data is not None else self._datas,
                        self._jobs, self._datasets)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __iter__(self) -> Any:
        return iter([self.job(i) for i in range(len(self.rows))])

    def job(self, i: int) -> GpuJob:
        """Row i's `GpuJob` (made once; the same object after)."""
        job = self._jobs[i]
        if job is None:
            g = self.geo[i].tolist()
            a, b = self.spans[i].tolist()
            job = self._jobs[i] = PlannedJob(g[ROW], self.data[a:b], tuple(self.box[i].tolist()), bool(g[FLIP]),
                                             g[HEIGHT], g[WIDTH], CropWindow(tuple(g[SRC]), tuple(g[DST]),
                                                                             bool(g[PADDED])),
                                             self._datasets[i], g[INDEX])
        return job


_ALL = np.logical_and.reduce


def plan_columns(plan: Any, n: int) -> GpuBatch:
    """The GPU rows among a batch plan's first `n` rows (`render.BatchPlan.gpu_rows`, one `GpuRows` per
    chunk the workers prepared) as columns, in row order. A batch of one chunk (decode="gpu": one claim
    per batch) is its columns as they are: a chunk's rows are in row order (`gpu_rows`)."""
    chunks = plan.gpu_rows
    if len(chunks) == 1 and type(chunks[0]) is GpuRows:
        only = chunks[0]
        geo = only.geo
        k = geo.shape[0]
        if k and geo[k - 1, ROW] < n:   # `only.batch()`, one call fewer
            return GpuBatch(geo, only.box, only.data, only.spans, [None] * k, [only.dataset] * k)
    parts = [chunk.batch() for chunk in chunks]
    if not parts:
        return GpuBatch.of_jobs([])
    batch = GpuBatch.join(parts)
    rows = batch.rows
    if len(parts) == 1 and (not len(rows) or (rows[-1] < n and _ALL(rows[1:] > rows[:-1]))):
        return batch   # in row order already
    keep = np.flatnonzero(rows < n)
    return batch.take(keep[np.argsort(rows[keep], kind="stable")])


def jpeg_bytes(jobs: GpuBatch) -> int:
    """The JPEG bytes of `jobs`."""
    if jobs.data is not None:
        spans = jobs.spans
        return int(np.add.reduce(spans[:, 1] - spans[:, 0]))   # (the ufunc itself: `ndarray.sum` is two calls more)
    return sum([d.shape[0] for d in jobs.datas])


def cpu_rows(n: int, jobs: GpuBatch) -> list[int]:
    """The rows of a batch of `n` that no GPU row writes: rendered on the CPU."""
    taken_rows = np.zeros(n, bool)
    rows = jobs.rows
    taken_rows[rows[(rows >= 0) & (rows < n)]] = True
    return (~taken_rows).nonzero()[0].tolist()


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


@dataclass(frozen=True)
class RowPlanner:
    """What the native planner needs to plan a batch's GPU rows itself (`native.plan_gpu_rows`,
    csrc/engine.c): the engine's program of the planned ops, the epoch's random stream (`order.stream_key`)
    and the stored sizes (int64). Each row's box and flip are then the engine's, which are
    `Pipeline.plan`'s (tests/test_engine.py), and its windows `crop_windows`'s, so no NumPy plan is
    needed for the batch. `by_position`: rows keyed by their position in the epoch (weighted sampling's
    draws), else by their dataset index."""

    program: np.ndarray
    stream: int
    heights: np.ndarray
    widths: np.ndarray
    by_position: bool = False
    # the C gather itself (`native.gather_spans` without its Python wrapper), looked up with the planner: the
    # rows it plans are gathered in one call, not two; None: the wrapper's (NumPy where the native path is off)
    gather: Any = None


def gpu_rows(dataset: Any, plan: Any, r0: int, r1: int, staging: JpegStaging | None, out_size: tuple[int, int],
             heights: np.ndarray, widths: np.ndarray, planner: RowPlanner | None = None, found: tuple | None = None
             ) -> tuple[GpuRows | None, list[int]]:
    """Rows r0..r1 of the batch `plan` (a `render.BatchPlan`) for the GPU in a few calls: which are JPEGs
    of a stored size (`dataset.jpeg_spans`), each one's plan and crop windows (by `planner` in one native
    call, `native.plan_gpu_rows`; without one from the batch's NumPy plan, `plan.geometry`, by
    `crop_windows`), their bytes gathered back to back into `staging` (a private buffer when there is
    none or they do not fit) by one more (`native.gather_spans`). Returns the record (None when no row
    is taken) and the rows it left, which are the caller's, one at a time (all of them when a shard
    fails its check: each row's own read reports it). `found`: what `dataset.pixel_spans` gave for these
    rows, where the caller asked for more rows at once (`engine.BatchEngine.fill_chunk`'s split batch)."""
    idx = plan.indices[r0:r1]
    if found is not None:
        blocks, spans, kinds = found
    else:
        try:   # `dataset.jpeg_spans(idx)`, one call fewer: the rows that are not JPEGs left here
            blocks, spans, kinds = dataset.pixel_spans(idx)
        except Exception:  # noqa: BLE001 - a shard that fails its check: each row's own read reports it
            return None, list(range(r0, r1))
    spans[kinds != JPEG_ROW, 0] = -1
    k = spans.shape[0]
    # one allocation for the four outputs, each a C-contiguous part of it: geo, box (float64), at, src
    words = np.empty(k * _OUT_COLUMNS, np.int64)
    geo = np.ndarray((k, GEO_COLUMNS), np.int64, words)
    box = np.ndarray((k, 4), np.float64, words, k * GEO_COLUMNS * 8)
    at = np.ndarray((k, 2), np.int64, words, k * (GEO_COLUMNS + 4) * 8)
    src = np.ndarray((k, 3), np.int64, words, k * (GEO_COLUMNS + 6) * 8)
    if planner is not None:
        n, total = native.plan_gpu_rows(spans, plan.positions[r0:r1] if planner.by_position else idx, idx,
                                        heights, widths, planner.stream, planner.program, r0, out_size, geo, box,
                                        at, src)
    else:
        n, total = _planned_rows(spans, idx, r0, plan.geometry, heights, widths, out_size, geo, box, at, src)
    left = []
    if n < k:
        took = np.zeros(k, bool)
        took[geo[:n, ROW] - r0] = True
        left = (np.flatnonzero(~took) + r0).tolist()
    if not n:
        return None, left
    start = None if staging is None else staging.reserve(total)
    if start is None:   # no staging buffer yet, or it is full: one private buffer for the chunk
        data, start = torch.empty(max(total, 1), dtype=torch.uint8), 0
        out = data.numpy()
    else:
        data, out = staging.buffer, staging.array
    at = at[:n]
    at += start
    (native.gather_spans if planner is None or planner.gather is None else planner.gather)(blocks, src[:n], out,
                                                                                         at[:, 0])
    return GpuRows(data, at, geo[:n], box[:n], dataset), left


def _planned_rows(spans: np.ndarray, idx: np.ndarray, r0: int, geometry: Any, heights: np.ndarray,
                  widths: np.ndarray, out_size: tuple[int, int], geo: np.ndarray, box: np.ndarray, at: np.ndarray,
                  src: np.ndarray) -> tuple[int, int]:
    """`native.plan_gpu_rows` in NumPy, from the batch's plan `geometry` (a `transforms.Plan`): where there
    is no native planner (the native path is off, or an op the engine does not plan). Returns (rows
    taken, their bytes), the rows written first into `geo`, `box`, `at` and `src`."""
    h, w = heights[idx].astype(np.int64), widths[idx].astype(np.int64)
    take = np.flatnonzero((spans[:, 0] >= 0) & (h > 0) & (w > 0))
    n = len(take)
    rows, h, w = take + r0, h[take], w[take]
    box[:n] = geometry.box[rows]
    s, d, padded = crop_windows(box[:n], h, w, *out_size)
    g = geo[:n]
    g[:, ROW], g[:, FLIP], g[:, HEIGHT], g[:, WIDTH] = rows, geometry.flip[rows], h, w
    g[:, SRC], g[:, DST], g[:, PADDED], g[:, PLANNED], g[:, INDEX] = s, d, padded, 1, idx[take]
    src[:n] = spans[take]
    np.cumsum(src[:n, 2] - src[:n, 1], out=at[:n, 1])
    at[:n, 0] = at[:n, 1] - (src[:n, 2] - src[:n, 1])
    return n, int(at[n - 1, 1]) if n else 0
