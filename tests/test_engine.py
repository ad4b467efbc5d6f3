"""The native batch engine (engine.py, csrc/engine.c): whole batches planned and rendered on native
threads. Batches are bit for bit those of the Python path (`STOKER_ENGINE=off`, and `STOKER_NATIVE=off`
with the torch resize) at any thread count, with raw, non-JPEG and damaged rows, errors, on_error
replacements, weighted draws and resume; the plan in C is `Pipeline.plan`'s, integer for integer;
stopping wakes a waiting coordinator at once and joins the pool's threads (break, close, garbage
collection)."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import PILLOW_CORPUS
from stoker.transforms.kinds import engine_program
from stoker import native
from stoker.errors import ConfigError
from stoker.loading import engine, route
from stoker.loader.loader import Loader
from stoker.loader.options import Sampling, Workers
from stoker.order import TAG_DRAW, TAG_SAMPLE, sample_keys, stream_key, uniforms
from stoker.transforms import CoverCrop, CenterCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop, Resize
from test_native_rows import TRAIN, VAL, build

pytestmark = pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")


class Counting:
    """A pool that counts the rows its `run` calls wrote (the engine served the batch)."""

    made: list["Counting"] = []

    def __init__(self, threads: int, nice: int = 0, most: int = 0) -> None:
        self.pool = native._mod.Engine(threads, nice, most)
        self.rows = self.float_rows = 0
        Counting.made.append(self)

    @property
    def active(self) -> int:
        return self.pool.active

    def run(self, *args, **floats):
        left, busy, state = self.pool.run(*args, **floats)
        self.rows += len(args[2]) - left
        self.float_rows += (len(args[2]) - left) if floats.get("floats") is not None else 0
        return left, busy, state

    def close(self) -> None:
        self.pool.close()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[Counting]:
    Counting.made = []
    monkeypatch.setattr(native, "engine", Counting)
    monkeypatch.setattr(route, "MIN_JPEG_SHARE", 0.0)   # the test data mixes PNG and raw rows in
    return Counting.made


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("engine") / "ds", corpus=PILLOW_CORPUS.is_dir())


def epoch(path: Path, transforms: list, threads: int, on_error: str = "skip", batch: int = 8,
          **options) -> tuple[np.ndarray, np.ndarray]:
    imgs, labels = [], []
    with Loader(path, batch, transforms=transforms, seed=5, device="numpy",
                workers=Workers(num_threads=threads, prefetch=1, on_error=on_error), **options) as loader:
        for x, y in loader:
            imgs.append(np.asarray(x).copy())
            labels.append(np.asarray(y).copy())
    return np.concatenate(imgs), np.concatenate(labels)


def same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> None:
    assert np.array_equal(a[1], b[1])
    bad = [i for i in range(len(a[0])) if not np.array_equal(a[0][i], b[0][i])]
    assert not bad, f"rows {bad[:10]} differ"


@pytest.mark.parametrize("transforms", [TRAIN, VAL, [CenterCrop(300), Resize((48, 40))],
                                        [RandomResizedCrop((40, 56), scale=(0.3, 1.0), ratio=(0.5, 2.0))],
                                        [CoverCrop((64, 192)), RandomHorizontalFlip()],
                                        [CoverCrop((320, 64), crop="center")]],
                         ids=["train", "val", "crop-resize", "rrc-rect", "cover-random", "cover-center"])
def test_the_engine_plans_each_row_as_pipeline_plan_does(transforms):
    """csrc/engine.c's plan (keys, draws, RandomResizedCrop's tries and fallback, resizes, crops, flip)
    against `Pipeline.plan` on the same keys: sizes from 1 pixel up, thin and very wide images (the
    fallback), sample and draw streams."""
    pipe = Pipeline(transforms)
    prog = engine_program(pipe.prefix, pipe.offsets)
    assert prog is not None
    rng = np.random.default_rng(21)
    n = 4000
    sizes = np.empty((n, 2), np.int64)
    sizes[:, 0], sizes[:, 1] = rng.integers(1, 3000, n), rng.integers(1, 3000, n)
    sizes[:200, 0], sizes[200:400, 1] = rng.integers(1, 12, 200), sizes[200:400, 0] * 9
    index = rng.permutation(n).astype(np.int64)
    for tag, ids in ((TAG_SAMPLE, index), (TAG_DRAW, np.arange(n, dtype=np.int64) + 77)):
        keys = sample_keys(4, 2, ids, tag=tag)
        geo = pipe.plan(sizes[index, 0], sizes[index, 1], uniforms(keys, max(pipe.draws, 1)))
        box, clip = np.empty((n, 4)), np.empty((n, 4))
        grid, size, flip = np.empty((n, 2), np.int64), np.empty((n, 2), np.int64), np.empty(n, np.uint8)
        native._mod.plan_batch(ids, index, sizes, int(stream_key(4, 2, tag)[0]), prog, box, clip, grid, size, flip)
        assert np.array_equal(size, geo.size) and np.array_equal(flip.astype(bool), geo.flip)
        assert np.array_equal(grid, geo.grid) and np.array_equal(clip, geo.clip) and np.array_equal(box, geo.box)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("transforms", [TRAIN, VAL], ids=["train", "val"])
def test_batches_are_the_same_with_the_engine_on_and_off_and_the_native_path_off(dataset, transforms, threads,
                                                                                   counted, monkeypatch):
    on = epoch(dataset, transforms, threads)
    assert sum(c.rows for c in counted) > 30, "the engine wrote too few rows"
    monkeypatch.setenv(engine.ENV, "off")
    python = epoch(dataset, transforms, threads)
    monkeypatch.delenv(engine.ENV)
    monkeypatch.setattr(native, "ON", False)
    off = epoch(dataset, transforms, threads)
    same(on, python)
    same(on, off)


def test_weighted_draws_and_a_partial_last_batch_are_the_same(dataset, counted, monkeypatch):
    """Weighted sampling keys each draw's stream by its position (`key_by_draw`): the engine hashes the
    positions; a batch size that leaves a short last batch."""
    from stoker.reader import open_dataset

    n = len(open_dataset(dataset))
    weights = np.linspace(1.0, 3.0, n)
    opts = {"sampling": Sampling(weights=weights)}
    on = epoch(dataset, TRAIN, 2, batch=7, **opts)
    assert sum(c.rows for c in counted) > 20
    monkeypatch.setattr(native, "ON", False)
    same(on, epoch(dataset, TRAIN, 2, batch=7, **opts))


def test_failing_rows_get_the_per_sample_errors_and_replacements(tmp_path, counted, monkeypatch):
    path = build(tmp_path / "bad", seed=1, bad=(10, 20))
    with pytest.raises(Exception) as on:
        epoch(path, TRAIN, 2, on_error="raise")
    skipped_on = epoch(path, TRAIN, 3)
    assert sum(c.rows for c in counted) > 20
    monkeypatch.setattr(native, "ON", False)
    with pytest.raises(Exception) as off:
        epoch(path, TRAIN, 2, on_error="raise")
    assert type(on.value) is type(off.value) and str(on.value) == str(off.value)
    assert "img/0010" in str(on.value) or "img/0020" in str(on.value)
    same(skipped_on, epoch(path, TRAIN, 1))


def test_a_resumed_pass_is_the_rest_of_the_whole_one(dataset, counted):
    loader = Loader(dataset, 8, transforms=TRAIN, seed=9, device="numpy",
                    workers=Workers(num_threads=2, on_error="skip"))
    whole = [np.asarray(x).copy() for x, _ in loader]
    loader.set_epoch(0)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    state = loader.state_dict()
    fresh = Loader(dataset, 8, transforms=TRAIN, seed=9, device="numpy",
                   workers=Workers(num_threads=3, on_error="skip"))
    fresh.load_state_dict(state)
    rest = [np.asarray(x).copy() for x, _ in fresh]
    assert len(rest) == len(whole) - 3 and all(np.array_equal(a, b) for a, b in zip(rest, whole[3:]))
    assert sum(c.rows for c in counted) > 20
    loader.close()
    fresh.close()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _task_files(name: str) -> list[str]:
    """`/proc/self/task/<tid>/<name>` of every thread of this process; a thread that ends while they are read
    (a pool of an earlier test finishing) is left out."""
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            out.append(Path(f"/proc/self/task/{t}/{name}").read_text())
        except OSError:
            continue
    return out


def _nices() -> list[int]:
    return [int(stat.rsplit(")", 1)[1].split()[16]) for stat in _task_files("stat")]   # field 19: nice


def _names() -> list[str]:
    return sorted(text.strip() for text in _task_files("comm"))


def _settles_to(n: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while _threads() > n and time.monotonic() < deadline:
        time.sleep(0.02)
    return _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_break_close_and_garbage_collection_join_the_pool(dataset, counted):
    epoch(dataset, TRAIN, 1)   # the libraries' own lazily started threads (OpenCV's, the allocator's) first
    before = _threads()
    loader = Loader(dataset, 8, transforms=TRAIN, seed=1, device="numpy",
                    workers=Workers(num_threads=3, on_error="skip"))
    for k, _ in enumerate(loader):
        if k == 1:
            break
    loader.close()
    assert _settles_to(before) <= before, _names()
    loader = Loader(dataset, 8, transforms=TRAIN, seed=1, device="numpy",
                    workers=Workers(num_threads=3, on_error="skip"))
    it = iter(loader)
    next(it)
    assert _threads() >= before + 3   # the pool's three threads and the coordinators
    del it
    gc.collect()
    assert _settles_to(before) <= before, _names()
    loader.close()
    assert counted and all(c.rows > 0 for c in counted)


def _big_batch(rows: int):
    from test_native_rows import _jpeg
    from conftest import smooth_rgb

    data = np.frombuffer(_jpeg(smooth_rgb(np.random.default_rng(0), 1200, 1600)), np.uint8)
    prog = engine_program([Resize((64, 64))], [0])
    spans = np.tile(np.array([[0, 0, len(data)]], np.int64), (rows, 1))
    ids = np.arange(rows, dtype=np.int64)
    sizes = np.array([[1200, 1600]], np.int64)
    images = np.zeros((rows, 64, 64, 3), np.uint8)
    status = np.empty(rows, np.uint8)
    return ([data], spans, ids, np.zeros(rows, np.int64), sizes, 1, prog, images, status, 0, 64, 64, True, 2.0,
            True, False, 1e12)


def test_close_wakes_a_waiting_coordinator_at_once():
    """`close()` from another thread: the waiting `run` returns after the rows in flight (state 1), the
    rows never started keep status 30, and the pool's threads are joined."""
    pool = native._mod.Engine(1)
    args = _big_batch(400)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.run(*args, 300.0)))
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    pool.close()
    waiter.join(120)
    assert not waiter.is_alive() and time.monotonic() - t0 < 120   # the close, not run's 300 s timeout
    left, busy, state = got[0]
    status = args[8]
    assert state == 1 and 0 < left < 400 and (status[status != 0] == 30).all() and busy > 0
    assert pool.run(*args, 300.0)[2] == 1   # a closed pool starts nothing


