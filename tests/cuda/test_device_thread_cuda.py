"""The Loader's device thread on a real GPU: which GPU it and the workers touch, host syncs inside it
(batch ops, decode="gpu"), stopping mid-epoch, and CUDA graph capture beside it (skipped without one).

torch.cuda.set_sync_debug_mode("error") is process-wide, so it covers the device thread; the
sanitizer (TORCH_CUDA_SANITIZER) is not used: its mode is per thread and it sees only the main one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cuda_helpers import gpu_decoders, gpu_sleep, no_host_syncs
from stoker.device.stage import DeviceOptions
from stoker.loader import Loader
from stoker.loader.options import Workers
from stoker.transforms import batch_ops
from stoker.transforms.mixing import Mixup
from test_loader import TRAIN, build_packed

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("device-thread") / "ds", n=96)


def stoker_threads() -> int:
    return sum(t.name.startswith("stoker") for t in threading.enumerate())


def wait_for_threads(count: int, seconds: float = 5.0) -> int:
    deadline = time.monotonic() + seconds
    while stoker_threads() > count and time.monotonic() < deadline:
        time.sleep(0.02)
    return stoker_threads()


def test_batch_ops_in_the_device_thread_never_sync_the_host(packed: Path) -> None:
    tf = [*TRAIN, batch_ops.BatchRandAugment(), batch_ops.Normalize(), batch_ops.RandomErasing(0.5),
          Mixup(0.8, 1.0, num_classes=96)]
    loader = Loader(packed, 16, transforms=tf, seed=3, device=DeviceOptions("cuda"),
                    workers=Workers(persistent=True))
    for _ in loader:  # epoch 0 warms the allocators, makes the constants
        pass
    with no_host_syncs():  # a sync in the device thread reaches this thread as its error, in order
        n = sum(x.shape[0] for x, _ in loader)
    loader.close()
    assert n == 96


@pytest.mark.skipif(not gpu_decoders(), reason="no GPU JPEG decoder imports here")
def test_gpu_decode_in_the_device_thread_never_syncs_the_host_with_torchcodec(packed: Path) -> None:
    opts = DeviceOptions("cuda", normalize="imagenet", dtype="bf16", decode="gpu")
    loader = Loader(packed, 16, transforms=TRAIN, seed=5, device=opts, workers=Workers(persistent=True))
    for _ in loader:
        pass
    if "TorchCodec" not in loader.stats.gpu_decoder:  # nvImageCodec's engines wait, on purpose, per chunk
        loader.close()
        pytest.skip(f"{loader.stats.gpu_decoder} waits on the host by design (docs/gpu-decode.md)")
    with no_host_syncs():
        n = sum(x.shape[0] for x, _ in loader)
    loader.close()
    assert n == 96 and loader.stats.gpu_fallbacks == 0


def test_a_break_mid_epoch_under_no_host_syncs_stops_every_thread(packed: Path) -> None:
    before = stoker_threads()
    loader = Loader(packed, 8, transforms=TRAIN, device=DeviceOptions("cuda", normalize="imagenet"),
                    workers=Workers(prefetch=3))
    for _ in loader:  # a whole epoch first: the allocators hold what the steady state uses
        pass
    with no_host_syncs():
        for i, (x, _) in enumerate(loader):
            gpu_sleep(5)
            if i == 2:
                break
    assert wait_for_threads(before) == before
    loader.set_epoch(5)
    assert sum(x.shape[0] for x, _ in loader) == 96  # and it starts again


def test_the_device_thread_runs_on_the_loaders_gpu(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device thread binds to the Loader's GPU when it starts (the last one here: cuda:1 on a
    two-GPU machine, while this thread stays on cuda:0) and builds every batch there."""
    from stoker.device.build import DeviceBuilder

    seen: list[tuple[str, int]] = []
    build = DeviceBuilder.__call__
    monkeypatch.setattr(DeviceBuilder, "__call__", lambda self, slot: (
        seen.append((threading.current_thread().name, torch.cuda.current_device())), build(self, slot))[1])
    last = torch.cuda.device_count() - 1
    before = torch.cuda.current_device()
    loader = Loader(packed, 16, transforms=TRAIN, device=f"cuda:{last}", workers=2)
    assert all(x.device == torch.device("cuda", last) for x, _ in loader)
    assert seen and set(seen) == {("stoker-device", last)}
    assert torch.cuda.current_device() == before   # the caller's thread is left alone


