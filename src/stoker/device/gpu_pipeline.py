"""The GPU decode path pipelined: the decode of batch N+1 overlaps the resample and convert of batch N.

Two device-side threads, both bound to the loader's GPU (worker threads still make no CUDA call):

- the **decode thread** (`DecodeThread`) calls the decoder library on a stream of its own, one chunk
  of a batch at a time (`GpuBatchDecoder.decode_chunk`), and records an event after each;
- the **device thread** (`PipelinedFeeder`, the loader's device thread) hands batch N+1's JPEGs to the
  decode thread as soon as its slot is complete, then finishes batch N: its copy stream waits for
  each chunk's event (on the GPU), resamples it into the batch (`resample_chunk`), decodes the
  samples the GPU could not on the CPU, converts, and queues the batch.

Decoder libraries that block the calling thread while they decode (TorchCodec host-synchronizes its
stream; the hardware JPEG engines write when called) so no longer hold up the resample: device-side
batches/s approach 1 / (decode time), not 1 / (decode + the rest) (benchmarks/bench_gpu_pipeline.py).

Memory: at most `RING` decoded chunks live at once. Before decoding chunk k the decode thread waits
for the device thread to have released chunk k - RING, then for that chunk's reads (an event on the
copy stream, recorded two chunks ago: in steady state it has long completed), and only then drops
its images. So a decoder that writes when called, or one that reuses its output buffers in a ring of
`RING` (`NvImageCodecDecoder(reuse=RING)`: no device allocation per image in steady state), never
writes memory the resample still reads. The uint8 batches the chunks are resampled into come from a
ring of `RING` preallocated buffers too (stream order on the copy stream makes their reuse safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .._system import join_at_exit
from .._torch import torch
from ..errors import LoaderClosedError, LoaderTimeoutError
from ..loading.jobs import GpuBatch, JpegStaging, cpu_rows, jpeg_bytes, plan_columns
from ..loading.slots import Slot
from .build import DeviceBuilder
from .feeder import Feeder
from .gpu_split import SplitControl
from .stage import storages_on

_log = logging.getLogger("stoker.gpu")

RING = 3  # decoded chunks (and uint8 batch buffers) in flight: decoding, resampling, converting
# how often a blocked wait re-checks the stop flag, seconds: every wait is also woken by what it waits for
# and by a stop (`DecodeThread.wake`), so this is only the safety net, long enough that idle threads cost
# no Python calls to speak of
_POLL_S = 1.0
LOG_EVERY = 100  # batches between two `stoker.gpu` log lines of the phase timers


@dataclass(eq=False)
class _Chunk:
    """One decoded chunk: what the device thread resamples, and how the decode thread knows it is done."""

    placed: list
    failures: list
    decoded: Any = None  # CUDA event after the decode (None on the CPU)
    reads: Any = None  # CUDA event after the resample's reads, recorded by the device thread
    released: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0  # the decode call's host time
    images: int = 0


@dataclass(eq=False)
class _Ticket:
    """A batch's JPEG rows handed to the decode thread; its chunks come back in order."""

    jobs: GpuBatch  # the rows to decode
    out_h: int
    out_w: int
    chunks: deque = field(default_factory=deque)
    n_chunks: int = -1  # known once the decode thread has cut the batch
    error: BaseException | None = None
    started: Any = None  # CUDA timing event on the decode stream before its first chunk (None on the CPU)


