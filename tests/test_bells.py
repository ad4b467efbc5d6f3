"""The hand-offs' waits (`loading.bells`): a Condition's contract at a few C calls, and no wake-up lost.

The Run's workers wait for a slot on `Bells` whose safety net (`slots._SLOT_POLL_S`) is seconds long, and a
freed slot wakes one worker, which passes the wake on: a lost wake-up would cost a whole safety-net period.
The end-to-end tests make that period longer than the loader's timeout, so a lost wake-up fails them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker import DeviceOptions, Loader, Workers
from stoker.loading import bells, slots
from stoker.loading.bells import Bells, StopFlag
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop
from gpu_standin import FixedRateDecoder
from test_gpu_decode import textured_pack

CROP = [RandomResizedCrop(48), RandomHorizontalFlip()]


def _waiter(b: Bells, timeout: float, out: list, started: threading.Event | None = None) -> threading.Thread:
    def run() -> None:
        with b:
            if started is not None:
                started.set()
            out.append((b.wait(timeout), b._is_owned()))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _settled(b: Bells, n: int) -> None:
    """Wait (bounded) until `n` threads are registered as waiting."""
    for _ in range(2000):
        with b:
            if len(b.waiting) == n:
                return
        threading.Event().wait(0.005)
    raise AssertionError(f"{n} waiters never registered")


def test_notify_wakes_the_longest_waiting_thread_only_and_notify_all_the_rest() -> None:
    b = Bells(threading.RLock())
    first, second = [], []
    t1 = _waiter(b, 30.0, first)
    _settled(b, 1)
    t2 = _waiter(b, 30.0, second)
    _settled(b, 2)
    with b:
        b.notify()
    t1.join(10)
    assert first == [(True, True)] and not second   # woken, holding the lock again; the other still waits
    with b:
        assert len(b.waiting) == 1
        b.notify_all()
    t2.join(10)
    assert second == [(True, True)] and b.waiting == []


def _ranked(b: Bells, rank: int, out: list, name: str, first_timeout: float = 30.0) -> threading.Thread:
    """A thread waiting on `b` with `rank` (a first wait of `first_timeout` s, then, timed out, again, as a
    slot wait's loop does), which appends `name` to `out` once woken."""
    def run() -> None:
        with b:
            if not b.wait(first_timeout, rank):
                b.wait(30.0, rank)
            out.append(name)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_ranked_waits_wake_the_lowest_rank_first_whatever_order_they_began_in() -> None:
    """A freed slot is for the lowest batch waiting: `notify` wakes that worker, not the longest waiting;
    equal ranks (claims of one batch's rows) in the order they began."""
    b = Bells(threading.RLock())
    woken: list[str] = []
    threads = []
    for n, (rank, name) in enumerate([(7, "7"), (5, "5a"), (9, "9"), (5, "5b")]):
        threads.append(_ranked(b, rank, woken, name))
        _settled(b, n + 1)
    for n in range(4):
        with b:
            b.notify()
        for _ in range(2000):   # the woken thread reports before the next is rung
            if len(woken) == n + 1:
                break
            threading.Event().wait(0.005)
    for t in threads:
        t.join(10)
    assert woken == ["5a", "5b", "7", "9"] and b.waiting == []


def test_a_ranked_wait_that_timed_out_waits_again_in_its_place() -> None:
    """The safety net's timeout and the wait after it put a worker back where its batch belongs, not behind
    the workers of later batches that began waiting meanwhile."""
    b = Bells(threading.RLock())
    woken: list[str] = []
    late = _ranked(b, 4, woken, "4")
    _settled(b, 1)
    early = _ranked(b, 2, woken, "2", first_timeout=0.05)   # times out once, then waits again
    _settled(b, 2)
    threading.Event().wait(0.2)   # well past its first timeout: waiting again by now
    _settled(b, 2)
    with b:
        b.notify()
    early.join(10)
    assert woken == ["2"] and not early.is_alive()
    with b:
        b.notify()
    late.join(10)
    assert woken == ["2", "4"] and b.waiting == []


def test_a_wait_times_out_with_the_lock_held_and_leaves_no_bell_behind() -> None:
    b = Bells(threading.RLock())
    with b:
        with b:   # held twice: the wait gives up both levels and takes both back
            assert b.wait(0.01) is False
            assert b._is_owned() and b.waiting == []
        assert b._is_owned()
    assert not b._is_owned()
    with b:
        b.notify()   # nobody waits: nothing happens
        b.notify_all()


class _LateBell:
    """A thread's bell whose wait times out just as it is rung (the ring lands before the lock comes back)."""

    def __init__(self, bells_: Bells) -> None:
        self.real = threading.Lock()
        self.real.acquire()
        self.bells = bells_

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and timeout > 0:   # the wait: rung from another thread, then it reports the timeout
            ringer = threading.Thread(target=lambda: (self.bells.lock.acquire(), self.bells.notify(),
                                                      self.bells.lock.release()))
            ringer.start()
            ringer.join(10)
            return False
        return self.real.acquire(blocking, timeout)

    def release(self) -> None:
        self.real.release()


def test_a_ring_after_the_timeout_is_drained_so_the_next_wait_sleeps() -> None:
    b = Bells(threading.RLock())
    out: list = []

    def run() -> None:
        bells._local.bell = late = _LateBell(b)
        with b:
            out.append(b.wait(5.0))
        out.append(late.real.locked())   # held again: the next wait would sleep, not return at once
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert out == [False, True] and b.waiting == []


def test_an_interrupted_wait_takes_the_lock_back_and_its_bell_out() -> None:
    b = Bells(threading.RLock())

    class Interrupting:
        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            raise KeyboardInterrupt

    out: list = []

    def run() -> None:
        bells._local.bell = Interrupting()
        with b:
            with pytest.raises(KeyboardInterrupt):
                b.wait(5.0)
            out.append((b._is_owned(), list(b.waiting)))
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert out == [(True, [])]


def test_stop_flag_keeps_its_attribute_and_the_event_in_step() -> None:
    flag = StopFlag()
    assert not flag.stopped and not flag.is_set()
    flag.set()
    assert flag.stopped and flag.is_set() and flag.wait(0)
    flag.clear()
    assert not flag.stopped and not flag.is_set()


# ---- end to end: with the safety net longer than the timeout, a lost wake-up fails the pass --------------

@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return textured_pack(tmp_path_factory.mktemp("bells"), 3, 40, lambda i: (80 + 3 * i, 96 + 2 * i))


@pytest.mark.parametrize("device", [None, "gpu", "auto"])
def test_every_slot_wait_is_woken_without_the_safety_net(packed: Path, device: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Small batches, a one-slot prefetch and more workers than slots: the workers wait for slots all the
    time. The safety net is 60 s and the timeout 20 s, so one wake-up lost stops the pass with a timeout."""
    monkeypatch.setattr(slots, "_SLOT_POLL_S", 60.0)
    opts = None
    if device is not None:
        share = 0.5 if device == "auto" else None
        opts = DeviceOptions("cpu", dtype=torch.uint8, decode=device, gpu_share=share,
                             gpu_decoder=FixedRateDecoder(latency_s=0.002))
    for threads in (1, 3):
        loader = Loader(packed, 4, transforms=CROP, seed=3, device=opts,
                        workers=Workers(num_threads=threads, prefetch=1, timeout=20.0))
        assert sum(len(x) for x, _ in loader) == 80
        loader.close()
