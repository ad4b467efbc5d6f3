"""GPU JPEG decode on a real GPU: the torchvision and nvImageCodec backends, and GpuBatchDecoder on
CUDA against the CPU crop path (skipped without a GPU; each backend skipped when not installed)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import simplejpeg
import torch

from conftest import jpeg_bytes, smooth_rgb
from stoker.errors import CorruptImageError
from stoker.gpu_decode import GpuBatchDecoder, make_decoder
from stoker.transforms import Pipeline, RandomHorizontalFlip, RandomResizedCrop
from test_gpu_decode import SIZES, jobs_for, make_jpegs, psnr, textured

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # the parent package ("nvidia") is missing
        return False


BACKENDS = [
    pytest.param("torchvision", marks=pytest.mark.skipif(not _installed("torchvision"),
                                                         reason="torchvision is not installed")),
    pytest.param("nvimgcodec", marks=pytest.mark.skipif(not _installed("nvidia.nvimgcodec"),
                                                        reason="nvImageCodec is not installed")),
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


def test_auto_picks_a_working_backend() -> None:
    if not (_installed("torchvision") or _installed("nvidia.nvimgcodec")):
        pytest.skip("no GPU JPEG decoder installed")
    dec = make_decoder("auto", torch.device("cuda"))
    assert dec.device == torch.device("cuda", torch.cuda.current_device())
    assert ("torchvision" in dec.name) == _installed("torchvision")