class DecodeThread:
    """Decodes the chunks of submitted batches, in order, on its own stream (`stoker-decode`)."""

    def __init__(self, gpu: Any, stop: threading.Event, timeout: float, phases: "Phases") -> None:
        self.gpu, self.stop_event, self.timeout, self.phases = gpu, stop, timeout, phases
        self.cuda = gpu.device.type == "cuda"
        self.todo: deque[_Ticket] = deque()
        self.cond = threading.Condition()
        self.live: deque[_Chunk] = deque()  # decoded chunks not yet dropped, oldest first
        self.count = 0  # chunks decoded
        self.calling_since: float | None = None  # monotonic time the decoder call in progress began
        self.thread = threading.Thread(target=self._work, name="stoker-decode", daemon=True)

    def start(self) -> None:
        self.thread.start()
        join_at_exit(self.thread, self.stop_event)

    def submit(self, ticket: _Ticket) -> None:
        with self.cond:
            self.todo.append(ticket)
            self.cond.notify_all()

    def _take(self) -> _Ticket | None:
        with self.cond:
            while not self.todo:
                if self.stop_event.is_set():
                    return None
                self.cond.wait(_POLL_S)
            return self.todo.popleft()

    def _work(self) -> None:
        stream = None
        if self.cuda:
            torch.cuda.set_device(self.gpu.device.index)
            stream = self.gpu.decode_stream()
        while (ticket := self._take()) is not None:
            try:
                chunks = list(self.gpu.chunks(ticket.jobs))
                with self.cond:
                    ticket.n_chunks = len(chunks)
                    self.cond.notify_all()
                if stream is not None and chunks:   # the GPU time of the split (`PipelinedBuilder._gpu_times`)
                    ticket.started = torch.cuda.Event(enable_timing=True)
                    ticket.started.record(stream)
                for jobs in chunks:
                    if not self._make_room():
                        return
                    chunk = self._decode(jobs, ticket, stream)
                    with self.cond:
                        self.live.append(chunk)
                        ticket.chunks.append(chunk)
                        self.cond.notify_all()
            except BaseException as exc:  # reaches the consumer through the device thread, in order
                with self.cond:
                    ticket.error = exc
                    self.cond.notify_all()

    def _make_room(self) -> bool:
        """Wait until fewer than RING chunks are live: the oldest released by the device thread, its
        reads done (an event two chunks old), then dropped. False when stopped first."""
        while len(self.live) >= RING:
            oldest = self.live[0]
            t0 = time.perf_counter()
            while not oldest.released.wait(_POLL_S):
                if self.stop_event.is_set():
                    return False
            if self.stop_event.is_set():   # woken by `wake`, not by the device thread
                return False
            if oldest.reads is not None:
                oldest.reads.synchronize()
            self.phases.add("reads_wait_s", time.perf_counter() - t0)
            with self.cond:
                self.live.popleft()
            oldest.placed = oldest.failures = []  # its images are free (or reusable by the decoder) now
        return True

    def _decode(self, jobs: list, ticket: _Ticket, stream: Any) -> _Chunk:
        use_entry = getattr(self.gpu.decoder, "use_entry", None)
        if use_entry is not None:  # a decoder reusing its outputs: this chunk takes those of chunk k - RING
            use_entry(self.count % RING)
        self.count += 1
        t0 = time.perf_counter()
        self.calling_since = time.monotonic()
        try:
            if stream is None:
                placed, failures = self.gpu.decode_chunk(jobs, ticket.out_h, ticket.out_w)
                event = None
            else:
                with torch.cuda.stream(stream):
                    placed, failures = self.gpu.decode_chunk(jobs, ticket.out_h, ticket.out_w)
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(stream)
        finally:
            self.calling_since = None
        seconds = time.perf_counter() - t0
        self.phases.add("decode_s", seconds)
        return _Chunk(placed, failures, event, seconds=seconds, images=len(jobs.rows))

    def next_chunk(self, ticket: _Ticket, k: int) -> _Chunk | None:
        """Chunk k of `ticket` once decoded (None when the batch has fewer), waiting bounded and
        stop-aware; raises what the decode thread raised for this batch."""
        deadline = time.monotonic() + self.timeout
        with self.cond:
            while True:
                if ticket.error is not None:
                    raise ticket.error
                if k < len(ticket.chunks):
                    return ticket.chunks[k]
                if 0 <= ticket.n_chunks <= k:
                    return None
                if self.stop_event.is_set():
                    raise LoaderClosedError("the loader was closed while a batch was being decoded on the GPU")
                if not self.thread.is_alive():
                    raise LoaderClosedError("the stoker decode thread ended before the batch was decoded")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderTimeoutError(f"the GPU decoder ({self.gpu.decoder.name}) returned nothing for "
                                             f"{self.timeout:g} s; raise workers=stoker.Workers(timeout=...) if "
                                             f"it is genuinely this slow, or use decode='cpu'")
                self.cond.wait(min(_POLL_S, left))

    def wake(self) -> None:
        """After the stop flag is set: wake every wait on this thread's condition and chunks now."""
        with self.cond:
            self.cond.notify_all()
            for chunk in self.live:
                chunk.released.set()

    def join(self, timeout: float) -> None:
        self.wake()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)


