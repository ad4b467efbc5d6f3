"""GPU JPEG decode on a real GPU: the TorchCodec and nvImageCodec backends, and GpuBatchDecoder on
CUDA against the CPU crop path (skipped without a GPU; each backend skipped when not installed)."""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg
import torch

from conftest import jpeg_bytes, smooth_rgb
from cuda_helpers import gpu_decoders, gpu_sleep, importable
from stoker.errors import CorruptImageError
from stoker.device.gpu_decode import GpuBatchDecoder, NvImageCodecDecoder, TorchCodecDecoder, make_decoder
from stoker.transforms import CenterCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop, Resize
from test_gpu_decode import SIZES, CpuDecoder, jobs_for, make_jpegs, psnr, textured

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


BACKENDS = [
    pytest.param("torchcodec", marks=pytest.mark.skipif(not importable("torchcodec.decoders"),
                                                        reason="TorchCodec does not import here")),
    pytest.param("nvimgcodec", marks=pytest.mark.skipif(not importable("nvidia.nvimgcodec"),
                                                        reason="nvImageCodec does not import here")),
]


@pytest.fixture(scope="module", params=BACKENDS)
def decoder(request: pytest.FixtureRequest):
    return make_decoder(request.param, "cuda")


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def sample_jpegs() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {
        "rgb-420": jpeg_bytes(smooth_rgb(rng, 120, 160)),
        "rgb-444": jpeg_bytes(smooth_rgb(rng, 97, 131), subsampling=0),
        "odd-size": jpeg_bytes(smooth_rgb(rng, 33, 70)),
        "gray": jpeg_bytes(smooth_rgb(rng, 64, 48)[..., 1]),
        "progressive": jpeg_bytes(smooth_rgb(rng, 150, 100), progressive=True),
        "progressive-gray": jpeg_bytes(smooth_rgb(rng, 81, 65)[..., 0], progressive=True),
        "large": jpeg_bytes(textured(rng, 1080, 1440)),
    }


def test_backend_decodes_like_libjpeg_turbo(decoder) -> None:
    jpegs = sample_jpegs()
    outs = decoder.decode([as_tensor(d) for d in jpegs.values()])
    assert len(outs) == len(jpegs)
    for (name, data), out in zip(jpegs.items(), outs):
        assert isinstance(out, torch.Tensor), f"{name}: {out!r}"
        ref = torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1)
        assert out.is_cuda and out.dtype == torch.uint8 and tuple(out.shape) == tuple(ref.shape), name
        mae = float((out.cpu().float() - ref.float()).abs().mean())
        assert mae < 2.5, f"{name}: mean abs error {mae:.2f} against libjpeg-turbo"
        if name.endswith("gray"):
            assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_a_corrupt_jpeg_fails_alone(decoder) -> None:
    jpegs = list(sample_jpegs().values())[:3]
    datas = [as_tensor(jpegs[0]), as_tensor(b"this is not a JPEG file at all " * 20), as_tensor(jpegs[1]),
             torch.zeros(0, dtype=torch.uint8), as_tensor(jpegs[2])]
    outs = decoder.decode(datas)
    assert [isinstance(o, Exception) for o in outs] == [False, True, False, True, False]
    for out, data in zip((outs[0], outs[2], outs[4]), jpegs):
        ref = torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1)
        assert float((out.cpu().float() - ref.float()).abs().mean()) < 2.5


