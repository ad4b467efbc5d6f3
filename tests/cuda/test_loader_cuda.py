"""stoker.Loader(device="cuda", ...) and decode="gpu" on a real GPU (skipped without one)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cuda_helpers import gpu_decoders, gpu_sleep, no_host_syncs
from stoker.device.stage import DeviceOptions, DeviceStage
from stoker.loader import Loader
from stoker.loader.options import Workers
from test_loader import TRAIN, build_packed

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_gpu_decoder = pytest.mark.skipif(not gpu_decoders(), reason="no GPU JPEG decoder imports here "
                                       "(pip install torchcodec, or nvidia-nvimgcodec-cu12 / -cu13)")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("cuda") / "ds", n=96)


def cpu_batches(packed: Path, **conversion) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The CPU stage's batches with DeviceOptions("cpu", **conversion), unpinned (the same values)."""
    return [(x.clone(), y.clone()) for x, y in Loader(packed, 16, transforms=TRAIN, seed=3,
                                                       device=DeviceOptions("cpu", **conversion), pin_memory=False)]


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

    # each upload lands late (the copy stream sleeps first): a hand-off that made the default stream wait
    # instead of `side` would let `side` sum the batch's memory before the copy has written it
    upload = DeviceStage.upload
    monkeypatch.setattr(DeviceStage, "upload", lambda self, t: (gpu_sleep(20), upload(self, t))[1])
    gpu_sleep(0.1)  # calibrated outside no_host_syncs()
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):  # the loader must make *this* stream wait, not the default one
        it = iter(loader)
        x, _ = next(it)  # the first batch: CUDA context, allocator pools, pinned ring
        sums.append(x.long().sum())
        with no_host_syncs():  # the steady state: no sync of any kind, in this thread or the device thread
            for x, _ in it:
                torch.cuda._sleep(2_000_000)  # a slow step: the next batch's copy overlaps it
                sums.append(x.long().sum())
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == [int(rx.long().sum()) for rx, _ in ref]
    assert loader._stage.stream != torch.cuda.current_stream()


def test_freed_batches_are_not_reused_while_in_flight(packed: Path) -> None:
    """record_stream: each batch is read only after a long step queued before the read, and dropped on the
    host at once. Without record_stream its block would go back to the copy stream's pool as soon as it
    is dropped, and the device thread's next batches (allocated there) would overwrite it before the
    queued read runs: the sums would come out wrong."""
    ref = cpu_batches(packed, dtype=torch.uint8)
    loader = Loader(packed, 16, transforms=TRAIN, seed=3, device=DeviceOptions("cuda", dtype=torch.uint8),
                    workers=Workers(prefetch=3))
    gpu_sleep(0.1)
    sums = []
    for x, _ in loader:
        gpu_sleep(50)  # the step: the read below waits behind it on the GPU while the host runs ahead
        sums.append(x.long().sum())
        del x
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


@needs_gpu_decoder
def test_gpu_decode_crops_like_the_cpu_path(packed: Path) -> None:
    ref = [(x.clone(), y.clone()) for x, y in Loader(packed, 16, transforms=TRAIN, seed=5, pin_memory=False)]
    assert all(rx.shape[1] == 3 for rx, _ in ref)  # the CPU stage's batches are [B, 3, H, W], as the GPU's
    loader = Loader(packed, 16, transforms=TRAIN, seed=5, device=DeviceOptions("cuda", dtype=torch.uint8, decode="gpu"))
    for (x, y), (rx, ry) in zip(loader, ref):
        assert x.is_cuda and torch.equal(y.cpu(), ry)
        assert x.shape == rx.shape and psnr(x.cpu(), rx) > 28
    assert loader.stats.gpu_decoded > 0 and loader.stats.gpu_fallbacks == 0


@needs_gpu_decoder
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


def test_readme_first_example_async_copies_of_pinned_batches_are_exact(packed: Path) -> None:
    """`images.cuda(non_blocking=True)` on a plain Loader's pinned batch, queued behind a long step: the
    next `next()` must not let the workers refill the slot before the GPU has run the copy."""
    ref = [(x.clone(), y.clone()) for x, y in Loader(packed, 16, transforms=TRAIN, seed=3, pin_memory=False)]
    loader = Loader(packed, 16, transforms=TRAIN, seed=3, workers=Workers(prefetch=1))  # a ring of 2 slots: reuse comes fast
    assert loader.pin_memory
    gpu_sleep(0.1)
    sums = []
    for _ in range(2):  # the second epoch reuses the ring the first one left guarded
        for images, labels in loader:
            gpu_sleep(30)  # the previous training step, still running on the GPU
            x = images.cuda(non_blocking=True)
            y = labels.cuda(non_blocking=True)
            sums.append((x.long().sum(), y.sum()))
    torch.cuda.synchronize()
    want = [(int(rx.long().sum()), int(ry.sum())) for rx, ry in ref] * 2
    assert [(int(a), int(b)) for a, b in sums] == want


def test_persistent_epochs_on_the_gpu_without_syncs(packed: Path) -> None:
    opts = DeviceOptions("cuda", normalize="imagenet", dtype=torch.bfloat16, memory_format="channels_last")
    plain = Loader(packed, 16, transforms=TRAIN, seed=3, device=opts)  # epochs 0, 1, 2, one pass each
    want = [[x.float().sum().item() for x, _ in plain] for _ in range(3)]
    loader = Loader(packed, 16, transforms=TRAIN, seed=3, device=opts, workers=Workers(persistent=True))
    got = [[x.float().sum() for x, _ in loader]]  # epoch 0 warms everything up
    with no_host_syncs():
        for _ in range(2):
            got.append([x.float().sum() for x, _ in loader])
    loader.close()
    assert [[float(v) for v in epoch] for epoch in got] == want


@needs_gpu_decoder
def test_gpu_decode_names_the_backend_that_ran(packed: Path) -> None:
    loader = Loader(packed, 16, transforms=TRAIN, seed=5, device=DeviceOptions("cuda", decode="gpu"))
    for _ in loader:
        pass
    name = loader.stats.gpu_decoder
    assert any(lib in name for lib in ("TorchCodec", "torchvision", "nvImageCodec")), name


@needs_gpu_decoder
def test_doctor_reports_the_gpu_decoder(packed: Path) -> None:
    from stoker.tools.doctor import run_doctor

    report = run_doctor(packed, batch_size=16, steps=2, device="cuda", decode="gpu", progress=False)
    assert report.gpu_decoder and f"GPU JPEG decode  {report.gpu_decoder}" in report.format()
