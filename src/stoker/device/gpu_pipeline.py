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
import queue
import threading
import time
from collections import deque
from typing import Any

from .._system import join_at_exit
from .._torch import torch
from ..errors import LoaderClosedError, LoaderTimeoutError
from ..loading.jobs import ROW, GpuBatch, GpuRows, JpegStaging, cpu_rows, jpeg_bytes, plan_columns
from ..loading.slots import Slot
from .build import DeviceBuilder
from .feeder import _WAKE, Feeder
from .gpu_split import SplitControl
from .stage import PASSED, convert, storages_on

_log = logging.getLogger("stoker.gpu")

RING = 3  # decoded chunks (and uint8 batch buffers) in flight: decoding, resampling, converting
# how often a blocked wait re-checks the stop flag, seconds: every wait is also woken by what it waits for
# and by a stop (`DecodeThread.wake`), so this is only the safety net, long enough that idle threads cost
# no Python calls to speak of
_POLL_S = 1.0
# the decode thread's wait for the next batch, while the device thread is busy with the last (a slow device
# side): a stop wakes it (`StopFlag.wakes`: `DecodeThread.wake`), so this safety net can be long
_IDLE_POLL_S = 5.0
LOG_EVERY = 100  # batches between two `stoker.gpu` log lines of the phase timers


class _Chunk:
    """One decoded chunk: what the device thread resamples, and how the decode thread knows it is done.

    Made by the decode thread without a constructor call (`_Chunk()`, then its fields set): one per chunk
    on the hot path, so no Python `__init__`; the defaults below are class attributes."""

    placed: Any = None
    failures: Any = None
    decoded: Any = None  # CUDA event after the decode (None on the CPU)
    reads: Any = None  # CUDA event after the resample's reads, recorded by the device thread
    seconds: float = 0.0  # the decode call's host time
    images: int = 0
    last: bool = False  # the last chunk of its ticket: no `_END` follows it


_END = object()   # a ticket's last item when it has no chunks: no more chunks for this batch


class _Ticket:
    """A batch's JPEG rows handed to the decode thread; its chunks come back in order through `out` (a
    C-level queue: a wait for the next chunk is one call), the last one marked `last` (or `_END` alone
    for a batch without chunks), or the exception that stopped it.

    Made per batch without a constructor call, as `_Chunk` (`_Ticket()`, then `jobs`, `out_h`, `out_w`
    and `out` set, in `PipelinedBuilder.submit`; `of` elsewhere); the defaults below are class attributes."""

    jobs: GpuBatch
    out_h: int
    out_w: int
    out: queue.SimpleQueue
    started: Any = None  # CUDA timing event on the decode stream before its first chunk (None on the CPU)
    ended = False  # its last chunk was handed to the device thread (`next_chunk`'s, alone)

    @classmethod
    def of(cls, jobs: GpuBatch, out_h: int, out_w: int) -> "_Ticket":
        """A ticket for `jobs`, resampled to `out_h` x `out_w` outputs (what `submit` makes inline)."""
        made = cls()
        made.jobs, made.out_h, made.out_w, made.out = jobs, out_h, out_w, queue.SimpleQueue()
        return made


