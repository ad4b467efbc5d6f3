"""stoker.Loader with a device stage (device="cpu" or a DeviceOptions: normalize, dtype, memory_format, decode="gpu").

Everything here runs on the CPU: device="cpu" drives the same device thread, builder and
conversion as CUDA (minus streams), and decode="gpu" runs with a stand-in decoder object that
decodes on the CPU, so the GPU path's planning, fallbacks and shutdown are tested without a GPU.
tests/cuda/ runs the real thing where a GPU is present.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch

import stoker
from stoker.device import DeviceOptions
from stoker.errors import ConfigError, LoaderTimeoutError, SampleError
from stoker.loader import Loader
from test_loader import TRAIN, build_packed

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class CpuJpegDecoder:
    """The GpuDecoder protocol on the CPU (simplejpeg), standing in for nvJPEG in these tests.
    Records each call's batch size; inputs of a length in `fail_sizes` (and corrupt ones) come back
    as per-sample errors; `delay_s` makes every call slow."""

    name = "cpu stand-in"

    def __init__(self, fail_sizes: set[int] = frozenset(), delay_s: float = 0.0) -> None:
        self.calls: list[int] = []
        self.fail_sizes = set(fail_sizes)
        self.delay_s = delay_s

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        self.calls.append(len(datas))
        if self.delay_s:
            time.sleep(self.delay_s)
        out: list[torch.Tensor | Exception] = []
        for d in datas:
            if int(d.numel()) in self.fail_sizes:
                out.append(RuntimeError("stand-in decoder refuses this one"))
                continue
            try:
                img = simplejpeg.decode_jpeg(d.numpy().tobytes(), colorspace="RGB")
            except Exception as exc:  # a corrupt file: the per-sample failure the protocol asks for
                out.append(exc)
                continue
            out.append(torch.from_numpy(img).permute(2, 0, 1).contiguous())
        return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("dev") / "ds", n=60)


@pytest.fixture(scope="module")
def packed_bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("devbad") / "ds", n=40, corrupt=(9, 17))


def reference(loader: Loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The plain CPU loader's batches (uint8 NHWC), cloned."""
    return [(x.clone(), y.clone()) for x, y in loader]


def normalized(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    return (x.permute(0, 3, 1, 2).double() / 255 - mean) / std


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def worker_threads() -> int:
    return sum(t.name.startswith("stoker") for t in threading.enumerate())


def wait_threads_gone(before: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while worker_threads() > before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return worker_threads()


# ---- device="cpu": the device stage without streams -------------------------------------------

def test_normalized_nchw_batches_match_the_uint8_batches(packed: Path) -> None:
    ref = reference(Loader(packed, 16, transforms=TRAIN, seed=3, num_threads=2))
    got = Loader(packed, 16, transforms=TRAIN, seed=3, num_threads=2,
                 device=DeviceOptions("cpu", normalize="imagenet"))
    batches = list(got)
    assert len(batches) == len(ref)
    for (x, y), (rx, ry) in zip(batches, ref):
        assert x.dtype == torch.float32 and x.shape == (rx.shape[0], 3, 32, 32)
        assert x.is_contiguous()
        torch.testing.assert_close(x.double(), normalized(rx), atol=1e-5, rtol=0)
        assert torch.equal(y, ry)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_channels_last(packed: Path, dtype: torch.dtype) -> None:
    ref = reference(Loader(packed, 16, transforms=TRAIN, seed=1, num_threads=2))
    got = list(Loader(packed, 16, transforms=TRAIN, seed=1, num_threads=2,
                      device=DeviceOptions("cpu", normalize=(MEAN, STD), dtype=dtype, memory_format="channels_last")))
    for (x, _), (rx, _) in zip(got, ref):
        assert x.dtype == dtype and x.is_contiguous(memory_format=torch.channels_last)
        tol = 1e-2 if dtype is torch.float16 else 3e-2
        torch.testing.assert_close(x.double(), normalized(rx), atol=tol * 3, rtol=tol)


def test_same_seed_same_bits_for_any_thread_count_and_prefetch_on_a_device(packed: Path) -> None:
    opts = DeviceOptions("cpu", normalize="imagenet")
    runs = [[x.clone() for x, _ in Loader(packed, 8, transforms=TRAIN, seed=5, num_threads=t, prefetch=p,
                                          device=opts)] for t, p in ((1, 1), (2, 3), (4, 2))]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_batches_stay_valid_after_the_next_step(packed: Path) -> None:
    """Device batches are fresh tensors: unlike ring slots, they may be kept across steps."""
    kept = list(Loader(packed, 8, transforms=TRAIN, seed=2, device=DeviceOptions("cpu", dtype=torch.uint8)))
    again = [x.clone() for x, _ in Loader(packed, 8, transforms=TRAIN, seed=2,
                                          device=DeviceOptions("cpu", dtype=torch.uint8))]
    assert all(torch.equal(a, b) for (a, _), b in zip(kept, again))
    assert kept[0][0].shape[1] == 3  # uint8, but laid out NCHW


def test_extras_and_resume_work_with_a_device(packed: Path) -> None:
    loader = Loader(packed, 8, transforms=TRAIN, seed=4, columns=["weight"],
                    device=DeviceOptions("cpu", normalize="imagenet"))
    full = [(x.clone(), y.clone(), e) for x, y, e in loader]
    assert all(e["weight"] == pytest.approx([v / 10 for v in y.tolist()]) for _, y, e in full)
    loader.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    it.close()
    fresh = Loader(packed, 8, transforms=TRAIN, seed=4, columns=["weight"],
                   device=DeviceOptions("cpu", normalize="imagenet"))
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert len(rest) == len(full) - 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rest, full[2:]))


