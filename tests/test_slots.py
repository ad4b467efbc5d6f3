"""The batch ring, its worker threads (Run) and the device thread (Feeder), driven by fake fill and
build functions: order, backpressure, errors reaching the consumer with their traceback, timeouts,
and shutdown that leaves no thread behind. The Loader-level behaviour is in test_loader*.py."""

from __future__ import annotations

import contextlib
import threading
import time
import traceback

import pytest

from stoker._system import poll_until
from stoker.device.stage import Fence
from stoker.errors import LoaderClosedError, LoaderTimeoutError, StokerError, WorkerError
from stoker.device.feeder import Feeder
from stoker.loading import slots
from stoker.loading.slots import BatchRing, Run, Slot
from stoker.loading.stats import WorkerTimes


def stoker_threads() -> int:
    return sum(t.name.startswith("stoker") for t in threading.enumerate())


def ring(n_slots: int = 2, batch: int = 4) -> BatchRing:
    return BatchRing(n_slots, batch, 2, 2, label_dtype=None, pin_memory=False)


def mark_fill(delay: float = 0.0):
    """A fill function that writes (batch, row) into the row, so the consumer can check where it landed."""
    def fill(plan, row: int, slot: Slot, scratch: dict, times: WorkerTimes) -> None:
        if delay:
            time.sleep(delay * ((row * 7919 + slot.batch) % 3))  # uneven: rows finish out of order
        slot.images_np[row, 0, 0, 0] = slot.batch
        slot.images_np[row, 0, 0, 1] = row
    return fill


def no_plan(b: int, slot: Slot) -> None:
    return None


def no_flush(times: WorkerTimes, samples: int) -> None:
    return None


def make_run(sizes: list[int], threads: int = 3, *, fill=None, prepare=no_plan, timeout: float = 10.0,
             n_slots: int = 2) -> Run:
    return Run(ring(n_slots, max(sizes)), sizes, threads, prepare, fill or mark_fill(), no_flush, timeout)


def test_batches_arrive_in_order_with_every_row_in_place() -> None:
    before = stoker_threads()
    sizes = [4, 4, 4, 4, 4, 2]
    run = make_run(sizes, fill=mark_fill(0.002))
    run.start()
    try:
        for b, n in enumerate(sizes):
            slot = run.next_batch(b)
            assert slot.size == n
            assert slot.images_np[:n, 0, 0, 0].tolist() == [b] * n
            assert slot.images_np[:n, 0, 0, 1].tolist() == list(range(n))
    finally:
        run.stop()
    assert run.alive() == 0 and stoker_threads() == before


def test_workers_never_plan_more_batches_than_the_ring_holds() -> None:
    """Backpressure: batch b is planned only once the consumer released batch b - n_slots."""
    seen: list[tuple[int, int]] = []
    run: Run

    def prepare(b: int, slot: Slot) -> None:
        seen.append((b, run.released))

    run = make_run([4] * 10, threads=4, prepare=prepare, n_slots=2)
    run.start()
    try:
        for b in range(10):
            time.sleep(0.01)  # a slow consumer: the workers are ahead and must wait
            run.next_batch(b)
    finally:
        run.stop()
    assert [b for b, _ in seen] == list(range(10))
    assert all(b < released + 2 for b, released in seen), seen


