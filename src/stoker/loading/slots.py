"""The batch ring and the worker threads that fill it.

A ring of `prefetch + 2` preallocated slots, each a `uint8 [B, H, W, 3]` tensor (pinned when CUDA is
available; a numpy array with `Loader(device="numpy")`, made by `numpy_output.NumpyBuffers`) plus a
label array. Worker threads claim sample positions from one shared counter, in
order, and write each sample straight into its row; the consumer takes batches in order.

A batch handed out stays valid as long as the caller holds it: a slot goes back to the workers only
when nothing references its memory any more (the storage's use count, which counts every view such
as `x[0]` or `x.permute(...)`, is back to the ring's own) and the GPU work queued on it is done (its
guard fence). The loop variable of `for x, y in loader` still holds batch k while batch k+1 is
fetched, so the last batch handed out may be held; an older one still held is one the caller keeps
(`list(loader)`, a cache): the ring lets it go and allocates a fresh slot in its place, so kept
batches cost memory (one warning past `KEPT_WARN` of them) and are never overwritten. In the common
loop no slot is ever allocated after the first pass.

Threads, not processes: libjpeg-turbo, OpenCV and Pillow release the GIL while they work, so the
threads share one address space and write directly into (pinned) batch memory. What runs under the
GIL per sample is a position claim (under a small lock of its own), a list append and the Python
glue of the fill function; the run's lock is taken once per batch (by the worker that completes it),
which also flushes the stats. Nothing relies on the GIL for atomicity, so the same code is correct on
a free-threaded build (docs/architecture.md, "Threads and the GIL").

Every wait has a timeout and checks the stop flag. Worker threads hold no reference to the
iterator that owns a run, so an abandoned iterator can be collected; its finalizer stops the run.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .._system import fork_generation, join_at_exit
from .._torch import torch
from ..errors import ConfigError, LoaderClosedError, LoaderTimeoutError, WorkerError
from .bells import Bells, StopFlag
from .stats import LoaderStats, WorkerTimes

_POLL_S = 0.1  # how often a blocked wait re-checks the stop flag, seconds
# how long a worker waiting for its batch's slot sleeps between checks: a release, a cleared guard, a stall and
# the stop flag however it is set (`StopFlag.wakes`: the interpreter's exit too) all notify it (`slot_cond`), so
# this is only the safety net. A short one costs a dozen Python calls per idle worker per period: while a slow
# device side holds every slot, the second worker in line waits two batches' time, and it would wake for nothing
_SLOT_POLL_S = 30.0
# how often the CUDA actor re-checks a slot's guard while the workers wait for it: nothing notifies
# the host when the GPU passes an event, so this one wait polls (seconds)
_FENCE_POLL_S = 0.001
#: batches the caller keeps (still referenced after the next step) before a one-time warning
KEPT_WARN = 16
# the number of strong references to a tensor storage: every tensor (view) over it holds one; torch
# keeps it per StorageImpl (what torch.multiprocessing's StorageWeakRef reads). Without it (a torch
# that lacks the function) every handed-out slot counts as held: always fresh memory, never wrong data.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Guard(Protocol):
    """What a slot's guard needs of a point on a CUDA stream (`device.stage.Fence` is one). Only the loader's
    CUDA actor asks `done()` (`Run.settle`): the device thread, or without one the consumer's thread.
    `on_gpu` (an attribute: read per batch, it costs no call) false says the guard is waiting for the
    actor's own work, not the GPU's, so it is not done yet and the actor need not poll it while it waits
    for a batch (`gpu_pipeline`'s batch in flight)."""

    what: str
    on_gpu: bool

    def done(self) -> bool: ...


def _release_if_owned(cond: "threading.Condition | Bells") -> None:
    """After an exception in the consuming thread: give the lock back if this thread still holds it.

    Ctrl-C raises KeyboardInterrupt at the next bytecode boundary, which can fall inside
    Condition.__enter__ after the lock was taken but before the with-block began, so __exit__ never
    runs and every worker would block on the lock forever. Locks here are RLocks, so this thread
    can tell whether it owns one."""
    while cond._is_owned():  # type: ignore[attr-defined]
        cond.release()


def notify_all(cond: "threading.Condition | Bells") -> None:
    """Wake every waiter of `cond`; safe against Ctrl-C landing while the lock is held."""
    try:
        with cond:
            cond.notify_all()
    except BaseException:
        _release_if_owned(cond)
        raise


@dataclass(eq=False)  # compared by identity (a ring finds its slots in lists)
class Slot:
    """One batch buffer. `images`/`labels` are preallocated tensors; `*_np` are numpy views of them
    (NumPy output: the same numpy arrays, `owner` the image array)."""

    images: torch.Tensor
    images_np: np.ndarray
    labels: torch.Tensor | None
    labels_np: np.ndarray | None
    objects: list[Any] = field(default_factory=list)  # labels that are not numbers (str, lists)
    extras: dict[str, Any] = field(default_factory=dict)  # column -> list per row; "sizes" -> tensor (pad=True)
    batch: int = -1  # which batch of the run the slot holds
    # GPU work that may still read this slot (the consumer's `images.cuda(non_blocking=True)`, the device
    # thread's copy): the workers refill the slot only once it is None again, which the CUDA actor sets
    # after it saw the fence done (`Run.settle`); workers never query a CUDA event themselves
    guard: Guard | None = None
    # time.perf_counter() when the guard was set (a guard that never completes times out): the clock the device
    # thread reads anyway as it sets a guard (`gpu_pipeline`), so setting it costs no call there
    guarded_at: float = 0.0
    size: int = 0  # samples in that batch
    remaining: int = 0  # samples not yet written; 0 once the batch is complete
    finished: list[int] = field(default_factory=list)  # rows written so far (appended without a lock)
    plan: Any = None  # the fill function's per-batch plan (`render.BatchPlan`: its GPU rows ride on it)
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    staging: Any = None  # the route's GPU columns: the slot's JPEG staging memory (jobs.JpegStaging), made by the device thread
    storage: int = 0  # the images' StorageImpl (an address; valid while `images` lives)
    uses: int = 0  # its use count with only the ring's own references
    owner: Any = None  # NumPy output: the image array, whose reference count counts its views (numpy_output)
    floats: Any = None  # the batch's float output the engine wrote (engine.FloatOut), [B, 3, H, W]; taken at hand-out
    base: Any = None  # aspect buckets: the images as allocated, which each batch views at its bucket's size

    def shape_rows(self, height: int, width: int) -> None:
        """This batch's images as [B, height, width, 3] over the slot's memory (aspect buckets: the ring is
        allocated at the largest bucket's area). Called when a free slot is planned, so nothing outside
        the ring holds it: the reference counts `held` compares with are taken anew."""
        if self.images.shape[1:3] == (height, width):
            return
        if self.base is None:
            self.base = self.images
        n = self.base.shape[0]
        room = self.base.size if isinstance(self.base, np.ndarray) else self.base.numel()
        if n * height * width * 3 > room:
            raise ValueError(f"a batch of {n} x {height}x{width} does not fit the slot of {tuple(self.base.shape)}")
        if isinstance(self.base, np.ndarray):   # NumPy output (and a worker process's slots): array views
            view = self.base.reshape(-1)[:n * height * width * 3].reshape(n, height, width, 3)
            self.images = self.images_np = view
            if self.owner is not None:   # the arrays' reference counts say what is held
                self.uses = sys.getrefcount(self.owner)
        else:
            view = self.base.view(-1)[:n * height * width * 3].view(n, height, width, 3)
            self.images, self.images_np = view, view.numpy()
            if _use_count is not None:
                self.uses = _use_count(self.storage)

    def held(self) -> bool:
        """Whether anything outside the ring still references this slot's image memory."""
        if self.owner is not None:
            return sys.getrefcount(self.owner) > self.uses
        return _use_count is None or _use_count(self.storage) > self.uses


class Buffers(Protocol):
    """What makes a ring's slots when they are not torch tensors (numpy_output.NumpyBuffers)."""

    def allocate(self, batch_size: int, height: int, width: int, label_dtype: np.dtype | None,
                 frames: int = 0) -> Slot: ...

    def weak(self, slot: Slot) -> Any:
        """A weak reference to the slot's memory whose `expired()` says the caller let go of it."""


def row_shape(height: int, width: int, frames: int = 0) -> tuple[int, ...]:
    """The shape of one batch row: an image ``(height, width, 3)``, or a clip of ``frames`` such
    images ``(frames, height, width, 3)`` (``frames`` 0: images)."""
    return (frames, height, width, 3) if frames else (height, width, 3)


def ring_bytes(n_slots: int, batch_size: int, height: int, width: int, frames: int = 0) -> int:
    """Bytes a ring of ``n_slots`` batches of uint8 ``[batch_size, height, width, 3]`` images (or
    ``[batch_size, frames, height, width, 3]`` clips), plus int64 labels, holds."""
    return n_slots * batch_size * (max(frames, 1) * height * width * 3 + 8)


def check_ring_fits(n_slots: int, batch_size: int, height: int, width: int, frames: int = 0) -> None:
    """Refuse, before allocating, a ring larger than the memory available now (an allocation that
    would fail with a bare RuntimeError deep in torch, or push the machine into swap), naming the
    knobs that size it."""
    import psutil

    need = ring_bytes(n_slots, batch_size, height, width, frames)
    available = psutil.virtual_memory().available
    if need > available:
        what = f"clips x {frames}x{height}x{width}x3" if frames else f"images x {height}x{width}x3"
        raise ConfigError(f"the batch ring needs {n_slots} slots x {batch_size} {what} bytes = "
                          f"{need / 2**30:,.1f} GiB, but only {available / 2**30:,.1f} GiB of memory is available; "
                          "lower batch_size= (--batch-size), workers=stoker.Workers(prefetch=...), the output size "
                          "of the transforms" + (" or Clips(frames=)" if frames else ""))


class BatchRing:
    """Preallocated batches: images uint8 [batch_size, height, width, 3] (clips: [batch_size, frames,
    height, width, 3]) and labels.

    `free` slots wait for the workers; `out` holds the slots handed to the caller, oldest first,
    until `reclaim` finds them unreferenced. A slot the caller keeps is let go and replaced by a
    fresh one (`slots_allocated` in the stats counts every slot made). Used under the lock of the
    Run that fills it (one Run at a time per ring)."""

    def __init__(self, n_slots: int, batch_size: int, height: int, width: int, *,
                 label_dtype: np.dtype | None, pin_memory: bool, stats: "LoaderStats | None" = None,
                 buffers: "Buffers | None" = None, frames: int = 0) -> None:
        self.batch_size, self.height, self.width, self.frames = batch_size, height, width, frames
        self.buffers = buffers  # None: torch tensors; else what makes the slots (numpy_output.NumpyBuffers)
        self.n_slots = n_slots
        self.label_dtype = label_dtype
        self.pin_memory = pin_memory
        self.stats = stats
        self.slots: list[Slot] = []  # every slot the ring owns (free, being filled, handed out)
        self.free: deque[Slot] = deque()
        self.out: list[Slot] = []
        self._kept: list[Any] = []  # StorageWeakRefs of the batches let go while the caller held them
        self._warned = False
        check_ring_fits(n_slots, batch_size, height, width, frames)
        self.top_up()

    def _make_slot(self) -> Slot:
        try:
            slot = self._allocate()
        except (RuntimeError, MemoryError) as exc:  # the memory went since check_ring_fits, or kept batches took it
            raise ConfigError(f"cannot allocate a batch ({self.batch_size} images x {self.height}x{self.width}x3 "
                              f"bytes; {len(self.live_kept())} batches kept by the caller): {exc}; drop references to "
                              "old batches (or .clone() the part you keep), or lower batch_size= (--batch-size), "
                              "workers=stoker.Workers(prefetch=...) or the output size of the transforms") from None
        self.slots.append(slot)
        if self.stats is not None:
            self.stats.slots_allocated += 1
        return slot

    def _allocate(self) -> Slot:
        if self.buffers is not None:
            return self.buffers.allocate(self.batch_size, self.height, self.width, self.label_dtype, self.frames)
        images = torch.empty((self.batch_size, *row_shape(self.height, self.width, self.frames)), dtype=torch.uint8,
                             pin_memory=self.pin_memory)
        labels = None
        if self.label_dtype is not None:
            labels = torch.empty(self.batch_size, dtype=torch.from_numpy(np.empty(0, self.label_dtype)).dtype,
                                 pin_memory=self.pin_memory)
        slot = Slot(images, images.numpy(), labels, None if labels is None else labels.numpy(),
                    objects=[None] * self.batch_size)
        slot.storage = images.untyped_storage()._cdata
        slot.uses = _use_count(slot.storage) if _use_count is not None else 0
        return slot

    def top_up(self) -> None:
        """Allocate slots until the ring holds `n_slots` (after a Run whose threads did not stop in
        time kept theirs)."""
        while len(self.free) + len(self.out) < self.n_slots:
            self.free.append(self._make_slot())

    def hand_out(self, slot: Slot) -> None:
        self.out.append(slot)

    def reclaim(self) -> bool:
        """Give the workers back every handed-out slot nothing references. The latest may still be
        the caller's loop variable and waits for the next call; an older one still referenced is
        kept by the caller: it is let go and a fresh slot takes its place. True if any came back."""
        out = self.out
        if not out:
            return False
        back, latest = False, out[-1]
        keep: list[Slot] = []
        for slot in out:
            if slot.owner is None and _use_count is not None:   # `Slot.held`, inlined: it runs per batch
                held = _use_count(slot.storage) > slot.uses
            else:
                held = slot.held()
            if not held:
                self.free.append(slot)
                back = True
            elif slot is latest:
                keep.append(slot)
            else:
                self._let_go(slot)
                back = True
        self.out = keep
        return back

    def _let_go(self, slot: Slot) -> None:
        self.slots.remove(slot)
        if self.buffers is not None:
            self._kept.append(self.buffers.weak(slot))
        else:
            from torch.multiprocessing.reductions import StorageWeakRef

            self._kept.append(StorageWeakRef(slot.images.untyped_storage()))
        self.free.append(self._make_slot())
        kept = self.live_kept()
        if len(kept) >= KEPT_WARN and not self._warned:
            self._warned = True
            mib = len(kept) * ring_bytes(1, self.batch_size, self.height, self.width, self.frames) / 2**20
            warnings.warn(f"{len(kept)} batches from this stoker Loader are still referenced ({mib:,.0f} MiB): "
                          f"every batch kept past the next step costs a fresh {self.batch_size}-image buffer. "
                          f"Keep only what you need (.clone() a slice, e.g. images[:8].clone(), or the "
                          f"labels) and drop the rest, so the loader can reuse its memory", ResourceWarning,
                          stacklevel=2)

    def live_kept(self) -> list[Any]:
        """The batches let go that the caller still holds (the rest are pruned)."""
        self._kept = [w for w in self._kept if not w.expired()]
        return self._kept

    def matches(self, n_slots: int, batch_size: int, height: int, width: int, label_dtype: np.dtype | None,
                pin_memory: bool, frames: int = 0) -> bool:
        """True when this ring can be reused for a run with these parameters."""
        return (self.n_slots, self.batch_size, self.height, self.width, self.label_dtype,
                self.pin_memory, self.frames) == (n_slots, batch_size, height, width, label_dtype, pin_memory, frames)


PrepareFn = Callable[[int, Slot], Any]  # (batch, slot) -> plan; fills labels/extras of the slot
FillFn = Callable[[Any, int, Slot, dict, WorkerTimes], None]  # (plan, row, slot, scratch, times)
FlushFn = Callable[[WorkerTimes, int], None]  # (times, samples done) under the run's lock
#: (plan, first row, end row, slot, scratch, times) -> [(row, exception)] of the rows that failed
ChunkFn = Callable[[Any, int, int, Slot, dict, WorkerTimes], list]


class HandOut:
    """The consumer's side that `Run` and the process mode's `procs.ProcessRun` share: a batch's slot
    handed out, the previous one guarded and released (`_next_batch` is each one's own)."""

    last_given: "tuple[int, Slot] | None"
    cond: "threading.Condition | Bells"   # a Run's are Bells; the process mode's a Condition
    _generation: int   # fork_generation() when made

    @property
    def forked(self) -> bool:
        """Made by a parent process before a fork(): its threads (or worker processes) are not this
        process's (`_system.fork_generation`)."""
        return self._generation != fork_generation()

    def _next_batch(self, b: int) -> Slot:
        raise NotImplementedError

    def next_batch(self, b: int, guard: Guard | None = None) -> Slot:
        """Release batch b-1 and return the slot of batch b once every row is written.

        `guard`: a fence behind the consumer's GPU work on batch b-1 (an asynchronous copy of its pinned
        slot); the workers refill that slot only once it is done (and nothing references it). Raises
        the first row's exception when a sample failed, LoaderTimeoutError after `timeout` seconds
        without the batch completing."""
        if guard is not None:   # before the release in _next_batch: no worker sees the slot unguarded
            self.guard(b - 1, guard)
        try:
            return self._next_batch(b)
        except BaseException:
            _release_if_owned(self.cond)
            raise

    def guard(self, b: int, guard: Guard | None) -> None:
        """Guard the slot of batch b (the last one handed out; the run ending or closing): see
        `next_batch`. The ring outlives the run, so the next run's workers honour it too."""
        last = self.last_given
        if guard is not None and last is not None and last[0] == b:
            last[1].guard, last[1].guarded_at = guard, time.perf_counter()


class Run(HandOut):
    """One pass over `batch_sizes` batches: worker threads fill ring slots, `next_batch` hands them out.

    `prepare(b, slot)` runs once per batch (in whichever worker gets there first, under a lock) and
    returns the plan; `fill(plan, row, slot, scratch, times)` writes one sample. Exceptions from fill
    are kept per row and raised by `next_batch` for the first failing row of that batch.

    With `fill_chunk`, workers claim `chunk` rows of a batch at a time and write them with one
    `fill_chunk(plan, r0, r1, slot, scratch, times)` (the native path: one GIL release for the
    chunk), which returns the failed rows' exceptions; which thread writes a row never changes it."""

    def __init__(self, ring: BatchRing, batch_sizes: list[int], num_threads: int, prepare: PrepareFn,
                 fill: FillFn, flush: FlushFn, timeout: float, name: str = "stoker", open_ended: bool = False,
                 fill_chunk: ChunkFn | None = None, chunk: int = 1, engine: Any = None,
                 threads: int | None = None) -> None:
        # the native batch engine (engine.BatchEngine): its pool renders the rows; the Run's threads
        # only coordinate whole batches, so a few of them do. `threads`: the claims' own count (whole
        # batches of GPU rows, `engine.run_claims`)
        self.engine = engine
        if engine is not None:
            num_threads = engine.coordinators
        elif threads is not None:
            num_threads = threads
        self.ring = ring
        ring.top_up()
        self.batch_sizes = list(batch_sizes)
        self.chunk = chunk if fill_chunk is not None else 1
        # first claim of each batch: a claim is `chunk` rows (the last of a batch may be fewer)
        self._starts = list(itertools.accumulate((-(-n // self.chunk) for n in self.batch_sizes), initial=0))
        self.total = self._starts[-1]
        # every batch one claim (claims as large as a batch): claim p is batch p (`_claim`, no search)
        self._whole = self.total == len(self.batch_sizes)
        # open_ended: batches may be appended (`extend`, the next epoch of a persistent Loader); workers
        # that run out wait for them (stop-aware) instead of exiting
        self.open_ended = open_ended
        self.prepare, self.fill, self.flush, self.fill_chunk = prepare, fill, flush, fill_chunk
        self.timeout = timeout
        self.lock = threading.RLock()  # an RLock so the consumer can tell it still holds it (Ctrl-C)
        # the consumer's waits (`bells.Bells`: a Condition's contract at a few C calls a wait)
        self.cond = Bells(self.lock)
        # the workers waiting for a slot wait on Bells of their own over the same lock: a batch completing
        # wakes only the consumer, a slot freed (or its guard cleared) only the workers, so no thread pays a
        # wake-up for what another waits for
        self.slot_cond = Bells(self.lock)
        self.stop_event = StopFlag()   # its `stopped` attribute: the hot loops' check, no call
        # however the flag is set (`stop`, or the interpreter's exit), every wait on the run's Bells wakes now:
        # the slot waits' safety net is long. The wake holds the Bells, not the run (no reference cycle)
        cond, slot_cond = self.cond, self.slot_cond
        self.stop_event.wakes.append(lambda: (notify_all(cond), notify_all(slot_cond)))
        self._generation = fork_generation()
        self.released = 0  # batches the consumer has moved past
        self.assigned: dict[int, Slot] = {}  # batch -> its slot, from planning until it is handed out
        self.next_assign = 0  # batches are given slots in order: no batch can take the slot an earlier one needs
        self.last_given: tuple[int, Slot] | None = None  # the batch handed out last, and its slot
        self.fatal: BaseException | None = None
        self.stalled: LoaderTimeoutError | None = None  # a slot's guard never completed
        # Positions are claimed under their own lock, not the Condition's (which the consumer takes): a
        # shared itertools.count was atomic only under the GIL; on a free-threaded build two workers
        # could draw the same position. Uncontended, the lock costs a fraction of a microsecond a sample.
        self._claim_lock = threading.Lock()
        self._next_position = 0
        self.threads = [threading.Thread(target=self._work, name=f"{name}-worker-{k}", daemon=True)
                        for k in range(num_threads)]
        for slot in ring.free:
            slot.batch = -1

    def start(self) -> None:
        if self.engine is not None:
            self.engine.start()
        for t in self.threads:
            t.start()
            join_at_exit(t, self.stop_event)

    # ---- workers -------------------------------------------------------------------------
    def extend(self, batch_sizes: list[int]) -> None:
        """Append batches to an open-ended run (their plans come from `prepare` like the others)."""
        with self.cond:
            with self._claim_lock:   # a claim reads `_starts` and `total` together
                for size in batch_sizes:
                    self.batch_sizes.append(size)
                    self._starts.append(self._starts[-1] + -(-size // self.chunk))  # claims of `chunk` rows
                self.total = self._starts[-1]
                self._whole = self.total == len(self.batch_sizes)
            self.cond.notify_all()

    def _claim(self) -> tuple[int, int, int] | None:
        """The next claim (batch, first row, end row): each handed out once, in order, with or without a GIL."""
        with self._claim_lock:
            p = self._next_position
            self._next_position = p + 1
            total = self.total
        if p >= total:
            if not self.open_ended:
                return None
            with self.cond:  # `extend` appends batches under this Condition and notifies it
                while p >= self.total and not self.stop_event.is_set():
                    self.cond.wait(_POLL_S)
                if p >= self.total:
                    return None
        if self._whole:   # one claim per batch: claim p is batch p, all of it
            return p, 0, self.batch_sizes[p]
        # `_starts` only grows, and position p's entries were appended before `total` passed p (under
        # the lock just taken), so it can be searched without the lock
        b = bisect.bisect_right(self._starts, p) - 1  # a partial batch may end an epoch mid-run
        r0 = (p - self._starts[b]) * self.chunk
        return b, r0, min(r0 + self.chunk, self.batch_sizes[b])

    def _wait_slot(self, b: int, times: WorkerTimes) -> Slot | None:
        """The slot of batch b, planned: the first worker to need it (or a later batch) takes the next
        free slot for each batch up to b, in order, once its guard is cleared (`settle`, by the CUDA
        actor: a worker makes no CUDA call). None when stopped or a guard timed out."""
        assigned = self.assigned
        with self.lock:   # slot_cond's lock
            while not self.stop_event.stopped and self.stalled is None:
                if b in assigned:
                    return assigned[b]
                free = self.ring.free
                if free and free[0].guard is None:   # the next batch in order takes it (b's or an earlier one)
                    a = self.next_assign
                    slot = free.popleft()
                    slot.errors = []   # batch a planned into the slot
                    slot.finished = []
                    slot.size = slot.remaining = self.batch_sizes[a]
                    slot.plan = self.prepare(a, slot)
                    slot.batch = a
                    assigned[a] = slot
                    self.next_assign = a + 1
                    waiting = self.slot_cond.waiting
                    if waiting:   # the workers waiting for batch a (claims of its other rows) come first: wake them
                        ranks = self.slot_cond.ranks
                        while waiting and ranks[waiting[0]] <= a:
                            waiting.pop(0).release()
                    if a == b:
                        if waiting and free and free[0].guard is None:   # another slot to take: pass the wake on
                            self.slot_cond.notify()
                        return slot
                    continue   # an earlier batch planned: b's may be next
                t0 = time.perf_counter()   # `times.wait`: the waits alone
                # notified by a release, or by settle() clearing a guard; in batch order (a freed slot wakes the
                # worker whose batch it is for: `Bells`' ranks)
                self.slot_cond.wait(_SLOT_POLL_S, b)
                times.wait += time.perf_counter() - t0
        return None

    def settle(self) -> bool:
        """Clear the guard of every free slot whose fence is done, and wake the workers for them; True
        while some guard is still pending. Called only by the loader's one CUDA actor (the thread that
        asks for batches: the device thread, or the consumer's without one), whose GPU is its current
        device, so no worker thread ever makes a CUDA call (a thread that never chose a device would
        make a context on GPU 0). Each `done()` is an event query: no wait, no host sync.

        A guard pending longer than `timeout` stalls the run: the consumer gets a LoaderTimeoutError
        naming the GPU work that never finished."""
        with self.lock:
            return self._settle()

    def _settle(self) -> bool:
        """`settle`, the run's lock held."""
        pending, cleared = False, False
        for slot in self.ring.free:
            guard = slot.guard
            if guard is None or not guard.on_gpu:   # done only by the actor's own work: no poll
                continue
            if guard.done():
                slot.guard, cleared = None, True
            elif time.perf_counter() - slot.guarded_at > self.timeout and self.stalled is None:
                self.stalled = LoaderTimeoutError(
                    f"batch {self.next_assign} cannot be written into its slot: {guard.what} had not finished "
                    f"after {self.timeout:g} s; the GPU may be hung or its copy engine starved by other work")
                cleared = True
            else:
                pending = True
        if cleared and self.slot_cond.waiting:   # a slot a worker may fill (or a stall they must all see)
            if self.stalled is not None:
                self.slot_cond.notify_all()
            else:
                self.slot_cond.waiting.pop(0).release()   # `Bells.notify`, inlined: it runs per batch
        return pending

    def _work(self) -> None:
        scratch: dict = {}
        times = WorkerTimes()
        done = 0  # samples written since this worker last flushed its counters
        try:
            while not self.stop_event.stopped:
                claim = self._claim()
                if claim is None:
                    break
                b, r0, r1 = claim
                slot = self._wait_slot(b, times)
                if slot is None:
                    break
                if self.fill_chunk is not None:
                    failed = self.fill_chunk(slot.plan, r0, r1, slot, scratch, times)
                    if failed:
                        slot.errors.extend(failed)
                else:
                    try:
                        self.fill(slot.plan, r0, slot, scratch, times)
                    except BaseException as exc:  # kept for the consumer, which raises it in order
                        slot.errors.append((r0, exc))
                done += r1 - r0
                # No lock per chunk: list.extend is atomic (under the GIL, or the list's own lock on a
                # free-threaded build), and each worker checks the length after its own extend, so the
                # one that adds the last rows always sees the batch complete. Two may both see it (the
                # last two extends land before either checks): both flush their own counters and notify,
                # which is harmless; the `is` check below skips a slot already refilled for a later batch.
                finished, size = slot.finished, slot.size
                if r1 - r0 == size:   # a claim of the whole batch (the GPU's rows): no other worker writes it
                    complete = True
                else:
                    finished.extend(range(r0, r1))
                    complete = len(finished) == size
                if complete:
                    with self.lock:
                        self.flush(times, done)
                        done = 0
                        if slot.finished is finished:  # still this batch (not refilled meanwhile)
                            slot.remaining = 0
                            if self.cond.waiting:
                                self.cond.notify_all()
        except BaseException as exc:  # a bug in the loop itself: never die silently
            with self.lock:
                self.fatal = exc
                self.cond.notify_all()
        finally:
            if done:  # what was written since the last completed batch
                with self.lock:
                    self.flush(times, done)

    # ---- consumer: next_batch and guard are HandOut's ----------------------------------------
    def _next_batch(self, b: int) -> Slot:
        deadline = None   # read the clock only when there is a wait
        assigned = self.assigned
        with self.lock:   # the Bells' lock: their waits and notifies inside hold it
            if b > self.released:
                self.released = b
            ring = self.ring
            # a slot back to the workers: wake one only if it can take it (an unguarded slot first in line)
            if ring.reclaim() and self.slot_cond.waiting and ring.free[0].guard is None:
                self.slot_cond.waiting.pop(0).release()   # `Bells.notify`, inlined: it runs per batch
            while True:
                pending = self._settle()  # this thread is the CUDA actor: it clears the slots' guards
                slot = assigned[b] if b in assigned else None
                if slot is not None and slot.remaining == 0:
                    break
                if self.fatal is not None:
                    raise WorkerError(f"a stoker worker thread failed outside any sample: {self.fatal!r}; "
                                      f"this is a bug in stoker, please report it with the traceback") from self.fatal
                if self.stalled is not None:
                    raise self.stalled
                if self.stop_event.stopped:
                    raise LoaderClosedError(f"the loader was closed while waiting for batch {b}")
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    pending = slot.size - len(slot.finished) if slot is not None else self.batch_sizes[b]
                    raise LoaderTimeoutError(
                        f"batch {b}: no complete batch after {self.timeout:.0f} s ({pending} of "
                        f"{self.batch_sizes[b]} samples pending, {sum(t.is_alive() for t in self.threads)} "
                        f"worker threads alive); storage may be stalled or a transform hangs — raise "
                        f"workers=stoker.Workers(timeout=...) if samples are genuinely this slow")
                self.cond.wait(min(_FENCE_POLL_S if pending else _POLL_S, left))
            del assigned[b]
            if ring.__class__ is BatchRing:   # `BatchRing.hand_out`, inlined: it runs per batch
                ring.out.append(slot)
            else:   # a worker process's ring (`proc_child`)
                ring.hand_out(slot)
            self.last_given = (b, slot)
        if slot.errors:
            row, exc = min(slot.errors, key=lambda e: e[0])
            raise exc
        return slot

    def stop(self, join_timeout: float = 5.0, give_back: bool = True) -> None:
        """Stop the workers and wait (bounded) for them to exit, then give the ring back the slots of
        batches never handed out. Safe to call repeatedly, from any thread. In a fork()ed child it only
        forgets: the threads are the parent's, and so may be the locks they held."""
        if self.forked:
            return
        self.stop_event.set()   # its `wakes` wake every wait on the run's Bells
        if self.engine is not None:  # wakes a coordinator waiting on the pool, joins the pool's threads
            self.engine.close()
        me = threading.current_thread()
        deadline = time.monotonic() + join_timeout
        for t in self.threads:
            if t is not me and t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        if give_back:
            self.give_back()

    def give_back(self) -> None:
        """Return the slots of planned batches never handed out to the ring, once no worker can write
        them any more (a worker still alive keeps them: the next Run allocates in their place)."""
        if self.alive():
            return
        with self.cond:
            self.ring.free.extend(self.assigned.values())
            self.assigned.clear()

    def alive(self) -> int:
        return sum(t.is_alive() for t in self.threads)
