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
from stoker.device.stage import DeviceOptions
from stoker.errors import ConfigError, LoaderTimeoutError, SampleError
from stoker.loader import Loader
from stoker.loader.options import Workers
from stoker.transforms import RandomResizedCrop
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
    """The plain CPU loader's batches (uint8 [B, 3, H, W]) as NHWC copies, to compare with decoded pixels."""
    return [(x.permute(0, 2, 3, 1).clone(), y) for x, y in loader]


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
    ref = reference(Loader(packed, 16, transforms=TRAIN, seed=3, workers=2))
    got = Loader(packed, 16, transforms=TRAIN, seed=3, 
                 device=DeviceOptions("cpu", normalize="imagenet"), workers=2)
    batches = list(got)
    assert len(batches) == len(ref)
    for (x, y), (rx, ry) in zip(batches, ref):
        assert x.dtype == torch.float32 and x.shape == (rx.shape[0], 3, 32, 32)
        assert x.is_contiguous()
        torch.testing.assert_close(x.double(), normalized(rx), atol=1e-5, rtol=0)
        assert torch.equal(y, ry)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_channels_last(packed: Path, dtype: torch.dtype) -> None:
    ref = reference(Loader(packed, 16, transforms=TRAIN, seed=1, workers=2))
    got = list(Loader(packed, 16, transforms=TRAIN, seed=1, 
                      device=DeviceOptions("cpu", normalize=(MEAN, STD), dtype=dtype, memory_format="channels_last"), workers=2))
    for (x, _), (rx, _) in zip(got, ref):
        assert x.dtype == dtype and x.is_contiguous(memory_format=torch.channels_last)
        tol = 1e-2 if dtype is torch.float16 else 3e-2
        torch.testing.assert_close(x.double(), normalized(rx), atol=tol * 3, rtol=tol)


def test_same_seed_same_bits_for_any_thread_count_and_prefetch_on_a_device(packed: Path) -> None:
    opts = DeviceOptions("cpu", normalize="imagenet")
    runs = [[x.clone() for x, _ in Loader(packed, 8, transforms=TRAIN, seed=5, 
                                          device=opts, workers=Workers(num_threads=t, prefetch=p))] for t, p in ((1, 1), (2, 3), (4, 2))]
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


def test_gpu_decode_refuses_interpolations_it_does_not_run(packed: Path) -> None:
    gpu = DeviceOptions("cpu", decode="gpu", gpu_decoder=CpuJpegDecoder())
    for op in (RandomResizedCrop(32, interpolation="bicubic"), RandomResizedCrop(32, antialias=False)):
        with pytest.raises(ConfigError, match="decode='gpu' resizes with antialiased bilinear only"):
            Loader(packed, 8, transforms=[op], device=gpu)
    Loader(packed, 8, transforms=[RandomResizedCrop(32)], device=gpu).close()


def test_shutdown_with_a_device_thread(packed: Path) -> None:
    before = worker_threads()
    loader = Loader(packed, 4, transforms=TRAIN, device=DeviceOptions("cpu", normalize="imagenet"), workers=2)
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


def wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_the_device_memory_the_loader_holds_is_in_its_stats(packed: Path) -> None:
    """LoaderStats.device_bytes: the built batches not yet handed out (prefetch queued, plus the one the
    device thread holds while it waits to queue it); the peak adds that build's uint8 upload, if any."""
    loader = Loader(packed, 10, transforms=TRAIN, seed=1, device=DeviceOptions("cpu", normalize="imagenet"),
                    workers=Workers(num_threads=2, prefetch=2))
    it = iter(loader)
    x0, y0 = next(it)
    per_batch = x0.untyped_storage().nbytes() + y0.untyped_storage().nbytes()   # what one batch holds
    assert per_batch == 10 * 3 * 32 * 32 * 4 + 10 * 8   # float32 images, int64 labels
    assert wait_for(lambda: loader.stats.device_bytes == 3 * per_batch), loader.stats.device_bytes
    # the uint8 batch converted from, freed once its build is done; none where the native engine writes the
    # float batch itself (the route's native path: this pack's small images are stored raw, which it reads)
    upload = 0 if loader.route.native else 10 * 32 * 32 * 3
    assert loader.stats.device_peak_bytes == 3 * per_batch + upload
    assert loader.stats.as_dict()["device_peak_bytes"] == 3 * per_batch + upload
    time.sleep(0.2)   # a full queue: nothing more is built
    assert loader.stats.device_bytes == 3 * per_batch
    assert sum(1 for _ in it) == 5   # every batch handed out: the caller's now
    assert loader.stats.device_bytes == 0
    it = iter(loader)
    next(it)
    assert wait_for(lambda: loader.stats.device_bytes == 3 * per_batch)
    loader.close()   # batches dropped unseen are no longer held
    assert loader.stats.device_bytes == 0 and loader.stats.device_peak_bytes == 3 * per_batch + upload


