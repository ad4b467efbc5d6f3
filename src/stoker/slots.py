"""The batch ring and the worker threads that fill it.

A ring of `prefetch + 1` preallocated slots, each a `uint8 [B, H, W, 3]` tensor (pinned when CUDA is
available) plus a label array. Worker threads claim sample positions from one shared counter, in
order, and write each sample straight into its row; the consumer takes batches in order. A slot is
refilled only after the consumer has moved past the batch it held, so memory is bounded by the ring
and a yielded batch stays valid until the next step.

Threads, not processes: libjpeg-turbo, OpenCV and Pillow release the GIL while they work, so the
threads share one address space and write directly into (pinned) batch memory. What runs under the
GIL per sample is a counter increment, two list appends and the Python glue of the fill function;
the lock is taken once per batch (by the worker that completes it), which also flushes the stats.

Every wait has a timeout and checks the stop flag. Worker threads hold no reference to the
iterator that owns a run, so an abandoned iterator can be collected; its finalizer stops the run.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

import numpy as np

from ._torch import torch
from ._system import poll_until
from .errors import ConfigError, LoaderClosedError, LoaderTimeoutError, WorkerError

_POLL_S = 0.1  # how often a blocked wait re-checks the stop flag, seconds


class Fence(Protocol):
    """What the Feeder and the workers need of a point on a CUDA stream (device.Fence is one)."""

    def done(self) -> bool: ...

    def wait(self, timeout: float, stop: threading.Event | None = None) -> None: ...


class Stage(Protocol):
    """What the Feeder needs of the device stage (device.DeviceStage is one)."""

    def context(self) -> ContextManager[None]: ...

    def fence(self) -> Any: ...

    def handoff(self, batch: Any, fence: Any) -> Any: ...


def _release_if_owned(cond: threading.Condition) -> None:
    """After an exception in the consuming thread: give the lock back if this thread still holds it.

    Ctrl-C raises KeyboardInterrupt at the next bytecode boundary, which can fall inside
    Condition.__enter__ after the lock was taken but before the with-block began, so __exit__ never
    runs and every worker would block on the lock forever. Locks here are RLocks, so this thread
    can tell whether it owns one."""
    while cond._is_owned():  # type: ignore[attr-defined]
        cond.release()


def notify_all(cond: threading.Condition) -> None:
    """Wake every waiter of `cond`; safe against Ctrl-C landing while the lock is held."""
    try:
        with cond:
            cond.notify_all()
    except BaseException:
        _release_if_owned(cond)
        raise


@dataclass
class Slot:
    """One batch buffer. `images`/`labels` are preallocated tensors; `*_np` are numpy views of them."""

    images: torch.Tensor
    images_np: np.ndarray
    labels: torch.Tensor | None
    labels_np: np.ndarray | None
    objects: list[Any] = field(default_factory=list)  # labels that are not numbers (str, lists)
    extras: dict[str, Any] = field(default_factory=dict)  # column -> list per row; "sizes" -> tensor (pad=True)
    batch: int = -1  # which batch of the run the slot holds
    # GPU work the consumer queued that may still read this slot (its `images.cuda(non_blocking=True)`):
    # the workers refill the slot only once this fence is done (`Run.next_batch(b, guard)`)
    guard: Fence | None = None
    size: int = 0  # samples in that batch
    remaining: int = 0  # samples not yet written; 0 once the batch is complete
    finished: list[int] = field(default_factory=list)  # rows written so far (appended without a lock)
    plan: Any = None  # the fill function's per-batch plan
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    jobs: list[Any] = field(default_factory=list)  # per row: work left for the device stage (GPU decode)


def ring_bytes(n_slots: int, batch_size: int, height: int, width: int) -> int:
    """Bytes a ring of ``n_slots`` batches of uint8 ``[batch_size, height, width, 3]`` images
    (plus int64 labels) holds."""
    return n_slots * batch_size * (height * width * 3 + 8)


def check_ring_fits(n_slots: int, batch_size: int, height: int, width: int) -> None:
    """Refuse, before allocating, a ring larger than the memory available now (an allocation that
    would fail with a bare RuntimeError deep in torch, or push the machine into swap), naming the
    knobs that size it."""
    import psutil

    need = ring_bytes(n_slots, batch_size, height, width)
    available = psutil.virtual_memory().available
    if need > available:
        raise ConfigError(f"the batch ring needs {n_slots} slots x {batch_size} images x {height}x{width}x3 bytes = "
                          f"{need / 2**30:,.1f} GiB, but only {available / 2**30:,.1f} GiB of memory is available; "
                          "lower batch_size= (--batch-size), prefetch= or the output size of the transforms")


class BatchRing:
    """`n_slots` preallocated batches: images uint8 [batch_size, height, width, 3] and labels."""

    def __init__(self, n_slots: int, batch_size: int, height: int, width: int, *,
                 label_dtype: np.dtype | None, pin_memory: bool) -> None:
        self.batch_size, self.height, self.width = batch_size, height, width
        self.label_dtype = label_dtype
        self.pin_memory = pin_memory
        check_ring_fits(n_slots, batch_size, height, width)
        try:
            self.slots = [self._make_slot(pin_memory) for _ in range(n_slots)]
        except (RuntimeError, MemoryError) as exc:  # the memory went between the check and now
            raise ConfigError(f"cannot allocate the batch ring ({n_slots} slots x {batch_size} images x "
                              f"{height}x{width}x3 bytes): {exc}; lower batch_size= (--batch-size), prefetch= "
                              "or the output size of the transforms") from None

    def _make_slot(self, pin: bool) -> Slot:
        images = torch.empty((self.batch_size, self.height, self.width, 3), dtype=torch.uint8, pin_memory=pin)
        labels = None
        if self.label_dtype is not None:
            labels = torch.empty(self.batch_size, dtype=torch.from_numpy(np.empty(0, self.label_dtype)).dtype,
                                 pin_memory=pin)
        return Slot(images, images.numpy(), labels, None if labels is None else labels.numpy(),
                    objects=[None] * self.batch_size)

    def matches(self, n_slots: int, batch_size: int, height: int, width: int, label_dtype: np.dtype | None,
                pin_memory: bool) -> bool:
        """True when this ring can be reused for a run with these parameters."""
        return (len(self.slots), self.batch_size, self.height, self.width, self.label_dtype,
                self.pin_memory) == (n_slots, batch_size, height, width, label_dtype, pin_memory)


@dataclass
class LoaderStats:
    """Counters of a Loader since it was made. Stage times are summed over worker threads (seconds)."""

    samples: int = 0
    batches: int = 0
    skipped: int = 0  # failed samples replaced under on_error="skip"
    skipped_keys: list[str] = field(default_factory=list)  # the first 100 of them
    read_s: float = 0.0  # getting the stored bytes (mmap view, or a file read for loose data)
    decode_s: float = 0.0
    augment_s: float = 0.0  # crop, resize, flip, user transforms, writing into the batch
    worker_wait_s: float = 0.0  # workers waiting for a free slot (the consumer is the bottleneck)
    consumer_wait_s: float = 0.0  # the training loop waiting for a batch (the loader is the bottleneck)
    device_s: float = 0.0  # the device thread building batches: uploads, conversion, GPU decode submission
    gpu_decoded: int = 0  # samples decoded on the GPU (decode="gpu")
    gpu_fallbacks: int = 0  # JPEGs the GPU could not decode, decoded on the CPU instead
    gpu_decoder: str = ""  # decode="gpu": the backend that decoded them (with what "auto" measured)

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}

    def add(self, times: "WorkerTimes", samples: int) -> None:
        """Add a worker's counters since its last flush (call under the run's lock) and reset them."""
        self.samples += samples
        self.read_s += times.read
        self.decode_s += times.decode
        self.augment_s += times.augment
        self.worker_wait_s += times.wait
        self.skipped += times.skipped
        if times.skipped_keys and len(self.skipped_keys) < 100:
            self.skipped_keys.extend(times.skipped_keys[:100 - len(self.skipped_keys)])
        times.read = times.decode = times.augment = times.wait = 0.0
        times.skipped = 0
        times.skipped_keys.clear()


@dataclass
class WorkerTimes:
    """Seconds one worker spent per stage since the last flush into the shared stats."""

    read: float = 0.0
    decode: float = 0.0
    augment: float = 0.0
    wait: float = 0.0
    skipped: int = 0
    skipped_keys: list[str] = field(default_factory=list)


PrepareFn = Callable[[int, Slot], Any]  # (batch, slot) -> plan; fills labels/extras of the slot
FillFn = Callable[[Any, int, Slot, dict, WorkerTimes], None]  # (plan, row, slot, scratch, times)
FlushFn = Callable[[WorkerTimes, int], None]  # (times, samples done) under the run's lock


class Run:
    """One pass over `batch_sizes` batches: worker threads fill ring slots, `next_batch` hands them out.

    `prepare(b, slot)` runs once per batch (in whichever worker gets there first, under a lock) and
    returns the plan; `fill(plan, row, slot, scratch, times)` writes one sample. Exceptions from fill
    are kept per row and raised by `next_batch` for the first failing row of that batch."""

    def __init__(self, ring: BatchRing, batch_sizes: list[int], num_threads: int, prepare: PrepareFn,
                 fill: FillFn, flush: FlushFn, timeout: float, name: str = "stoker", open_ended: bool = False
                 ) -> None:
        self.ring = ring
        self.n_slots = len(ring.slots)
        self.batch_sizes = list(batch_sizes)
        self._starts = list(itertools.accumulate(self.batch_sizes, initial=0))  # first position of each batch
        self.total = self._starts[-1]
        # open_ended: batches may be appended (`extend`, the next epoch of a persistent Loader); workers
        # that run out wait for them (stop-aware) instead of exiting
        self.open_ended = open_ended
        self.prepare, self.fill, self.flush = prepare, fill, flush
        self.timeout = timeout
        self.lock = threading.RLock()  # an RLock so the consumer can tell it still holds it (Ctrl-C)
        self.cond = threading.Condition(self.lock)
        self.stop_event = threading.Event()
        self.released = 0  # batches the consumer has moved past; slots of batches < released + n_slots are free
        self.fatal: BaseException | None = None
        self.stalled: LoaderTimeoutError | None = None  # a slot's guard never completed
        self._counter = itertools.count()
        self.threads = [threading.Thread(target=self._work, name=f"{name}-worker-{k}", daemon=True)
                        for k in range(num_threads)]
        for s in ring.slots:
            s.batch = -1

    def start(self) -> None:
        for t in self.threads:
            t.start()

    # ---- workers -------------------------------------------------------------------------
    def extend(self, batch_sizes: list[int]) -> None:
        """Append batches to an open-ended run (their plans come from `prepare` like the others)."""
        with self.cond:
            for size in batch_sizes:
                self.batch_sizes.append(size)
                self._starts.append(self._starts[-1] + size)
            self.total = self._starts[-1]
            self.cond.notify_all()

    def _claim(self) -> tuple[int, int] | None:
        p = next(self._counter)  # atomic under the GIL: positions are handed out once, in order
        if p >= self.total:
            if not self.open_ended:
                return None
            with self.cond:
                while p >= self.total and not self.stop_event.is_set():
                    self.cond.wait(_POLL_S)
            if p >= self.total:
                return None
        b = bisect.bisect_right(self._starts, p) - 1  # a partial batch may end an epoch mid-run
        return b, p - self._starts[b]

    def _wait_slot(self, b: int, times: WorkerTimes) -> Slot | None:
        if b >= self.released + self.n_slots:
            t0 = time.perf_counter()
            with self.cond:
                while b >= self.released + self.n_slots and not self.stop_event.is_set():
                    self.cond.wait(_POLL_S)
            times.wait += time.perf_counter() - t0
        if self.stop_event.is_set():
            return None
        slot = self.ring.slots[b % self.n_slots]
        if slot.batch != b:
            if not self._wait_guard(slot, b, times):
                return None
            with self.lock:
                if slot.batch != b:  # first worker on this batch: plan it
                    slot.errors = []
                    slot.finished = []
                    slot.size = slot.remaining = self.batch_sizes[b]
                    slot.plan = self.prepare(b, slot)
                    slot.batch = b
        return slot

    def _wait_guard(self, slot: Slot, b: int, times: WorkerTimes) -> bool:
        """Before batch b overwrites `slot`: wait (polling, bounded by `timeout`) until the GPU has run
        what the consumer queued on the batch the slot held. False when stopped or timed out (the
        timeout then reaches the consumer as a LoaderTimeoutError)."""
        guard = slot.guard
        if guard is None or guard.done():
            return True
        t0 = time.perf_counter()
        try:
            guard.wait(self.timeout, self.stop_event)
        except LoaderTimeoutError as exc:
            with self.lock:
                self.stalled = LoaderTimeoutError(f"batch {b} cannot be written into its slot: {exc}")
                self.cond.notify_all()
            return False
        finally:
            times.wait += time.perf_counter() - t0
        if self.stop_event.is_set():
            return False
        slot.guard = None
        return True

    def _work(self) -> None:
        scratch: dict = {}
        times = WorkerTimes()
        done = 0  # samples written since this worker last flushed its counters
        try:
            while not self.stop_event.is_set():
                claim = self._claim()
                if claim is None:
                    break
                b, row = claim
                slot = self._wait_slot(b, times)
                if slot is None:
                    break
                try:
                    self.fill(slot.plan, row, slot, scratch, times)
                except BaseException as exc:  # kept for the consumer, which raises it in order
                    slot.errors.append((row, exc))
                done += 1
                # No lock per sample: list.append is atomic under the GIL, and only the worker that
                # sees the last row arrive takes the lock, to flush its counters and wake the consumer.
                finished, size = slot.finished, slot.size
                finished.append(row)
                if len(finished) == size:
                    with self.lock:
                        self.flush(times, done)
                        done = 0
                        if slot.finished is finished:  # still this batch (not refilled meanwhile)
                            slot.remaining = 0
                            self.cond.notify_all()
        except BaseException as exc:  # a bug in the loop itself: never die silently
            with self.lock:
                self.fatal = exc
                self.cond.notify_all()
        finally:
            if done:  # what was written since the last completed batch
                with self.lock:
                    self.flush(times, done)

    # ---- consumer ------------------------------------------------------------------------
    def next_batch(self, b: int, guard: Fence | None = None) -> Slot:
        """Release batch b-1 and return the slot of batch b once every row is written.

        `guard`: a fence behind the consumer's GPU work on batch b-1 (an asynchronous copy of its pinned
        slot); the workers refill that slot only once it is done. Raises the first row's exception when
        a sample failed, LoaderTimeoutError after `timeout` seconds without the batch completing."""
        self.guard(b - 1, guard)  # before the release in _next_batch: no worker sees the slot unguarded
        try:
            return self._next_batch(b)
        except BaseException:
            _release_if_owned(self.cond)
            raise

    def guard(self, b: int, guard: Fence | None) -> None:
        """Guard the slot of batch b (already yielded, the run ending or closing): see `next_batch`.
        The ring outlives the run, so the next run's workers honour it too."""
        if guard is not None and b >= 0:
            slot = self.ring.slots[b % self.n_slots]
            if slot.batch == b:
                slot.guard = guard

    def _next_batch(self, b: int) -> Slot:
        slot = self.ring.slots[b % self.n_slots]
        deadline = time.monotonic() + self.timeout
        with self.cond:
            if self.released < b:
                self.released = b
                self.cond.notify_all()
            while not (slot.batch == b and slot.remaining == 0):
                if self.fatal is not None:
                    raise WorkerError(f"a stoker worker thread failed outside any sample: {self.fatal!r}; "
                                      f"this is a bug in stoker, please report it with the traceback") from self.fatal
                if self.stalled is not None:
                    raise self.stalled
                if self.stop_event.is_set():
                    raise LoaderClosedError(f"the loader was closed while waiting for batch {b}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pending = slot.size - len(slot.finished) if slot.batch == b else self.batch_sizes[b]
                    raise LoaderTimeoutError(
                        f"batch {b}: no complete batch after {self.timeout:.0f} s ({pending} of "
                        f"{self.batch_sizes[b]} samples pending, {sum(t.is_alive() for t in self.threads)} "
                        f"worker threads alive); storage may be stalled or a transform hangs — raise "
                        f"Loader(timeout=...) if samples are genuinely this slow")
                self.cond.wait(min(_POLL_S, left))
        if slot.errors:
            row, exc = min(slot.errors, key=lambda e: e[0])
            raise exc
        return slot

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop the workers and wait (bounded) for them to exit. Safe to call repeatedly, from any thread."""
        self.stop_event.set()
        notify_all(self.cond)
        me = threading.current_thread()
        deadline = time.monotonic() + join_timeout
        for t in self.threads:
            if t is not me and t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    def alive(self) -> int:
        return sum(t.is_alive() for t in self.threads)


BuildFn = Callable[[Slot], "tuple[Any, Fence]"]  # slot -> (device batch, fence after which the slot is reusable)


class Feeder:
    """The device stage's thread: takes the finished slots of a `Run` in order, moves each to the
    device with `build` (on the stage's copy stream) and queues the result, `depth` batches ahead.

    A slot goes back to the workers (by asking the Run for the next batch) only once the fence that
    `build` returned is done, i.e. its copy has finished: pinned memory is never overwritten while
    the GPU still reads it. The consumer's stream waits on each batch's ready fence (no device-wide
    sync). Errors from the Run (a failed sample, a timeout) or from `build` reach the consumer in
    batch order. Every wait has a timeout and checks the stop flag.

    The hand-off is a deque polled with short sleeps (`_system.poll_until`) rather than a queue.Queue:
    the consumer then takes no lock, so Ctrl-C in the training loop can never leave one held (see
    _release_if_owned)."""

    def __init__(self, run: Run, stage: Stage, build: BuildFn, depth: int, timeout: float,
                 name: str = "stoker-device") -> None:
        self.run, self.stage, self.build = run, stage, build
        self.timeout = timeout
        self.depth = depth
        self.ready: deque[tuple[str, Any, Any]] = deque()  # append/popleft are atomic
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _put(self, item: tuple[str, Any, Any]) -> bool:
        """Queue `item` once fewer than `depth` are waiting (only this thread appends, so the check
        cannot go stale); False when stopped first. No timeout: a slow training step is no fault."""
        if not poll_until(lambda: len(self.ready) < self.depth, None, stop=self.stop_event):
            return False
        self.ready.append(item)
        return True

    def _more(self, b: int) -> bool:
        """Whether the run has a batch b, waiting (stop-aware) for an open-ended run to be extended."""
        run = self.run
        if b < len(run.batch_sizes) or not run.open_ended:
            return b < len(run.batch_sizes)
        with run.cond:
            while b >= len(run.batch_sizes) and not self.stop_event.is_set():
                run.cond.wait(_POLL_S)
        return b < len(run.batch_sizes)

    def _work(self) -> None:
        b = -1
        while self._more(b := b + 1):
            if self.stop_event.is_set():
                return
            try:
                slot = self.run.next_batch(b)  # hands the slot of batch b-1 back to the workers
                with self.stage.context():
                    out, reusable = self.build(slot)
                    ready = self.stage.fence()
                reusable.wait(self.timeout, self.stop_event)
            except BaseException as exc:  # for the consumer, in order; this thread is done
                self._put(("error", exc, None))
                return
            if not self._put(("batch", out, ready)):
                return

    def get(self, b: int) -> Any:
        """Batch b on the device, ready to use on the caller's current stream. Raises what the
        pipeline raised for it, LoaderTimeoutError after `timeout` seconds without it."""
        thread = self.thread
        ok = poll_until(lambda: self.ready or not thread.is_alive(), self.timeout, stop=self.stop_event,
                        on_timeout=lambda: LoaderTimeoutError(
                            f"batch {b}: nothing reached the device after {self.timeout:.0f} s "
                            f"({self.run.alive()} worker threads alive); storage may be stalled or a transform "
                            f"hangs — raise Loader(timeout=...) if samples are genuinely this slow"))
        if not self.ready:  # stopped, or the thread ended
            if not ok or self.stop_event.is_set():
                raise LoaderClosedError(f"the loader was closed while waiting for batch {b}")
            raise WorkerError(f"the stoker device thread ended before batch {b}; this is a bug in stoker, "
                              f"please report it")
        kind, value, ready = self.ready.popleft()
        if kind == "error":
            raise value
        return self.stage.handoff(value, ready)

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop this thread and the Run's workers, bounded. Safe to call repeatedly, from any thread."""
        self.stop_event.set()
        self.run.stop(join_timeout)
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(join_timeout)
        self.ready.clear()  # drop queued device batches now rather than at collection

    def alive(self) -> int:
        return self.run.alive() + self.thread.is_alive()