def test_every_worker_waiting_for_a_batchs_rows_wakes_when_it_is_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims of one row each: several workers wait for the slot of the same batch. The one woken plans it
    and wakes the others (first in line, ranked by batch), not the workers of later batches. The safety net is
    longer than the timeout here, so one wake-up lost fails the pass."""
    monkeypatch.setattr(slots, "_SLOT_POLL_S", 60.0)
    run = make_run([4] * 12, threads=4, n_slots=2, timeout=20.0)
    run.start()
    try:
        for b in range(12):
            time.sleep(0.005)  # a slow consumer: every worker waits for a slot
            assert run.next_batch(b).images_np[:4, 0, 0, 0].tolist() == [b] * 4
    finally:
        run.stop()
    assert run.alive() == 0


def test_a_failing_sample_reaches_the_consumer_with_its_worker_traceback() -> None:
    def fill(plan, row, slot, scratch, times):
        if slot.batch == 1 and row in (2, 3):
            raise ValueError(f"bad row {row}")
        mark_fill()(plan, row, slot, scratch, times)

    run = make_run([4, 4, 4], fill=fill)
    run.start()
    try:
        run.next_batch(0)
        with pytest.raises(ValueError, match="bad row 2") as info:  # the first failing row of the batch
            run.next_batch(1)
    finally:
        run.stop()
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "fill" in frames  # raised where it happened, in the worker thread


def test_a_broken_worker_loop_is_a_worker_error() -> None:
    def prepare(b: int, slot: Slot) -> None:
        raise RuntimeError("planning exploded")

    run = make_run([4, 4], prepare=prepare)
    run.start()
    try:
        with pytest.raises(WorkerError, match="failed outside any sample") as info:
            run.next_batch(0)
    finally:
        run.stop()
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, StokerError)
    assert str(info.value.__cause__) == "planning exploded"


def test_a_stalled_batch_times_out_and_stop_ends_the_threads() -> None:
    release = threading.Event()

    def fill(plan, row, slot, scratch, times):
        release.wait(60.0)

    before = stoker_threads()
    run = make_run([4, 4], threads=2, fill=fill, timeout=0.3)
    run.start()
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match=r"batch 0: no complete batch after 0 s \(4 of 4 samples pending"):
        run.next_batch(0)
    assert time.monotonic() - t0 < 30.0   # the 0.3 s timeout, not the 60 s fill: a hang guard
    release.set()
    run.stop()
    assert run.alive() == 0 and stoker_threads() == before


def test_stop_is_idempotent_and_a_closed_run_raises_loader_closed() -> None:
    release = threading.Event()
    run = make_run([4, 4], fill=lambda *a: release.wait(5.0))
    run.start()
    run.stop(join_timeout=0.1)
    release.set()
    run.stop()
    run.stop()
    with pytest.raises(LoaderClosedError, match="closed while waiting for batch 0") as info:
        run.next_batch(0)
    assert isinstance(info.value, RuntimeError)
    assert run.alive() == 0


# ---- the Feeder ----------------------------------------------------------------------------------

class Stage:
    """The Feeder's view of a device stage, with no device: batches pass through."""

    def bind(self) -> None:
        pass

    def context(self):
        return contextlib.nullcontext()

    def fence(self) -> Fence:
        return Fence(None)

    def handoff(self, batch, fence):
        return batch


def test_feeder_delivers_built_batches_in_order_and_stops_cleanly() -> None:
    before = stoker_threads()
    run = make_run([4] * 6, fill=mark_fill(0.001))
    feeder = Feeder(run, Stage(), lambda slot: ((slot.batch, slot.images.clone()), Fence(None)), depth=2,
                    timeout=10.0)
    run.start(), feeder.start()
    try:
        got = [feeder.get(b) for b in range(6)]
    finally:
        feeder.stop()
        feeder.stop()  # idempotent
    assert [b for b, _ in got] == list(range(6))
    assert all(int(x[0, 0, 0, 0]) == b for b, x in got)
    assert feeder.alive() == 0 and stoker_threads() == before


def test_feeder_passes_a_build_error_on_in_batch_order() -> None:
    def build(slot):
        if slot.batch == 2:
            raise KeyError("no such column")
        return slot.batch, Fence(None)

    run = make_run([4] * 4)
    feeder = Feeder(run, Stage(), build, depth=2, timeout=10.0)
    run.start(), feeder.start()
    try:
        assert [feeder.get(0), feeder.get(1)] == [0, 1]
        with pytest.raises(KeyError, match="no such column"):
            feeder.get(2)
    finally:
        feeder.stop()
    assert feeder.alive() == 0


def test_feeder_times_out_and_reports_a_closed_loader() -> None:
    release = threading.Event()
    run = make_run([4, 4], fill=lambda *a: release.wait(5.0))
    feeder = Feeder(run, Stage(), lambda slot: (slot.batch, Fence(None)), depth=2, timeout=0.3)
    run.start(), feeder.start()
    with pytest.raises(LoaderTimeoutError, match="nothing reached the device after 0 s"):
        feeder.get(0)
    release.set()
    feeder.stop()
    with pytest.raises(LoaderClosedError):
        feeder.get(0)
    assert feeder.alive() == 0



def test_feeder_hand_offs_block_on_a_notify_instead_of_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer waiting for a slow build, and the device thread waiting for room in the queue,
    each wake on the other side's notify: neither calls time.sleep (a poll would, every 0.2-2 ms)."""
    sleeps: dict[str, int] = {}
    real_sleep = time.sleep

    def counting_sleep(seconds: float) -> None:
        name = threading.current_thread().name
        sleeps[name] = sleeps.get(name, 0) + 1
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", counting_sleep)
    slow_build, pause = threading.Event(), threading.Event()

    def build(slot):
        if slot.batch == 0:
            slow_build.wait(5.0)
        return slot.batch, Fence(None)

    run = make_run([4] * 4)
    feeder = Feeder(run, Stage(), build, depth=1, timeout=10.0)
    run.start(), feeder.start()
    timer = threading.Timer(0.1, slow_build.set)
    timer.start()
    try:
        got = [feeder.get(0)]  # waits ~0.1 s for batch 0's build
        pause.wait(0.1)  # a slow training step: the device thread waits with batch 1 queued (depth 1)
        got += [feeder.get(b) for b in range(1, 4)]
    finally:
        timer.cancel()
        feeder.stop()
    assert got == [0, 1, 2, 3]
    assert sleeps.get(threading.current_thread().name, 0) == 0, sleeps
    assert sleeps.get(feeder.thread.name, 0) == 0, sleeps


