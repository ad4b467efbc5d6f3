"""stoker.Loader(device="cuda", ...) and decode="gpu" on a real GPU (skipped without one)."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.device import DeviceOptions
from stoker.loader import Loader
from test_loader import TRAIN, build_packed

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_torchvision = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                       reason="decode='gpu' here uses torchvision's nvJPEG decode")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("cuda") / "ds", n=96)


def cpu_batches(packed: Path, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in Loader(packed, 16, transforms=TRAIN, seed=3, device="cpu", **kw)]


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_batches_arrive_on_the_gpu_converted_like_the_cpu_stage(packed: Path) -> None:
    ref = cpu_batches(packed, normalize="imagenet")
    loader = Loader(packed, 16, transforms=TRAIN, seed=3, device=DeviceOptions("cuda", normalize="imagenet"))
    assert loader.pin_memory
    for (x, y), (rx, ry) in zip(loader, ref):
        assert x.is_cuda and y.is_cuda and x.dtype == torch.float32 and x.shape[1] == 3
        torch.testing.assert_close(x.cpu(), rx, atol=1e-5, rtol=0)
        assert torch.equal(y.cpu(), ry)


def test_bf16_channels_last_on_the_gpu(packed: Path) -> None:
    ref = cpu_batches(packed, normalize="imagenet", dtype=torch.bfloat16, memory_format="channels_last")
    opts = DeviceOptions("cuda", normalize="imagenet", dtype=torch.bfloat16, memory_format="channels_last")
    got = Loader(packed, 16, transforms=TRAIN, seed=3, device=opts)
    for (x, _), (rx, _) in zip(got, ref):
        assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(x.cpu().float(), rx.float(), atol=2e-2, rtol=1e-2)


def test_no_device_wide_sync_and_a_consumer_on_its_own_stream(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = cpu_batches(packed, dtype=torch.uint8)
    loader = Loader(packed, 16, transforms=TRAIN, seed=3, device=DeviceOptions("cuda", dtype=torch.uint8))

    def forbidden(*a, **k):
        raise AssertionError("the loader must not call torch.cuda.synchronize()")
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):  # the loader must make *this* stream wait, not the default one
        for x, _ in loader:
            torch.cuda._sleep(2_000_000)  # a slow step: the next batch's copy overlaps it
            sums.append(x.long().sum())
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == [int(rx.long().sum()) for rx, _ in ref]
    assert loader._stage.stream != torch.cuda.current_stream()


def test_freed_batches_are_not_reused_while_in_flight(packed: Path) -> None:
    """record_stream: drop each batch at once and churn the allocator; later batches stay exact."""
    ref = cpu_batches(packed, dtype=torch.uint8)
    loader = Loader(packed, 16, transforms=TRAIN, seed=3, device=DeviceOptions("cuda", dtype=torch.uint8), prefetch=3)
    sums = []
    for x, _ in loader:
        sums.append(x.long().sum())
        del x
        junk = torch.empty(16 * 3 * 32 * 32, dtype=torch.uint8, device="cuda").fill_(255)
        torch.cuda._sleep(1_000_000)
        del junk
    assert [int(s) for s in sums] == [int(rx.long().sum()) for rx, _ in ref]


def test_break_stops_the_device_thread(packed: Path) -> None:
    before = sum(t.name.startswith("stoker") for t in threading.enumerate())
    loader = Loader(packed, 8, transforms=TRAIN, device=DeviceOptions("cuda", normalize="imagenet"))
    for _ in loader:
        break
    deadline = time.monotonic() + 5
    while sum(t.name.startswith("stoker") for t in threading.enumerate()) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sum(t.name.startswith("stoker") for t in threading.enumerate()) == before


@needs_torchvision
def test_gpu_decode_crops_like_the_cpu_path(packed: Path) -> None:
    ref = [(x.clone(), y.clone()) for x, y in Loader(packed, 16, transforms=TRAIN, seed=5)]
    loader = Loader(packed, 16, transforms=TRAIN, seed=5, device=DeviceOptions("cuda", dtype=torch.uint8, decode="gpu"))
    for (x, y), (rx, ry) in zip(loader, ref):
        assert x.is_cuda and torch.equal(y.cpu(), ry)
        assert psnr(x.cpu(), rx.permute(0, 3, 1, 2)) > 28
    assert loader.stats.gpu_decoded > 0 and loader.stats.gpu_fallbacks == 0


@needs_torchvision
def test_gpu_decode_normalized_bf16(packed: Path) -> None:
    opts = DeviceOptions("cuda", normalize="imagenet", dtype=torch.bfloat16, memory_format="channels_last",
                         decode="gpu")
    loader = Loader(packed, 32, transforms=TRAIN, seed=5, device=opts)
    n = 0
    for x, y in loader:
        assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
        assert torch.isfinite(x.float()).all() and -3 < float(x.float().mean()) < 3
        n += x.shape[0]
    assert n == 96