def test_prefetch_over_a_loader_equals_the_loaders_own_device_stage(packed: Path) -> None:
    own = [x.clone() for x, _ in Loader(packed, 8, transforms=TRAIN, seed=6,
                                        device=DeviceOptions("cpu", normalize="imagenet"))]
    wrapped = [x.clone() for x, _ in stoker.prefetch(Loader(packed, 8, transforms=TRAIN, seed=6),
                                                     DeviceOptions("cpu", normalize="imagenet"))]
    assert len(own) == len(wrapped) and all(torch.equal(a, b) for a, b in zip(own, wrapped))
    with pytest.raises(ConfigError, match="already delivers"):
        list(stoker.prefetch(Loader(packed, 8, transforms=TRAIN, device="cpu"), "cpu"))


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "cpu", "decode": "nvjpeg"}, "decode must be one of"),
    ({"device": "cpu", "decode": "gpu"}, "needs a CUDA device"),
    ({"device": "cpu", "decode": "gpu", "gpu_decoder": 42}, "gpu_decoder must be"),
    ({"device": "cpu", "normalize": (0.5, 120)}, "looks like 0-255 units"),
    ({"device": "cpu", "normalize": "imagenet", "dtype": "uint8"}, "uint8 cannot hold normalized values"),
])
def test_bad_device_settings_name_the_fix(packed: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Loader(packed, 8, transforms=TRAIN, device=DeviceOptions(**kwargs))


@pytest.mark.parametrize("device, match", [(2.5, "device must be 'cuda'"), ("tpu", "device='tpu'"),
                                           (True, "device must be 'cuda'")])
def test_a_bad_device_value_is_refused_by_the_loader(packed: Path, device: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Loader(packed, 8, transforms=TRAIN, device=device)


def test_a_device_string_means_uint8_nchw_batches_there(packed: Path) -> None:
    ref = reference(Loader(packed, 8, transforms=TRAIN, seed=2))
    loader = Loader(packed, 8, transforms=TRAIN, seed=2, device="cpu")
    assert loader.device == DeviceOptions("cpu")
    for (x, _), (rx, _) in zip(loader, ref):
        assert x.dtype == torch.uint8 and torch.equal(x, rx.permute(0, 3, 1, 2))


def test_gpu_decode_refuses_user_callables(packed: Path) -> None:
    def solarize(img: np.ndarray) -> np.ndarray:
        return 255 - img
    with pytest.raises(ConfigError, match="solarize work on numpy arrays"):
        Loader(packed, 8, transforms=[*TRAIN, solarize], device=DeviceOptions("cpu", decode="gpu",
                                                                              gpu_decoder=CpuJpegDecoder()))


def test_shutdown_with_a_device_thread(packed: Path) -> None:
    before = worker_threads()
    loader = Loader(packed, 4, transforms=TRAIN, num_threads=2, device=DeviceOptions("cpu", normalize="imagenet"))
    for _ in loader:  # exhaustion
        pass
    assert wait_threads_gone(before) == before
    for _ in loader:  # break
        break
    assert wait_threads_gone(before) == before
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            1 / 0
    assert wait_threads_gone(before) == before
    it = iter(loader)
    next(it)
    del it  # abandoned: the finalizer stops the device thread and the workers
    assert wait_threads_gone(before) == before
    loader.close()


def test_a_stalled_device_stage_times_out_and_stops(packed: Path) -> None:
    before = worker_threads()
    slow = CpuJpegDecoder(delay_s=3.0)
    loader = Loader(packed, 8, transforms=TRAIN, device=DeviceOptions("cpu", decode="gpu", gpu_decoder=slow),
                    timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match="nothing reached the device"):
        next(iter(loader))
    assert time.monotonic() - t0 < 2.9  # the 0.5 s timeout, not the 3 s decode
    assert wait_threads_gone(before, timeout=8.0) == before


# ---- decode="gpu" with a stand-in decoder -------------------------------------------------

def test_gpu_decode_path_crops_like_the_cpu_path(packed: Path) -> None:
    ref = reference(Loader(packed, 16, transforms=TRAIN, seed=7, num_threads=2))
    dec = CpuJpegDecoder()
    loader = Loader(packed, 16, transforms=TRAIN, seed=7, num_threads=2,
                    device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu", gpu_decoder=dec))
    got = [(x.clone(), y.clone()) for x, y in loader]
    for (x, y), (rx, ry) in zip(got, ref):
        assert torch.equal(y, ry)
        # same crop boxes and flips; only the resampling kernel differs (torch bilinear vs OpenCV)
        assert psnr(x, rx.permute(0, 3, 1, 2)) > 28
    jpegs = sum(1 for i in range(60) if i % 11 != 5 and i % 13 != 6)
    assert loader.stats.gpu_decoded == jpegs and loader.stats.gpu_fallbacks == 0
    assert sum(dec.calls) == jpegs  # raw and PNG samples never reach the GPU decoder


def test_gpu_decode_failures_fall_back_to_the_cpu_per_sample(packed: Path) -> None:
    ref = reference(Loader(packed, 60, transforms=TRAIN, seed=8, order="sequential"))
    from stoker.reader import open_dataset
    with open_dataset(packed) as ds:
        sizes = {len(ds.sample(i).data) for i in (0, 1, 2)}
    loader = Loader(packed, 60, transforms=TRAIN, seed=8, order="sequential",
                    device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu",
                                         gpu_decoder=CpuJpegDecoder(fail_sizes=sizes)))
    (x, y), = list(loader)
    assert loader.stats.gpu_fallbacks == 3
    rx = ref[0][0].permute(0, 3, 1, 2)
    for i in (0, 1, 2):  # decoded on the CPU: exactly the CPU path's pixels
        assert torch.equal(x[i], rx[i])
    assert torch.equal(y, ref[0][1])


def test_gpu_decode_corrupt_samples_raise_or_are_replaced_like_the_cpu_path(packed_bad: Path) -> None:
    opts = DeviceOptions("cpu", dtype=torch.uint8, decode="gpu", gpu_decoder=CpuJpegDecoder())
    with pytest.raises(SampleError, match=r"img/0009|img/0017"):
        list(Loader(packed_bad, 8, transforms=TRAIN, seed=9, device=opts))
    cpu = Loader(packed_bad, 8, transforms=TRAIN, seed=9, on_error="skip")
    ref_labels = [y.clone() for _, y in cpu]
    gpu = Loader(packed_bad, 8, transforms=TRAIN, seed=9, on_error="skip", device=opts)
    labels = [y.clone() for _, y in gpu]
    assert all(torch.equal(a, b) for a, b in zip(labels, ref_labels))  # the same stand-ins
    assert gpu.stats.skipped == cpu.stats.skipped == 2


def test_gpu_decode_is_deterministic_across_thread_counts(packed: Path) -> None:
    runs = [[x.clone() for x, _ in Loader(packed, 8, transforms=TRAIN, seed=10, num_threads=t,
                                          device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu",
                                                               gpu_decoder=CpuJpegDecoder()))]
            for t in (1, 3)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_ctrl_c_inside_the_lock_cannot_strand_the_workers(packed: Path) -> None:
    """KeyboardInterrupt can land in Condition.__enter__ after the lock was taken; the consumer
    must give it back, or every worker blocks on it forever."""
    from stoker.slots import Run

    loader = Loader(packed, 8, transforms=TRAIN, num_threads=2)
    it = iter(loader)
    run: Run = it._run
    real = run._next_batch

    def interrupted(b: int):
        run.cond.acquire()  # the with-statement's acquire succeeded, its body never started
        raise KeyboardInterrupt
    run._next_batch = interrupted
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert not run.cond._is_owned()
    run._next_batch = real
    assert run.alive() == 0  # next() closed the run, and the workers could take the lock to leave


def test_profile_reports_the_device_stage(packed: Path) -> None:
    loader = Loader(packed, 8, transforms=TRAIN, device=DeviceOptions("cpu", normalize="imagenet"))
    prof = stoker.profile(loader, verbose=False)
    for _ in prof:
        pass
    report = prof.report()
    assert report.stages["device_ms"] > 0 and "device stage" in report.format()