def test_batch_decoder_on_cuda_matches_the_cpu_crop_path(decoder) -> None:
    pipe = Pipeline([RandomResizedCrop(224), RandomHorizontalFlip()])
    jpegs = make_jpegs(seed=11)
    jobs, refs = jobs_for(pipe, jpegs, SIZES, seed=2)
    jobs[3].data = as_tensor(b"not a JPEG " * 100)  # corrupt: comes back as a failure named by its key
    nhwc = torch.full((len(jobs), 224, 224, 3), 9, dtype=torch.uint8, device="cuda")
    out = nhwc.permute(0, 3, 1, 2)  # the Loader passes a channels_last view of its NHWC batch
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the Loader runs it on its copy stream
        failures = GpuBatchDecoder(decoder, "cuda").run(jobs, out)
    side.synchronize()
    assert [job.row for job, _ in failures] == [3]
    assert isinstance(failures[0][1], CorruptImageError) and failures[0][1].key == jobs[3].key
    got = nhwc.cpu().numpy()
    assert (got[3] == 9).all()
    for i, ref in enumerate(refs):
        if i == 3:
            continue
        assert psnr(got[i], ref) > 30, f"sample {i}: {psnr(got[i], ref):.1f} dB"
        assert psnr(got[i], ref[:, ::-1]) < 25


def test_decoding_never_overwrites_memory_still_in_use(decoder) -> None:
    """torchvision allocates its outputs on the current stream but writes them from a private one
    (pytorch/vision#9606): freed blocks that queued kernels still read must not be handed to it."""
    side_len = 512
    jpeg = as_tensor(jpeg_bytes(smooth_rgb(np.random.default_rng(1), side_len, side_len)))
    numel = 3 * side_len * side_len // 4  # float32 tensors the size of one decoded image
    stream = torch.cuda.Stream()
    wrong = 0
    with torch.cuda.stream(stream):
        for _ in range(20):
            victims = [torch.full((numel,), float(k + 1), device="cuda") for k in range(4)]
            stream.synchronize()
            torch.cuda._sleep(50_000_000)  # the reductions below are still queued when the decode starts
            sums = [v.sum() for v in victims]
            del victims
            outs = decoder.decode([jpeg, jpeg])
            assert all(isinstance(o, torch.Tensor) for o in outs)
            del outs
            stream.synchronize()
            wrong += sum(float(s) != (k + 1) * numel for k, s in enumerate(sums))
    assert wrong == 0


def test_peak_memory_follows_the_budget(decoder) -> None:
    if "torchvision" not in decoder.name:
        pytest.skip("nvImageCodec's buffers are not in PyTorch's allocator statistics")
    rng = np.random.default_rng(5)
    h, w, n = 600, 800, 16
    sizes = [(h, w)] * n
    jpegs = [jpeg_bytes(textured(rng, h, w)) for _ in range(n)]
    jobs, _ = jobs_for(Pipeline([RandomResizedCrop(64)]), jpegs, sizes)
    image = 3 * h * w
    budget = 2 * image
    out = torch.zeros((n, 3, 64, 64), dtype=torch.uint8, device="cuda")
    gpu = GpuBatchDecoder(decoder, "cuda", budget_bytes=budget)
    gpu.run(jobs[:2], out)  # warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert gpu.run(jobs, out) == []
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # Decoded pixels (the budget) + one image's float32 crop + slack; all 16 images at once would be 23 MB.
    assert peak <= budget + 4 * image + (1 << 20), f"peak {peak / 2**20:.1f} MiB"
    assert peak < n * image


def test_auto_takes_torchcodec_else_nvimgcodec() -> None:
    if not gpu_decoders():
        pytest.skip("no GPU JPEG decoder imports here")
    dec = make_decoder("auto", torch.device("cuda"))
    assert dec.device == torch.device("cuda", torch.cuda.current_device())
    want = TorchCodecDecoder if importable("torchcodec.decoders") else NvImageCodecDecoder
    assert isinstance(dec, want), dec.name
    outs = dec.decode([as_tensor(d) for d in sample_jpegs().values()])
    assert all(isinstance(o, torch.Tensor) for o in outs)


class OnDevice(CpuDecoder):
    """simplejpeg's pixels uploaded to the GPU: the batched resample on CUDA against the same on the CPU."""

    def one(self, data: torch.Tensor) -> torch.Tensor:
        return super().one(data).cuda()


@pytest.mark.parametrize("ops", [[RandomResizedCrop(224), RandomHorizontalFlip()],
                                 [Resize(30), CenterCrop(48), RandomHorizontalFlip(p=1.0)]])