class Phases:
    """Seconds per phase of the GPU decode path (LoaderStats.gpu_phases), summed over batches:
    plan_s (the workers' crop windows and byte copies), upload_s, decode_s (decoder calls, on the
    decode thread), reads_wait_s (the decode thread waiting for a chunk's reads before reusing its
    memory), decode_wait_s (the device thread waiting for a decoded chunk), resample_s, fallback_s
    (the CPU decode of samples the GPU could not), convert_s (conversion and batch ops)."""

    NAMES = ("plan_s", "upload_s", "decode_s", "reads_wait_s", "decode_wait_s", "resample_s", "fallback_s",
             "convert_s")

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.lock = threading.Lock()
        for name in self.NAMES:
            stats.gpu_phases.setdefault(name, 0.0)

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.stats.gpu_phases[name] += seconds

    def line(self, batches: int) -> str:
        p = self.stats.gpu_phases
        parts = ", ".join(f"{name[:-2]} {p[name]:.2f}" for name in self.NAMES)
        return (f"GPU decode after {batches} batches, seconds per phase: {parts}; GPU share "
                f"{self.stats.gpu_share:.0%} ({self.stats.gpu_split})")


class _Pending:
    """A batch submitted to the decode thread, not yet finished; also the guard of its slot."""

    what = "the GPU decode of a batch"

    def __init__(self, slot: Slot, x: torch.Tensor, ticket: _Ticket, copied: Any, t0: float) -> None:
        self.slot, self.x, self.ticket, self.copied, self.t0 = slot, x, ticket, copied, t0
        self.finished = False  # set by the device thread once nothing more is written from or into the slot
        self.submit_s = 0.0

    def done(self) -> bool:
        """The slot may be refilled: the batch is finished (or abandoned) and its copies have run."""
        return self.finished and self.copied.done()

    @property
    def on_gpu(self) -> bool:
        """Until the device thread finishes the batch, only it can clear this guard: the device thread
        waiting for the next batch need not poll it (`slots.Guard`); after, its copies are the GPU's."""
        return self.finished


