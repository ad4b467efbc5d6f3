"""Faults while loading: a failing user transform, Ctrl-C, abandoned iterators, many Loaders,
a hung transform. No hang (every wait has a timeout), no leaked thread or file handle, memory flat.
"""

from __future__ import annotations

import _thread
import gc
import random
import threading
import time
import traceback

import numpy as np
import psutil
import pytest

from .rhelpers import open_fds, settle_threads

from stoker import DeviceOptions, Loader, RandomHorizontalFlip, RandomResizedCrop, Workers
from stoker.errors import LoaderTimeoutError, SampleError

TRANSFORMS = [RandomResizedCrop(16), RandomHorizontalFlip()]


def _loader(root, *, num_threads: int = 2, timeout: float = 30.0, **kw) -> Loader:
    kw = {"transforms": TRANSFORMS, **kw}
    return Loader(root, 4, workers=Workers(num_threads=num_threads, prefetch=2, timeout=timeout), **kw)


def test_user_transform_exception_arrives_with_traceback(small_pack):
    def exploding_transform(img):
        if img[0, 0, 0] % 3 == 0:  # some samples only: the error arrives in order, later
            raise ZeroDivisionError("boom in user code")
        return img

    with _loader(small_pack, transforms=[*TRANSFORMS, exploding_transform]) as loader:
        with pytest.raises(SampleError) as info:
            for _ in loader:
                pass
    err = info.value
    assert err.key and err.shard and err.shard.endswith(".arrow") and err.row is not None
    assert err.key in str(err) and "boom in user code" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)
    frames = "".join(traceback.format_exception(err.__cause__))
    assert "exploding_transform" in frames, "the worker's traceback travels with the error"


@pytest.mark.parametrize("device", [{}, {"device": DeviceOptions("cpu", normalize="imagenet")}],
                         ids=["host", "device-thread"])
def test_ctrl_c_at_random_points(small_pack, device):
    """KeyboardInterrupt delivered to the main thread at seeded random moments: it propagates,
    the worker threads (and the device thread) stop, and the Loader works again afterwards."""
    baseline = threading.active_count()
    rng = random.Random(3)
    with _loader(small_pack, **device) as loader:
        for trial in range(6):
            delay = rng.uniform(0.0, 0.05)
            timer = threading.Timer(delay, _thread.interrupt_main)
            interrupted = False
            deadline = time.monotonic() + 30
            try:
                # inside the try: with a delay of a few ms on a loaded machine the interrupt can arrive while
                # start() still waits for the timer thread to have begun
                timer.start()
                while time.monotonic() < deadline:
                    for images, _ in loader:
                        images.sum()
            except KeyboardInterrupt:
                interrupted = True
            finally:
                timer.cancel()
                timer.join()
            assert interrupted, f"trial {trial}: the interrupt never arrived"
            assert settle_threads(baseline) == baseline, f"trial {trial}: worker threads left running"
        state = loader.state_dict()   # where the interrupted pass stopped
        assert sum(x.shape[0] for x, _ in loader) == len(loader.dataset)   # a new iter(): a whole pass
        loader.load_state_dict(state)   # resuming part-way is explicit: exactly what the interrupt left
        left = len(loader.epoch_indices(state["epoch"])) - state["sample"]
        assert sum(x.shape[0] for x, _ in loader) == left
    assert settle_threads(baseline) == baseline


def test_abandon_iterator_1000_times(small_pack):
    """1,000 passes abandoned after one batch (by break, by dropping the iterator, by close()):
    threads, file handles and RSS stay flat.

    RSS bound: 40 MiB over 1,000 passes. The ring is allocated once (3 x 4 x 16 x 16 x 3 bytes);
    a leak of one ring, one thread stack or one decode buffer per pass (>= 1 MiB of scratch per
    worker) would add far more. Below that, allocator noise on a shared machine dominates."""
    proc = psutil.Process()
    threads, fds = threading.active_count(), open_fds()
    with _loader(small_pack) as loader:
        for k in range(50):  # warm-up: decoder scratch buffers, allocator pools
            next(iter(loader))
        gc.collect()
        rss = proc.memory_info().rss
        for k in range(1000):
            if k % 3 == 0:
                for _ in loader:
                    break
            elif k % 3 == 1:
                it = iter(loader)
                next(it)
                del it
            else:
                it = iter(loader)
                next(it)
                it.close()
            assert threading.active_count() <= threads + 2 * loader.num_threads
        gc.collect()
        grown = proc.memory_info().rss - rss
    assert settle_threads(threads) == threads
    assert open_fds() == fds
    assert grown < 40 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 1,000 abandoned passes"


def test_many_loaders_alive_at_once(small_pack):
    """20 Loaders iterating interleaved, then closed, or just dropped: no thread or fd left."""
    threads, fds = threading.active_count(), open_fds()
    loaders = [_loader(small_pack, seed=k, num_threads=1) for k in range(20)]
    iters = [iter(ld) for ld in loaders]
    for _ in range(3):
        for it in iters:
            images, labels = next(it)
            assert images.shape == (4, 3, 16, 16)  # CHW, the default layout
    assert threading.active_count() > threads
    for ld in loaders[:10]:
        ld.close()
    del iters, it, ld
    del loaders  # the other 10 are only dropped: their finalizers stop the threads
    assert settle_threads(threads) == threads
    gc.collect()
    assert open_fds() == fds, "every shard mapping is released"


def test_loaders_created_and_dropped_release_files(small_pack, tmp_path):
    threads, fds = threading.active_count(), open_fds()
    for k in range(50):
        ld = _loader(small_pack)
        if k % 2:
            next(iter(ld))
        del ld
    gc.collect()
    assert settle_threads(threads) == threads
    assert open_fds() == fds


def test_hung_transform_times_out_instead_of_hanging(small_pack):
    release = threading.Event()

    def stuck(img):
        release.wait(120)
        return img

    threads = threading.active_count()
    loader = _loader(small_pack, transforms=[*TRANSFORMS, stuck], timeout=0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(LoaderTimeoutError, match="batch 0"):
            next(iter(loader))
        assert time.monotonic() - t0 < 60   # the 0.5 s timeout, not the 120 s transform
    finally:
        release.set()
        loader.close()
    assert settle_threads(threads) == threads


def test_worker_memory_flat_across_epochs(small_pack):
    """Ten full epochs: RSS after epoch 10 within 8 MiB of epoch 2 (the soak benchmark runs 50)."""
    proc = psutil.Process()
    with _loader(small_pack) as loader:
        rss = []
        for epoch in range(10):
            for images, _ in loader:
                np.asarray(images).sum()
            gc.collect()
            rss.append(proc.memory_info().rss)
    assert rss[-1] - rss[1] < 8 * 2**20, [r // 2**20 for r in rss]
