"""Workers(processes=1): the worker threads in a child process, batches in shared memory. The same
bits, resume, shutdown and error guarantees as the thread mode (tests/test_loader.py)."""

from __future__ import annotations

import _thread
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import stoker
from stoker.loading import procs, shared_slots
from stoker.errors import ConfigError, CorruptImageError, LoaderTimeoutError, SampleError, WorkerError
from stoker.loader import Loader
from stoker.loader.options import Workers

from test_loader import TRAIN, build_packed, run_epoch

pytestmark = pytest.mark.skipif(procs._posixshmem is None, reason="POSIX shared memory only")

PROCESS = Workers(num_threads=2, processes=1)
THREADS = Workers(num_threads=2)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("packed") / "ds", n=48)


@pytest.fixture(scope="module")
def packed_bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("bad") / "ds", n=24, corrupt=(13,))


def shm_left() -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"stoker-{os.getpid()}-*")] if Path("/dev/shm").is_dir() else []


def workers_alive() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name == "stoker-worker-process"]


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def clean(pids: list[int]) -> None:
    """No worker process alive and no shared memory name left."""
    assert all(gone(pid) for pid in pids)
    assert not workers_alive()
    assert shm_left() == []


def test_processes_is_validated() -> None:
    assert Workers(processes=1).processes == 1 and Workers().processes == 0
    assert Workers(processes=2).processes == 2   # any N >= 1 (tests/test_procs_many.py)
    for bad in (-1, True, "1", 1.0):
        with pytest.raises(ConfigError, match="processes must be 0"):
            Workers(processes=bad)


def test_what_cannot_cross_is_refused_with_the_fix(packed: Path) -> None:
    with pytest.raises(ConfigError, match="pickl.*drop processes="):
        Loader(packed, 8, transforms=[*TRAIN, lambda img: img], workers=PROCESS)
    with pytest.raises(ConfigError, match="decode='cpu'"):
        Loader(packed, 8, transforms=TRAIN, workers=PROCESS, device=stoker.DeviceOptions("cpu", decode="gpu"))


def test_same_bits_as_threads_over_two_epochs(packed: Path) -> None:
    threads = Loader(packed, 8, transforms=TRAIN, seed=5, workers=THREADS)
    process = Loader(packed, 8, transforms=TRAIN, seed=5, workers=PROCESS)
    for _ in range(2):
        xt, yt = run_epoch(threads)
        xp, yp = run_epoch(process)
        assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
    assert process.stats.samples == 2 * 48 and process.stats.decode_s > 0   # the child's counters came home
    # the child renders as the threads do (this pack is under 90% JPEG: not the engine), and the stats say so
    assert process.stats.engine == threads.stats.engine and process.stats.per_sample_python == []
    assert process.epoch == 2
    clean([])


def test_the_stats_say_the_child_renders_with_the_engine(tmp_path: Path) -> None:
    from stoker.packing import pack
    from stoker.tools.synth import make_tiny_jpegs

    pack(make_tiny_jpegs(tmp_path / "src", 16, classes=2, size=(72, 80)), tmp_path / "ds", progress=False)   # over raw_below
    for workers in (THREADS, PROCESS):
        with Loader(tmp_path / "ds", 8, transforms=TRAIN, workers=workers) as loader:
            assert loader.route.native, workers   # decided when made: every row a JPEG, the engine in either
            run_epoch(loader)
            assert loader.stats.engine and loader.stats.route is loader.route, workers
    clean([])


def test_persistent_one_worker_process_runs_on_through_the_epochs(packed: Path) -> None:
    threads = Loader(packed, 8, transforms=TRAIN, seed=6, workers=Workers(num_threads=2, persistent=True))
    process = Loader(packed, 8, transforms=TRAIN, seed=6, workers=Workers(num_threads=2, processes=1,
                                                                          persistent=True))
    pids = set()
    for _ in range(3):
        xt, yt = run_epoch(threads)
        xp, yp = run_epoch(process)
        assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
        pids |= {p.pid for p in workers_alive()}
    assert len(pids) == 1   # started once: the next epoch was already under way
    assert shm_left() == []
    process.close()
    threads.close()
    clean(list(pids))


def test_kept_batches_are_never_overwritten(packed: Path) -> None:
    """The caller keeps every batch: the parent lets each slot go and sends the child fresh memory."""
    expected = [x.clone() for x, _ in Loader(packed, 4, transforms=TRAIN, seed=1, workers=THREADS)]
    kept = list(Loader(packed, 4, transforms=TRAIN, seed=1, workers=PROCESS))
    assert len(kept) == len(expected) == 12
    for (x, _), want in zip(kept, expected):
        assert np.array_equal(x.numpy(), want.numpy())
    clean([])