class DecodeThread:
    """Decodes the chunks of submitted batches, in order, on its own stream (`stoker-decode`).

    Its hand-offs are C-level queues (`queue.SimpleQueue`): tickets in (`todo`), each ticket's chunks
    out (`_Ticket.out`), and the chunks the device thread is done reading back (`released`, in decode
    order). A wait is then one call, however long it lasts, rather than a Condition's dozen; each wait
    is bounded (`_POLL_S`, re-checking the stop flag), and `wake` unblocks every one with a stop.

    The decoded chunks in flight are a ring of RING entries (`live`, None where free): chunk c takes
    entry c % RING, and with it the decoder's output buffers of that entry (`use_entry`), once the chunk
    that held it before, c - RING, is released, its reads done, and dropped. A chunk whose decode raised
    takes no entry: `count` is the chunks decoded."""

    def __init__(self, gpu: Any, stop: threading.Event, timeout: float, phases: "Phases") -> None:
        self.gpu, self.stop_event, self.timeout, self.phases = gpu, stop, timeout, phases
        self.cuda = gpu.device.type == "cuda"
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.released: queue.SimpleQueue = queue.SimpleQueue()
        self.live: list[_Chunk | None] = [None] * RING  # decoded chunks not yet dropped, by ring entry (this thread's)
        self.count = 0  # chunks decoded
        self.calling_since: float | None = None  # monotonic time the decoder call in progress began
        self.waiting: _Ticket | None = None  # the ticket the device thread reads chunks of (`wake` ends its wait)
        self._use_entry = getattr(gpu.decoder, "use_entry", None)  # `GpuDecoder`'s ring of outputs, if it has one
        self.thread = threading.Thread(target=self._work, name="stoker-decode", daemon=True)

    def start(self) -> None:
        self.thread.start()
        join_at_exit(self.thread, self.stop_event)

    def submit(self, ticket: _Ticket) -> None:
        self.todo.put(ticket)

    def release(self, chunk: _Chunk) -> None:
        """The device thread is done queuing reads of `chunk` (chunks are released in decode order)."""
        self.released.put(chunk)

    def _get(self, q: queue.SimpleQueue) -> Any:
        """The next item of `q`, or None once stopped (`wake` puts _END in both queues; a wait that
        missed it re-checks the stop flag every `_POLL_S`)."""
        while True:
            try:
                item = q.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop_event.is_set():
                    return None
                continue
            return None if item is _END else item

    def _work(self) -> None:
        stream = None
        if self.cuda:
            torch.cuda.set_device(self.gpu.device.index)
            stream = self.gpu.decode_stream()
            torch.cuda.set_stream(stream)   # this thread queues its work on the decode stream only
        self._loop(stream)

    def _loop(self, stream: Any) -> None:
        """Decode each ticket's chunks, each into the next ring entry, until stopped. A chunk is a fixed
        number of calls in steady state: the release of its entry's previous chunk (already queued, its
        reads done: one call, not timed), the decoder call between two clock reads (the first is also
        `calling_since`), the hand-off. `decode_s` and `reads_wait_s` are added to the stats' phase
        totals directly: this thread is their only writer (`Phases.add`)."""
        gpu, todo, released, live = self.gpu, self.todo, self.released, self.live
        totals, use_entry, stop = self.phases.stats.gpu_phases, self._use_entry, self.stop_event
        while True:
            try:
                ticket = todo.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                if stop.is_set():
                    return
                continue
            if ticket is _END:   # `wake`
                return
            out = ticket.out
            try:
                if stream is not None and ticket.jobs.rows.shape[0]:   # the split's GPU time (`_gpu_times`)
                    ticket.started = torch.cuda.Event(enable_timing=True)
                    ticket.started.record(stream)
                chunks = gpu.chunks(ticket.jobs)
                if not chunks:
                    out.put(_END)
                    continue
                last = chunks[-1]
                for jobs in chunks:
                    k = self.count % RING
                    if self.count >= RING:   # entry k's previous chunk: released and read (as a rule) or waited for
                        try:
                            oldest = released.get(False)
                        except queue.Empty:
                            oldest = None
                        if oldest is _END:   # `wake`
                            return
                        if oldest is None or (oldest.reads is not None and not oldest.reads.query()):
                            if (oldest := self._wait_reads(oldest)) is None:
                                return
                        live[k] = None
                        oldest.placed = oldest.failures = None  # its images are free (or reusable by the decoder) now
                    if use_entry is not None:   # a decoder reusing its outputs: this chunk takes those of entry k
                        use_entry(k)
                    self.calling_since = t0 = time.monotonic()
                    try:
                        placed, failures = gpu.decode_chunk(jobs, ticket.out_h, ticket.out_w)
                        event = None
                        if stream is not None:
                            event = torch.cuda.Event(enable_timing=True)
                            event.record(stream)
                    finally:
                        self.calling_since = None
                    chunk = _Chunk()
                    chunk.seconds = time.monotonic() - t0
                    totals["decode_s"] += chunk.seconds
                    chunk.placed, chunk.failures, chunk.decoded = placed, failures, event
                    chunk.images, chunk.last = jobs.rows.shape[0], jobs is last
                    live[k] = chunk
                    self.count += 1
                    out.put(chunk)
            except BaseException as exc:  # reaches the consumer through the device thread, in order
                out.put(exc)

    def _wait_reads(self, oldest: _Chunk | None) -> _Chunk | None:
        """The chunk to drop next (`oldest`, or the next released, None when stopped first) once its reads
        are done: waited for, bounded and stop-aware, and timed (reads_wait_s)."""
        t0 = time.monotonic()
        if oldest is None and (oldest := self._get(self.released)) is None:
            return None
        if oldest.reads is not None:
            oldest.reads.synchronize()
        self.phases.stats.gpu_phases["reads_wait_s"] += time.monotonic() - t0
        return oldest

    def next_chunk(self, ticket: _Ticket) -> _Chunk | None:
        """The next chunk of `ticket` once decoded (None after its last), waiting bounded and stop-aware;
        raises what the decode thread raised for this batch. One call per chunk: the one after the last
        is known without a wait."""
        if ticket.ended:
            return None
        self.waiting = ticket
        try:
            item = ticket.out.get(timeout=_POLL_S)   # the common case: one call
        except queue.Empty:
            item = self._wait_chunk(ticket)
        if item.__class__ is _Chunk:
            ticket.ended = item.last
            return item
        if item is _END:
            return None
        raise item

    def _wait_chunk(self, ticket: _Ticket) -> Any:
        deadline = time.monotonic() + self.timeout
        while True:
            if self.stop_event.is_set():
                raise LoaderClosedError("the loader was closed while a batch was being decoded on the GPU")
            if not self.thread.is_alive():
                raise LoaderClosedError("the stoker decode thread ended before the batch was decoded")
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderTimeoutError(f"the GPU decoder ({self.gpu.decoder.name}) returned nothing for "
                                         f"{self.timeout:g} s; raise workers=stoker.Workers(timeout=...) if "
                                         f"it is genuinely this slow, or use decode='cpu'")
            try:
                return ticket.out.get(timeout=min(_POLL_S, left))
            except queue.Empty:
                continue

    def wake(self) -> None:
        """After the stop flag is set: wake every wait now, the decode thread's and the device thread's
        for a chunk (one that begins after this re-checks the flag within `_POLL_S`)."""
        self.todo.put(_END)
        self.released.put(_END)
        ticket = self.waiting
        if ticket is not None:
            ticket.out.put(LoaderClosedError("the loader was closed while a batch was being decoded on the GPU"))

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
        for name in self.NAMES:
            stats.gpu_phases.setdefault(name, 0.0)

    def add(self, name: str, seconds: float) -> None:
        """Add to one phase. No lock: each phase has one writer thread (decode_s and reads_wait_s the
        decode thread, plan_s the worker flushing its counters under the run's lock (`LoaderStats.add`), the
        others the device thread), and a dict item's update is atomic for its key."""
        self.stats.gpu_phases[name] += seconds

    def line(self, batches: int) -> str:
        p = self.stats.gpu_phases
        parts = ", ".join(f"{name[:-2]} {p[name]:.2f}" for name in self.NAMES)
        return (f"GPU decode after {batches} batches, seconds per phase: {parts}; GPU share "
                f"{self.stats.gpu_share:.0%} ({self.stats.gpu_split})")