class PipelinedBuilder:
    """`DeviceBuilder`'s work split in two for the pipeline: `submit` (upload the rows rendered on the
    CPU into a ring buffer, hand the JPEG rows to the decode thread) and `finish` (resample the
    decoded chunks, CPU fallbacks, convert)."""

    def __init__(self, base: DeviceBuilder, gpu: Any, split: SplitControl | None, timeout: float,
                 stop: threading.Event) -> None:
        self.base, self.gpu = base, gpu   # gpu: the gpu_decode.GpuBatchDecoder
        self.stage, self.opts, self.stats = base.stage, base.opts, base.stats
        self.split = split
        self.phases = Phases(self.stats)
        self.decoder = DecodeThread(gpu, stop, timeout, self.phases)
        self.buffers: list[torch.Tensor | None] = [None] * RING
        # batches whose GPU time is not read yet: (images, events, seconds of CPU fallbacks), oldest first
        self.timings: deque = deque()
        self.turn = 0
        self.batches = 0
        self.measure = base.measure

    def start(self) -> None:
        self.decoder.start()

    def _buffer(self, shape: tuple) -> torch.Tensor:
        """The next of RING preallocated uint8 batches (made once per shape): queued on the copy stream
        after the previous use of that buffer, so stream order makes the reuse safe."""
        k = self.turn
        self.turn = (k + 1) % RING
        x = self.buffers[k]
        if x is None or tuple(x.shape) != tuple(shape):
            x = self.buffers[k] = torch.empty(shape, dtype=torch.uint8, device=self.opts.device)
        return x

    def submit(self, slot: Slot) -> _Pending:
        t0 = time.perf_counter()
        n = slot.size
        jobs = plan_columns(slot.plan, n)   # the rows the workers left for the GPU, as columns in row order
        x = self._buffer(tuple(slot.images[:n].shape))
        self.base.upload_rows(slot, x, cpu_rows(n, jobs))
        t1 = time.perf_counter()
        self.phases.add("upload_s", t1 - t0)
        if slot.plan.gpu_plan_s:
            self.phases.add("plan_s", sum(slot.plan.gpu_plan_s))
        ticket = _Ticket(jobs, x.shape[1], x.shape[2])
        self._stage_bytes(slot, ticket.jobs)
        self.decoder.submit(ticket)
        pending = _Pending(slot, x, ticket, self.stage.fence(), t0)
        pending.submit_s = time.perf_counter() - t0
        return pending

    def _stage_bytes(self, slot: Slot, jobs: GpuBatch) -> None:
        """The slot's staging buffer for its next batch: made (pinned on a CUDA host) the first time, or
        larger when this batch's JPEGs did not fit; 1.5 times this batch's bytes. Once per slot in
        steady state."""
        staging = slot.staging
        used = jpeg_bytes(jobs)
        if staging is not None and staging.overflow == 0:
            return
        size = max(used * 3 // 2, 1 << 16)
        pin = self.opts.is_cuda
        slot.staging = JpegStaging(torch.empty(size, dtype=torch.uint8, pin_memory=pin))

    def finish(self, pending: _Pending) -> tuple[Any, Any]:
        """Batch `pending` built (as `DeviceBuilder.__call__` returns it) and its fence."""
        t_finish = time.perf_counter()
        slot, x, ticket = pending.slot, pending.x, pending.ticket
        nchw = x.permute(0, 3, 1, 2)
        failures: list = []
        k, decode_wait, resample, decode_s = 0, 0.0, 0.0, 0.0
        cuda = self.stage.stream is not None
        last_decoded = res_start = None
        while True:
            t0 = time.perf_counter()
            chunk = self.decoder.next_chunk(ticket, k)
            t1 = time.perf_counter()
            decode_wait += t1 - t0
            if chunk is None:
                break
            if chunk.decoded is not None:
                self.stage.stream.wait_event(chunk.decoded)
                last_decoded = chunk.decoded
                if res_start is None:
                    res_start = torch.cuda.Event(enable_timing=True)
                    res_start.record(self.stage.stream)
            failures += chunk.failures
            decode_s += chunk.seconds
            failures += self.gpu.resample_chunk(chunk.placed, nchw)
            if self.stage.stream is not None:
                chunk.reads = torch.cuda.Event()
                chunk.reads.record(self.stage.stream)
            chunk.released.set()
            resample += time.perf_counter() - t1
            k += 1
        self.phases.add("decode_wait_s", decode_wait)
        self.phases.add("resample_s", resample)
        events = None
        if cuda and res_start is not None and ticket.started is not None:
            res_end = torch.cuda.Event(enable_timing=True)
            res_end.record(self.stage.stream)
            events = (ticket.started, last_decoded, res_start, res_end)
        t2 = time.perf_counter()
        labels, extras = self.base.host_items(slot)
        if failures:   # rendered on the Python path, and on_error="skip" may replace a sample, label and extras
            self.base.fallback(slot, x, failures)
            labels, extras = self.base.host_items(slot)
        fallback = time.perf_counter() - t2
        self.phases.add("fallback_s", fallback)
        reusable = self.stage.fence()
        pending.copied, pending.finished = reusable, True
        t3 = time.perf_counter()
        batch = self.base.finish(slot, x, labels, extras)
        t4 = time.perf_counter()
        self.phases.add("convert_s", t4 - t3)
        # the GPU side's pace: its busier stage, the decode calls or the resample (they overlap), and the
        # CPU decode of the images it could not decode
        self._account(slot, ticket, failures, gpu_side=max(decode_s, resample) + (fallback if failures else 0.0),
                      events=events, fallback=fallback if failures else 0.0)
        self.stats.device_s += pending.submit_s + t4 - t_finish - decode_wait
        self.base.working = storages_on(x, self.opts.device)
        if storages_on(batch, self.opts.device).keys() & self.base.working.keys():
            self.buffers[self.buffers.index(x)] = None  # handed out as it is: never reused
        return batch, reusable

    def _account(self, slot: Slot, ticket: _Ticket, failures: list, gpu_side: float, events: Any = None,
                 fallback: float = 0.0) -> None:
        """Count the batch, and feed the split its two sides: the CPU rows' seconds on the workers, the GPU
        rows' seconds (`gpu_side`, host time; on a GPU the device time of the CUDA `events`, read once they
        have completed, `_gpu_times`)."""
        stats = self.stats
        n_gpu = len(ticket.jobs)
        with self.base.lock:
            stats.add(self.base.times, 0)
            stats.gpu_decoded += n_gpu - len(failures)
            stats.gpu_fallbacks += len(failures)
            stats.gpu_decoder = self.gpu.decoder.name
        if self.split is not None:
            cpu_s = sum(slot.plan.cpu_render_s)
            n_cpu = slot.size - n_gpu
            if n_cpu > 0:
                self.split.observe_cpu(n_cpu, cpu_s)
            if n_gpu and events is not None:   # timed on the GPU, read when done
                self.timings.append((n_gpu - len(failures), events, fallback))
            elif n_gpu:   # what the GPU decoded: its fallbacks were the CPU's work, on its time
                self.split.observe_gpu(n_gpu - len(failures), gpu_side)
            self._gpu_times()
            # the batch's pace: its slower side, each timed where it ran (not the gap between two
            # batches, which a backlog of finished slots would shorten)
            self.split.observe_batch(slot.size, max(cpu_s / self.split.threads, gpu_side if n_gpu else 0.0),
                                     split=n_gpu > 0)
            self.split.batch_done()
            stats.gpu_share, stats.gpu_split = self.split.settled, self.split.reason
        self.batches += 1
        if self.batches % LOG_EVERY == 0:
            _log.info(self.phases.line(self.batches))

    def _gpu_times(self) -> None:
        """Feed the split the GPU time of every earlier batch whose events have completed (`query`: never
        a wait): its busier stream, the decode (from before its first chunk to after its last) or the
        resample (they overlap across batches), plus the host seconds of its CPU fallbacks."""
        timings = self.timings
        while timings:
            images, (started, decoded, res_start, res_end), fallback = timings[0]
            if not res_end.query() or not decoded.query():
                return
            timings.popleft()
            ms = max(started.elapsed_time(decoded), res_start.elapsed_time(res_end))
            self.split.observe_gpu(images, ms / 1e3 + fallback)   # type: ignore[union-attr]

    def close(self, timeout: float) -> None:
        self.decoder.join(timeout)
        if self.batches:
            _log.info(self.phases.line(self.batches))


class PipelinedFeeder(Feeder):
    """The device thread with the GPU decode pipelined: batch b is submitted to the decode thread as
    soon as its slot is complete, then batch b-1 is finished and queued (`PipelinedBuilder`). The slot
    of batch b stays guarded until its batch is finished and its copies have run."""

    def __init__(self, *args: Any, pipe: PipelinedBuilder, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipe = pipe
        pipe.decoder.stop_event = self.stop_event

    def start(self) -> None:
        self.pipe.start()
        super().start()

    def _loop(self) -> None:
        if not self._bound():
            return
        open_: deque[_Pending] = deque()  # submitted, not finished: at most two
        try:
            b = -1
            while self._more(b := b + 1):
                if self.stop_event.is_set():
                    return
                slot = self.run.next_batch(b)
                with self.stage.context():
                    submitted = self.pipe.submit(slot)
                open_.append(submitted)
                self.run.guard(b, submitted)
                if len(open_) > 1 and not self._finish(open_.popleft()):
                    return
            while open_:
                if not self._finish(open_.popleft()):
                    return
        except BaseException as exc:  # for the consumer, in order; this thread is done
            self._put(("error", exc, None))
        finally:
            for pending in open_:
                pending.finished = True  # abandoned: nothing writes its slot any more (its copies: `copied`)

    def _finish(self, pending: _Pending) -> bool:
        try:
            with self.stage.context():
                out, _ = self.pipe.finish(pending)
                ready = self.stage.fence()
        finally:
            pending.finished = True
        held = self._hold(out)
        if not self._put(("batch", out, (ready, held))):
            self._release(held)
            return False
        return True

    def _stuck(self) -> str:
        since = self.pipe.decoder.calling_since
        if since is None:
            return ""
        return (f"the GPU decoder ({self.pipe.gpu.decoder.name}) has been inside one decode call for "
                f"{time.monotonic() - since:.0f} s; if it is hung, use decode='cpu'")

    def stop(self, join_timeout: float = 5.0) -> None:
        if self.run.forked:   # the decode thread is the parent's
            return
        self.stop_event.set()
        self.pipe.decoder.wake()   # the device thread may be waiting for a decoded chunk
        super().stop(join_timeout)
        self.pipe.close(join_timeout)
