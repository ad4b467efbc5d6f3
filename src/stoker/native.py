"""The native pixel path: torchvision's uint8 bilinear resize in C (``stoker._jpeg.resample``), the
batch engine's pool (``stoker._jpeg.Engine``: region decode + resize + flip of whole batches on native
threads), the plan of the GPU columns' rows, and the byte gathers and float maps around them, each one call
that releases the GIL.

Worker threads share the training process, so each microsecond of Python they run per sample is
taken from the training loop's own Python (the GIL). The C resize gives the same pixels as
libtorch's kernel (csrc/resample.c: the same double-precision weights, quantised to int16 at the
same precision, horizontal pass then vertical, the same rounding), so it replaces the torch call
wherever the interpolation is bilinear; tests/test_resample_native.py checks every pixel against
torch.

``STOKER_NATIVE=off`` (read when stoker is imported) turns the native path off: the torch kernel
and the per-sample Python path, as before (the same pixels; for comparisons and benchmarks).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Sequence

import numpy as np

ENV = "STOKER_NATIVE"


def _module() -> ModuleType | None:
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    try:
        from . import _jpeg
    except ImportError:  # not compiled (no C compiler at install time): torch's kernels serve
        return None
    return _jpeg if hasattr(_jpeg, "resample") else None


_mod = _module()
#: True when the native path is in use (the extension is built and STOKER_NATIVE does not turn it off)
ON = _mod is not None


def resample(src: np.ndarray, dst: np.ndarray, antialias: bool) -> bool:
    """Bilinear-resize the uint8 [h, w, 3] `src` into `dst` (rows of either may be strided) as
    torchvision does; False when the native path is off or the arrays are not packed RGB rows
    (the caller then uses torch)."""
    if (not ON or src.ndim != 3 or dst.ndim != 3 or src.strides[1:] != (3, 1) or dst.strides[1:] != (3, 1)
            or src.strides[0] <= 0 or dst.strides[0] <= 0 or src.dtype != np.uint8 or dst.dtype != np.uint8):
        return False
    _mod.resample(src, dst, antialias=antialias)
    return True


def engine_available() -> bool:
    """True when the native batch engine can render rows (the extension is on and found a libjpeg-turbo
    for its region decoder)."""
    from . import _libjpeg

    return ON and _libjpeg.region_decoder() is not None


def plans_rows() -> bool:
    """True when the native planner of the GPU columns' rows (`plan_gpu_rows`) is there to use."""
    return ON and hasattr(_mod, "plan_gpu_rows")


def plan_gpu_rows(spans: np.ndarray, ids: np.ndarray, index: np.ndarray, heights: np.ndarray, widths: np.ndarray,
                  stream: int, program: np.ndarray, first: int, out_size: tuple[int, int], geo: np.ndarray,
                  box: np.ndarray, at: np.ndarray, src: np.ndarray) -> tuple[int, int]:
    """The GPU's rows of a chunk (`loading.jobs.gpu_rows`) planned in one call that releases the GIL: of
    rows `first + i` (dataset rows `index`, int64 [k], their random streams keyed by `ids` in `stream`;
    `spans` as `Dataset.jpeg_spans` gives them), those with JPEG bytes and a stored size (`heights`,
    `widths`: int64, every dataset row) each planned as the engine plans it (`program`, its box and flip
    `Pipeline.plan`'s), its crop windows for `out_size` computed as `jobs.crop_windows` computes them, and
    written taken rows first (csrc/engine.c): `geo` (int64 [k, jobs.GEO_COLUMNS]), `box` (float64 [k, 4]),
    `at` (int64 [k, 2]: each row's bytes, back to back from 0) and `src` (int64 [k, 3]: its `spans` row).
    Returns (rows taken, their bytes). Only where `plans_rows()`."""
    return _mod.plan_gpu_rows(spans, ids, index, heights, widths, stream, program, first, out_size, geo, box, at, src)


if plans_rows():   # the C function itself (the same arguments): a worker's chunk makes one call here, not two
    plan_gpu_rows = _mod.plan_gpu_rows  # noqa: F811


#: the C gather (`gather_spans`), looked up once: a worker calls it for every chunk of GPU rows
_gather = getattr(_mod, "gather_spans", None)


def gather_c() -> Any:
    """The C gather (`gather_spans`'s native path, the same arguments) where the native path is on now,
    else None: for a caller that calls it per chunk and decided once (`jobs.RowPlanner`)."""
    return _gather if ON else None


def gather_spans(blocks: Sequence, spans: np.ndarray, out: np.ndarray, offsets: np.ndarray) -> int:
    """Row i's bytes `spans[i, 1]:spans[i, 2]` of `blocks[spans[i, 0]]` (int64 [k, 3], as
    `Dataset.jpeg_spans` gives them) copied to `out[offsets[i]:]` (uint8, writable; `offsets` int64 [k], of
    any stride) for
    every row whose block is not -1, in one call that releases the GIL for the copies (NumPy, one copy
    per row, where the native path is off). Returns the bytes copied."""
    if ON and _gather is not None:
        return _gather(blocks, spans, out, offsets)
    total = 0
    for (block, lo, hi), at in zip(spans.tolist(), offsets.tolist()):
        if block >= 0:
            out[at:at + hi - lo] = np.frombuffer(blocks[block], np.uint8)[lo:hi]
            total += hi - lo
    return total


def map_levels(images: np.ndarray, rows: np.ndarray, levels: np.ndarray, out: np.ndarray, nchw: bool) -> None:
    """Rows `rows` (int64) of the uint8 batch `images` [n, h, w, 3] through the per-channel tables `levels`
    ([3, 256] values of 2 or 4 bytes) into `out` ([n, 3, h, w] when `nchw`, else [n, h, w, 3], the tables'
    item size), as the engine's threads map the rows they render (csrc/engine.c), the GIL released."""
    _mod.map_levels(images, rows, levels, out, nchw)


def mark_process() -> int:
    """Record this process among the stoker processes whose CPU no engine pool grows against (csrc/crowd.h):
    for a process with no engine of its own that worker processes feed. The entry, or -1 (not recorded)."""
    return _mod.mark() if _mod is not None else -1


def unmark_process(entry: int) -> None:
    """Clear what `mark_process` recorded."""
    if _mod is not None and entry >= 0:
        _mod.unmark(entry)


def engine(threads: int, nice: int = 0, most: int = 0) -> object:
    """A started pool of `threads` native threads that render whole batches (`stoker._jpeg.Engine`,
    csrc/engine.c; `loading.engine.BatchEngine` drives it), each at Linux nice value `nice`; while other
    processes take its cores it runs up to `most` threads (csrc/crowd.h)."""
    return _mod.Engine(threads, nice, most)