class _Pending:
    """A batch submitted to the decode thread, not yet finished; also the guard of its slot. Made per batch
    with no `__init__` call (`PipelinedBuilder.submit` sets `slot`, `x` (its ring buffer), `k` (the buffer's
    place in the ring), `ticket` and `upload_s`)."""

    what = "the GPU decode of a batch"
    slot: Slot
    x: torch.Tensor
    k: int
    ticket: _Ticket
    upload_s: float
    copied: Any = None   # the fence after the last copy from the slot, made when the batch is let go
    # finished (or abandoned): the device thread writes nothing more from or into the slot. Until then only it
    # can clear this guard, so while it waits for the next batch it need not poll it (`slots.Guard`); after,
    # the slot waits for its copies, which are the GPU's
    on_gpu = False

    def let_go(self, fence: Any) -> None:
        """The batch is finished or abandoned; `fence` (on the copy stream, after everything this thread
        queued that reads the slot) says when the slot may be refilled."""
        self.copied, self.on_gpu = fence, True

    def done(self) -> bool:
        """The slot may be refilled: the batch is finished (or abandoned) and its copies have run (its
        fence's `Fence.done`, inlined: the device thread asks once a batch)."""
        if not self.on_gpu:
            return False
        event = self.copied.event
        return event is None or bool(event.query())


