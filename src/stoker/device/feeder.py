"""The device thread: takes a Run's finished slots in order, builds each into a device batch, and
hands the batches to the consumer (`Feeder`), the loader's one CUDA actor."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, ContextManager, Protocol

from .._system import join_at_exit
from ..errors import LoaderClosedError, LoaderTimeoutError, WorkerError
from ..loading.bells import StopFlag
from ..loading.slots import _FENCE_POLL_S, _POLL_S, Guard, Run, Slot
from ..loading.stats import LoaderStats


class Stage(Protocol):
    """What the Feeder needs of the device stage (device.DeviceStage is one)."""

    def bind(self) -> None: ...

    def context(self) -> ContextManager[None]: ...

    def fence(self) -> Any: ...

    def handoff(self, batch: Any, fence: Any) -> Any: ...


BuildFn = Callable[[Slot], "tuple[Any, Guard]"]  # slot -> (device batch, fence after which the slot is reusable)
MeasureFn = Callable[[Any], "tuple[int, int]"]  # device batch -> (bytes it holds, working bytes of its build)
_WAKE = object()   # in `ready` or `room`: the device thread ended, or the feeder stops: look again


class Feeder:
    """The device stage's thread: takes the finished slots of a `Run` in order, moves each to the
    device with `build` (on the stage's copy stream) and queues the result, `depth` batches ahead.

    This thread is the loader's one CUDA actor: it binds to the stage's GPU first (`stage.bind()`) and
    makes every event query. The fence that `build` returns (its copy has finished) becomes the guard
    of the slot (`Run.guard`) before the slot goes back to the workers (by asking the Run for the next
    batch); this thread clears the guard once the fence is done (`Run.settle`, also while it waits to
    queue a batch), and only then do the workers refill the slot: pinned memory is never overwritten
    while the GPU still reads it, the workers never touch CUDA, and this thread never waits for its
    own copy. The consumer's stream waits on each batch's ready fence (no device-wide
    sync). Errors from the Run (a failed sample, a timeout) or from `build` reach the consumer in
    batch order. Every wait has a timeout and checks the stop flag.

    The hand-off is two C-level queues (`queue.SimpleQueue`): the queued batches (`ready`), and one
    token per free place of the `depth` (`room`), which the device thread takes before it queues a
    batch and the consumer gives back when it takes one. Each side wakes as soon as the other acts,
    with no sleep in between, and a wait is one call however long it lasts (the device thread's
    Python per batch is the trainer's GIL). Each wait is bounded (`_POLL_S`, re-checking the stop
    flag), `stop()` wakes every waiter, and Ctrl-C in a wait leaves no lock held."""

    def __init__(self, run: Run, stage: Stage, build: BuildFn, depth: int, timeout: float,
                 name: str = "stoker-device", stats: LoaderStats | None = None,
                 measure: MeasureFn | None = None) -> None:
        self.run, self.stage, self.build = run, stage, build
        # the device memory of built batches until handed out: `measure(batch)` -> (bytes held, working
        # bytes of its build), summed into `stats` (LoaderStats.device_bytes)
        self.stats, self.measure = stats, measure
        self.timeout = timeout
        self.depth = depth
        self.ready: queue.SimpleQueue = queue.SimpleQueue()   # ("batch" | "error", value, meta), or _WAKE
        self.room: queue.SimpleQueue = queue.SimpleQueue()   # a token per free place of `depth`, or _WAKE
        for _ in range(depth):
            self.room.put(True)
        self.ended = False  # the device thread has left its loop
        self.stop_event = StopFlag()   # `stopped`: the loop's check, no call
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()
        join_at_exit(self.thread, self.stop_event)

    def _put(self, item: tuple[str, Any, Any]) -> bool:
        """Queue `item` once fewer than `depth` are waiting (a `room` token taken); False when stopped
        first. No timeout: a slow training step is no fault. While it waits it keeps clearing the
        slots' guards (`Run.settle`), so the workers go on."""
        try:
            token = self.room.get_nowait()   # room at once: the next batch's `next_batch` settles the guards
        except queue.Empty:
            token = self._wait_room()
        if token is _WAKE or token is None:   # `stop`
            return False
        self.ready.put(item)
        return True

    def _wait_room(self) -> Any:
        """A `room` token once the consumer takes a batch, clearing the slots' guards meanwhile; None when
        stopped first."""
        pending = self.run.settle()
        while True:
            try:
                return self.room.get(timeout=_FENCE_POLL_S if pending else _POLL_S)
            except queue.Empty:
                if self.stop_event.is_set():
                    return None
                pending = self.run.settle()

    def _more(self, b: int) -> bool:
        """Whether the run has a batch b, waiting (stop-aware) for an open-ended run to be extended."""
        run = self.run
        if b < len(run.batch_sizes) or not run.open_ended:
            return b < len(run.batch_sizes)
        with run.cond:
            while b >= len(run.batch_sizes) and not self.stop_event.is_set():
                run.cond.wait(_FENCE_POLL_S if run.settle() else _POLL_S)
        return b < len(run.batch_sizes)

    def _work(self) -> None:
        try:
            self._loop()
        finally:  # wake a consumer waiting for a batch that will never come
            self.ended = True
            self.ready.put(_WAKE)

    def _bound(self) -> bool:
        """Bind this thread to the stage's GPU, the loader's one CUDA actor, before any CUDA call (a new
        thread starts on GPU 0, where a query would make a context); False (the error handed on) if it fails."""
        try:
            self.stage.bind()
        except BaseException as exc:
            self._put(("error", exc, None))
            return False
        return True

    def _loop(self) -> None:
        if not self._bound():
            return
        run, stop = self.run, self.stop_event
        closed = -1 if run.open_ended else len(run.batch_sizes)   # a closed run: its count, no wait to ask
        b = -1
        while (b := b + 1) < closed or (closed < 0 and self._more(b)):
            if stop.stopped:
                return
            try:
                slot = self.run.next_batch(b)  # hands the slot of batch b-1 back to the workers
                out, reusable = self.build(slot)   # on the copy stream: current since `_bound`
                ready = self.stage.fence()
                # no wait here: the copy's fence becomes the slot's guard, so the workers refill the
                # slot only once the GPU has read it, and this thread goes straight on to batch b+1
                self.run.guard(b, reusable)
                held = self._hold(out)
            except BaseException as exc:  # for the consumer, in order; this thread is done
                self._put(("error", exc, None))
                return
            if not self._put(("batch", out, (ready, held))):
                self._release(held)
                return

    def _hold(self, out: Any) -> int:
        """Count a built batch's device memory as the loader's (until `_release`); its size in bytes."""
        if self.stats is None or self.measure is None:
            return 0
        held, working = self.measure(out)
        self.stats.hold_device(held, working)
        return held

    def _release(self, held: int) -> None:
        if held and self.stats is not None:
            self.stats.release_device(held)

    def get(self, b: int) -> Any:
        """Batch b on the device, ready to use on the caller's current stream. Raises what the
        pipeline raised for it, LoaderTimeoutError after `timeout` seconds without it."""
        kind, value, meta = self._take(b)
        if kind == "error":
            raise value
        ready, held = meta
        self._release(held)   # the caller's from here on
        return self.stage.handoff(value, ready)

    def _take(self, b: int) -> tuple[str, Any, Any]:
        """The next queued item, waiting (bounded, stop-aware) until the device thread queues one."""
        deadline = time.monotonic() + self.timeout
        thread = self.thread
        while True:
            if self.stop_event.is_set():
                raise LoaderClosedError(f"the loader was closed while waiting for batch {b}")
            try:
                item = self.ready.get(timeout=_POLL_S)
            except queue.Empty:
                item = _WAKE
            if item is not _WAKE:
                self.room.put(True)  # room for the device thread's next batch
                return item
            if self.ended or not thread.is_alive():
                if self.stop_event.is_set():
                    raise LoaderClosedError(f"the loader was closed while waiting for batch {b}")
                raise WorkerError(f"the stoker device thread ended before batch {b}; this is a bug in stoker, "
                                  f"please report it")
            if time.monotonic() >= deadline:
                stuck = self._stuck()
                raise LoaderTimeoutError(
                    f"batch {b}: nothing reached the device after {self.timeout:.0f} s "
                    f"({self.run.alive()} worker threads alive); "
                    + (stuck or "storage may be stalled or a transform hangs")
                    + " — raise workers=stoker.Workers(timeout=...) if samples are genuinely this slow")

    def _stuck(self) -> str:
        """What the device thread's side is stuck in, when it knows (the GPU decode pipeline: a decoder
        call), for the consumer's timeout message; "" when nothing in particular."""
        return ""

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop this thread and the Run's workers, bounded. Safe to call repeatedly, from any thread;
        a fork()ed child leaves its parent's threads alone (`HandOut.forked`)."""
        if self.run.forked:
            return
        self.stop_event.set()
        self.room.put(_WAKE)   # the device thread waiting for room
        self.ready.put(_WAKE)  # a consumer waiting for a batch
        self.run.stop(join_timeout, give_back=False)
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(join_timeout)
        if not self.thread.is_alive():  # it may still be reading the slot it builds from
            self.run.give_back()
        while True:   # drop queued device batches now rather than at collection
            try:
                item = self.ready.get_nowait()
            except queue.Empty:
                break
            if item is not _WAKE and item[0] == "batch":
                self._release(item[2][1])

    def alive(self) -> int:
        return self.run.alive() + self.thread.is_alive()
