"""Workers(processes=1) under hostile use: a small /dev/shm, Ctrl-C handled by the script, a worker
process killed while starting, a transform the worker process cannot import, a dataset replaced
between epochs, the whole job killed at once, a daemonic parent, Loaders abandoned without close()."""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from stoker.loading import procs
from stoker.loading.process_errors import has_main_guard, start_failure
from stoker.errors import ConfigError, SampleError, ShardError, WorkerError
from stoker.loader.loader import Loader
from stoker.loader.options import Workers

from test_loader import TRAIN, build_packed, run_epoch
from test_procs import PROCESS, THREADS, clean, gone, workers_alive

pytestmark = pytest.mark.skipif(procs._posixshmem is None, reason="POSIX shared memory only")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("packed") / "ds", n=32)


def _script(path: Path, body: str) -> list[str]:
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


# ---- 1. a /dev/shm smaller than the ring ------------------------------------------------------------
def test_a_dev_shm_smaller_than_the_ring_is_refused_naming_both_sizes(packed: Path, monkeypatch) -> None:
    """Where the ring's segments are files in /dev/shm (no memfd_create), a /dev/shm too small for it
    (Docker's 64 MB default) is refused before the worker process starts, naming both sizes and the
    fixes, instead of the child dying of SIGBUS."""
    from stoker.loading import shared_slots

    monkeypatch.setattr(shared_slots, "_memfd", None)
    monkeypatch.setattr(shared_slots, "_shm_free", lambda: (Path("/dev/shm"), 1 << 16, 64 << 20))
    loader = Loader(packed, 8, transforms=TRAIN, workers=PROCESS)
    with pytest.raises(ConfigError) as info:
        next(iter(loader))
    msg = str(info.value)
    assert "/dev/shm" in msg and "0.1 MiB free of 64.0 MiB" in msg and "--shm-size" in msg
    assert "Workers(prefetch=" in msg and "Workers(processes=0)" in msg
    ring = 4 * 8 * (32 * 32 * 3 + 8)
    assert f"{ring / 2**20:.1f} MiB" in msg
    assert not workers_alive()
    loader.close()


def test_the_ring_does_not_live_in_dev_shm_where_memfd_exists(packed: Path, monkeypatch) -> None:
    """On Linux the ring's memory has no name (memfd_create): /dev/shm's size does not bound it."""
    from stoker.loading import shared_slots

    if shared_slots._memfd is None:
        pytest.skip("memfd_create is Linux only")
    monkeypatch.setattr(shared_slots, "_shm_free", lambda: (Path("/dev/shm"), 1 << 16, 64 << 20))
    xt, yt = run_epoch(Loader(packed, 8, transforms=TRAIN, seed=2, workers=THREADS))
    xp, yp = run_epoch(Loader(packed, 8, transforms=TRAIN, seed=2, workers=PROCESS))
    assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
    clean([])


def test_a_worker_process_killed_by_sigbus_names_shared_memory() -> None:
    msg = start_failure(-signal.SIGBUS, 1234, guarded=True)
    assert "SIGBUS" in msg and "shared memory" in msg and "--shm-size" in msg


# ---- 2. Ctrl-C handled by the script ------------------------------------------------------------------
def test_a_graceful_ctrl_c_handler_finishes_its_epoch(packed: Path, tmp_path: Path) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C), once while the worker process starts
    and once mid-epoch: the script's handler decides; the worker process ignores it."""
    cmd = _script(tmp_path / "train.py", f"""
        import os, signal
        from stoker import Loader, Workers, RandomResizedCrop
        from test_procs_hostile import slowly
        stop = []
        if __name__ == "__main__":
            signal.signal(signal.SIGINT, lambda *_: stop.append(1))
            loader = Loader({str(packed)!r}, 4, transforms=[RandomResizedCrop(32), slowly],
                            workers=Workers(num_threads=2, processes=1))
            n = 0
            it = iter(loader)
            os.killpg(os.getpgrp(), signal.SIGINT)   # while the worker process is starting
            for x, y in it:
                n += 1
                if n == 2:
                    os.killpg(os.getpgrp(), signal.SIGINT)
            print(n, len(stop), flush=True)
    """)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV, start_new_session=True,
                         cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["8", "2"]