def test_numpy_output_over_shared_slots_and_kept_arrays(packed: Path) -> None:
    """device="numpy": the slots are numpy arrays over shared memory whose holders are counted."""
    def epoch(workers: Workers) -> list:
        return list(Loader(packed, 8, transforms=TRAIN, seed=8, workers=workers, device="numpy"))   # kept

    threads, process = epoch(THREADS), epoch(PROCESS)
    assert len(threads) == len(process) == 6
    for (xt, yt), (xp, yp) in zip(threads, process):
        assert isinstance(xp, np.ndarray) and xp.shape == (8, 3, 32, 32)
        assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
    clean([])


def test_resume_mid_epoch_gives_the_rest(packed: Path) -> None:
    full = [y.tolist() for _, y in Loader(packed, 8, transforms=TRAIN, seed=2, workers=THREADS)]
    first = Loader(packed, 8, transforms=TRAIN, seed=2, workers=PROCESS)
    got = []
    for _, y in first:
        got.append(y.tolist())
        if len(got) == 2:
            state = first.state_dict()
            break
    second = Loader(packed, 8, transforms=TRAIN, seed=2, workers=PROCESS)
    second.load_state_dict(state)
    threads = Loader(packed, 8, transforms=TRAIN, seed=2, workers=THREADS)
    threads.load_state_dict(state)
    rest = run_epoch(second)
    assert np.array_equal(rest[0], run_epoch(threads)[0])
    assert got + [y.tolist() for y in np.split(rest[1], len(full) - 2)] == full
    clean([])


def shutdown_every_way(loader: Loader, processes: int) -> list[int]:
    """Iterate `loader` to exhaustion, then break, raise in the loop and close() mid-pass: each time its
    `processes` worker processes run while the pass does and are gone after it, with no shared memory
    left. Returns the pids seen (a new set each pass)."""
    pids: list[int] = []

    def running() -> None:
        alive = workers_alive()
        assert len(alive) == processes
        pids.extend(p.pid for p in alive)

    it = iter(loader)
    next(it)
    running()
    list(it)   # exhaustion
    clean(pids)
    for _ in loader:   # break
        running()
        break
    gc.collect()
    clean(pids)
    with pytest.raises(RuntimeError, match="boom"):
        for _ in loader:
            running()
            raise RuntimeError("boom")
    clean(pids)
    it = iter(loader)
    next(it)
    running()
    loader.close()
    clean(pids)
    return pids


def test_shutdown_on_exhaustion_break_exception_and_close(packed: Path) -> None:
    pids = shutdown_every_way(Loader(packed, 8, transforms=TRAIN, workers=PROCESS), 1)
    assert len(set(pids)) == 4


def test_a_pass_beside_a_running_one_and_an_abandoned_pass(packed: Path) -> None:
    loader = Loader(packed, 8, transforms=TRAIN, workers=PROCESS)
    first = iter(loader)
    next(first)
    second = iter(loader)   # its own worker process and ring; both passes whole
    assert len(workers_alive()) == 2
    assert len(list(second)) == len(loader) and len(list(first)) == len(loader) - 1
    del first, second
    abandoned = iter(loader)
    next(abandoned)
    del abandoned   # collected: its worker process stops
    gc.collect()
    clean([])


def slow(img: np.ndarray) -> np.ndarray:
    time.sleep(0.05)
    return img


@pytest.mark.parametrize("batch, workers, within", [(24, PROCESS, 10.0), (12, Workers(num_threads=2, processes=2), 15.0)],
                         ids=["one-process", "two-processes"])
def test_ctrl_c_stops_the_worker_processes(packed: Path, batch: int, workers: Workers, within: float) -> None:
    loader = Loader(packed, batch, transforms=[*TRAIN, slow], workers=workers)
    it = iter(loader)
    timer = threading.Timer(0.3, _thread.interrupt_main)   # while next() waits for the first batch
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in it:
            pass
    timer.join()
    assert time.monotonic() - t0 < within
    clean([])


def test_a_killed_worker_process_is_an_error_naming_it(packed: Path) -> None:
    loader = Loader(packed, 4, transforms=TRAIN, workers=Workers(num_threads=2, processes=1, timeout=60))
    it = iter(loader)
    next(it)
    (proc,) = workers_alive()
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        for _ in it:
            pass
    assert time.monotonic() - t0 < 50   # found while waiting, not after the 60 s timeout
    assert f"pid {proc.pid}" in str(info.value) and "code -9" in str(info.value)
    clean([proc.pid])