def test_the_gpu_decode_path_counts_its_device_memory_like_the_storages(packed: Path) -> None:
    """The pipelined GPU decode measures a batch from its storages, then a batch like it (same shapes and
    dtypes, fresh tensors) by the same bytes with no call: the figures match the storages' all the way,
    and the peak adds the ring buffer the batch was resampled into."""
    loader = Loader(packed, 10, transforms=TRAIN, seed=1, workers=Workers(num_threads=2, prefetch=2),
                    device=DeviceOptions("cpu", normalize="imagenet", decode="gpu", gpu_decoder=CpuJpegDecoder()))
    it = iter(loader)
    x0, y0 = next(it)
    per_batch = x0.untyped_storage().nbytes() + y0.untyped_storage().nbytes()
    assert per_batch == 10 * 3 * 32 * 32 * 4 + 10 * 8
    assert wait_for(lambda: loader.stats.device_bytes == 3 * per_batch), loader.stats.device_bytes
    assert loader.stats.device_peak_bytes == 3 * per_batch + 10 * 32 * 32 * 3   # and a uint8 ring buffer
    held = []
    for x, y in it:
        assert x.untyped_storage().nbytes() + y.untyped_storage().nbytes() == per_batch
        held.append(loader.stats.device_bytes)
    assert loader.stats.device_bytes == 0 and max(held) <= 3 * per_batch and held[-1] == 0
    loader.close()


def test_a_gpu_decode_batch_that_is_its_ring_buffer_is_never_overwritten(packed: Path) -> None:
    """uint8 channels_last output is the ring buffer the batch was resampled into, viewed as NCHW: that
    buffer leaves the ring, so batches the caller keeps stay as they were handed out."""
    opts = DeviceOptions("cpu", memory_format="channels_last", decode="gpu", gpu_decoder=CpuJpegDecoder())
    kept = list(Loader(packed, 10, transforms=TRAIN, seed=4, device=opts, workers=2))
    cloned = [(x.clone(), y.clone()) for x, y in Loader(packed, 10, transforms=TRAIN, seed=4, device=opts, workers=2)]
    assert len(kept) == len(cloned) == 6
    assert len({x.untyped_storage().data_ptr() for x, _ in kept}) == 6   # six buffers: none reused
    assert all(torch.equal(x, cx) and torch.equal(y, cy) for (x, y), (cx, cy) in zip(kept, cloned))


# ---- decode="gpu" with a stand-in decoder -------------------------------------------------

