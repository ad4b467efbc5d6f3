"""The engine pool beside other programs (csrc/crowd.c, `Workers(max_threads=)`): the fair-share model
and its check, window by window, and end to end in a process pinned to one CPU, where busy processes
beside the Loader make its pool grow, and their end (or max_threads) keeps it at its own size; every
thread it started is joined when the Loader closes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_image_folder
from stoker import native
from stoker.errors import ConfigError
from stoker.loader.options import Workers
from stoker.loading import engine

pytestmark = pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")

HOLD_S = 10.0   # crowd.h's STOKER_CROWD_HOLD_S
FRESH = (0, 0.0, 0.0, 0.0)   # (active, hold_until, rate_before, gain): crowd_next reads active 0 as base


def step(base: int, most: int, state: tuple, window: tuple, now: float = 100.0) -> tuple:
    """One measuring window: (window_s, pool_cpu_s, pool_wall_s, others, cores)."""
    return native._mod.crowd_next(base, most, state, window, now)


def crowded(threads: int, rivals: float, cores: int = 2, busy: float = 1.0, seconds: float = 0.5) -> tuple:
    """The window of `threads` busy pool threads beside `rivals` busy threads of other processes, each
    getting its fair share of `cores` (the kernel's share at equal priority)."""
    share = min(1.0, cores / (threads + rivals))
    wall = threads * seconds * busy
    return seconds, wall * share, wall, rivals * share, cores


def test_alone_or_waiting_for_work_the_pool_keeps_its_own_size():
    assert step(2, 8, FRESH, crowded(2, 0.0))[0] == 2   # no other process
    assert step(2, 8, FRESH, crowded(2, 0.1))[0] == 2   # a trickle of other work: below CROWDED
    assert step(2, 8, FRESH, crowded(2, 2.0, busy=0.4))[0] == 2   # crowded, but the threads wait for work
    assert step(2, 2, FRESH, crowded(2, 2.0))[0] == 2   # most = base: it never grows
    assert step(2, 8, FRESH, (0.5, 0.0, 0.0, 0.0, 2.0))[0] == 2   # no row ended in the window


def test_beside_other_busy_processes_the_pool_grows_to_keep_its_share():
    # one busy process per core: 4x the threads keep 0.8 of the cores
    assert step(2, 8, FRESH, crowded(2, 2.0))[0] == 8
    assert step(2, 6, FRESH, crowded(2, 2.0))[0] == 6   # as far as most
    # the model's count keeps GOAL (0.8) of what the pool would use alone, wherever most allows it
    for base, cores, rivals in ((1, 1, 2.0), (2, 2, 1.0), (13, 16, 16.0), (4, 16, 12.0), (8, 8, 3.0)):
        n = step(base, 1024, FRESH, crowded(base, rivals, cores))[0]
        fair = cores * n / (n + rivals)
        assert fair >= 0.8 * min(base, cores) - 1e-9, (base, cores, rivals, n)
        assert cores * (n - 1) / (n - 1 + rivals) < 0.8 * min(base, cores) or n == base, (base, cores, rivals, n)


def test_a_growth_that_gains_nothing_is_undone_and_held_off():
    grown = step(2, 8, FRESH, crowded(2, 2.0), now=100.0)
    assert grown[0] == 8 and grown[2] > 0 and grown[3] > 1.5   # the cores before, and the gain promised
    # the next window: the pool's CPU no higher (its share is not by threads: another CPU cgroup)
    same = crowded(2, 2.0)
    flat = (same[0], same[1], 8 * same[0], same[3], same[4])
    undone = step(2, 8, grown, flat, now=100.5)
    assert undone[0] == 2 and undone[1] == pytest.approx(100.5 + HOLD_S) and undone[2] == 0
    assert step(2, 8, undone, crowded(2, 2.0), now=105.0)[0] == 2   # held off
    assert step(2, 8, undone, crowded(2, 2.0), now=100.5 + HOLD_S + 0.1)[0] == 8   # tried again after


def test_a_growth_that_gains_stays_and_follows_the_load():
    grown = step(2, 8, FRESH, crowded(2, 2.0), now=100.0)
    kept = step(2, 8, grown, crowded(8, 2.0), now=100.5)
    assert kept[0] == 8 and kept[2] == 0   # checked once
    assert step(2, 8, kept, crowded(8, 1.0), now=101.0)[0] == 4   # less load, fewer threads
    assert step(2, 8, kept, crowded(8, 0.0), now=101.0)[0] == 2   # the load ended: its own size at once
    # the grown pool now waits for work part of the time: as many threads as stay busy, never below base
    assert step(2, 8, kept, crowded(8, 2.0, busy=0.3), now=101.0)[0] == 4
    # it was fast enough after growing (waiting for work): the check does not undo it
    assert step(2, 8, grown, crowded(8, 2.0, busy=0.3), now=100.5)[0] == 4


def test_max_threads_is_checked_and_defaults_to_a_multiple_of_the_threads():
    assert engine.pool_most(3) == 3 * engine.CROWD_FACTOR
    assert engine.pool_most(3, 5) == 5 and engine.pool_most(3, 1) == 3 and engine.pool_most(400) == 1024
    assert Workers(num_threads=2, max_threads=2).max_threads == 2
    with pytest.raises(ConfigError, match="max_threads=1 is below num_threads=2"):
        Workers(num_threads=2, max_threads=1)
    with pytest.raises(ConfigError, match="max_threads"):
        Workers(max_threads=0)
    pool = native.engine(2, 0, 5)
    try:
        assert (pool.threads, pool.active, pool.peak, pool.most) == (2, 2, 2, 5)
        assert pool.others == 0.0 and pool.crowded_s == 0.0
    finally:
        pool.close()


def test_the_split_reads_a_grown_pools_seconds_as_its_own_thread_counts():
    """decode="auto" rates the CPU side at rows x threads / seconds. 8 threads that spent 4 s in all on 64 rows
    (each row 0.5 s, waiting for a core) finished them in 0.5 s: 128 rows/s, which 2 threads give in 1 s."""
    threads, active, busy, rows = 2, 8, 4.0, 64
    assert rows * threads / engine.split_seconds(busy, threads, active) == rows / (busy / active) == 128
    assert engine.split_seconds(busy, threads, threads) == busy   # not grown: as measured


CHILD = r"""
import json, multiprocessing as mp, os, sys, time
from stoker import Loader, RandomResizedCrop, Workers

def spin(peer):
    if peer:   # another stoker process (a rank of the same job): its CPU is no reason to grow
        from stoker import native
        native.mark_process()
    while True:
        pass

def epochs(ld, until, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        for _ in ld:
            pass

if __name__ == "__main__":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # one CPU: the spinners' and the pool's
    path, spinners, most, processes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    peers = sys.argv[5] == "peers"
    pool = lambda: sum(open(f"/proc/self/task/{t}/comm").read().strip() == "stoker-pool"
                       for t in os.listdir("/proc/self/task"))
    procs = [mp.get_context("fork").Process(target=spin, args=(peers,), daemon=True) for _ in range(spinners)]
    for p in procs:
        p.start()
    out = {}
    try:
        with Loader(path, 16, transforms=[RandomResizedCrop(160)], device="numpy",
                    workers=Workers(num_threads=1, max_threads=most, persistent=True, processes=processes)) as ld:
            epochs(ld, lambda: ld.stats.pool_threads_peak > 1, 40.0 if spinners and most > 1 and not peers else 4.0)
            out["peak"], out["named"] = ld.stats.pool_threads_peak, pool()
            for p in procs:
                p.kill()
                p.join()
            epochs(ld, lambda: ld.stats.pool_threads == 1, 40.0)
            out["after"] = ld.stats.pool_threads
    finally:
        for p in procs:
            p.kill()
    out["threads_left"] = pool()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stoker.packing import PackOptions, pack

    root = tmp_path_factory.mktemp("crowd")
    make_image_folder(root / "imgs", n_per_class=16, classes=("a", "b"), sizes=((480, 640), (512, 384)))
    pack(root / "imgs", root / "packed", options=PackOptions(workers=1), progress=False)
    return root / "packed"


def _child(photos: Path, spinners: int, most: int, processes: int = 0, peers: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    script = Path(photos).parent / "crowd_child.py"   # a file: the worker processes start by "spawn"
    script.write_text(CHILD)
    done = subprocess.run([sys.executable, str(script), str(photos), str(spinners), str(most), str(processes),
                           "peers" if peers else "others"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool grows on Linux (/proc/stat)")
@pytest.mark.parametrize("processes", [0, 1])
def test_busy_processes_beside_the_loader_make_its_pool_grow_and_their_end_shrinks_it(photos: Path, processes: int):
    """In this process, and in a worker process (Workers(processes=1): its pool's figures reach the Loader's
    stats)."""
    got = _child(photos, spinners=2, most=4, processes=processes)
    assert 1 < got["peak"] <= 4 and got["named"] >= (0 if processes else got["peak"]), got
    assert got["after"] == 1, got
    assert got["threads_left"] == 0, got   # the threads it started too were joined


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool grows on Linux (/proc/stat)")
@pytest.mark.parametrize("spinners, most", [(0, 4), (2, 1)])
def test_alone_or_at_max_threads_the_pool_keeps_its_size(photos: Path, spinners: int, most: int):
    got = _child(photos, spinners=spinners, most=most)
    assert got["peak"] == 1 and got["named"] == 1 and got["after"] == 1 and got["threads_left"] == 0, got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool grows on Linux (/proc/stat)")
def test_busy_stoker_processes_beside_the_loader_are_no_reason_to_grow(photos: Path):
    """Other ranks of a job: were each pool to grow against the others, all would, and take the cores from
    every training loop with no gain. Their CPU is not another program's."""
    got = _child(photos, spinners=2, most=4, peers=True)
    assert got["peak"] == 1 and got["after"] == 1, got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stoker processes are listed on Linux")
def test_a_stoker_process_is_listed_while_marked():
    import numpy as np

    entry = native.mark_process()
    if entry < 0:
        pytest.skip("no shared memory folder to list the stoker processes in")
    table = Path(f"/dev/shm/stoker-pools-{os.getuid()}")
    try:
        assert np.fromfile(table, np.int32)[entry] == os.getpid()
        assert table.stat().st_mode & 0o077 == 0   # this user's alone
    finally:
        native.unmark_process(entry)
    assert np.fromfile(table, np.int32)[entry] != os.getpid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stoker processes are listed on Linux")
def test_a_table_cut_short_reads_as_free_entries():
    """The table is read and written as a file, never mapped: cut short by someone else's mistake, its lost
    entries read as free, and nothing faults."""
    import numpy as np

    entry = native.mark_process()
    if entry < 0:
        pytest.skip("no shared memory folder to list the stoker processes in")
    table = Path(f"/dev/shm/stoker-pools-{os.getuid()}")
    try:
        os.truncate(table, 0)
        again = native.mark_process()
        assert again >= 0 and np.fromfile(table, np.int32)[again] == os.getpid()
        native.unmark_process(again)
    finally:
        native.unmark_process(entry)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stoker processes are listed on Linux")
def test_a_table_held_by_a_stopped_process_costs_a_moment_not_a_hang():
    """Whoever holds the table's lock holds it for microseconds; one that was stopped holding it (a debugger,
    SIGSTOP) makes a new Engine give up listing itself after a few milliseconds, never wait."""
    import fcntl
    import threading

    first = native.mark_process()
    if first < 0:
        pytest.skip("no shared memory folder to list the stoker processes in")
    native.unmark_process(first)
    table = Path(f"/dev/shm/stoker-pools-{os.getuid()}")
    got: list = []

    def make() -> None:   # a waiting lock would never return here: the test fails at the join, not by hanging
        got.append(native.mark_process())
        pool = native.engine(1, 0, 2)   # the pool still starts, unlisted
        pool.close()
        got.append("started")

    with open(table, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # another open file: as another process would hold it
        maker = threading.Thread(target=make, daemon=True)
        maker.start()
        maker.join(120)
        fcntl.flock(held, fcntl.LOCK_UN)
    assert got == [-1, "started"]
    entry = native.mark_process()
    assert entry >= 0
    native.unmark_process(entry)