def slowly(img: np.ndarray) -> np.ndarray:
    time.sleep(0.01)
    return img


# ---- 3. killed while starting ---------------------------------------------------------------------------
def test_a_worker_process_killed_while_starting_is_not_called_a_missing_guard(packed: Path) -> None:
    loader = Loader(packed, 8, transforms=TRAIN, workers=PROCESS)
    it = iter(loader)
    (proc,) = workers_alive()
    os.kill(proc.pid, signal.SIGKILL)   # as the OOM killer would, before it has imported stoker
    with pytest.raises(WorkerError) as info:
        next(it)
    msg = str(info.value)
    assert f"pid {proc.pid}" in msg and "SIGKILL" in msg and "out-of-memory killer" in msg
    assert "__main__" not in msg
    it.close()
    clean([proc.pid])


def test_the_guard_is_named_only_for_a_script_without_one(tmp_path: Path) -> None:
    guarded = tmp_path / "a.py"
    guarded.write_text('import x\n\nif __name__ == "__main__":\n    x.run()\n')
    bare = tmp_path / "b.py"
    bare.write_text("import x\nx.run()\n")
    assert '__name__ == "__main__"' not in start_failure(1, 7, guarded=has_main_guard(guarded))
    assert '__name__ == "__main__"' in start_failure(1, 7, guarded=has_main_guard(bare))