def test_a_sample_error_reads_as_in_thread_mode(packed_bad: Path) -> None:
    errors = []
    for workers in (THREADS, PROCESS):
        got = []
        with pytest.raises(SampleError) as info:
            for _, y in Loader(packed_bad, 4, transforms=TRAIN, order="sequential", workers=workers):
                got.extend(y.tolist())
        assert got == list(range(12))
        errors.append(info.value)
    threads, process = errors
    assert type(process) is type(threads) and str(process) == str(threads)
    assert (process.key, process.shard, process.row) == (threads.key, threads.shard, threads.row) == \
        ("img/0013.x", "shard-00001.arrow", 1)
    assert isinstance(process.__cause__, CorruptImageError)
    assert "decode_rgb" in str(process.__cause__.__cause__)   # the worker's traceback, as text
    clean([])


def test_skip_gives_the_same_replacements_and_counts(packed_bad: Path) -> None:
    runs = []
    for workers in (THREADS, PROCESS):
        loader = Loader(packed_bad, 4, transforms=TRAIN, order="sequential",
                        workers=Workers(num_threads=2, processes=workers.processes, on_error="skip"))
        runs.append((run_epoch(loader), loader.stats.skipped, loader.stats.skipped_keys))
    (xt, yt), skipped_t, keys_t = runs[0]
    (xp, yp), skipped_p, keys_p = runs[1]
    assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
    assert skipped_p == skipped_t == 1 and keys_p == keys_t == ["img/0013.x"]
    clean([])


