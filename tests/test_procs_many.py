"""Workers(processes=N), N > 1: worker process i renders batches i, i + N, ...; the batches are the
thread mode's (and processes=1's) bit for bit whatever N and num_threads, through partial last
batches, resume, persistent epochs and kept batches; and shutdown, a killed worker process and sample
errors hold as with one process (tests/test_procs.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from stoker.errors import ConfigError, SampleError, WorkerError
from stoker.loader import Loader
from stoker.loader.options import Workers
from stoker.loading import procs

from test_loader import TRAIN, run_epoch
from test_procs import (THREADS, clean, gone, packed, packed_bad,  # noqa: F401 - the same packs, as fixtures
                        shutdown_every_way, workers_alive)

pytestmark = pytest.mark.skipif(procs._posixshmem is None, reason="POSIX shared memory only")


def many(n: int, threads: int | None = None, **kw) -> Workers:
    return Workers(num_threads=threads or n, processes=n, **kw)


def brighten(img: np.ndarray) -> np.ndarray:
    """A user transform: Python per sample in each worker process (not the native engine)."""
    return np.minimum(img.astype(np.int16) + 7, 255).astype(np.uint8)


def test_processes_n_is_validated_and_threads_count_all_processes(packed: Path) -> None:
    assert Workers(processes=3).processes == 3 and Workers(processes=np.int64(2)).processes == 2
    with pytest.raises(ConfigError, match=r"all 3 worker processes together(.|\n)*num_threads= to 3"):
        Workers(num_threads=2, processes=3)
    loader = Loader(packed, 8, transforms=TRAIN, workers=Workers(processes=3))
    assert loader.num_threads >= 3   # the default: at least one thread per process
    assert "in 3 worker processes" in repr(loader)
    assert procs.thread_shares(7, 3) == [3, 2, 2] and procs.thread_shares(3, 3) == [1, 1, 1]
    loader.close()


def test_same_bits_as_threads_and_one_process_with_a_partial_last_batch(packed: Path) -> None:
    """48 samples in batches of 10: the last batch has 8; two epochs; 2 processes of 2 and 1 threads."""
    def loaders(workers: Workers) -> Loader:
        return Loader(packed, 10, transforms=TRAIN, seed=5, workers=workers)

    threads, one, two = loaders(THREADS), loaders(many(1, 2)), loaders(many(2, 3))
    for _ in range(2):
        xt, yt = run_epoch(threads)
        for loader in (one, two):
            xp, yp = run_epoch(loader)
            assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
    assert two.stats.samples == 2 * 48 and two.stats.decode_s > 0   # every child's counters came home
    clean([])


def test_three_processes_drop_last_and_a_user_transform(packed: Path) -> None:
    """Python per sample in the children (a user transform), drop_last: the thread mode's batches."""
    def epoch(workers: Workers) -> tuple[np.ndarray, np.ndarray]:
        return run_epoch(Loader(packed, 10, transforms=[*TRAIN, brighten], seed=9, drop_last=True, workers=workers))

    (xt, yt), (xp, yp) = epoch(THREADS), epoch(many(3, 4))
    assert len(yt) == 40 and np.array_equal(xt, xp) and np.array_equal(yt, yp)
    clean([])


def test_persistent_processes_run_on_through_the_epochs(packed: Path) -> None:
    """5 batches an epoch over 3 processes: each epoch starts on another process; started once."""
    threads = Loader(packed, 10, transforms=TRAIN, seed=6, workers=Workers(num_threads=2, persistent=True))
    process = Loader(packed, 10, transforms=TRAIN, seed=6, workers=many(3, persistent=True))
    pids = set()
    for _ in range(3):
        xt, yt = run_epoch(threads)
        xp, yp = run_epoch(process)
        assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
        pids |= {p.pid for p in workers_alive()}
    assert len(pids) == 3
    process.close()
    threads.close()
    clean(list(pids))


def test_resume_mid_epoch_with_another_process_count(packed: Path) -> None:
    full = [y.tolist() for _, y in Loader(packed, 8, transforms=TRAIN, seed=2, workers=THREADS)]
    first = Loader(packed, 8, transforms=TRAIN, seed=2, workers=many(3))
    got = []
    for _, y in first:
        got.append(y.tolist())
        if len(got) == 2:
            state = first.state_dict()
            break
    second = Loader(packed, 8, transforms=TRAIN, seed=2, workers=many(2))
    second.load_state_dict(state)
    threads = Loader(packed, 8, transforms=TRAIN, seed=2, workers=THREADS)
    threads.load_state_dict(state)
    rest = run_epoch(second)
    assert np.array_equal(rest[0], run_epoch(threads)[0])
    assert got + [y.tolist() for y in np.split(rest[1], len(full) - 2)] == full
    clean([])


def test_kept_batches_and_numpy_output_over_many_processes(packed: Path) -> None:
    """Every batch kept: fresh slots, each sent to a process that never mapped it (its descriptor
    follows); numpy output counts its holders the same way."""
    expected = [x.clone() for x, _ in Loader(packed, 4, transforms=TRAIN, seed=1, workers=THREADS)]
    kept = list(Loader(packed, 4, transforms=TRAIN, seed=1, workers=many(3)))
    assert len(kept) == len(expected) == 12
    for (x, _), want in zip(kept, expected):
        assert np.array_equal(x.numpy(), want.numpy())
    arrays = list(Loader(packed, 8, transforms=TRAIN, seed=1, workers=many(2), device="numpy"))
    for (x, _), want in zip(arrays, [x for x, _ in Loader(packed, 8, transforms=TRAIN, seed=1, workers=THREADS,
                                                           device="numpy")]):
        assert isinstance(x, np.ndarray) and np.array_equal(x, want)
    clean([])


