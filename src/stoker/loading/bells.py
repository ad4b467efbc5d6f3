"""The hand-offs' waits and stop flag at the cost of a few C calls: `Bells` and `StopFlag`.

Every Python call a loader thread makes is a bite of the trainer's GIL, and the batch ring's hand-offs
(a worker waiting for a slot, the consumer for a batch) wait and wake once or twice a batch.
`threading.Condition` is written in Python: a wait makes a new lock, registers it, gives the owner's
lock up and takes it back through three more calls, and a notify walks its waiters through two more
functions, about a dozen calls a wait. `Bells` keeps Condition's contract (a waiter registers under
the lock, so no wake-up is lost between its check and its wait; every wait has a timeout; `notify`
wakes the longest waiting, `notify_all` every waiter) with one C lock per waiting thread, made once per thread and kept, and the owner's
RLock given up and taken back by its own C methods: a wait is about six C calls, a notify with no
waiter none (callers test `waiting` first).

A wait may give a rank (the batch a worker waits for a slot for): the waiters are then kept lowest rank
first, whatever order their waits began in, so `notify` wakes the one the next free slot is for. A wait
that timed out (the safety net) and waits again goes back to its place, not to the end of the line: in
arrival order it would wake before the worker whose batch comes first, plan that batch for it, wake it
and wait again, two wait rounds where one does.

`StopFlag` is a `threading.Event` whose state is also a plain attribute (`stopped`), so a hot loop reads
it with no call at all; `set` and `clear` keep the two in step.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_local = threading.local()   # each thread's bell: a C lock, held (not rung) while the thread is not waiting


def _bell() -> Any:
    """The calling thread's bell, made on its first wait."""
    try:
        return _local.bell
    except AttributeError:
        bell = _local.bell = threading.Lock()
        bell.acquire()
        return bell


class Bells:
    """A Condition over an RLock (`lock`), for the hand-offs' hot waits: `wait(timeout)` and `notify_all()`
    with the lock held, as `threading.Condition`'s; `with bells:` takes the lock. `waiting` holds the bells
    of the threads waiting now, in the order `notify` wakes them (test it before calling `notify_all` on a
    hot path). The waits on one Bells are all ranked or none."""

    __slots__ = ("lock", "waiting", "ranks")

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.waiting: list[Any] = []
        self.ranks: dict[Any, int] = {}   # a ranked wait's bell -> its rank (one entry per thread that waited)

    def __enter__(self) -> bool:
        return self.lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.lock.__exit__(*exc)

    def _is_owned(self) -> bool:
        return self.lock._is_owned()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def wait(self, timeout: float, rank: int | None = None) -> bool:
        """Give the lock up (held by the caller, however deeply), sleep until `notify_all` or `timeout`
        seconds, take the lock back; True when notified. Interrupted (Ctrl-C), it still takes the lock
        back and leaves no bell behind. `rank`: woken before the waiters of a higher rank, after those of a
        lower or the same one (which began waiting first)."""
        try:   # `_bell()`, inlined: a wait is the hot path
            bell = _local.bell
        except AttributeError:
            bell = _bell()
        waiting = self.waiting
        if rank is None:
            waiting.append(bell)
        else:   # its place in the line: before the first waiter of a higher rank (a few threads: a short walk)
            ranks = self.ranks
            ranks[bell] = rank
            for i, other in enumerate(waiting):
                if ranks[other] > rank:
                    waiting.insert(i, bell)
                    break
            else:
                waiting.append(bell)
        state = self.lock._release_save()
        rung = False
        try:
            rung = bell.acquire(True, timeout)
        finally:
            self.lock._acquire_restore(state)
            if not rung:
                if bell in waiting:   # not rung: take the bell back out
                    waiting.remove(bell)
                else:   # rung after the timeout, before the lock came back: held again for the next wait
                    bell.acquire(False)
        return rung

    def notify(self) -> None:
        """Wake the longest-waiting thread (of ranked waits, the first of the lowest rank), if any (the lock
        held)."""
        waiting = self.waiting
        if waiting:
            waiting.pop(0).release()

    def notify_all(self) -> None:
        """Wake every waiting thread (the lock held)."""
        waiting = self.waiting
        for bell in waiting:
            bell.release()
        waiting.clear()


class StopFlag(threading.Event):
    """A `threading.Event` that also keeps its state in the plain attribute `stopped`: a hot loop reads
    `stopped` (no call); every other reader may use the Event's API. `wakes`: functions `set` calls after
    it, from the setting thread, to wake the waits that do not watch the flag (whoever sets it, the
    loader's `stop` or the interpreter's exit), so they need no short poll to notice."""

    stopped = False

    def __init__(self) -> None:
        super().__init__()
        self.wakes: list[Callable[[], None]] = []

    def set(self) -> None:
        # the Event first: a thread that saw `stopped` and ended leaves its waiter an Event already set, so the
        # waiter tells a stop from a thread that ended early (`Feeder._take`)
        super().set()
        self.stopped = True
        for wake in list(self.wakes):
            wake()

    def clear(self) -> None:
        self.stopped = False
        super().clear()