def test_a_worker_process_that_cannot_start_its_work_says_why(packed: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    loader = Loader(copy, 8, transforms=TRAIN, workers=PROCESS)
    (copy / "stoker.json").unlink()   # the worker process reopens the dataset by its path
    with pytest.raises(WorkerError, match=r"failed outside any sample:(.|\n)*stoker.json"):
        next(iter(loader))
    loader.close()
    clean([])


def _training_script(packed: Path, path: Path, then: str = "") -> tuple[list[str], dict]:
    """A training process that takes one batch in process mode, prints its pid and its worker's, then
    runs `then`: the command and environment to start it with."""
    path.write_text(textwrap.dedent(f"""
        import multiprocessing, os, time
        from stoker import Loader, Workers, RandomResizedCrop
        if __name__ == "__main__":
            loader = Loader({str(packed)!r}, 4, transforms=[RandomResizedCrop(32)],
                            workers=Workers(num_threads=2, processes=1))
            it = iter(loader)
            next(it)
            print(os.getpid(), multiprocessing.active_children()[0].pid, flush=True)
    """) + (f"    {then}\n" if then else ""))
    return [sys.executable, str(path)], {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_a_script_without_a_main_guard_gets_an_error_that_names_the_guard(packed: Path, tmp_path: Path) -> None:
    """The worker process is spawned, which imports the main script again: a script that iterates at
    its top level (fine with threads, and with DataLoader's fork on Linux) fails there. The training
    process must say so, not "killed, or out of memory?", and must not fail again while stopping: it says
    so when the Loader is made, naming the line, before any child starts (stoker.mainguard)."""
    (tmp_path / "run.py").write_text(textwrap.dedent(f"""
        from stoker import Loader, Workers, RandomResizedCrop
        loader = Loader({str(packed)!r}, 4, transforms=[RandomResizedCrop(32)],
                        workers=Workers(num_threads=2, processes=1))
        next(iter(loader))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(tmp_path / "run.py")], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("stoker.errors.ConfigError") and 'if __name__ == "__main__":' in last, out.stderr
    assert "line 3 of" in last and "can only join a started process" not in out.stderr
    assert "bootstrapping" not in out.stderr   # no child ran the script again


def test_interpreter_exit_ends_the_worker_process(packed: Path, tmp_path: Path) -> None:
    cmd, env = _training_script(packed, tmp_path / "run.py")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    parent, child = map(int, out.stdout.split())
    assert gone(child)
    assert not list(Path("/dev/shm").glob(f"stoker-{parent}-*"))
    assert "leaked" not in out.stderr


def test_a_killed_training_process_leaves_no_worker_process(packed: Path, tmp_path: Path) -> None:
    cmd, env = _training_script(packed, tmp_path / "run.py", then="time.sleep(60)")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        parent, child = map(int, proc.stdout.readline().split())
        proc.kill()
        proc.wait(10)
        assert gone(child)   # its pipe closed: the worker process stopped on its own
        deadline = time.monotonic() + 10
        while list(Path("/dev/shm").glob(f"stoker-{parent}-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not list(Path("/dev/shm").glob(f"stoker-{parent}-*"))
    finally:
        proc.kill()
        proc.stdout.close()


class FakeCudart:
    """torch.cuda.cudart()'s two calls, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_shared_slots_are_registered_pinned_and_unregistered_before_unmapping(monkeypatch) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(shared_slots, "_cudart", lambda: fake)
    buffers = shared_slots.SharedBuffers(pin=True)
    slot = buffers.allocate(4, 8, 8, np.dtype(np.int64))
    name = buffers.segments[slot].name
    ((kind, ptr, size, flags),) = fake.calls
    assert kind == "register" and flags == 0 and size >= 4 * 8 * 8 * 3 + 4 * 8
    assert slot.images.data_ptr() == ptr   # the batch tensor is a view of the registered memory
    view = slot.images[1:]
    buffers.unlink_all()
    assert not (Path("/dev/shm") / name).exists()
    del slot
    gc.collect()
    assert len(fake.calls) == 1   # a view still holds the memory: still registered
    view[0, 0, 0, 0] = 7   # still mapped
    del view
    gc.collect()
    assert fake.calls[1:] == [("unregister", ptr)]


def test_the_device_stage_and_extra_columns_work_over_shared_slots(packed: Path) -> None:
    """device="cpu" runs the device thread (the Feeder) on the process mode's slots; extras come along."""
    def epoch(workers: Workers) -> list:
        loader = Loader(packed, 8, transforms=TRAIN, seed=4, workers=workers, device="cpu", columns=["weight"])
        return [(x.clone(), y.clone(), list(extras["weight"])) for x, y, extras in loader]

    threads, process = epoch(THREADS), epoch(PROCESS)
    assert len(threads) == len(process) == 6
    for (xt, yt, wt), (xp, yp, wp) in zip(threads, process):
        assert xt.dtype == xp.dtype and xt.equal(xp) and yt.equal(yp) and wt == wp
    clean([])


class NeverDone:
    what = "a copy that never finishes"
    on_gpu = True   # the GPU's work (slots.Guard)

    def done(self) -> bool:
        return False


def test_a_guard_that_never_passes_times_out_naming_it(packed: Path) -> None:
    """Slots whose GPU copy never completes are never sent back to the child: once every slot is
    stuck, a timeout naming the copy, not a hang."""
    # the timeout also bounds each batch the child makes before the slots are stuck: 4 s is far above a
    # batch of 8 on a loaded machine, so the only wait that can run out is the copy's
    loader = Loader(packed, 8, transforms=TRAIN, workers=Workers(num_threads=2, processes=1, prefetch=1, timeout=4))
    it = iter(loader)
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match="a copy that never finishes"):
        for k, _ in enumerate(it):
            it._run.guard(k, NeverDone())   # as a copy of batch k queued on a stream would
    assert time.monotonic() - t0 < 30
    clean([])


@pytest.mark.parametrize("batch, workers", [(2, PROCESS), (1, Workers(num_threads=2, processes=2))],
                         ids=["one-process", "two-processes"])
def test_video_clips_give_the_same_batches_as_threads(tmp_path: Path, batch: int, workers: Workers) -> None:
    """Clips, where the process mode pays most (PyAV's per-frame Python), cross as images do, over one
    worker process and over two (batches of 1: each process renders every other one)."""
    pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")
    import stoker
    from stoker.loading.clips import Clips
    from stoker.packing import pack
    from stoker.tools.synth_video import VideoStyle, make_kinetics_like
    from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

    make_kinetics_like(tmp_path / "src", 2, classes=2, style=VideoStyle(seconds=1, fps=10, size=(40, 48)))
    pack(tmp_path / "src", tmp_path / "ds", progress=False)

    def run(workers: Workers) -> list:
        with stoker.Loader(tmp_path / "ds", batch, sampling=stoker.Sampling(clips=Clips(frames=3)),
                           transforms=[RandomResizedCrop(24), RandomHorizontalFlip()], seed=3, workers=workers) as loader:
            return [(x.clone(), y.clone()) for x, y in loader]

    threads, process = run(THREADS), run(workers)
    assert len(threads) == len(process) == 4 // batch and threads[0][0].shape == (batch, 3, 3, 24, 24)
    for (xt, yt), (xp, yp) in zip(threads, process):
        assert xt.equal(xp) and yt.equal(yp)
    clean([])
