"""stoker.device.stage on a real GPU: the copy stream, events instead of syncs, record_stream, values
(skipped without CUDA). The CPU side of the same module is tested in tests/test_device.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from stoker.device.stage import DeviceOptions, DeviceStage, convert
from stoker.device.prefetcher import prefetch
from stoker.errors import LoaderTimeoutError
from cuda_helpers import gpu_sleep, no_host_syncs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORMATS = [torch.contiguous_format, torch.channels_last]
# GPU vs CPU: both compute in float32 (fused multiply-add may differ by an ulp) and cast, so one output ulp
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
def nhwc(b: int = 4, h: int = 32, w: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, h, w, 3), dtype=torch.uint8, generator=g)


def dataloader(n: int = 64, batch_size: int = 8, h: int = 40, w: int = 48) -> DataLoader:
    data = TensorDataset(nhwc(n, h, w, seed=1), torch.arange(n))
    return DataLoader(data, batch_size=batch_size, shuffle=False, pin_memory=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("normalize", [None, "imagenet"])
def test_convert_on_the_gpu_matches_the_cpu(dtype, fmt, layout, normalize):
    x = nhwc()
    if layout == "nchw":
        x = x.permute(0, 3, 1, 2).contiguous()
    want = convert(x, DeviceOptions("cpu", normalize, dtype, fmt), layout=layout)
    opts = DeviceOptions("cuda", normalize, dtype, fmt)
    stage = DeviceStage(opts)
    with stage.context():
        out = stage.convert(stage.upload(x.pin_memory()), layout)
        fence = stage.fence()
    out = stage.handoff(out, fence)
    assert out.is_cuda and out.device == stage.opts.device and out.dtype == dtype and out.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(out.cpu().double(), want.double(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_uint8_output_on_the_gpu(fmt):
    x = nhwc()
    stage = DeviceStage(DeviceOptions("cuda", memory_format=fmt))
    with stage.context():
        out = stage.convert(stage.upload(x.pin_memory()), "nhwc")
        fence = stage.fence()
    out = stage.handoff(out, fence)
    assert out.is_cuda and out.dtype == torch.uint8 and out.is_contiguous(memory_format=fmt)
    assert torch.equal(out.cpu(), x.permute(0, 3, 1, 2))


def test_prefetch_with_options_that_change_nothing_only_moves():
    x = nhwc()
    (out,) = prefetch([x.pin_memory()], DeviceOptions("cuda"))  # uint8, plain NCHW, no normalize
    assert out.is_cuda and torch.equal(out.cpu(), x)  # as it came: NHWC


def test_cuda_resolves_to_the_current_gpu(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert DeviceOptions("cuda").device == torch.device("cuda")   # resolved when a pass starts
    assert DeviceOptions("cuda").resolved().device == torch.device("cuda", torch.cuda.current_device())
    assert DeviceOptions(0).device == torch.device("cuda", 0)


def test_prefetch_over_a_pinned_dataloader_equals_a_plain_copy():
    dl = dataloader()
    first_x, _ = next(iter(dl))
    assert first_x.is_pinned()
    got = [(x.clone(), y.clone()) for x, y in prefetch(dl, "cuda")]
    plain = [(x.cuda(), y.cuda()) for x, y in dl]
    assert len(got) == len(plain) == len(dl)
    for (a, b), (c, d) in zip(got, plain):
        assert a.is_cuda and b.is_cuda and torch.equal(a, c) and torch.equal(b, d)


def test_prefetch_converts_like_convert_after_a_plain_copy():
    dl = dataloader()
    opts = DeviceOptions("cuda", "imagenet", torch.bfloat16, "channels_last")
    got = [x.clone() for x, _ in prefetch(dl, DeviceOptions("cuda", normalize="imagenet", dtype="bf16",
                                                            memory_format="channels_last"))]
    want = [convert(x.cuda(), opts, layout="nhwc") for x, _ in dl]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16 and a.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(a, b)  # the same kernels on the same GPU: bit for bit


def test_the_copy_runs_on_one_side_stream_kept_across_epochs(monkeypatch):
    p = prefetch(dataloader(), DeviceOptions("cuda", normalize="imagenet"))
    stream = p.stage.stream
    assert stream is not None and stream != torch.cuda.current_stream()
    assert stream.device == torch.device("cuda", torch.cuda.current_device())
    seen = []
    upload = p.stage.upload

    def spy(t):
        seen.append(torch.cuda.current_stream())
        return upload(t)

    monkeypatch.setattr(p.stage, "upload", spy)
    for _ in range(2):  # two epochs
        for _ in p:
            assert torch.cuda.current_stream() != stream  # the caller is back on its own stream
    assert p.stage.stream is stream and len(seen) == 2 * 2 * len(p)  # images and labels
    assert all(s == stream for s in seen)


def test_the_next_copy_is_done_by_the_time_it_is_handed_over(monkeypatch):
    gpu_sleep(0.1)  # calibrate outside the timed loop
    p = prefetch(dataloader(), DeviceOptions("cuda", normalize="imagenet"))
    done_at_handoff = []
    handoff = p.stage.handoff

    def spy(batch, fence):
        done_at_handoff.append(fence.done())
        return handoff(batch, fence)

    monkeypatch.setattr(p.stage, "handoff", spy)
    for x, y in p:
        gpu_sleep(20)  # the training step
        torch.cuda.current_stream().synchronize()  # like loss.item(): the host waits for the step
    assert len(done_at_handoff) == len(p)
    assert all(done_at_handoff[1:]), done_at_handoff  # each copy ran during the previous step


def test_the_copy_does_not_wait_for_the_consumers_stream(monkeypatch):
    gpu_sleep(0.1)
    p = prefetch(dataloader(), "cuda")
    for _ in p:  # warm up: pinned and device memory cached, so nothing below allocates from the driver
        pass
    fences = []
    fence = p.stage.fence

    def spy():
        fences.append(fence())
        return fences[-1]

    monkeypatch.setattr(p.stage, "fence", spy)
    it = iter(p)
    next(it)  # batch 0 handed over, batch 1 staged
    gpu_sleep(400)  # a long step queued on the caller's stream
    next(it)  # stages batch 2 while the step runs
    fences[2].wait(0.3)  # the copy finishes long before the step does
    assert not torch.cuda.current_stream().query()
    torch.cuda.current_stream().synchronize()
    it.close()


@pytest.mark.parametrize("normalize", [None, "imagenet"])
def test_freed_batches_are_not_overwritten_while_the_consumer_still_reads_them(normalize):
    """record_stream: the caller drops each batch on the host while kernels that read it are still queued
    behind a slow step; the copy stream must not reuse that memory for the next batches before they ran."""
    gpu_sleep(0.1)
    n, shape = 40, (16, 64, 64, 3)

    def source():
        for k in range(n):
            yield torch.full(shape, k % 251, dtype=torch.uint8).pin_memory(), torch.tensor([k])

    p = prefetch(source(), DeviceOptions("cuda", normalize=normalize))
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for k, (x, y) in enumerate(p):
        gpu_sleep(2)  # the caller's stream falls behind the host
        if normalize is None:
            bad += (x != k % 251).sum()
        else:
            ref = convert(torch.full((1, 1, 1, 3), k % 251, dtype=torch.uint8, device="cuda"), p.opts)
            bad += ((x - ref).abs() > 1e-5).sum()
        bad += (y != k).sum()
        del x, y
        junk = torch.empty(shape, dtype=torch.float32, device="cuda").fill_(-7.0)  # allocate on the caller's stream
        del junk
    torch.cuda.current_stream().synchronize()
    assert bad.item() == 0


def test_handoff_orders_the_consumer_after_the_copy():
    gpu_sleep(0.1)
    stage = DeviceStage(DeviceOptions("cuda", dtype="float32"))
    x = nhwc(8, 64, 64).pin_memory()
    with stage.context():
        gpu_sleep(100)  # the copy stream is busy: the copy below lands late
        out = stage.convert(stage.upload(x), "nhwc")
        fence = stage.fence()
    out = stage.handoff(out, fence)
    total = out.double().sum()  # queued on the caller's stream, which must wait for the copy
    assert abs(total.item() - x.double().sum().item() / 255) < 1.0


def test_no_host_synchronization_while_iterating(monkeypatch):
    dl = dataloader()
    p = prefetch(dl, DeviceOptions("cuda", normalize="imagenet", dtype="bf16", memory_format="channels_last"))

    def forbidden(*args, **kwargs):
        raise AssertionError("the prefetcher must not block the host on the GPU")

    for _ in p:  # warm up: the caching allocators (device and pinned host) hold what the steady state uses
        pass
    monkeypatch.setattr(torch.cuda.Event, "synchronize", forbidden)
    count = 0
    with no_host_syncs():  # explicit and implicit syncs alike raise
        for _ in range(2):
            for x, y in p:
                x.float().mean()  # some work on the caller's stream
                count += 1
    monkeypatch.undo()
    assert count == 2 * len(dl)


def test_the_first_batch_of_a_fresh_stage_does_not_sync():
    """The normalize constants are filled on the device, not copied from pageable host memory (which
    blocks the host: an implicit sync on every new stage's first batch)."""
    x = nhwc(8, 32, 32).pin_memory()
    torch.empty(1, device="cuda")  # the CUDA context exists, as in any training script
    opts = DeviceOptions("cuda", normalize=((0.4, 0.5, 0.6), (0.2, 0.3, 0.4)), dtype="bf16")
    stage = DeviceStage(opts)
    with no_host_syncs():
        with stage.context():
            out = stage.convert(stage.upload(x), "nhwc")
            fence = stage.fence()
        out = stage.handoff(out, fence)
    want = convert(x, DeviceOptions("cpu", normalize=opts.normalize, dtype="bf16"))
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOLERANCE[torch.bfloat16], rtol=0)