def test_batched_resample_on_cuda_matches_the_cpu(ops: list) -> None:
    sizes = SIZES if len(ops) == 2 else [(41, 51), (40, 33), (64, 20)]
    jobs, _ = jobs_for(Pipeline(ops), make_jpegs(seed=21, sizes=sizes), sizes, seed=2)
    h = 224 if len(ops) == 2 else 48
    cpu = torch.zeros((len(jobs), 3, h, h), dtype=torch.uint8)
    assert GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, cpu) == []
    gpu = torch.zeros((len(jobs), h, h, 3), dtype=torch.uint8, device="cuda").permute(0, 3, 1, 2)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert GpuBatchDecoder(OnDevice(), "cuda").run(jobs, gpu) == []
    side.synchronize()
    diff = (gpu.cpu().int() - cpu.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01


def test_decoded_images_outlive_a_slow_consumer(decoder) -> None:
    """Decoded images freed on the host while a long step still queues reads of them: their memory is
    not overwritten by the next decode (TorchCodec: outputs recorded on the caller's stream; for
    nvImageCodec's hardware engines, which ignore stream order, see the next test). Two
    different images of one size take turns, so a block handed to the next decode too early shows
    up as the other image's sum (the same image twice would rewrite the same bytes)."""
    if getattr(decoder, "writes_at_call", False):
        pytest.skip(f"{decoder.name} writes when called: GpuBatchDecoder orders its chunks (next test)")
    rng = np.random.default_rng(2)
    jpegs = [as_tensor(jpeg_bytes(smooth_rgb(rng, 256, 256))) for _ in range(2)]
    want = [decoder.decode([jpeg])[0].long().sum().item() for jpeg in jpegs]
    assert want[0] != want[1]
    gpu_sleep(0.1)
    sums = []
    for i in range(20):
        jpeg = jpegs[i % 2]
        img = decoder.decode([jpeg, jpeg])
        gpu_sleep(10)  # the reads below wait behind this on the caller's stream
        sums.append(img[0].long().sum())
        del img
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == [want[i % 2] for i in range(20)]


def test_a_chunk_is_not_overwritten_by_the_next_while_the_stream_is_busy(decoder) -> None:
    """One image per chunk, decoded while a long step keeps the stream busy: each chunk's resample (its
    images' last read) runs late, and a decoder that writes when called (the hardware JPEG engines)
    could be handed the previous chunk's freed memory before that read. GpuBatchDecoder waits for an
    event after those reads; the rows must equal an idle run's with the same chunks.

    `want` is decoded the way `got` is (eight calls of one image): one call of eight is not the same
    computation, as nvImageCodec spreads a batch over its backends (hardware engines, CUDA, hybrid), whose
    pixels may differ by a level; that comparison is the looser one at the end."""
    sizes = [(256, 256)] * 8
    jobs, _ = jobs_for(Pipeline([CenterCrop(224)]), make_jpegs(seed=8, sizes=sizes), sizes)
    one_image = 3 * 256 * 256
    want = torch.zeros((8, 3, 224, 224), dtype=torch.uint8, device="cuda")
    assert GpuBatchDecoder(decoder, "cuda", budget_bytes=one_image).run(jobs, want) == []
    torch.cuda.synchronize()
    got = torch.zeros_like(want)
    gpu = GpuBatchDecoder(decoder, "cuda", budget_bytes=one_image)
    assert len(list(gpu.chunks(jobs))) == 8
    gpu_sleep(0.1)
    gpu_sleep(50)
    assert gpu.run(jobs, got) == []
    torch.cuda.synchronize()
    overwritten = [row for row in range(8) if not torch.equal(got[row], want[row])]
    assert overwritten == [], f"rows {overwritten} differ from an idle run of the same chunks"
    together = torch.zeros_like(want)
    assert GpuBatchDecoder(decoder, "cuda").run(jobs, together) == []   # one call of eight
    torch.cuda.synchronize()
    mae = float((together.float() - want.float()).abs().mean())
    assert mae < 2.5, f"one call of eight against eight of one: mean abs difference {mae:.2f}"  # as vs libjpeg-turbo
