"""One CUDA actor per Loader: a recorded log of (fake) torch.cuda calls, per thread, proves the worker
threads make none and the device thread binds to its GPU before anything else.

A thread that never chose a device runs its CUDA calls on GPU 0: under torchrun every rank > 0 made a
context there (about 0.5 GB each) when a worker queried a slot's guard event. These tests run on the
CPU; tests/cuda/test_device_thread_cuda.py checks the same on real GPUs."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch

from stoker.device.stage import DeviceOptions, DeviceStage
from stoker.loader import Loader
from stoker.loader.options import Workers
from stoker.device.feeder import Feeder
from stoker.loading.slots import BatchRing, Run
from test_loader import TRAIN, build_packed


class FakeCuda:
    """torch.cuda with `count` GPUs whose every call is logged as (thread name, call, argument), with the
    runtime's per-thread current device (GPU 0 in a new thread). An event is done at its `lag`-th query,
    so slots stay guarded for a while, as behind a busy GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = 2, lag: int = 3) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.local = threading.local()
        cuda = self

        class Stream:
            def __init__(self, device: object = None) -> None:
                cuda.log("Stream", device)
                self.device = device

            def wait_event(self, event: object) -> None:
                cuda.log("wait_event", None)

        class Event:
            def __init__(self, *args: object, **kwargs: object) -> None:
                cuda.log("Event", None)
                self.queries = 0

            def record(self, stream: object = None) -> None:
                cuda.log("record", None)

            def query(self) -> bool:
                cuda.log("query", cuda.current())
                self.queries += 1
                return self.queries >= lag

        @contextlib.contextmanager
        def stream(s: object):
            cuda.log("stream", None)
            yield

        for name, value in {
            "is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: count,
            "current_device": lambda: self.log("current_device", None) or self.current(),
            "set_device": lambda d: self.log("set_device", int(d)) or setattr(self.local, "device", int(d)),
            "Stream": Stream, "Event": Event, "stream": stream,
            "set_stream": lambda s: self.log("set_stream", None),
            "current_stream": lambda device=None: self.log("current_stream", device) or Stream(device),
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def current(self) -> int:
        return getattr(self.local, "device", 0)

    def log(self, call: str, arg: object) -> None:
        self.calls.append((threading.current_thread().name, call, arg))

    def by(self, prefix: str) -> list[tuple[str, object]]:
        return [(call, arg) for name, call, arg in self.calls if name.startswith(prefix)]


def fill(plan, row, slot, scratch, times) -> None:
    slot.images_np[row] = slot.batch


def test_only_the_device_thread_touches_cuda_and_it_binds_first(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    stage = DeviceStage(DeviceOptions("cuda:1"))

    def build(slot):
        return slot.images[:slot.size].clone(), stage.fence()   # as DeviceBuilder: the copy's fence

    ring = BatchRing(3, 4, 2, 2, label_dtype=None, pin_memory=False)   # 3 slots, 8 batches: each reused
    run = Run(ring, [4] * 8, 2, lambda b, slot: None, fill, lambda t, n: None, timeout=10.0, name="stoker")
    feeder = Feeder(run, stage, build, depth=1, timeout=10.0, name="stoker-device")
    run.start(), feeder.start()
    try:
        got = [int(feeder.get(b)[0, 0, 0, 0]) for b in range(8)]
    finally:
        feeder.stop()
    assert got == list(range(8))   # no slot refilled while its (fake) copy was pending
    assert cuda.by("stoker-worker") == []   # the workers made no CUDA call at all
    device = cuda.by("stoker-device")
    first = next(k for k, (call, _) in enumerate(device) if call != "current_device")
    assert device[first] == ("set_device", 1)   # bound before its first stream, event or query
    queries = [arg for call, arg in device if call == "query"]
    assert len(queries) > 8 and set(queries) == {1}   # guards were pending, and queried on GPU 1 only


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("cuda-actor") / "ds", n=60)


def test_a_plain_loaders_guards_are_queried_by_the_consumer_not_the_workers(packed: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a device stage the caller's thread records a guard at each next() (its own
    `images.cuda(non_blocking=True)` may still read the slot): it queries them too, not the workers."""
    cuda = FakeCuda(monkeypatch)
    loader = Loader(packed, 10, transforms=TRAIN, seed=6, timeout=20, workers=Workers(num_threads=2, prefetch=1, pin_memory=False))
    batches = [x.clone() for x, _ in loader]
    assert len(batches) == 6
    assert [call for call, _ in cuda.by("stoker")] == []   # no worker touched CUDA
    me = threading.current_thread().name
    assert [call for name, call, _ in cuda.calls if name == me and call == "query"]   # the guards were checked here
