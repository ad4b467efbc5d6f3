"""Every GPU JPEG decoder wrapper against its real library, on the CPU: nvImageCodec (its CPU
backend) and TorchCodec each run the same library calls with device="cpu" as on a GPU,
so the wrappers, `GpuBatchDecoder` and a whole decode="gpu" Loader are checked against the real
libraries before any GPU runs them. Each library is skipped where it does not import: `make test`
installs nvImageCodec (`test-gpu-decode`); TorchCodec needs a CUDA build of torch
(its library loads CUDA's), so they run on machines that have one. tests/cuda runs them on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
import torch

from conftest import jpeg_bytes, smooth_rgb
from stoker import DeviceOptions, Loader
from stoker.errors import ConfigError
from stoker.device.gpu_decode import NvImageCodecDecoder, TorchCodecDecoder
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop
from test_gpu_decode import psnr, textured
from test_loader import build_packed

WRAPPERS = {"nvimgcodec": NvImageCodecDecoder, "torchcodec": TorchCodecDecoder}


@pytest.fixture(scope="module", params=sorted(WRAPPERS))
def decoder(request: pytest.FixtureRequest) -> Any:
    try:
        return WRAPPERS[request.param]("cpu")
    except ConfigError as exc:  # the library does not import here: the message names the pip install
        pytest.skip(f"{request.param}: {exc}")


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


def close_to_libjpeg_turbo(out: Any, data: bytes) -> bool:
    """The same size, RGB, and within a level on average (every library here links a libjpeg-turbo,
    built with its own upsampling options)."""
    ref = libjpeg_turbo(data)
    return (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.shape == ref.shape
            and float((out.float() - ref.float()).abs().mean()) < 1.0)


def test_decodes_every_kind_of_jpeg_like_libjpeg_turbo(decoder: Any) -> None:
    jpegs = kinds_of_jpeg()
    outs = decoder.decode([as_tensor(d) for d in jpegs.values()])
    for (name, data), out in zip(jpegs.items(), outs):
        assert close_to_libjpeg_turbo(out, data), f"{decoder.name}, {name}: {out!r}"
        assert out.device.type == "cpu"
        if name == "gray":  # RGB out of a grayscale JPEG: three equal channels
            assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_a_bad_sample_fails_alone(decoder: Any) -> None:
    good = list(kinds_of_jpeg().values())[:3]
    datas = [as_tensor(good[0]), as_tensor(b"this is not a JPEG file at all " * 20), as_tensor(good[1]),
             as_tensor(b""), as_tensor(good[2][: len(good[2]) // 3]), as_tensor(good[2])]
    outs = decoder.decode(datas)
    assert [isinstance(o, Exception) for o in outs][:4] == [False, True, False, True]
    for i, data in ((0, good[0]), (2, good[1]), (5, good[2])):
        assert close_to_libjpeg_turbo(outs[i], data), f"{decoder.name}: sample {i}"


def test_the_loader_decodes_with_each_library(decoder: Any, tmp_path: Path) -> None:
    train = [RandomResizedCrop(64), RandomHorizontalFlip()]
    packed = build_packed(tmp_path / "ds", n=40)
    on_cpu = Loader(packed, 8, transforms=train, seed=3, device=DeviceOptions("cpu", dtype=torch.uint8))
    expected = [x.clone() for x, _ in on_cpu]
    with Loader(packed, 8, transforms=train, seed=3, 
                device=DeviceOptions("cpu", dtype=torch.uint8, decode="gpu", gpu_decoder=decoder), workers=2) as loader:
        got = [x.clone() for x, _ in loader]
        jpegs = sum(i % 11 != 5 and i % 13 != 6 for i in range(40))  # build_packed: raw and PNG rows aside
        assert loader.stats.gpu_decoded == jpegs and loader.stats.gpu_fallbacks == 0
        assert loader.stats.gpu_decoder == decoder.name
    assert len(got) == len(expected)
    for x, y in zip(got, expected):  # the same crops and flips; only the resampling kernel differs
        for a, b in zip(x.permute(0, 2, 3, 1).numpy(), y.permute(0, 2, 3, 1).numpy()):
            assert psnr(a, b) > 30


def test_the_pillow_gauntlet_never_crashes_a_decoder(decoder: Any, pillow_corpus: Path) -> None:
    files = sorted(p for p in pillow_corpus.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".jfif", ".mpo"))
    assert len(files) > 30
    outs = decoder.decode([as_tensor(p.read_bytes()) for p in files])
    failed = {p.name for p, o in zip(files, outs) if isinstance(o, Exception)}
    for path, out in zip(files, outs):
        if isinstance(out, torch.Tensor):
            assert out.dtype == torch.uint8 and out.dim() == 3 and out.shape[0] == 3, path.name
    # a truncated file fails on its own (libraries differ on files libjpeg only warns about, such as
    # junk before a marker: nvImageCodec refuses them, TorchCodec decodes them)
    assert "truncated_jpeg.jpg" in failed
    assert len(failed) < len(files) // 4