GPU_1 = """
import os, sys, torch
from stoker import DeviceOptions, Loader
from stoker.transforms import RandomResizedCrop
early = DeviceOptions("cuda")          # made before set_device, as a script may
torch.cuda.set_device(1)
for x, _ in Loader(sys.argv[1], 16, transforms=[RandomResizedCrop(32)], device=early, workers=4):
    assert x.device == torch.device("cuda", 1), x.device
torch.cuda.synchronize()
print("context on GPU 0:", torch._C._cuda_hasPrimaryContext(0))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_rank_1_under_torchrun_never_makes_a_context_on_gpu_0(packed: Path) -> None:
    """New threads start on GPU 0: an event query from the device thread or a worker used to create a
    context there (about 0.5 GB per rank), and "cuda" made before set_device meant cuda:0."""
    env = {**os.environ, "LOCAL_RANK": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", GPU_1, str(packed)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "context on GPU 0: False" in out.stdout


def test_a_graph_captured_in_thread_local_mode_while_the_loader_runs(packed: Path) -> None:
    """The device thread queries events, launches kernels and allocates while the training thread
    captures: in the default capture_error_mode="global" CUDA may refuse those calls and invalidate
    the capture; "thread_local" (docs/device.md) confines the checks to the capturing thread."""
    loader = Loader(packed, 16, transforms=TRAIN, seed=3, device=DeviceOptions("cuda", normalize="imagenet"),
                    workers=Workers(prefetch=3))
    model = torch.nn.Sequential(*[torch.nn.Conv2d(3, 3, 3, padding=1) for _ in range(8)]).cuda()
    it = iter(loader)
    first, _ = next(it)
    static_x = first.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch's docs ask
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the device thread is still busy
        static_y = model(static_x)
    got, want = [], []
    with torch.no_grad():
        for x, _ in it:
            static_x.copy_(x)
            graph.replay()
            got.append(static_y.sum().item())
            want.append(model(x).sum().item())
    assert len(got) == 5 and got == pytest.approx(want, rel=1e-4)


def test_the_gpu_memory_in_the_stats_matches_torchs_allocator(packed: Path) -> None:
    """LoaderStats.device_bytes sums the loader's own tensors; torch's allocator, asked once the device
    thread sits on a full queue, holds that plus the batch this thread has (and the constants)."""
    loader = Loader(packed, 16, transforms=TRAIN, seed=1, device=DeviceOptions("cuda", normalize="imagenet"),
                    workers=Workers(prefetch=2))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    it = iter(loader)
    x, y = next(it)
    per_batch = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    deadline = time.monotonic() + 30
    while loader.stats.device_bytes < 3 * per_batch and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - per_batch   # less the batch this thread holds
    assert loader.stats.device_bytes == 3 * per_batch   # prefetch queued + the one waiting to be queued
    assert abs(held - loader.stats.device_bytes) <= 16 * 1024, (held, loader.stats.device_bytes)
    assert loader.stats.device_peak_bytes >= 3 * per_batch + 16 * 32 * 32 * 3   # + the uint8 upload
    del x, y, it
    loader.close()


def test_doctor_reports_the_loaders_gpu_memory(packed: Path) -> None:
    from stoker.tools.doctor import run_doctor

    report = run_doctor(packed, batch_size=16, steps=2, device="cuda", progress=False)
    one_batch = 16 * 3 * 224 * 224 * 4   # float32, normalized
    assert report.loader_gpu_bytes is not None and report.loader_gpu_bytes >= one_batch
    assert "loader GPU mem" in report.format()
    assert report.loader_batch_bytes is not None and report.loader_batch_bytes >= one_batch
