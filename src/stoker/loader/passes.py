"""Passes over the data: the pass/lease protocol between the Loader and its threads.

`Passes` is given a Loader's frozen `LoadPlan` (the render spec, the epoch order, the ring's shape,
the thread settings), its dataset and stats, and a `Cursor` it reports progress to; it never reaches
back into the Loader. Each `begin()` is a whole pass (`PassIter`): the epoch's batches from its start,
or from where `load_state_dict` put the cursor. A pass started while another is still running gets
threads and a ring of its own, as a second DataLoader iterator would. A persistent Loader's
threads (`_Crew`) run on into the next epoch, and the next pass leases them when it starts
exactly where they are.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .._system import fork_generation
from .._torch import torch
from ..device.stage import DeviceOptions, DeviceStage, consumer_fence, uint8_levels
from ..dataset import Dataset
from ..errors import ConfigError
from ..device.build import DeviceBuilder
from ..loading.handout import host_batch, numpy_batch
from ..loading.engine import FloatOut, run_claims
from ..loading.render import EpochChain, Filler, RenderSpec
from ..device.feeder import Feeder
from ..loading.slots import BatchRing, Run
from ..loading.stats import LoaderStats
from ..transforms import Normalize

if TYPE_CHECKING:
    from .plan import LoadPlan

__all__ = ["Cursor", "PassIter", "Passes"]


class Cursor:
    """Where the data stands: the epoch the next pass reads, the samples of it the latest pass
    yielded, and where `load_state_dict` asks the next pass to start (None: at the epoch's start)."""

    def __init__(self) -> None:
        self.epoch, self.sample = 0, 0
        self.resume: int | None = None
        self.lock = threading.RLock()

    def begin(self) -> tuple[int, int]:
        """A pass starts: its epoch and first sample (the resume point once, else 0)."""
        with self.lock:
            start, self.resume = self.resume or 0, None
            self.sample = start
            return self.epoch, start

    def advance(self, epoch: int, sample: int, done: bool) -> None:
        """A pass of `epoch` has yielded its samples up to `sample`; `done`: the epoch is complete."""
        with self.lock:
            if epoch == self.epoch:
                self.epoch, self.sample = (epoch + 1, 0) if done else (epoch, sample)

    def move(self, epoch: int, sample: int = 0, resume: bool = False) -> None:
        with self.lock:
            self.epoch, self.sample = int(epoch), int(sample)
            self.resume = int(sample) or None if resume else None


def float_out(spec: RenderSpec, opts: DeviceOptions | None) -> FloatOut | None:
    """The float output the engine's threads can write for this pass (`engine.FloatOut`), or None: a
    float batch on the CPU made from the uint8 rows by a per-level table, either the batch ops being one
    Normalize (host batches) or `convert` with a CPU DeviceOptions and no batch ops. Images only."""
    if spec.kind.frames:
        return None
    ops = spec.pipeline.batch
    if opts is None:
        if ops is None or ops.mix is not None or len(ops.ops) != 1 or type(ops.ops[0]) is not Normalize \
                or len(ops.ops[0].mean) not in (1, 3):
            return None
        return FloatOut(ops.ops[0].levels(3).view(3, 256))
    if opts.device.type != "cpu" or ops is not None or (
            opts.normalize is not None and max(map(len, opts.normalize)) not in (1, 3)):
        return None
    levels = uint8_levels(opts)
    return None if levels is None else FloatOut(levels, opts.memory_format == torch.channels_last)


class GpuDecoders:
    """A Loader's GPU batch decoders (`gpu_decode.GpuBatchDecoder`), one per device, made on first need
    (the decoder libraries load only then); `probe` is the route's question (`loading.route.decide`)."""

    def __init__(self) -> None:
        self.made: dict[Any, Any] = {}

    def get(self, opts: DeviceOptions) -> Any:
        from ..device.gpu_decode import GpuBatchDecoder, make_decoder

        opts = opts.resolved(warn=False)  # a Loader checks its decoder when made: the pass warns, if need be
        found = self.made.get(opts.device)
        if found is None:
            spec = opts.gpu_decoder
            decoder = make_decoder(spec, opts.device) if isinstance(spec, str) else spec
            if not isinstance(getattr(decoder, "name", None), str):   # the stats, the log and errors name it
                raise ConfigError(f"gpu_decoder={type(decoder).__name__} object has no `name`: give it a str attribute "
                                  f"naming the decoder (LoaderStats.gpu_decoder and errors show it), e.g. "
                                  f"name = \"my nvJPEG wrapper\"")
            if isinstance(spec, str) and hasattr(decoder, "keep_outputs"):
                from ..device.gpu_pipeline import RING

                decoder.keep_outputs(RING)  # no device allocation per image in steady state
            found = self.made[opts.device] = GpuBatchDecoder(decoder, opts.device)
        return found

    def probe(self, opts: DeviceOptions) -> str | None:
        """None where a decoder works here for `opts`, else why not; decode="gpu" raises instead (its
        ConfigError names the install)."""
        try:
            self.get(opts)
        except ConfigError as exc:
            if opts.decode == "gpu":
                raise
            return f"no GPU JPEG decoder works here ({str(exc).splitlines()[0]})"
        return None


class Passes:
    """The Loader's passes: their threads, the batch ring, the device stage and GPU decoder they share."""

    def __init__(self, plan: "LoadPlan", dataset: Dataset, stats: LoaderStats, cursor: Cursor,
                 decoders: GpuDecoders) -> None:
        self.plan, self.dataset, self.stats, self.cursor = plan, dataset, stats, cursor
        self.decoders = decoders
        self._ring: BatchRing | None = None
        self._stage: DeviceStage | None = None  # one copy stream per loader, made on first use
        self._split: Any = None  # the GPU columns' gpu_split.SplitControl
        self._specs: dict[Any, RenderSpec] = {}  # device options of iter_on -> the spec with their route
        self._live: _Crew | None = None  # persistent: the pipeline running on into the next epoch
        self._iters: weakref.WeakSet[PassIter] = weakref.WeakSet()  # the passes made, while they live
        self._floats: tuple[Any, FloatOut | None] | None = None  # (options, float_out's answer), kept across passes
        self._lock = threading.RLock()  # re-entrant: Ctrl-C inside its with-statement cannot lock us out
        self._generation = fork_generation()

    def _after_fork(self) -> None:
        """In a fork()ed child (a torch DataLoader fork worker, os.fork()), forget the parent's passes,
        threads, ring and device state without touching them; the next pass starts its own. A CUDA
        device cannot follow a fork: that is refused, naming the fix."""
        if self._generation == fork_generation():
            return
        self._generation = fork_generation()
        self._lock = threading.RLock()
        self._iters = weakref.WeakSet()
        self._live = self._ring = self._stage = self._split = None
        self._floats = None
        self.decoders.made.clear()

    def begin(self, opts: DeviceOptions | None) -> PassIter:
        """A whole pass of the cursor's epoch (from the resume point `load_state_dict` set, once).
        "cuda" is resolved to a GPU here, as the pass starts (`DeviceOptions.resolved`)."""
        self._after_fork()
        if opts is not None and opts.device.type == "cuda" and self._forked_cuda():
            raise ConfigError("this Loader copies its batches to CUDA, and this is a fork()ed child process: CUDA "
                              "cannot be used after fork(). Start the workers with multiprocessing_context=\"spawn\" "
                              "(torch DataLoader) or multiprocessing.get_context(\"spawn\"), or use the Loader "
                              "without a device in the child")
        opts = None if opts is None else opts.resolved()
        with self._lock:
            epoch, start = self.cursor.begin()
            # a pass still running keeps its threads and its ring: this one gets its own
            busy = any(it.running for it in list(self._iters))
            it = PassIter(self, epoch, start, opts, private=busy)
            self._iters.add(it)
            return it

    def ring(self, extra: int = 0, private: bool = False) -> BatchRing:
        """The batch ring: `prefetch` batches being prepared, the one the caller is using and the one
        its loop variable still holds while the next is fetched (FFCV's `batches_ahead + 2`), plus
        `extra`. `private`: a ring of its own, for a pass that runs beside another."""
        p = self.plan
        h, w = p.spec.output_size
        n_slots = p.prefetch + 2 + extra
        frames = p.spec.frames
        if private or self._ring is None or not self._ring.matches(n_slots, p.batch_size, h, w, p.label_dtype,
                                                                   p.pin_memory, frames):
            ring = BatchRing(n_slots, p.batch_size, h, w, label_dtype=p.label_dtype, pin_memory=p.pin_memory,
                             stats=self.stats, buffers=p.buffers, frames=frames)
            if private:
                return ring
            self._ring = ring
        return self._ring

    def floats(self, spec: RenderSpec, opts: DeviceOptions | None) -> FloatOut | None:
        """`float_out` for a pass with `opts`: the same FloatOut (so its float batches are reused) while
        the options stay the same."""
        if self._floats is None or self._floats[0] != opts:
            self._floats = (opts, float_out(spec, opts))
        return self._floats[1]

    def stage(self, opts: DeviceOptions) -> DeviceStage:
        """The DeviceStage: one copy stream per loader, kept across epochs (the CUDA caching
        allocator pools memory per stream)."""
        if self._stage is None or self._stage.opts != opts:
            self._stage = DeviceStage(opts)
        return self._stage

    def spec_for(self, opts: DeviceOptions | None) -> RenderSpec:
        """The RenderSpec of a pass with `opts`: the plan's, whose route was decided with its own device
        options; a pass moved to another device (`Loader.iter_on`) gets the route for those, once."""
        if opts == self.plan.device or (opts is not None and self.plan.device is not None
                                        and opts.resolved(warn=False) == self.plan.device.resolved(warn=False)):
            return self.plan.spec
        found = self._specs.get(opts)
        if found is None:
            from .plan import route_of

            found = self._specs[opts] = replace(self.plan.spec, route=route_of(
                self.plan.asked, self.plan.spec, self.dataset, opts, self.decoders.probe))
        return found

    def split(self, share: float | None) -> Any:
        """The SplitControl of the route's GPU columns (`share`: fixed, or None: measured), kept across
        passes (its measurements carry over)."""
        from ..device.gpu_split import SplitControl

        if self._split is None or self._split.fixed != share:
            self._split = SplitControl(self.plan.num_threads, share)
            self.stats.gpu_share, self.stats.gpu_split = self._split.settled, self._split.reason
        return self._split

    def pipeline_for(self, epoch: int, start: int, opts: DeviceOptions | None, private: bool = False
                     ) -> tuple["_Crew", int]:
        """The pipeline for (epoch, from sample start) and the run batch index it starts at: the
        persistent one when it is exactly there already, else a new one. `private`: another pass
        is running; this one gets its own threads and ring and leaves the other's alone."""
        if private:
            return _Crew(self, epoch, start, opts, persistent=False, private=True), 0
        live, self._live = self._live, None
        if live is not None:
            g = live.find(epoch, start)
            running = live.run is not None and not live.run.stop_event.is_set() and live.run.alive() > 0
            if running and live.opts == opts and g is not None and g == live.next_g:
                live.append(self.plan, epoch + 1)  # keep one epoch ahead
                self._live = live
                return live, g
            live.stop()
        # a dataset in object storage gives its cache each epoch's order when that epoch starts (the
        # plan decides what is downloaded and evicted), so its pipelines do not run on into the next
        pipe = _Crew(self, epoch, start, opts, persistent=self.plan.persistent)
        if pipe.persistent and pipe.run is not None:
            self._live = pipe
            weakref.finalize(self, pipe.stop)  # the Passes collected (with its Loader): its threads stop
        return pipe, 0

    def stop_live(self) -> None:
        """Stop a persistent pipeline running on (a set_epoch / load_state_dict elsewhere, close)."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def _forked_cuda(self) -> bool:
        """In a child of a process that had started CUDA (torch's own record of it)."""
        return fork_generation() > 0 and bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: False)())

    def close(self) -> None:
        """End every pass and stop every thread. Idempotent. A fork()ed child only forgets its parent's."""
        self._after_fork()
        for it in list(self._iters):
            it.close()
        self.stop_live()
        self._ring = None
        self._stage = None
        self.decoders.made.clear()