def test_the_device_stage_over_many_processes(packed: Path) -> None:
    def epoch(workers: Workers) -> list:
        loader = Loader(packed, 8, transforms=TRAIN, seed=4, workers=workers, device="cpu", columns=["weight"])
        return [(x.clone(), y.clone(), list(extras["weight"])) for x, y, extras in loader]

    threads, process = epoch(THREADS), epoch(many(2))
    assert len(threads) == len(process) == 6
    for (xt, yt, wt), (xp, yp, wp) in zip(threads, process):
        assert xt.equal(xp) and yt.equal(yp) and wt == wp
    clean([])


def test_shutdown_on_exhaustion_break_exception_close_and_collection(packed: Path) -> None:
    pids = shutdown_every_way(Loader(packed, 8, transforms=TRAIN, workers=many(2)), 2)
    abandoned = iter(Loader(packed, 8, transforms=TRAIN, workers=many(3)))
    next(abandoned)
    ring = weakref.ref(abandoned._run.ring)
    pids.extend(p.pid for p in workers_alive())
    del abandoned   # dropped without close(): reference counting alone stops its processes
    assert ring() is None
    clean(pids)
    assert len(set(pids)) == 4 * 2 + 3


@pytest.mark.parametrize("index", [0, 1], ids=["the-due-one", "a-later-one"])
def test_a_killed_worker_process_of_three_is_an_error_naming_which(packed: Path, index: int) -> None:
    """After batches 0, 1 and 2 (one from each process), process 1 (whose batch 3 is due) or process 2
    (whose next batch is 4) is killed: a WorkerError naming it and what to do, at once, not after the
    timeout; the others are stopped and nothing is left."""
    loader = Loader(packed, 4, transforms=TRAIN, workers=many(3, timeout=60))
    it = iter(loader)
    for _ in range(3):
        next(it)
    victim = it._run.children[index].process
    pids = [c.process.pid for c in it._run.children]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        for _ in it:
            pass
    msg = str(info.value)
    assert time.monotonic() - t0 < 50   # found while waiting, not after the 60 s timeout
    assert f"worker process {index + 1} of 3 (pid {victim.pid})" in msg and "code -9" in msg
    assert "start a new one" in msg and "other worker processes are stopped" in msg
    clean(pids)


def test_a_worker_process_killed_while_starting_is_named(packed: Path) -> None:
    loader = Loader(packed, 4, transforms=TRAIN, workers=many(3, timeout=60))
    it = iter(loader)
    victim = it._run.children[2].process   # batch 2's, killed before it has imported stoker
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(WorkerError) as info:
        for _ in it:
            pass
    msg = str(info.value)
    assert f"worker process 3 of 3 (pid {victim.pid})" in msg and "SIGKILL" in msg and "while starting" in msg
    it.close()
    clean([])


def test_a_sample_error_and_skip_read_as_in_thread_mode(packed_bad: Path) -> None:
    errors = []
    for workers in (THREADS, many(3)):
        got = []
        with pytest.raises(SampleError) as info:
            for _, y in Loader(packed_bad, 4, transforms=TRAIN, order="sequential", workers=workers):
                got.extend(y.tolist())
        assert got == list(range(12))   # every batch before the failing one, in order
        errors.append(info.value)
    threads, process = errors
    assert type(process) is type(threads) and str(process) == str(threads)
    runs = []
    for n in (0, 2):
        loader = Loader(packed_bad, 4, transforms=TRAIN, order="sequential",
                        workers=Workers(num_threads=2, processes=n, on_error="skip"))
        runs.append((run_epoch(loader), loader.stats.skipped, loader.stats.skipped_keys))
    ((xt, yt), st, kt), ((xp, yp), sp, kp) = runs
    assert np.array_equal(xt, xp) and np.array_equal(yt, yp) and st == sp == 1 and kt == kp == ["img/0013.x"]
    clean([])


def _script(packed: Path, path: Path, processes: int, then: str = "") -> tuple[list[str], dict]:
    """A training process that takes one batch from `processes` worker processes, prints its pid and
    theirs, then runs `then`: the command and environment to start it with."""
    path.write_text(textwrap.dedent(f"""
        import multiprocessing, os, time
        from stoker import Loader, Workers, RandomResizedCrop
        if __name__ == "__main__":
            loader = Loader({str(packed)!r}, 4, transforms=[RandomResizedCrop(32)],
                            workers=Workers(processes={processes}))
            it = iter(loader)
            next(it)
            print(os.getpid(), *(p.pid for p in multiprocessing.active_children()
                                 if p.name == "stoker-worker-process"), flush=True)
    """) + (f"    {then}\n" if then else ""))
    return [sys.executable, str(path)], {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_interpreter_exit_ends_every_worker_process(packed: Path, tmp_path: Path) -> None:
    cmd, env = _script(packed, tmp_path / "run.py", 2)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    parent, *children = map(int, out.stdout.split())
    assert len(children) == 2 and all(gone(child) for child in children)
    assert not list(Path("/dev/shm").glob(f"stoker-{parent}-*"))
    assert "leaked" not in out.stderr


def test_a_killed_training_process_leaves_no_worker_process(packed: Path, tmp_path: Path) -> None:
    cmd, env = _script(packed, tmp_path / "run.py", 3, then="time.sleep(60)")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        parent, *children = map(int, proc.stdout.readline().split())
        assert len(children) == 3
        proc.kill()
        proc.wait(10)
        assert all(gone(child) for child in children)   # their pipes closed: each stopped on its own
        assert not list(Path("/dev/shm").glob(f"stoker-{parent}-*"))
    finally:
        proc.kill()
        proc.stdout.close()