def test_a_timed_out_batch_leaves_its_rows_to_the_caller():
    pool = native._mod.Engine(1)
    args = _big_batch(200)
    left, _, state = pool.run(*args, 0.05)
    status = args[8]
    assert state == 2 and left > 0 and set(np.unique(status[status != 0]).tolist()) == {30}
    pool.close()


def test_pipelines_with_per_sample_work_keep_their_path(dataset, counted):
    """A colour op after the crop runs per sample (not the engine's): no pool is made, the batches come."""
    from stoker.transforms import ColorJitter

    with Loader(dataset, 8, transforms=[RandomResizedCrop(32), ColorJitter(0.2)], device="numpy",
                workers=Workers(num_threads=2, on_error="skip")) as loader:
        assert sum(len(y) for _, y in loader) == len(loader.dataset)
    assert counted == []
    assert engine_program([RandomResizedCrop(32), ColorJitter(0.2)], [0, 22]) is None


def test_a_gpu_host_leaves_the_trainer_its_cores(monkeypatch):
    """The default thread count with batches going to a GPU keeps TRAINER_THREADS cores for the training
    thread, autograd's thread and the device thread (one on hosts of 2 to 4 cores); the CPU default and
    the torchrun share are as before."""
    import stoker._system as system

    for cpus, world, cpu_default, gpu_default in ((16, 1, 16, 13), (8, 1, 8, 5), (4, 1, 4, 3), (2, 1, 2, 1),
                                                  (1, 1, 1, 1), (32, 2, 16, 13), (8, 8, 1, 1)):
        monkeypatch.setattr(system, "cpu_ids", lambda n=cpus: list(range(n)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
        assert (system.threads_per_process(), system.threads_per_process(gpu=True)) == (cpu_default, gpu_default)


def test_loader_stats_name_the_python_per_sample_and_the_fix(dataset, monkeypatch):
    """The route (repr, LoaderStats) says whether the engine serves the batches and, where not, what runs
    Python per sample; the doctor's line names the cost and the fix."""
    from stoker.tools.doctor import _per_sample
    from stoker.transforms import ColorJitter

    monkeypatch.setattr(route, "MIN_JPEG_SHARE", 0.0)
    with Loader(dataset, 8, transforms=TRAIN, device="numpy", workers=Workers(num_threads=2, on_error="skip")) as ld:
        next(iter(ld))
        assert ld.stats.engine and ld.stats.per_sample_python == [] and ld.stats.route is ld.route
        assert "none" in _per_sample(ld.stats.per_sample_python) and "cpu native" in repr(ld)
    with Loader(dataset, 8, transforms=[RandomResizedCrop(32), ColorJitter(0.2)], device="numpy",
                workers=Workers(num_threads=2, on_error="skip")) as ld:
        next(iter(ld))
        assert not ld.stats.engine and any("ColorJitter" in why for why in ld.stats.per_sample_python)
        line = _per_sample(ld.stats.per_sample_python)
        assert "ColorJitter" in line and "processes=1" in line and "GPU" in line
    monkeypatch.setenv(engine.ENV, "off")
    with Loader(dataset, 8, transforms=TRAIN, device="numpy", workers=Workers(num_threads=2, on_error="skip")) as ld:
        next(iter(ld))
        assert not ld.stats.engine and any("STOKER_ENGINE" in why for why in ld.stats.per_sample_python)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread priorities through Linux's /proc")
def test_the_pool_threads_take_the_nice_value_they_are_given():
    nices = _nices
    pool = native._mod.Engine(3, 7)
    deadline = time.monotonic() + 10
    while nices().count(7) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nices().count(7) == 3 and os.getpriority(os.PRIO_PROCESS, 0) == 0   # the caller's own stays
    pool.close()
    assert nices().count(7) == 0


def test_the_pool_runs_at_the_trainers_priority_unless_told(monkeypatch):
    monkeypatch.delenv(engine.ENV + "_NICE", raising=False)
    assert engine.pool_nice() == engine.NICE == 0   # at 19 any other busy program starves it (docs/loader.md)
    monkeypatch.setenv(engine.ENV + "_NICE", "19")
    assert engine.pool_nice() == 19 and engine.pool_nice(5) == 5   # Workers(nice=) over the variable
    monkeypatch.setenv(engine.ENV + "_NICE", "low")
    assert engine.pool_nice() == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread priorities through Linux's /proc")
def test_workers_nice_sets_the_pools_priority(dataset, monkeypatch):
    """`Workers(nice=)` is the pool's nice value (over STOKER_ENGINE_NICE), in threads and in a worker process."""
    nices = _nices

    def count(value: int, at_least: int) -> int:   # a pool thread sets its own nice value when it starts
        deadline = time.monotonic() + 10
        while nices().count(value) < at_least and time.monotonic() < deadline:
            time.sleep(0.01)
        return nices().count(value)

    monkeypatch.setattr(route, "MIN_JPEG_SHARE", 0.0)
    monkeypatch.setenv("STOKER_ENGINE_NICE", "3")
    with Loader(dataset, 8, transforms=TRAIN, device="numpy", workers=Workers(num_threads=2, nice=6)) as ld:
        it = iter(ld)
        next(it)
        assert count(6, 2) >= 2 and nices().count(3) == 0
    with Loader(dataset, 8, transforms=TRAIN, device="numpy", workers=Workers(num_threads=2)) as ld:
        it = iter(ld)
        next(it)
        assert count(3, 2) >= 2
    with pytest.raises(ConfigError, match="nice must be"):
        Workers(nice=20)
