"""The nvImageCodec backend against the real library, on any machine: nvImageCodec's CPU backend
(libjpeg-turbo) runs the same Python API the GPU path calls (decoder, decode parameters, code-stream
regions, None for a failed image), so its wrapper, region decode and the whole decode="gpu" path are
checked here before any GPU runs them. tests/cuda/test_gpu_decode_cuda.py runs it on a GPU.

`make test` installs nvImageCodec (the `test-gpu-decode` extra); where it does not import, these skip.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import jpeg_bytes, smooth_rgb
from stoker import DeviceOptions, Loader
from stoker.errors import ConfigError, CorruptImageError
from stoker.gpu_decode import (NVIMGCODEC_GPU_REGIONS_BEFORE, REGION_MARGIN, GpuBatchDecoder, MeasuredDecoder,
                               NvImageCodecDecoder, NvImageCodecHardwareDecoder, nvimgcodec_regions)
from stoker.transforms import CenterCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop
from test_gpu_decode import SIZES, CpuDecoder, jobs_for, make_jpegs, psnr, rows, textured
from test_loader import build_packed

try:
    from nvidia import nvimgcodec as nv
except Exception as exc:  # missing, or a build whose libraries do not load here
    pytest.skip(f"nvImageCodec does not import here ({type(exc).__name__}: {exc}); pip install -e '.[test-gpu-decode]'",
                allow_module_level=True)

TRAIN = [RandomResizedCrop(64), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def decoder() -> NvImageCodecDecoder:
    return NvImageCodecDecoder("cpu")


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def kinds_of_jpeg() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {
        "rgb-420": jpeg_bytes(textured(rng, 181, 243)),
        "rgb-444": jpeg_bytes(textured(rng, 97, 131), subsampling=0),
        "rgb-422": jpeg_bytes(textured(rng, 120, 90), subsampling=1),
        "odd-size": jpeg_bytes(smooth_rgb(rng, 33, 71)),
        "gray": jpeg_bytes(textured(rng, 81, 65)[..., 1]),
        "progressive": jpeg_bytes(textured(rng, 150, 100), progressive=True),
    }


def libjpeg_turbo(data: bytes) -> torch.Tensor:
    return torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1)


def test_the_wrapper_builds_on_the_installed_release(decoder: NvImageCodecDecoder) -> None:
    # the names the wrapper uses exist in this release (ColorSpec.SRGB, not RGB, since 0.7; Backend kinds)
    assert decoder.name.startswith(f"nvImageCodec {nv.__version__} CPU (libjpeg-turbo)")
    assert decoder.regions and decoder.name.endswith("region decode")
    with pytest.raises(ConfigError, match="hardware JPEG engines are on the GPU"):
        NvImageCodecHardwareDecoder("cpu")


def test_decodes_every_kind_of_jpeg_like_libjpeg_turbo(decoder: NvImageCodecDecoder) -> None:
    jpegs = kinds_of_jpeg()
    outs = decoder.decode([as_tensor(d) for d in jpegs.values()])
    for (name, data), out in zip(jpegs.items(), outs):
        assert isinstance(out, torch.Tensor), f"{name}: {out!r}"
        assert out.dtype == torch.uint8 and out.device.type == "cpu"
        assert torch.equal(out, libjpeg_turbo(data)), name  # 3 channels for gray too, pixel for pixel


def test_a_bad_sample_fails_alone(decoder: NvImageCodecDecoder) -> None:
    good = list(kinds_of_jpeg().values())[:3]
    datas = [as_tensor(good[0]), as_tensor(b"this is not a JPEG file at all " * 20), as_tensor(good[1]),
             as_tensor(b""), as_tensor(good[2][: len(good[2]) // 3]), as_tensor(good[2])]
    outs = decoder.decode(datas)
    assert [isinstance(o, Exception) for o in outs][:4] == [False, True, False, True]
    assert isinstance(outs[5], torch.Tensor) and torch.equal(outs[5], libjpeg_turbo(good[2]))
    assert torch.equal(outs[0], libjpeg_turbo(good[0])) and torch.equal(outs[2], libjpeg_turbo(good[1]))


JPEGS = kinds_of_jpeg()
REGION_DECODER = NvImageCodecDecoder("cpu")


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(sorted(JPEGS)), corners=st.tuples(*[st.floats(0, 1)] * 4),
       thin=st.tuples(st.booleans(), st.booleans()))
def test_inside_its_margin_a_region_decode_is_the_whole_decode(kind: str, corners: tuple[float, ...],
                                                               thin: tuple[bool, bool]) -> None:
    whole = libjpeg_turbo(JPEGS[kind])
    h, w = whole.shape[1:]
    top, left = min(int(corners[0] * h), h - 1), min(int(corners[1] * w), w - 1)
    bottom = top + 1 + (int(corners[2] * 3) if thin[0] else int(corners[2] * (h - top - 1)))  # 1-3 px or any
    right = left + 1 + (int(corners[3] * 3) if thin[1] else int(corners[3] * (w - left - 1)))
    bottom, right = min(bottom, h), min(right, w)
    m = REGION_MARGIN
    region = (max(0, top - m), max(0, left - m), min(h, bottom + m), min(w, right + m))
    out = REGION_DECODER.decode([as_tensor(JPEGS[kind])], regions=[region])[0]
    assert isinstance(out, torch.Tensor), out
    assert tuple(out.shape) == (3, region[2] - region[0], region[3] - region[1])
    inner = out[:, top - region[0]:bottom - region[0], left - region[1]:right - region[1]]
    assert torch.equal(inner, whole[:, top:bottom, left:right])


def test_regions_only_where_the_release_decodes_them_soundly() -> None:
    def module(version: str, regions: bool = True) -> types.SimpleNamespace:
        code_stream = type("CodeStream", (), {"get_sub_code_stream": lambda self: None} if regions else {})
        return types.SimpleNamespace(__version__=version, Region=object, CodeStream=code_stream)

    before = ".".join(map(str, NVIMGCODEC_GPU_REGIONS_BEFORE))
    assert NVIMGCODEC_GPU_REGIONS_BEFORE <= (0, 9)  # 0.9.0 crashes on H100 (NVIDIA/nvImageCodec#55)
    assert nvimgcodec_regions(module("0.8.1"), "cuda")
    assert not nvimgcodec_regions(module(before + ".0"), "cuda")
    assert not nvimgcodec_regions(module("0.9.0.20"), "cuda")
    assert nvimgcodec_regions(module("0.9.0"), "cpu")  # the CPU backend's regions are sound (tested above)
    assert not nvimgcodec_regions(module("0.8.1"), "cuda", hardware=True)  # the engines decode whole images
    assert not nvimgcodec_regions(module("0.5.0", regions=False), "cpu")


def test_batch_decoder_decodes_only_the_crops_and_matches_the_cpu_path(decoder: NvImageCodecDecoder) -> None:
    pipe = Pipeline([RandomResizedCrop(96), RandomHorizontalFlip()])
    jpegs = make_jpegs(seed=7)
    jobs, refs = jobs_for(pipe, jpegs, SIZES, seed=4)
    jobs[2].data = as_tensor(b"not a JPEG " * 50)  # a corrupt sample comes back as a failure naming its key
    decoded: list[tuple[int, int]] = []

    class Recording(NvImageCodecDecoder):
        def _tensor(self, image):
            out = super()._tensor(image)
            decoded.append(tuple(out.shape[1:]))
            return out

    out = torch.full((len(jobs), 3, 96, 96), 9, dtype=torch.uint8)
    failures = GpuBatchDecoder(Recording("cpu"), "cpu").run(jobs, out)
    assert [job.row for job, _ in failures] == [2]
    assert isinstance(failures[0][1], CorruptImageError) and failures[0][1].key == jobs[2].key
    assert (rows(out)[2] == 9).all()
    # only each crop's rectangle was decoded (the probe aside): fewer pixels than the whole images
    assert sum(h * w for h, w in decoded) < 0.9 * sum(h * w for i, (h, w) in enumerate(SIZES) if i != 2)
    whole = torch.full_like(out, 9)
    plain = NvImageCodecDecoder("cpu")
    plain.regions = False
    assert len(GpuBatchDecoder(plain, "cpu").run(jobs, whole)) == 1
    assert torch.equal(out, whole)  # region decode changes no pixel
    for i, ref in enumerate(refs):
        if i != 2:
            assert psnr(rows(out)[i], ref) > 40, f"sample {i}: {psnr(rows(out)[i], ref):.1f} dB against the CPU path"


def test_auto_mixes_region_and_whole_image_backends(decoder: NvImageCodecDecoder) -> None:
    # the first batch goes through every candidate; whichever wins, its images (a region or the whole
    # image) land in the right place: the batch decoder tells them apart by size
    jobs, refs = jobs_for(Pipeline([RandomResizedCrop(48), RandomHorizontalFlip()]), make_jpegs(seed=5), SIZES)
    for order in ([NvImageCodecDecoder("cpu"), CpuDecoder()], [CpuDecoder(), NvImageCodecDecoder("cpu")]):
        auto = MeasuredDecoder(order, torch.device("cpu"), synchronize=lambda device: None)
        assert auto.regions
        out = torch.zeros((len(jobs), 3, 48, 48), dtype=torch.uint8)
        gpu = GpuBatchDecoder(auto, "cpu")
        assert gpu.run(jobs, out) == [] and auto.chosen is not None
        again = torch.zeros_like(out)
        assert gpu.run(jobs, again) == []
        assert torch.equal(out, again)
        for i, ref in enumerate(refs):
            assert psnr(rows(out)[i], ref) > 30


def test_the_loader_decodes_with_nvimgcodec(tmp_path: Path) -> None:
    packed = build_packed(tmp_path / "ds", n=40)
    on_cpu = Loader(packed, 8, transforms=TRAIN, seed=3, device=DeviceOptions("cpu", dtype=torch.uint8))
    expected = [x.clone() for x, _ in on_cpu]
    with Loader(packed, 8, transforms=TRAIN, seed=3, num_threads=2,
                device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu",
                                     gpu_decoder=NvImageCodecDecoder("cpu"))) as loader:
        got = [x.clone() for x, _ in loader]
        jpegs = sum(i % 11 != 5 and i % 13 != 6 for i in range(40))  # build_packed: raw and PNG rows aside
        assert loader.stats.gpu_decoded == jpegs and loader.stats.gpu_fallbacks == 0
        assert loader.stats.gpu_decoder.startswith("nvImageCodec") and "region decode" in loader.stats.gpu_decoder
    assert len(got) == len(expected)
    for x, y in zip(got, expected):  # the same crops and flips; only the resampling kernel differs
        for a, b in zip(x.permute(0, 2, 3, 1).numpy(), y.permute(0, 2, 3, 1).numpy()):
            assert psnr(a, b) > 30


def test_the_pillow_gauntlet_never_crashes_the_decoder(decoder: NvImageCodecDecoder, pillow_corpus: Path) -> None:
    files = sorted(p for p in pillow_corpus.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".jfif", ".mpo"))
    assert len(files) > 30
    outs = decoder.decode([as_tensor(p.read_bytes()) for p in files])
    failed = {p.name for p, o in zip(files, outs) if isinstance(o, Exception)}
    for path, out in zip(files, outs):
        if isinstance(out, torch.Tensor):
            assert out.dtype == torch.uint8 and out.dim() == 3 and out.shape[0] == 3, path.name
    assert {"truncated_jpeg.jpg", "junk_jpeg_header.jpg"} <= failed  # broken files fail, each on its own
    assert len(failed) < len(files) // 4


def test_the_decoder_benchmark_counts_what_region_decode_saves(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_decode.py"
    spec = importlib.util.spec_from_file_location("stoker_bench_gpu_decode", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([str(tmp_path / "cache"), "--images", "12", "--batch", "5", "--rounds", "1",
                       "--json", str(tmp_path / "r.json")]) == 0
    rows = {r["decoder"].rsplit(", ", 1)[1]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert set(rows) == {"region decode", "whole images"}
    assert rows["whole images"]["failed"] == rows["region decode"]["failed"] == 0
    # RandomResizedCrop reads part of each image: a region decode hands back fewer pixels
    assert rows["region decode"]["decoded_mpix_per_image"] < rows["whole images"]["decoded_mpix_per_image"]
    assert "| decoder | ms/image |" in capsys.readouterr().out