class PipelinedBuilder:
    """`DeviceBuilder`'s work split in two for the pipeline: `submit` (upload the rows rendered on the
    CPU into a ring buffer, hand the JPEG rows to the decode thread) and `finish` (resample the
    decoded chunks, CPU fallbacks, convert). Each is a fixed number of Python calls whatever the rows
    (the GPU half's share of the trainer's GIL: benchmarks/bench_calls.py --decode gpu)."""

    def __init__(self, base: DeviceBuilder, gpu: Any, split: SplitControl | None, timeout: float,
                 stop: threading.Event) -> None:
        self.base, self.gpu = base, gpu   # gpu: the gpu_decode.GpuBatchDecoder
        self.stage, self.opts, self.stats = base.stage, base.opts, base.stats
        self.split = split
        self.pinned = self.opts.is_cuda   # staging memory pinned (a property: read once, not per slot)
        self.phases = Phases(self.stats)
        self.decoder = DecodeThread(gpu, stop, timeout, self.phases)
        self.buffers: list[torch.Tensor | None] = [None] * RING
        self.views: list[Any] = [None] * RING   # each buffer as NCHW, what the resample writes
        self.storages: list[dict[int, int]] = [{}] * RING   # each buffer's storage (`measure`'s working bytes)
        # batches whose GPU time is not read yet: (images, events, seconds of CPU fallbacks), oldest first
        self.timings: deque = deque()
        self.turn = 0
        self.batches = 0
        # the last batch built, the device bytes it holds and those of its build's working buffer (`measure`)
        self._held: tuple[Any, int, int] = (None, 0, 0)
        self._kind: tuple | None = None   # the last batch measured from its storages, when another like it needs not be
        # the clock (`time.perf_counter`) read as the last `submit` ended, until a `finish` begins: the device
        # thread goes straight from submitting batch b to finishing batch b-1 (`PipelinedFeeder._loop`), so
        # that reading also starts the finish, and times the slot's guard (`Slot.guarded_at`)
        self.since: float | None = None

    def start(self) -> None:
        self.decoder.start()

    def _buffer(self, shape: tuple) -> tuple[torch.Tensor, int]:
        """The next of RING preallocated uint8 batches (made once per shape) and its place in the ring:
        queued on the copy stream after the previous use of that buffer, so stream order makes the
        reuse safe."""
        k = self.turn
        self.turn = (k + 1) % RING
        x = self.buffers[k]
        if x is None or x.shape != shape:
            x = self.buffers[k] = torch.empty(shape, dtype=torch.uint8, device=self.opts.device)
            self.views[k] = x.permute(0, 3, 1, 2)
            self.storages[k] = storages_on(x, self.opts.device)
        return x, k

    def submit(self, slot: Slot) -> _Pending:
        """Upload the batch's rows rendered on the CPU into the next ring buffer and hand its GPU rows to the
        decode thread (which decodes them while the device thread finishes the batch before)."""
        t0 = time.perf_counter()
        n = slot.size
        # the rows the workers left for the GPU, as columns in row order (`plan_columns`; its first case, one
        # chunk of rows all in the batch, inlined: decode="gpu" makes one chunk a batch)
        chunks = slot.plan.gpu_rows
        only = chunks[0] if len(chunks) == 1 else None
        if only.__class__ is GpuRows and (m := (geo := only.geo).shape[0]) and geo[m - 1, ROW] < n:
            jobs = GpuBatch(geo, only.box, only.data, only.spans, [None] * m, [only.dataset] * m)
        else:
            jobs = plan_columns(slot.plan, n)
        images = slot.images
        k = self.turn   # `_buffer`'s fast path, inlined: it runs per batch
        x = self.buffers[k]
        if x is None or x.shape[0] != n or x.shape[1:] != images.shape[1:]:
            x, k = self._buffer((n, *images.shape[1:]))
        else:
            self.turn = k + 1 if k + 1 < RING else 0
        rows = jobs.rows
        g = rows.shape[0]
        if g == 0 or (rows[0] == n - g and rows[-1] == n - 1):   # the GPU's rows end the batch: one copy
            if g < n:
                x[:n - g].copy_(images[:n - g], non_blocking=True)
        else:
            self.base.upload_rows(slot, x, cpu_rows(n, jobs))
        made = _Ticket()   # `_Ticket.of`, inlined: it runs per batch
        made.jobs, made.out_h, made.out_w, made.out = jobs, x.shape[1], x.shape[2], queue.SimpleQueue()
        staging = slot.staging
        if staging is None or staging.overflow:
            self._stage_bytes(slot, jobs)
        self.decoder.todo.put(made)   # `DecodeThread.submit`
        pending = _Pending()
        pending.slot, pending.x, pending.k, pending.ticket = slot, x, k, made
        self.since = now = time.perf_counter()
        pending.upload_s = now - t0   # the upload and the hand-off to the decode thread
        return pending

    def _stage_bytes(self, slot: Slot, jobs: GpuBatch) -> None:
        """The slot's staging buffer for its next batch, where it has none or this batch's JPEGs did not
        fit (`submit` checks): made (pinned on a CUDA host) 1.5 times this batch's bytes. Once per slot
        in steady state."""
        size = max(jpeg_bytes(jobs) * 3 // 2, 1 << 16)
        slot.staging = JpegStaging(torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned))

    def finish(self, pending: _Pending) -> tuple[Any, Any]:
        """Batch `pending` built (as `DeviceBuilder.__call__` returns it) and its fence, which is also its
        slot's: the slot is let go (`_Pending.let_go`) behind everything that reads it and the batch's
        conversion, one fence for both."""
        t0, self.since = self.since, None   # the end of the submit just made (`since`)
        if t0 is None:   # the run's last batch, finished after the one before it rather than after a submit
            t0 = time.perf_counter()
        t_finish = t0
        slot, x, ticket = pending.slot, pending.x, pending.ticket
        nchw = self.views[pending.k]   # x as NCHW
        stream = self.stage.stream
        decoder, gpu = self.decoder, self.gpu
        failures: list = []
        decode_wait, resample, decode_s = 0.0, 0.0, 0.0
        last_decoded = res_start = None
        chunk = None
        while chunk is None or not chunk.last:   # a batch's last chunk says so: no call to learn it ended
            if (chunk := decoder.next_chunk(ticket)) is None:   # a batch with no GPU row
                break
            t1 = time.perf_counter()
            decode_wait += t1 - t0
            if chunk.decoded is not None:
                stream.wait_event(chunk.decoded)
                last_decoded = chunk.decoded
                if res_start is None:
                    res_start = torch.cuda.Event(enable_timing=True)
                    res_start.record(stream)
            if chunk.failures:
                failures += chunk.failures
            decode_s += chunk.seconds
            more = gpu.resample_chunk(chunk.placed, nchw)
            if more:
                failures += more
            if stream is not None:
                chunk.reads = torch.cuda.Event()
                chunk.reads.record(stream)
            decoder.released.put(chunk)   # `DecodeThread.release`
            t0 = time.perf_counter()
            resample += t0 - t1
        # from here the clock of the last resample: the ticket's end follows its last chunk at once
        events = None
        if res_start is not None and ticket.started is not None:
            res_end = torch.cuda.Event(enable_timing=True)
            res_end.record(stream)
            events = (ticket.started, last_decoded, res_start, res_end)
        base = self.base
        labels, extras = base.host_items(slot) if slot.extras else (base._labels(slot), None)
        fallback = 0.0
        t3 = t0
        if failures:   # rendered on the Python path, and on_error="skip" may replace a sample, label and extras
            self.base.fallback(slot, x, failures)
            labels, extras = self.base.host_items(slot)
            t3 = time.perf_counter()
            fallback = t3 - t0
        k = pending.k
        working = self.storages[k]
        if extras is None and x.ndim == 4 and base.chain.spec.pipeline.batch is None:   # `DeviceBuilder.finish`
            batch = (convert(nchw, self.opts, layout="nchw"), labels)   # with no batch ops nor clips, inlined
            base.working = working
        else:
            batch = base.finish(slot, x, labels, extras, working=working)
        fence = self.stage.fence()
        pending.copied, pending.on_gpu = fence, True   # `_Pending.let_go`, inlined: it runs per batch
        t4 = time.perf_counter()
        p = self.stats.gpu_phases   # this thread is the only writer of these phases (`Phases`)
        p["upload_s"] += pending.upload_s
        p["decode_wait_s"] += decode_wait
        p["resample_s"] += resample
        p["fallback_s"] += fallback
        p["convert_s"] += t4 - t3
        # the GPU side's pace: its busier stage, the decode calls or the resample (they overlap), and the
        # CPU decode of the images it could not decode
        self._account(slot, ticket, failures, gpu_side=(decode_s if decode_s > resample else resample) + fallback,
                      events=events, fallback=fallback)
        self.stats.device_s += pending.upload_s + t4 - t_finish - decode_wait
        # the device bytes the batch holds: a batch like the last one measured (`_measure`) holds the same, with
        # no call to read them; a batch of a kind never cached is measured every time
        images, labels = batch[0], batch[1]
        kind = None
        if (extras is None and labels.__class__ is torch.Tensor and images._base is None and labels._base is None
                and images is not self.buffers[k]):
            kind = (images.shape, images.dtype, images.device, labels.shape, labels.dtype, labels.device)
        if kind is not None and kind == self._kind:
            self._held = (batch, self._held[1], self._held[2])
        else:
            self._measure(batch, kind, k, working)
        return batch, fence

    def _measure(self, batch: tuple, kind: tuple | None, k: int, working: dict[int, int]) -> None:
        """The device bytes `batch` holds and those of ring buffer `k` (`working`) it does not (`measure`),
        read from the storages; a batch that holds the buffer takes it out of the ring. `kind`: the batch's
        images' and labels' shapes, dtypes and devices where both are tensors of their own (no view) and
        there are no extras, else None. A kind whose batch holds fresh outputs only, each the whole of its
        storage, is kept (`_kind`): a batch of the same kind holds the same bytes (`finish` reads them
        from here with no call)."""
        images, labels = batch[0], batch[1]
        held = storages_on(batch, self.opts.device)
        extra = 0   # the working buffer's bytes the batch does not hold (the peak's)
        for ptr, n in working.items():
            if ptr in held:
                self.buffers[k] = None  # handed out as it is: never reused
                kind = None
            else:
                extra += n
        total = sum(held.values())
        device = self.opts.device
        own = (images.nbytes if images.device == device else 0) + (labels.nbytes if labels.device == device else 0)
        if total != own:
            kind = None   # a tensor that is not the whole of its storage: measured every time
        self._kind = kind
        self._held = (batch, total, extra)

    def measure(self, batch: Any) -> tuple[int, int]:
        """`DeviceBuilder.measure`, from what `finish` found for the batch it built last."""
        made, held, extra = self._held
        if batch is not made:
            return self.base.measure(batch)
        return held, extra

    def _account(self, slot: Slot, ticket: _Ticket, failures: list, gpu_side: float, events: Any = None,
                 fallback: float = 0.0) -> None:
        """Count the batch, and feed the split its two sides: the CPU rows' seconds on the workers, the GPU
        rows' seconds (`gpu_side`, host time; on a GPU the device time of the CUDA `events`, read once they
        have completed, `_gpu_times`)."""
        stats = self.stats
        n_gpu = ticket.jobs.rows.shape[0]
        if failures:   # the CPU's fallback decodes are worker-like time, flushed as the workers' are
            with self.base.lock:
                stats.add(self.base.times, 0)
            stats.gpu_fallbacks += len(failures)
        stats.gpu_decoded += n_gpu - len(failures) if failures else n_gpu   # these three: this thread's alone
        stats.gpu_decoder = self.gpu.decoder.name
        split = self.split
        if split is not None and split.fixed is not None:   # gpu_share= fixed: nothing to measure
            stats.gpu_share, stats.gpu_split = split.fixed, split.reason
        elif split is not None:
            cpu_s = sum(slot.plan.cpu_render_s)
            n_cpu = slot.size - n_gpu
            if n_cpu > 0:
                split.observe_cpu(n_cpu, cpu_s)
            if n_gpu and events is not None:   # timed on the GPU, read when done
                self.timings.append((n_gpu - len(failures), events, fallback))
            elif n_gpu:   # what the GPU decoded: its fallbacks were the CPU's work, on its time
                split.observe_gpu(n_gpu - len(failures), gpu_side)
            if self.timings:
                self._gpu_times()
            # the batch's pace: its slower side, each timed where it ran (not the gap between two
            # batches, which a backlog of finished slots would shorten)
            split.observe_batch(slot.size, max(cpu_s / split.threads, gpu_side if n_gpu else 0.0),
                                split=n_gpu > 0)
            split.batch_done()
            stats.gpu_share, stats.gpu_split = split.settled, split.reason
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
        self.stop_event.wakes.append(pipe.decoder.wake)   # however the flag is set (the interpreter's exit too)

    def start(self) -> None:
        self.pipe.start()
        super().start()

    def _loop(self) -> None:
        if not self._bound():
            return
        run, pipe, stop = self.run, self.pipe, self.stop_event
        prev: _Pending | None = None   # submitted, not finished
        last: _Pending | None = None   # submitted just now
        try:
            b = -1
            closed = -1 if run.open_ended else len(run.batch_sizes)   # a closed run: its count, no wait to ask
            while (b := b + 1) < closed or (closed < 0 and self._more(b)):
                if stop.stopped:
                    return
                slot = run._next_batch(b)   # `next_batch` with no guard to set, and no Ctrl-C in this thread
                last = pipe.submit(slot)   # on the copy stream: current since `_bound`
                # `run.guard(b, last)`: b's slot, handed out last, timed by the clock submit read last
                slot.guard, slot.guarded_at = last, pipe.since
                if prev is not None and not self._finish(prev):
                    return
                prev, last = last, None
            if prev is not None:
                self._finish(prev)
        except BaseException as exc:  # for the consumer, in order; this thread is done
            self._put(("error", exc, None))
        finally:   # abandoned: nothing writes their slots any more; their copies are behind one fence
            self._let_go([p for p in (prev, last) if p is not None and not p.on_gpu])

    def _let_go(self, abandoned: list[_Pending]) -> None:
        if not abandoned:
            return
        try:
            fence = self.stage.fence()
        except BaseException:   # CUDA itself failed (the error reaches the consumer): nothing more runs there
            fence = PASSED
        for pending in abandoned:
            pending.let_go(fence)

    def _finish(self, pending: _Pending) -> bool:
        """Finish `pending` and queue its batch (`Feeder._put`, inlined: this runs per batch); False when
        stopped first."""
        out, ready = self.pipe.finish(pending)   # its slot let go, behind the fence `ready`
        held = 0
        if self.stats is not None:
            _, held, extra = self.pipe._held
            self.stats.hold_device(held, extra)
        try:
            token = self.room.get_nowait()
        except queue.Empty:
            token = self._wait_room()
        if token is _WAKE or token is None:   # `stop`
            self._release(held)
            return False
        self.ready.put(("batch", out, (ready, held)))
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