def test_gpu_decode_path_crops_like_the_cpu_path(packed: Path) -> None:
    ref = reference(Loader(packed, 16, transforms=TRAIN, seed=7, workers=2))
    dec = CpuJpegDecoder()
    loader = Loader(packed, 16, transforms=TRAIN, seed=7, 
                    device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu", gpu_decoder=dec), workers=2)
    got = [(x.clone(), y.clone()) for x, y in loader]
    for (x, y), (rx, ry) in zip(got, ref):
        assert torch.equal(y, ry)
        # same crop boxes and flips; only the resampling kernel differs (torch bilinear vs OpenCV)
        assert psnr(x, rx.permute(0, 3, 1, 2)) > 28
    jpegs = sum(1 for i in range(60) if i % 11 != 5 and i % 13 != 6)
    assert loader.stats.gpu_decoded == jpegs and loader.stats.gpu_fallbacks == 0
    assert sum(dec.calls) == jpegs  # raw and PNG samples never reach the GPU decoder
    assert loader.stats.gpu_decoder == "cpu stand-in" == loader.stats.as_dict()["gpu_decoder"]  # which one ran


def test_gpu_decode_uploads_only_the_rows_decoded_on_the_cpu() -> None:
    """The GPU decode overwrites every JPEG row: uploading the whole pinned slot first moved 38.5 MB per
    256x224x224 batch for nothing. On "meta" (a device tensor that runs here), every copy from host
    memory is recorded."""
    import types

    from torch.utils._python_dispatch import TorchDispatchMode

    from stoker.device.stage import DeviceStage
    from stoker.device.build import DeviceBuilder
    from stoker.loading.slots import Slot
    from stoker.loading.stats import LoaderStats

    class Uploads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            if func.__name__.startswith("copy_") and args[1].device.type == "cpu" and args[0].device.type == "meta":
                self.rows.append(args[1].shape[0])
            return func(*args, **(kwargs or {}))

    opts = DeviceOptions("cpu", dtype=torch.uint8)
    object.__setattr__(opts, "device", torch.device("meta"))
    from stoker.loading.jobs import GpuBatch, cpu_rows

    stage = DeviceStage(DeviceOptions("cpu"))
    stage.opts = opts
    chain = types.SimpleNamespace(spec=types.SimpleNamespace(pipeline=types.SimpleNamespace(batch=None)),
                                  multi_label=None)
    builder = DeviceBuilder(stage, chain, threading.RLock(), LoaderStats())
    images = torch.zeros((8, 4, 6, 3), dtype=torch.uint8)
    slot = Slot(images, images.numpy(), torch.arange(8), None, size=7)
    # rows 1, 2 and 5 are JPEGs for the GPU; 0, 3, 4 and 6 were rendered on the CPU
    gpu = GpuBatch.of_jobs([types.SimpleNamespace(row=r, flip=False, height=4, width=6, window=None, box=(0, 0, 4, 6),
                                                  data=torch.zeros(1, dtype=torch.uint8)) for r in (1, 2, 5)])
    x = torch.empty((7, 4, 6, 3), dtype=torch.uint8, device="meta")
    with Uploads() as uploads:
        builder.upload_rows(slot, x, cpu_rows(7, gpu))
    assert uploads.rows == [1, 2, 1]  # rows 0, 3-4, 6: one copy per run, none of the GPU's


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
    cpu = Loader(packed_bad, 8, transforms=TRAIN, seed=9, workers=Workers(on_error="skip"))
    ref_labels = [y.clone() for _, y in cpu]
    gpu = Loader(packed_bad, 8, transforms=TRAIN, seed=9, device=opts, workers=Workers(on_error="skip"))
    labels = [y.clone() for _, y in gpu]
    assert all(torch.equal(a, b) for a, b in zip(labels, ref_labels))  # the same stand-ins
    assert gpu.stats.skipped == cpu.stats.skipped == 2


def test_gpu_decode_is_deterministic_across_thread_counts(packed: Path) -> None:
    runs = [[x.clone() for x, _ in Loader(packed, 8, transforms=TRAIN, seed=10, 
                                          device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu",
                                                               gpu_decoder=CpuJpegDecoder()), workers=t)]
            for t in (1, 3)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_ctrl_c_inside_the_lock_cannot_strand_the_workers(packed: Path) -> None:
    """KeyboardInterrupt can land in Condition.__enter__ after the lock was taken; the consumer
    must give it back, or every worker blocks on it forever."""
    from stoker.loading.slots import Run

    loader = Loader(packed, 8, transforms=TRAIN, workers=2)
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


def test_the_uploads_are_fenced_before_the_gpu_decode_and_the_slot_after_it(packed: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipelined GPU decode: batch b's JPEGs reach the decoder (on the decode thread) once submitted;
    its slot is guarded until batch b is finished, the CPU fallbacks and the conversion included, then
    by one fence after them, which is also the batch's ready fence (one fence a batch)."""
    import threading

    from stoker.device import gpu_pipeline
    from stoker.device.gpu_decode import GpuBatchDecoder
    from stoker.device.stage import DeviceStage

    log: list[str] = []
    fence, decode = DeviceStage.fence, GpuBatchDecoder.decode_chunk
    submit, finish = gpu_pipeline.PipelinedBuilder.submit, gpu_pipeline.PipelinedBuilder.finish
    monkeypatch.setattr(DeviceStage, "fence", lambda self: log.append("fence") or fence(self))
    monkeypatch.setattr(GpuBatchDecoder, "decode_chunk", lambda self, *a: log.append(
        f"decode on {threading.current_thread().name}") or decode(self, *a))
    monkeypatch.setattr(gpu_pipeline.PipelinedBuilder, "submit", lambda self, slot: log.append(
        f"submit {slot.batch}") or submit(self, slot))
    monkeypatch.setattr(gpu_pipeline.PipelinedBuilder, "finish", lambda self, p: log.append(
        f"finish {p.slot.batch}") or finish(self, p))
    loader = Loader(packed, 20, transforms=TRAIN, seed=2,
                    device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu", gpu_decoder=CpuJpegDecoder()), workers=2)
    assert len(list(loader)) == 3
    device = [e for e in log if not e.startswith("decode")]
    assert device == ["submit 0", "submit 1", "finish 0", "fence", "submit 2", "finish 1", "fence", "finish 2",
                      "fence"]
    decodes = [i for i, e in enumerate(log) if e.startswith("decode")]
    assert [log[i] for i in decodes] == ["decode on stoker-decode"] * 3
    for b, i in enumerate(decodes):  # each batch's decode after its submission
        assert log.index(f"submit {b}") < i


# ---- a plain Loader's pinned slots and the caller's asynchronous copies (README's first example) ---------

class FakeStream:
    """The caller's current CUDA stream: the GPU 'runs' it up to an event when the test says so."""


class FakeEvent:
    """torch.cuda.Event stand-in: records on a stream, done only once the test completes it."""

    made: list["FakeEvent"] = []
    gpu_idle = False  # events recorded from now on are complete at once

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.stream: object = None
        self.completed = FakeEvent.gpu_idle
        FakeEvent.made.append(self)

    def record(self, stream: object = None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.completed


def idle_reference(packed: Path, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches ([B, 3, H, W]), read while the fake GPU keeps up."""
    FakeEvent.gpu_idle = True
    try:
        return [(x.clone(), y) for x, y in Loader(packed, batch_size, transforms=TRAIN, seed=6, workers=2)]
    finally:
        FakeEvent.made, FakeEvent.gpu_idle = [], False


@pytest.fixture
def fake_gpu_stream(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    """CUDA 'initialised', with a current stream whose events complete only when the test says."""
    stream = FakeStream()
    FakeEvent.made, FakeEvent.gpu_idle = [], False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return stream


def test_a_yielded_slot_is_not_refilled_before_the_callers_gpu_copy_ran(packed: Path,
                                                                        fake_gpu_stream: FakeStream) -> None:
    """`images.cuda(non_blocking=True)` queues a copy that reads the pinned slot later; the next
    `next()` must not let the workers overwrite the slot before the GPU has run that copy."""
    want = idle_reference(packed, 10)
    loader = Loader(packed, 10, transforms=TRAIN, seed=6, timeout=20, workers=Workers(num_threads=2, prefetch=1))  # 2 slots
    it = iter(loader)
    x0, _ = next(it)  # the caller queues x0.cuda(non_blocking=True) here; the GPU is busy with its step
    assert torch.equal(x0, want[0][0])
    x1, _ = next(it)  # batch 2 may now be planned into batch 0's slot, once the copy has run
    assert torch.equal(x1, want[1][0])
    time.sleep(0.5)  # the workers have had all the time they need to refill the slot
    assert torch.equal(x0, want[0][0]), "the slot was refilled while the GPU copy was still queued"
    guard = FakeEvent.made[-1]
    assert guard.stream is fake_gpu_stream and not guard.completed  # recorded on the caller's stream
    guard.completed = FakeEvent.gpu_idle = True  # the GPU ran the copy, and keeps up from now on
    x2, _ = next(it)
    assert torch.equal(x2, want[2][0])
    assert [torch.equal(x, w[0]) for (x, _), w in zip(it, want[3:])] == [True] * (len(want) - 3)


def test_a_guard_that_never_completes_times_out_naming_the_gpu_work(packed: Path,
                                                                    fake_gpu_stream: FakeStream) -> None:
    loader = Loader(packed, 10, transforms=TRAIN, seed=6, timeout=1.0, workers=Workers(num_threads=2, prefetch=1))
    it = iter(loader)
    for _ in range(3):   # a ring of prefetch + 2 slots: batch 3 is the first to reuse one (batch 0's,
        next(it)         # which the caller dropped, but whose GPU copy never completes)
    with pytest.raises(LoaderTimeoutError, match=r"batch 3 cannot be written into its slot: your GPU work on an earlier "
                                                  r"batch .* had not finished after 1 s"):
        next(it)
    assert wait_threads_gone(0) == 0


def test_the_last_slot_of_an_epoch_stays_guarded_for_the_next_epoch(packed: Path,
                                                                   fake_gpu_stream: FakeStream) -> None:
    want = idle_reference(packed, 30)
    loader = Loader(packed, 30, transforms=TRAIN, seed=6, timeout=20, workers=Workers(num_threads=2, prefetch=1))
    first = [x for x, _ in loader]  # 2 batches: slot 1 holds the last one
    assert len(FakeEvent.made) == 2  # at next() for batch 1, and when the epoch ended (guarding slot 1)
    last = FakeEvent.made[-1]
    assert not last.completed and torch.equal(first[1], want[1][0])
    for e in FakeEvent.made[:-1]:
        e.completed = True
    it = iter(loader)  # epoch 1 reuses the ring: its batch 1 goes into slot 1
    next(it)
    time.sleep(0.3)
    assert torch.equal(first[1], want[1][0]), "the next epoch overwrote a slot whose copy was still queued"
    assert last.stream is fake_gpu_stream
    for e in FakeEvent.made:
        e.completed = True
    FakeEvent.gpu_idle = True
    assert len([x for x, _ in it]) == 1
    loader.close()


# ---- persistent=True: straight on into the next epoch -------------------------------------------------

def epochs(loader: Loader, n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [[(x.clone(), y.clone()) for x, y in loader] for _ in range(n)]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(len(ea) == len(eb) and all(torch.equal(x, u) and torch.equal(y, v)
                                                                 for (x, y), (u, v) in zip(ea, eb))
                                    for ea, eb in zip(a, b))


@pytest.mark.parametrize("device", [None, DeviceOptions("cpu", normalize="imagenet")])
def test_persistent_epochs_give_the_same_batches(packed: Path, device: object) -> None:
    # 60 samples in batches of 16: each epoch ends with a partial batch in the middle of the run
    kw = dict(transforms=TRAIN, seed=4, device=device)
    want = epochs(Loader(packed, 16, **kw, workers=2), 3)
    for threads in (1, 3):
        with Loader(packed, 16, **kw, workers=Workers(num_threads=threads, persistent=True)) as loader:
            assert same(epochs(loader, 3), want)


def test_persistent_prepares_the_next_epoch_while_this_one_drains(packed: Path) -> None:
    before = worker_threads()
    loader = Loader(packed, 10, transforms=TRAIN, seed=4, workers=Workers(num_threads=2, prefetch=2, persistent=True))
    it = iter(loader)
    for _ in range(len(loader)):  # every batch of epoch 0, not yet StopIteration
        next(it)
    # run batches 0-5 are epoch 0; the workers go on with epoch 1's first three (6, 7, 8), as far as
    # the ring allows (prefetch + 2 slots, one still holding batch 5, which the caller may hold; the
    # stats count a worker's samples only when it completes a batch: read the ring)
    run = loader._passes._live.run
    done = lambda: sorted(s.batch for s in run.ring.slots if s.batch >= 6 and s.remaining == 0)  # noqa: E731
    deadline = time.monotonic() + 10
    while done() != [6, 7, 8] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done() == [6, 7, 8]
    threads = {t for t in threading.enumerate() if t.name.startswith("stoker")}
    assert list(it) == []
    again = epochs(loader, 1)[0]  # epoch 1 from the same threads
    assert {t for t in threading.enumerate() if t.name.startswith("stoker")} == threads
    assert same([again], [epochs(Loader(packed, 10, transforms=TRAIN, seed=4), 2)[1]])
    loader.close()
    assert wait_threads_gone(before) == before


@pytest.mark.parametrize("device", [None, DeviceOptions("cpu", normalize="imagenet")])
def test_persistent_batch_ops_draw_from_each_batchs_own_epoch_and_index(packed: Path, device: object) -> None:
    # a Mixup's draws are keyed by (seed, epoch, batch of the epoch): a pipeline running across epochs
    # must hand the device stage each batch's own epoch and index, not the run's batch count
    kw = dict(transforms=[*TRAIN, stoker.Mixup(mixup_alpha=1.0, cutmix_alpha=1.0, num_classes=60)], seed=4,
              device=device, drop_last=True)
    want = epochs(Loader(packed, 16, **kw, workers=2), 3)
    with Loader(packed, 16, **kw, workers=Workers(num_threads=2, persistent=True)) as loader:
        assert same(epochs(loader, 3), want)


@pytest.mark.parametrize("leave", ["close", "drop"])
def test_persistent_hands_on_an_epoch_read_to_the_end_but_not_exhausted(packed: Path, leave: str) -> None:
    # `for step, batch in zip(range(steps), loader)` or a break after the last batch: the iterator never
    # raised StopIteration, yet the epoch was read whole, so epoch 1 comes from the same threads
    kw = dict(transforms=TRAIN, seed=4, workers=2)
    want = epochs(Loader(packed, 10, **kw), 2)
    loader = Loader(packed, 10, **{**kw, "workers": Workers(num_threads=2, persistent=True)})
    it = iter(loader)
    first = [(x.clone(), y.clone()) for x, y in (next(it) for _ in range(len(loader)))]
    threads = {t for t in threading.enumerate() if t.name.startswith("stoker")}
    if leave == "close":
        it.close()
    else:
        del it
        gc.collect()
    again = epochs(loader, 1)[0]
    assert {t for t in threading.enumerate() if t.name.startswith("stoker")} == threads
    assert same([first, again], want)
    loader.close()


def test_persistent_resume_and_moves_elsewhere_restart_the_pipeline(packed: Path) -> None:
    kw = dict(transforms=TRAIN, seed=4, workers=2)
    want = epochs(Loader(packed, 10, **kw), 3)
    before = worker_threads()
    loader = Loader(packed, 10, **{**kw, "workers": Workers(num_threads=2, persistent=True)})
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    it.close()  # left mid-epoch (closed, or dropped after a break): the threads stop
    assert wait_threads_gone(before) == before
    loader.load_state_dict(state)
    assert same([[(x.clone(), y.clone()) for x, y in loader]], [want[0][2:]])
    loader.set_epoch(2)  # not the epoch the pipeline has ahead: it is replaced
    assert same(epochs(loader, 1), [want[2]])
    loader.close()
    assert wait_threads_gone(before) == before


def test_persistent_threads_stop_when_the_loader_is_dropped(packed: Path) -> None:
    before = worker_threads()
    loader = Loader(packed, 10, transforms=TRAIN, 
                    device=DeviceOptions("cpu", dtype=torch.uint8), workers=Workers(num_threads=2, persistent=True))
    epochs(loader, 1)
    assert worker_threads() > before  # running on into epoch 1
    del loader
    assert wait_threads_gone(before) == before