# ---- the one polling wait ------------------------------------------------------------------------

def test_poll_until_returns_true_false_or_raises_the_callers_timeout() -> None:
    ticks = iter(range(100))
    assert poll_until(lambda: next(ticks) >= 3, 1.0) is True
    stop = threading.Event()
    stop.set()
    assert poll_until(lambda: False, 1.0, stop=stop) is False
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match="late"):
        poll_until(lambda: False, 0.05, on_timeout=lambda: LoaderTimeoutError("late"))
    assert 0.04 <= time.monotonic() - t0 < 30.0   # never early; the upper bound only guards a hang
    with pytest.raises(TimeoutError):
        poll_until(lambda: False, 0.01)


# ---- the Feeder: a slot goes back to the workers only after its copy finished ----------------

class _SlowFence:
    """A copy that finishes `seconds` after it was queued, as the GPU would, with no notification."""

    what = "a slow copy"
    on_gpu = True   # the GPU's work (slots.Guard)

    def __init__(self, log: list, b: int, seconds: float = 0.03) -> None:
        self.log, self.b = log, b
        self.finished_at = time.perf_counter() + seconds

    def done(self) -> bool:
        if time.perf_counter() < self.finished_at:
            return False
        if ("copied", self.b) not in self.log:
            self.log.append(("copied", self.b))
        return True

    def wait(self, timeout: float, stop: threading.Event | None = None) -> None:
        poll_until(self.done, timeout, stop=stop)


class _FakeStage(Stage):
    def __init__(self, log: list) -> None:
        self.log = log


def test_feeder_returns_a_slot_to_the_workers_only_after_its_copy_finished() -> None:
    log: list = []
    ring = BatchRing(2, 4, 2, 2, label_dtype=None, pin_memory=False)
    lock = threading.Lock()

    def prepare(b, slot):
        with lock:
            log.append(("fill", b))

    def fill(plan, row, slot, scratch, times):
        slot.images_np[row] = slot.batch

    def build(slot):
        return slot.images.clone(), _SlowFence(log, slot.batch)

    run = Run(ring, [4] * 8, 2, prepare, fill, lambda t, n: None, timeout=10.0)
    feeder = Feeder(run, _FakeStage(log), build, depth=2, timeout=10.0)
    run.start(), feeder.start()
    try:
        out = [feeder.get(b) for b in range(8)]
    finally:
        feeder.stop()
    assert [int(x[0, 0, 0, 0]) for x in out] == list(range(8))
    for b in range(6):  # batch b+2 reuses b's slot: it is planned only after b's copy is done
        assert log.index(("copied", b)) < log.index(("fill", b + 2)), log
    assert not feeder.thread.is_alive() and run.alive() == 0


def test_the_device_thread_does_not_wait_for_its_own_copy() -> None:
    """The copy's fence guards the slot for the workers; the device thread builds the next batch at
    once instead of waiting the copy out: three batches are handed out while none of their copies (each
    60 s long) is done, and no one waited on a fence. Counted, not timed."""
    fences: list[_SlowFence] = []
    waits: list[int] = []

    class Counted(_SlowFence):
        def wait(self, timeout: float, stop: threading.Event | None = None) -> None:
            waits.append(self.b)
            super().wait(timeout, stop)

    def build(slot):
        fences.append(Counted([], slot.batch, 60.0))
        return slot.batch, fences[-1]

    run = make_run([4] * 3, n_slots=4)
    feeder = Feeder(run, Stage(), build, depth=3, timeout=30.0)
    run.start(), feeder.start()
    try:
        got = [feeder.get(b) for b in range(3)]
        pending = [not f.done() for f in fences]
    finally:
        feeder.stop()
    assert got == [0, 1, 2]
    assert len(fences) == 3 and all(pending) and waits == [], (pending, waits)


# ---- the ring: a slot returns only when nothing references it ----------------------------------

def test_a_held_slot_is_never_refilled_and_a_kept_one_is_replaced() -> None:
    ring = BatchRing(3, 4, 2, 2, label_dtype=None, pin_memory=False)
    first = ring.free.popleft()
    ring.hand_out(first)
    view = first.images[1:2].permute(0, 3, 1, 2)   # a view keeps the memory, as the batch itself would
    assert ring.reclaim() is False and ring.out == [first]   # the latest: maybe the loop variable
    second = ring.free.popleft()
    ring.hand_out(second)
    assert ring.reclaim() is True   # `first` is older and still held: let go, a fresh slot in its place
    assert first not in ring.slots and first not in ring.free and len(ring.slots) == 3
    assert ring.out == [] and second in ring.free   # nothing referenced it: back to the workers
    del view, first
    assert ring.live_kept() == []   # the caller dropped it: its memory is gone, not back in the ring