# ---- 4. a transform the worker process cannot import ---------------------------------------------------
def test_a_transform_from_python_c_is_refused_naming_the_fix(packed: Path) -> None:
    code = textwrap.dedent(f"""
        from stoker import Loader, Workers, RandomResizedCrop
        from stoker.errors import ConfigError
        def brighten(img):
            return img
        try:
            Loader({str(packed)!r}, 4, transforms=[RandomResizedCrop(32), brighten],
                   workers=Workers(num_threads=2, processes=1))
        except ConfigError as exc:
            print("refused:", exc)
        else:
            print("accepted")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:"), out.stdout + out.stderr
    assert "'brighten'" in out.stdout and "module" in out.stdout and "drop processes=" in out.stdout


# ---- 7. the dataset replaced between epochs ------------------------------------------------------------
def test_a_pack_replaced_between_epochs_is_the_threads_shard_error(tmp_path: Path) -> None:
    """The worker process reopens the dataset by its path each pass: a folder replaced by a new pack
    between epochs must fail as the threads fail (a ShardError naming the replaced shard), never give
    the new images with the labels and order of the pack the Loader opened."""
    errors = []
    for workers in (THREADS, PROCESS):
        ds = build_packed(tmp_path / f"ds{workers.processes}", n=24)
        new = build_packed(tmp_path / f"new{workers.processes}", n=24, seed=9)
        loader = Loader(ds, 8, transforms=TRAIN, order="sequential", workers=workers)
        run_epoch(loader)
        shutil.rmtree(ds)
        shutil.copytree(new, ds)   # the folder replaced by a new pack, as an update would
        with pytest.raises(SampleError) as info:
            run_epoch(loader)
        errors.append(info.value)
        loader.close()
    threads, process = errors
    assert type(process.__cause__) is type(threads.__cause__) is ShardError
    assert str(process.__cause__).replace("ds1", "ds") == str(threads.__cause__).replace("ds0", "ds")
    assert "replaced while the dataset was open" in str(process.__cause__)
    clean([])


# ---- 8. the whole job killed at once -------------------------------------------------------------------
@pytest.mark.parametrize("processes", [1, 3])
def test_killing_the_whole_job_while_the_worker_starts_leaves_nothing_in_dev_shm(packed: Path, tmp_path: Path,
                                                                                   processes: int) -> None:
    cmd = _script(tmp_path / "job.py", f"""
        import multiprocessing, os, time
        from stoker import Loader, Workers, RandomResizedCrop
        if __name__ == "__main__":
            loader = Loader({str(packed)!r}, 4, transforms=[RandomResizedCrop(32)],
                            workers=Workers(num_threads={max(2, processes)}, processes={processes}))
            it = iter(loader)   # the worker process is starting
            print(os.getpid(), flush=True)
            time.sleep(60)
    """)
    for _ in range(3):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
        try:
            parent = int(proc.stdout.readline())
            os.killpg(proc.pid, signal.SIGKILL)   # parent, worker process and resource tracker at once
            proc.wait(10)
            time.sleep(0.5)
            assert not list(Path("/dev/shm").glob(f"stoker-{parent}-*"))
        finally:
            proc.kill()
            proc.stdout.close()


# ---- 9. inside a daemonic process -----------------------------------------------------------------------
def loader_in_pool_worker(path: str) -> str:
    try:
        Loader(path, 4, transforms=TRAIN, workers=PROCESS)
    except ConfigError as exc:
        return f"ConfigError: {exc}"
    return "accepted"


def test_the_process_mode_inside_a_pool_worker_names_the_threads(packed: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        msg = pool.apply(loader_in_pool_worker, (str(packed),))
    assert msg.startswith("ConfigError:") and "daemonic" in msg and "Workers(processes=0)" in msg


# ---- 10. Loaders abandoned without close() --------------------------------------------------------------
@pytest.mark.parametrize("workers", [THREADS, PROCESS], ids=["threads", "process"])
def test_abandoned_loaders_free_their_rings_without_the_garbage_collector(packed: Path, workers: Workers) -> None:
    """Loaders dropped after one batch (no close(), the iterator simply dropped): each ring (and its
    worker process) goes at once, by reference counting, not when the cyclic collector next runs."""
    gc.collect()
    gc.disable()
    try:
        rings, loaders = [], []
        for _ in range(20):
            loader = Loader(packed, 8, transforms=TRAIN, workers=workers)
            it = iter(loader)
            x, _ = next(it)
            rings.append(weakref.ref(it._run.ring))
            loaders.append(weakref.ref(loader))
            del loader, it, x, _
        assert sum(r() is not None for r in rings) == 0
        assert sum(r() is not None for r in loaders) == 0
        deadline = time.monotonic() + 10
        while workers_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not workers_alive()
    finally:
        gc.enable()


def test_too_few_open_files_names_the_limit_and_the_fix(packed: Path) -> None:
    """With an open-file limit of 20 the worker processes cannot start: a WorkerError naming the limit,
    `ulimit -n` and worker threads (it was a raw OSError from multiprocessing's resource tracker); with
    threads the same limit loads the epoch."""
    code = textwrap.dedent(f"""
        import resource
        import stoker
        from stoker import RandomResizedCrop
        from stoker.errors import WorkerError

        if __name__ == "__main__":
            resource.setrlimit(resource.RLIMIT_NOFILE, (20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            try:
                for _ in stoker.Loader({str(packed)!r}, 8, transforms=[RandomResizedCrop(16)],
                                       workers=stoker.Workers(num_threads=2, processes=2)):
                    pass
            except WorkerError as exc:
                print("refused:", exc)
            threads = stoker.Loader({str(packed)!r}, 8, transforms=[RandomResizedCrop(16)], workers=2)
            print("threads:", sum(len(y) for _, y in threads))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    assert "limit of 20 open files" in out.stdout and "ulimit -n" in out.stdout, out.stdout + out.stderr
    assert "Workers(processes=0)" in out.stdout and "threads: 32" in out.stdout, out.stdout + out.stderr