class _Crew:
    """The worker threads (and the device thread) of one or more epochs' batches in a row.

    Run batch g: the batches of (epoch, from `start`) first, then, for a persistent Loader, whole
    epochs appended one at a time (`append`), so the workers prepare epoch N+1's first batches while
    the training loop drains epoch N. Every batch comes from its epoch's own Filler: the same batches,
    bit for bit, as a fresh `iter()` of that epoch would give."""

    def __init__(self, passes: "Passes", epoch: int, start: int, opts: DeviceOptions | None, persistent: bool,
                 private: bool = False) -> None:
        self.opts = opts
        self.persistent = persistent
        self.dataset = passes.dataset   # not the Passes: collecting it (with its Loader) stops these threads
        parts = passes.plan
        self.spec = spec = passes.spec_for(opts)
        route = spec.route
        self.split = passes.split(route.share) if route.gpu_decode else None
        passes.stats.route = route
        if not route.gpu_decode:
            passes.stats.gpu_share, passes.stats.gpu_split = 0.0, route.cpu_only
        # the engine's float output: where the caller's conversion is a per-level table on the CPU
        floats = (passes.floats(spec, opts) if route.native and not route.gpu_decode and parts.output != "numpy"
                  and spec.buckets is None else None)
        self.chain = EpochChain(spec)
        self.epochs: list[tuple[int, int, int, int]] = []  # (epoch, first run batch, batches, first sample)
        self._orders: list[tuple[int, np.ndarray, int]] = []  # (epoch, its indices, first sample): a worker process's
        sizes = self._segment(parts, epoch, start)
        self.run: Run | None = None
        self.feeder: Feeder | None = None
        self.lease = 0  # which iterator holds the pipeline (see _LoaderIter)
        self.next_g = 0  # the run batch the next iterator starts at (persistent: where the last one ended)
        if not sizes:
            return
        threads = min(parts.num_threads, max(1, sum(sizes)))
        # with a device stage, one more slot: the one whose copy to the device is in flight
        # (the GPU decode pipeline: one more, the slot whose batch is still being decoded)
        extra = 0 if opts is None else 2 if spec.gpu_decode else 1
        if parts.child_spec is not None:   # the threads in a worker process, over a ring in shared memory
            from ..loading.procs import process_run

            self.run = process_run(parts, passes.dataset, passes.stats, self._orders, sizes, threads, extra,
                                   open_ended=persistent)
        else:
            ring = passes.ring(extra=extra, private=private)
            self.run = Run(ring, sizes, threads, self.chain.prepare, self.chain.fill, passes.stats.add,
                           parts.timeout, open_ended=persistent,
                           **run_claims(spec, self.chain, threads, parts.timeout, floats, parts.asked.workers.nice,
                                      parts.asked.workers.max_threads))
        if opts is not None:
            stage = passes.stage(opts)
            build = DeviceBuilder(stage, self.chain, self.run.lock, passes.stats)
            if route.gpu_decode:  # the GPU's columns, decoded while the batch before is finished: gpu_pipeline
                from ..device.gpu_pipeline import PipelinedBuilder, PipelinedFeeder

                stop = threading.Event()
                pipe = PipelinedBuilder(build, passes.decoders.get(opts), self.split, parts.timeout, stop)
                self.feeder = PipelinedFeeder(self.run, stage, build, parts.prefetch, parts.timeout,
                                              stats=passes.stats, measure=pipe.measure, pipe=pipe)
            else:
                self.feeder = Feeder(self.run, stage, build, parts.prefetch, parts.timeout, stats=passes.stats,
                                     measure=build.measure)
        if persistent:
            self.append(parts, epoch + 1)
        self._started = False

    def start(self) -> None:
        """Start the threads (once; call after whoever stops them holds the pipeline, so Ctrl-C landing
        in between cannot leave threads no one stops)."""
        if self.run is None or self._started:
            return
        self._started = True
        self.run.start()
        if self.feeder is not None:
            self.feeder.start()

    def _segment(self, parts: "LoadPlan", epoch: int, start: int) -> list[int]:
        """Batch sizes of `epoch` from its sample `start` on (a resume may start between batches)."""
        indices = parts.epochs.indices(epoch)
        dataset = self.dataset
        if dataset.plans_downloads:  # downloads follow the order; done shards make room
            ahead = (parts.prefetch + 2) * parts.batch_size + parts.num_threads
            dataset.plan(indices[start:], lookahead=ahead, order=parts.order)
        bs, left = parts.batch_size, max(len(indices) - start, 0)
        sizes = [min(bs, left - k * bs) for k in range(-(-left // bs))]
        first = self.epochs[-1][1] + self.epochs[-1][2] if self.epochs else 0
        self.chain.add(Filler(self.spec, dataset, epoch, indices, start, self.split), first)
        self._orders.append((epoch, indices, start))
        self.epochs.append((epoch, first, len(sizes), start))
        return sizes

    def append(self, parts: "LoadPlan", epoch: int) -> None:
        """Queue the whole of `epoch` after the batches already planned (persistent Loaders)."""
        assert self.run is not None
        with self.run.cond:
            self.run.extend(self._segment(parts, epoch, 0))

    def find(self, epoch: int, start: int) -> int | None:
        """The run batch index of (epoch, from sample start), if this pipeline has it ahead."""
        for e, first, n, s0 in self.epochs:
            k, r = divmod(start - s0, self.spec.batch_size)
            if e == epoch and r == 0 and 0 <= k < n:
                return first + k
        return None

    def stop(self) -> None:
        if self.run is not None:
            (self.feeder or self.run).stop(2.0)


def tokenized(tokenizer: Any, column: str, extras: dict[str, Any]) -> dict[str, Any]:
    """The batch's extras with `tokenizer(captions)`'s items added (one call for the batch); a tokenizer that
    fails, or returns anything but a mapping with "input_ids" and "attention_mask" of one row per caption, is
    a ConfigError naming Targets(tokenizer=)."""
    captions = extras[column]
    try:
        got = tokenizer(list(captions))
    except Exception as exc:
        raise ConfigError(f"Targets(tokenizer={getattr(tokenizer, '__name__', type(tokenizer).__name__)}) failed on "
                          f"a batch of {len(captions)} captions: {type(exc).__name__}: {exc}") from exc
    keys = list(got.keys()) if hasattr(got, "keys") else None
    if keys is None or "input_ids" not in keys or "attention_mask" not in keys:
        raise ConfigError(f"Targets(tokenizer=) must return a mapping with 'input_ids' and 'attention_mask' (one row "
                          f"per caption), got {type(got).__name__}{f' with keys {keys}' if keys else ''}")
    for key in ("input_ids", "attention_mask"):
        rows = len(got[key]) if hasattr(got[key], "__len__") and getattr(got[key], "ndim", 1) != 0 else None
        if rows != len(captions):
            found = f"{rows} rows" if rows is not None else f"a {type(got[key]).__name__} (no rows)"
            raise ConfigError(f"Targets(tokenizer=) returned {found} of {key!r} for {len(captions)} captions; it must "
                              f"return one row per caption (a list of lists, an array or a tensor)")
    taken = [k for k in keys if k in extras]
    if taken:
        raise ConfigError(f"Targets(tokenizer=) returned {taken}, which the batch's extras already hold; rename "
                          f"them in the tokenizer, or the columns when packing")
    return {**extras, **{k: got[k] for k in keys}}


def _end_lease(pipe: _Crew, lease: int, keep: list[bool], last: list[int]) -> None:
    """An iterator's end (closed, exhausted or dropped): guard the slot of the last batch it handed out
    (an `images.cuda(non_blocking=True)` may still read it), then stop its pipeline unless it was
    handed on (`keep`) or another iterator holds it."""
    if pipe.run is not None and pipe.run.forked:   # a fork()ed child: the pipeline is its parent's
        return
    if pipe.run is not None and pipe.feeder is None and last[0] >= 0:
        pipe.run.guard(last[0], consumer_fence())
    if pipe.lease == lease and not keep[0]:
        pipe.stop()


class PassIter:
    """One pass over an epoch (from its start, or from where `load_state_dict` put it): the caller's
    iterator. It reports where the data stands to the `Cursor`; closing it (or dropping it) stops its
    threads, unless it ran to the end of its epoch in a persistent Loader: the pipeline then goes on
    with the next epoch."""

    def __init__(self, passes: "Passes", epoch: int, start: int, opts: DeviceOptions | None = None,
                 private: bool = False) -> None:
        parts = passes.plan
        self._parts, self._cursor, self._stats = parts, passes.cursor, passes.stats
        self._epoch = epoch
        bs = parts.batch_size
        left = max(parts.epochs.samples(epoch) - start, 0)
        sizes = [min(bs, left - k * bs) for k in range(-(-left // bs))]
        self._n = len(sizes)
        self._start = start   # samples of the epoch before this pass (a resumed pass)
        self._first_batch = start // bs   # the epoch's batch number of this pass's first batch (batch ops' key)
        self._ends = np.cumsum(sizes, dtype=np.int64) + start if sizes else np.zeros(0, np.int64)
        self._b = 0
        self._closed = False
        pipe, g0 = passes.pipeline_for(epoch, start, opts, private)
        self._pipe, self._g0 = pipe, g0
        self._run, self._feeder = pipe.run, pipe.feeder
        pipe.lease += 1
        self._keep = [False]  # set when the epoch ends in a persistent pipeline: hand it on, do not stop it
        self._last = [-1]  # the run batch handed out last (its slot is guarded at the end)
        self._finalizer = weakref.finalize(self, _end_lease, pipe, pipe.lease, self._keep, self._last)
        pipe.start()

    @property
    def running(self) -> bool:
        """Whether this pass still has batches to hand out and has not been closed."""
        return not self._closed and self._b < self._n

    def __iter__(self) -> "PassIter":
        return self

    def __next__(self) -> tuple:
        if self._closed or self._run is None or self._b >= self._n:
            self.close()
            raise StopIteration
        parts = self._parts
        t0 = time.perf_counter()
        g = self._g0 + self._b
        try:
            if self._feeder is not None:
                batch = self._feeder.get(g)
            else:
                # the yielded batch is a pinned ring slot the caller may have copied asynchronously
                # (`images.cuda(non_blocking=True)`): its refill waits for that copy (Slot.guard)
                slot = self._run.next_batch(g, consumer_fence() if self._b else None)
                self._last[0] = g
        except BaseException:  # SampleError, timeout, Ctrl-C: stop the threads before propagating
            self.close()
            raise
        self._stats.step_wait(time.perf_counter() - t0)
        self._stats.batches += 1
        self._b += 1
        if self._b == self._n:  # the whole epoch was read (even if this iterator is then dropped, not
            # exhausted): a persistent pipeline goes on into the next one
            self._keep[0] = self._pipe.persistent
            self._pipe.next_g = g + 1
        self._cursor.advance(self._epoch, int(self._ends[self._b - 1]), self._b == self._n)
        if self._feeder is not None:   # built by the device thread (DeviceBuilder)
            out = batch
        elif parts.output == "numpy":
            out = numpy_batch(slot, parts.spec.multi_label)
        else:   # the batch ops' key: the batch's index in its epoch
            out = host_batch(slot, parts.spec, self._epoch, self._first_batch + self._b - 1)
        if parts.tokenizer is not None:   # once per batch, on this (the caller's) thread
            t1 = time.perf_counter()
            out = (*out[:2], tokenized(parts.tokenizer, parts.asked.targets.captions, out[2]))
            self._stats.tokenize_s += time.perf_counter() - t1
        if parts.collate is not None:   # the user's batching of the extra columns, on this (their) thread
            out = (*out[:2], parts.collate(out[2]))
        return out

    def close(self) -> None:
        """Stop the worker threads (prompt: they check a stop flag at least every 0.1 s); a persistent
        Loader's pipeline whose epoch was read to the end keeps running into the next one instead.
        The slot of the last batch yielded is guarded by the GPU work queued so far (the ring outlives
        this iterator)."""
        self._closed = True
        self._finalizer()
