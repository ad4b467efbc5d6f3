"""The native batch engine: a whole batch of the standard pipeline in one call, on native threads.

Worker threads share the training process, and every Python call one of them makes needs the GIL
that the training loop's own thread takes for each op it dispatches (docs/architecture.md, "Threads
and the GIL"). For the standard pipeline (packed JPEGs, a planned geometric prefix of
RandomResizedCrop / Resize / CenterCrop / RandomHorizontalFlip resampled bilinearly, nothing per
sample after it) the engine takes the per-sample work out of Python altogether: a pool of pthreads
(`stoker._jpeg.Engine`, csrc/engine.c) that never touch the interpreter computes each row's random
stream, crop plan (RandomResizedCrop's box draw included: the same draws and integers as
`transforms.geometry`), DCT-scaled region decode, antialiased resize, placement and flip, straight
into the batch's slot, and a status per row.

Python coordinates a batch with a handful of GIL takes: a coordinator thread of the `Run` (two
of them, so the next batch is planned and queued while the pool renders this one) claims the whole
batch, plans its labels (`Filler.prepare(deferred=True)`), gathers the rows' byte spans, then one
`Engine.run` call queues the batch and waits, the GIL released, until the pool is done, the
timeout passes or `close()` stops it (no sleep-polling: `Run.stop` closes the engine, which wakes
the wait at once). Rows the pool refused (not a JPEG, damaged, a size it does not serve) then go
through today's per-sample path (`Filler.fill`: its errors, fallbacks and on_error replacements),
with the batch's plan computed in NumPy only then. Pixels, labels and replacements are the same as
without the engine, at any thread count (tests/test_engine.py compares them bit for bit).

With decode="auto" (or a `gpu_share=` below 1) the CPU's share of each split batch goes through
the engine too: a coordinator leaves the GPU's rows for the device thread in one call
(`Filler.queue_gpu_rows`: each planned natively, `jobs.RowPlanner`, with its crop windows and gathered
JPEG bytes; the batch's NumPy plan is deferred here too), then renders the rows before
`BatchPlan.gpu_from` in one `Engine.run`; the pool's busy seconds are the CPU side's
time the split measures (`BatchPlan.cpu_render_s`). Which rows the GPU takes changes no CPU row's
pixels: each row's stream and plan depend on its sample alone.

On Linux the pool's threads run at nice `NICE` (0; `Workers(nice=)` or `STOKER_ENGINE_NICE` sets another
value, 0 to 19).
Whether batches take this path is the route's (`route.Route`, decided when the Loader is made):
`STOKER_ENGINE=off` then sends every row through the Python path on `num_threads` worker threads;
`STOKER_NATIVE=off` turns every native path off.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._torch import torch
from .. import codecs, native
from ..errors import LoaderClosedError
from ..order import TAG_DRAW, TAG_SAMPLE, stream_key
from ..transforms.geometry import AA_HEADROOM
from .route import ENV

if TYPE_CHECKING:
    from .render import BatchPlan, EpochChain, RenderSpec
    from .slots import Slot, WorkerTimes

#: Python threads that coordinate batches: two keep the pool fed (one plans and queues the next batch
#: while the pool renders the other's), more would only add Python beside the training loop
COORDINATORS = 2
_STOPPED = 1   # Engine.run's state when close() stopped the pool
#: the pool threads' Linux nice value (`Workers(nice=)`, STOKER_ENGINE_NICE). 0, the training process's own:
#: beside one busy process per core (another job on the machine), the pool kept 0.48 of its images/s alone at
#: nice 0, 0.26 at 5, 0.09 at 10 and 0.01 at 19 (benchmarks/bench_priority.py, 1,000 real photographs, 2
#: cores): at 19 any competing load starves it. Beside a dispatch-bound step the earlier runs of
#: benchmarks/bench_engine.py measured 0.8-4.2% step inflation at 19 and 2.6-16.5% at 0 where the pool
#: shares the trainer's cores; on a GPU host the default thread count leaves the training process cores
#: of its own (`_system.TRAINER_THREADS`), and Workers(nice=19) gives it precedence where they are shared
NICE = 0
#: while other processes take the pool's cores, it runs up to this many times its own threads (`Workers(max_threads=)`
#: sets the most): at equal priority a busy core is shared among the runnable threads, and beside one busy process
#: per core 4x the threads keeps 0.8 of the cores: it kept 0.79 of its images/s alone there, 0.50 without growing
#: (benchmarks/bench_priority.py, 1,200 real photographs, 2 cores; docs/loader.md, "The pool beside other programs")
CROWD_FACTOR = 4


@dataclass(frozen=True)
class FloatOut:
    """The batch's float output, written by the engine's threads: each row they render is mapped through
    per-channel tables (`levels`: float32, float16 or bfloat16 [3, 256], the value of each uint8 level as
    the caller's conversion computes it) into a float batch while the row is in cache, instead of a pass
    over the whole uint8 batch afterwards. A table lookup copies the value, so the output is the
    conversion's bit for bit. `channels_last`: NHWC memory (viewed as NCHW), else contiguous NCHW."""

    levels: Any = field(compare=False)   # torch tensor [3, 256]
    channels_last: bool = False
    #: (rows, height, width) -> the FloatBuffers of batches that shape: kept while this value is (a Loader's life)
    kept: dict = field(default_factory=dict, compare=False, repr=False)

    def buffers(self, rows: int, height: int, width: int) -> "FloatBuffers":
        """The reusable output batches of that shape (any thread; the first made is the one kept)."""
        key = (rows, height, width)
        found = self.kept.get(key)
        return found if found is not None else self.kept.setdefault(key, FloatBuffers(self, rows, height, width))

    def table(self) -> np.ndarray:
        """The tables as the engine reads them: their values' bytes (bfloat16 has no NumPy dtype)."""
        return _bytes_of(self.levels.contiguous())

    def new(self, rows: int, height: int, width: int) -> tuple[Any, np.ndarray]:
        """A fresh output batch: ([rows, 3, H, W] tensor in the asked layout, the NumPy array the engine writes)."""
        dtype = self.levels.dtype
        if self.channels_last:
            t = torch.empty((rows, height, width, 3), dtype=dtype)
            images = t.permute(0, 3, 1, 2)
        else:
            images = t = torch.empty((rows, 3, height, width), dtype=dtype)
        return images, _bytes_of(t)


def _bytes_of(t: Any) -> np.ndarray:
    """A float tensor's memory as NumPy: int16 for a 2-byte dtype (bfloat16 has no NumPy dtype), else as is."""
    return (t.view(torch.int16) if t.element_size() == 2 else t).numpy()


_NO_FLOATS: dict = {}
#: float output batches kept for reuse (each the size of 4 uint8 slots for float32): a fresh one per batch
#: (38.5 MB at 64 x 224 x 224) costs its page faults and zeroing, about 0.2 ms an image on the machine of
#: docs/benchmarks.md. 8: what a running pass holds at once with the default prefetch (the ring's slots,
#: the device thread's finished batches, the caller's)
KEEP_FLOATS = 8
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class FloatBuffers:
    """The float output batches of one engine, reused once nothing outside holds them (the storage's use
    count back to what these references make, as `slots.Slot.held` asks of a slot): a batch the caller
    keeps is left to it and a new one made. At most `KEEP_FLOATS` kept; any thread."""

    def __init__(self, out: FloatOut, rows: int, height: int, width: int) -> None:
        self.out, self.shape = out, (rows, height, width)
        self.kept: list[tuple[Any, np.ndarray, int, int]] = []   # (images, array, storage, own uses)
        self.lock = threading.Lock()

    def take(self) -> tuple[Any, np.ndarray]:
        """An output batch nothing else references: ([rows, 3, H, W] tensor, the array the engine writes)."""
        with self.lock:
            for k, (images, buf, storage, uses) in enumerate(self.kept):
                if _use_count is not None and _use_count(storage) == uses:
                    self.kept.append(self.kept.pop(k))   # the most recently used last
                    return images, buf
            images, buf = self.out.new(*self.shape)
            storage = images.untyped_storage()._cdata
            if _use_count is not None:
                if len(self.kept) >= KEEP_FLOATS:
                    self.kept.pop(0)   # the oldest, held by the caller: theirs now
                self.kept.append((images, buf, storage, _use_count(storage)))
            return images, buf


def pool_most(threads: int, asked: int | None = None) -> int:
    """The most threads the pool runs while other processes take its cores: `Workers(max_threads=)` where given
    (at most `threads`: it never grows), else `CROWD_FACTOR` x `threads`, within the engine's 1,024."""
    return min(1024, max(threads, CROWD_FACTOR * threads if asked is None else asked))


def split_seconds(busy: float, threads: int, active: int) -> float:
    """The pool's row seconds `busy` as the split reads them: seconds of `threads` threads (its rate is rows x
    threads / seconds). A pool grown beside other programs renders on `active` threads, each row slower (it
    waits for a core) but more at once: its seconds count for threads / active."""
    return busy * threads / active if active > threads else busy


def pool_nice(asked: int | None = None) -> int:
    """The pool threads' nice value (Linux): `Workers(nice=)` where given, else STOKER_ENGINE_NICE, else `NICE`."""
    if asked is not None:
        return asked
    try:
        return int(os.environ.get(ENV + "_NICE", NICE))
    except ValueError:
        return NICE


class BatchEngine:
    """One Run's engine: `start()` makes the pool, `fill_chunk` renders a batch (the Run's `ChunkFn`,
    with `chunk` = the batch size), `close()` stops and joins the pool (repeatable, from any thread)."""

    def __init__(self, spec: "RenderSpec", prog: np.ndarray, threads: int, timeout: float,
                 floats: FloatOut | None = None, nice: int | None = None, most: int | None = None) -> None:
        self.spec = spec
        self.nice = pool_nice(nice)
        self.most = pool_most(threads, most)
        self.program = prog
        self.threads = threads
        # a split batch: the coordinators also leave the GPU's rows as jobs, Python the pool does not do
        self.split = spec.gpu_decode
        self.coordinators = COORDINATORS if self.split else min(threads, COORDINATORS)
        self.timeout = timeout
        sizes = np.empty((len(spec.heights), 2), np.int64)   # stored (height, width) of every sample
        sizes[:, 0], sizes[:, 1] = spec.heights, spec.widths
        self.sizes = sizes
        self.out_h, self.out_w = spec.output_size
        self.full_size = spec.decode_quality == "exact"
        self.fast = spec.decode_quality == "fast"
        self.antialias = spec.pipeline.resampling[1]
        self.tag = TAG_DRAW if spec.key_by_draw else TAG_SAMPLE
        self.floats = None if self.split else floats
        self.levels = None if self.floats is None else self.floats.table()
        self.buffers: FloatBuffers | None = None
        self._streams: dict[int, int] = {}   # epoch -> the root of its random streams
        self.pool: Any = None
        self._closed = False

    def start(self) -> None:
        """Start the pool's threads (`Run.start`)."""
        if self.pool is None and not self._closed:
            self.pool = native.engine(self.threads, self.nice, self.most)

    def close(self) -> None:
        """Stop the pool: a coordinator waiting in `Engine.run` wakes at once (after the rows in flight),
        and the threads are joined (`Run.stop`; the Engine's own finalizer is the safety net)."""
        self._closed = True
        if self.pool is not None:
            self.pool.close()

    def _stream(self, epoch: int) -> int:
        s = self._streams.get(epoch)
        if s is None:
            s = self._streams[epoch] = int(stream_key(self.spec.seed, epoch, self.tag)[0])
        return s

    def fill_chunk(self, bp: "BatchPlan", r0: int, r1: int, slot: "Slot", scratch: dict,
                   times: "WorkerTimes") -> list[tuple[int, BaseException]]:
        """Rows r0..r1 (the whole batch) of `bp` into `slot`: one `Engine.run`, then the refused rows
        through `Filler.fill` with the batch's NumPy plan (`Filler.complete`). Returns the (row,
        exception) of the rows that failed, as `Filler.fill_split` does.

        A split batch: rows from `gpu_from` on are left for the GPU first, in one call
        (`Filler.queue_gpu_rows`), then the rows before it go through the pool; the pool's busy seconds
        are the CPU side's time."""
        filler = bp.filler
        errors: list = []
        end = r1
        idx = bp.indices[r0:r1]   # the engine reads int64 rows, one after the other
        if idx.dtype != np.int64 or not idx.flags.c_contiguous:   # (attributes: as a rule no call)
            idx = np.ascontiguousarray(idx, np.int64)
        try:   # JPEGs and stored raw pixels: the pool reads both (kinds), everything else is refused to Python
            blocks, spans, kinds = filler.ds.pixel_spans(idx)   # for both sides of a split batch: one check
        except Exception:  # noqa: BLE001 - a shard that fails its check: each row's own read reports it
            blocks = None
        if self.split:
            end = r0 if bp.gpu_from < r0 else r1 if bp.gpu_from > r1 else bp.gpu_from   # gpu_from within [r0, r1]
            cut = end - r0
            if end < r1:   # the GPU's rows first, from their part of the spans
                errors = filler.queue_gpu_rows(bp, end, r1, slot, scratch, times, found=None if blocks is None
                                               else (blocks, spans[cut:], kinds[cut:]))
                idx = idx[:cut]
                if blocks is not None:
                    spans, kinds = spans[:cut], kinds[:cut]
        rows: Any = range(r0, end)
        if end == r0:
            return errors
        floats = _NO_FLOATS
        if self.floats is not None:   # the float output: written by the pool's threads row by row
            if self.buffers is None:
                self.buffers = self.floats.buffers(slot.images_np.shape[0], self.out_h, self.out_w)
            out, buf = self.buffers.take()
            floats = {"floats": buf, "levels": self.levels, "nchw": not self.floats.channels_last}
            slot.floats = out[:]   # a view of its own: the batch counts as held until it is handed out and let go
        if blocks is not None and self.pool is not None:
            try:   # each row's outcome, which the pool writes for every row: this thread's buffer, kept
                status = scratch["status"]
            except KeyError:
                status = scratch["status"] = np.empty(self.spec.batch_size, np.uint8)
            status = status[:end - r0]
            program, (oh, ow), corners = self.program, (self.out_h, self.out_w), {}
            if bp.bucket >= 0:   # aspect buckets: the batch's own size and program; the pool writes each crop corner
                program, (oh, ow) = self.spec.buckets.programs[bp.bucket], self.spec.buckets.sizes[bp.bucket]
                if bp.keys is None:
                    corners = {"corners": slot.extras["crop_top_left"][r0:end]}
            left, busy, state = self.pool.run(
                blocks, spans, bp.positions[r0:end] if self.spec.key_by_draw else idx, idx, self.sizes,
                self._streams[filler.epoch] if filler.epoch in self._streams else self._stream(filler.epoch),
                program, slot.images_np, status, r0, oh, ow,
                self.full_size, AA_HEADROOM, self.antialias, self.fast, codecs.MAX_PIXELS, self.timeout, **floats,
                **({"kinds": kinds} if kinds[kinds.argmax()] else {}), **corners)   # raw rows: read in place, no decode
            times.decode += busy
            times.pool_threads = active = self.pool.active   # (an attribute: no call)
            if self.split:
                bp.cpu_render_s.append(split_seconds(busy, self.threads, active) if active > self.threads else busy)
            if state == _STOPPED:   # the Run is stopping: should this batch still be asked for, it says so
                return [(r0, LoaderClosedError(f"the loader was closed while batch rows {r0}..{r1 - 1} were being "
                                               f"rendered"))]
            rows = (np.flatnonzero(status) + r0).tolist() if left else ()
        if not rows:
            return errors
        filler.complete(bp)
        if bp.bucket >= 0:   # the refused rows' corners, which the pool may not have planned
            refused = np.asarray(rows, np.int64)
            hf, wf = filler.float_sizes
            b = bp.indices[refused]
            fixed = np.empty((len(refused), 2), np.int64)
            self.spec.buckets.corners(bp.bucket, hf[b], wf[b], bp.u[refused], fixed)
            slot.extras["crop_top_left"][refused] = fixed
        errors += filler.fill_rows(bp, rows, slot, scratch, times)
        if floats:   # the rows rendered in Python, mapped as the pool maps its own
            native.map_levels(slot.images_np, np.asarray(rows, np.int64), self.levels, floats["floats"],
                              floats["nchw"])
        return errors


def run_claims(spec: "RenderSpec", chain: "EpochChain", threads: int, timeout: float, floats: Any = None,
               nice: int | None = None, most: int | None = None) -> dict[str, Any]:
    """`Run`'s claim arguments for the route of `spec`: whole batches through the native engine
    (`engine.BatchEngine`; `floats`: its float output, `engine.FloatOut`), or the GPU's rows (`Filler.fill_split`:
    a whole batch per claim where every JPEG row is the GPU's, else a chunk at a time), else one row per claim
    through `fill` on every worker thread."""
    route = spec.route
    if route.native and native.engine_available():   # loads its libjpeg-turbo here too (a worker process)
        engine = BatchEngine(spec, route.program, threads, timeout, floats, nice, most)
        return {"fill_chunk": engine.fill_chunk, "chunk": spec.batch_size, "engine": engine}
    if route.gpu_decode:
        # every JPEG row the GPU's: the whole batch in one claim (its rows prepared in one call, the claim's
        # cost paid once), on `COORDINATORS` threads that take batches in turn (a thread more would only
        # wait for a slot, woken with the others each time a batch completes); where the CPU renders a share
        # row by row, four claims per thread per batch, so the threads share that work
        if route.share == 1.0:
            return {"fill_chunk": chain.fill_split, "chunk": spec.batch_size, "threads": max(1, min(threads, COORDINATORS))}
        return {"fill_chunk": chain.fill_split, "chunk": max(1, -(-spec.batch_size // (4 * max(threads, 1))))}
    return {}