def test_half_precision_output_is_written_in_one_pass():
    """addcmul(out=) stores bf16 directly: no float32 batch is ever allocated (it would be 2x the output)."""
    x = nhwc(16, 128, 128).cuda()
    opts = DeviceOptions("cuda", normalize="imagenet", dtype="bf16", memory_format="channels_last")
    convert(x, opts)  # constants made
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = convert(x, opts)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= out.numel() * 2 + (1 << 20), f"{extra} bytes for a {out.numel() * 2}-byte output"
    f32 = convert(x, DeviceOptions("cuda", normalize="imagenet", memory_format="channels_last"))
    assert torch.equal(out, f32.to(torch.bfloat16))


def test_the_copy_stream_does_not_outrank_the_training_stream():
    stage = DeviceStage(DeviceOptions("cuda"))
    assert stage.stream.priority == torch.cuda.current_stream().priority == 0


def test_fence_on_the_copy_stream():
    gpu_sleep(0.1)
    stage = DeviceStage(DeviceOptions("cuda"))
    with stage.context():
        gpu_sleep(300)
        fence = stage.fence()
    assert not fence.done()
    with pytest.raises(LoaderTimeoutError, match="the copy of a batch to cuda"):
        fence.wait(0.05)
    stop = threading.Event()
    stop.set()
    fence.wait(10.0, stop)  # returns at once, no error
    fence.wait(10.0)
    assert fence.done()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_second_gpu():
    before = torch.cuda.current_device()
    x = nhwc().pin_memory()
    p = prefetch([(x, torch.tensor([1]))], DeviceOptions("cuda:1", normalize="imagenet"))
    ((out, label),) = list(p)
    assert out.device == torch.device("cuda", 1) and label.device == torch.device("cuda", 1)
    assert p.stage.stream.device == torch.device("cuda", 1)
    assert torch.cuda.current_device() == before
    want = convert(x, DeviceOptions("cpu", "imagenet"))
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=0)
