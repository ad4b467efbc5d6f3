"""The C bilinear resize (csrc/resample.c, `native.resample`) against libtorch's uint8 kernels, which
torchvision's `resize` calls on a uint8 tensor: every pixel equal, for thousands of (input, output)
size pairs — shrinks down to one pixel, upscales, sizes that do not change, odd strides on both
sides — with and without antialiasing, through the AVX2, SSSE3/SSE2 and portable loops (a CPU
without AVX2 runs the SSSE3 ones under the "avx2" id too)."""

from __future__ import annotations

import numpy as np
import pytest

from stoker import native
from stoker.transforms import geometry

torch = pytest.importorskip("torch")
needs_native = pytest.mark.skipif(not native.ON, reason="the stoker._jpeg extension is not built (or STOKER_NATIVE=off)")


def torch_resize(src: np.ndarray, size: tuple[int, int], antialias: bool) -> np.ndarray:
    """torchvision's uint8 resize: F.interpolate on the channels-last image (libtorch's kernel)."""
    x = torch.from_numpy(np.ascontiguousarray(src).transpose(2, 0, 1)[None])
    out = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=antialias)
    return out[0].permute(1, 2, 0).numpy()


def size_pairs(rng: np.random.Generator, n: int) -> list[tuple[int, int, int, int]]:
    """(in_h, in_w, out_h, out_w): ordinary shrinks and growths, plus the corners."""
    pairs = [tuple(int(v) for v in rng.integers(1, 160, 4)) for _ in range(n)]
    pairs += [(1, 1, 7, 9), (7, 9, 1, 1), (1, 300, 1, 1), (300, 1, 1, 1), (2, 2, 1, 1), (1, 1, 1, 1),
              (500, 3, 2, 3), (3, 700, 3, 2), (37, 41, 37, 5), (37, 41, 6, 41), (5, 5, 311, 297),
              (224, 224, 223, 225), (999, 2, 1, 2), (64, 64, 63, 1)]
    pairs += [(int(rng.integers(200, 900)), int(rng.integers(200, 900)), 224, 224) for _ in range(20)]
    return pairs


@needs_native
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("simd", [2, 1, 0], ids=["avx2", "ssse3", "portable"])
def test_every_pixel_equals_torch(antialias: bool, simd: int):
    rng = np.random.default_rng(7 + antialias + 2 * simd)
    bad = []
    for sh, sw, dh, dw in size_pairs(rng, 1200 if simd == 2 else 400):
        src = rng.integers(0, 256, (sh, sw, 3), dtype=np.uint8)
        out = np.empty((dh, dw, 3), np.uint8)
        native._mod.resample(src, out, antialias=antialias, simd=simd)
        if not np.array_equal(out, torch_resize(src, (dh, dw), antialias)):
            bad.append((sh, sw, dh, dw))
    assert not bad, f"{len(bad)} size pairs differ from torch, e.g. {bad[:5]}"


@needs_native
def test_strided_rows_in_and_out():
    """A window of a wider image into a window of a wider row (the region cut from a decode, the
    part of a batch row a padded crop fills): the same pixels as on packed copies."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        big = rng.integers(0, 256, (int(rng.integers(20, 120)), int(rng.integers(20, 120)), 3), dtype=np.uint8)
        y0, x0 = int(rng.integers(0, 10)), int(rng.integers(0, 10))
        src = big[y0:y0 + int(rng.integers(1, big.shape[0] - y0)), x0:x0 + int(rng.integers(1, big.shape[1] - x0))]
        canvas = np.zeros((90, 130, 3), np.uint8)
        dh, dw = int(rng.integers(1, 80)), int(rng.integers(1, 120))
        dst = canvas[5:5 + dh, 7:7 + dw]
        assert geometry.native.resample(src, dst, True)
        assert np.array_equal(dst, torch_resize(src, (dh, dw), True))
        assert not canvas[:5].any() and not canvas[:, :7].any()  # nothing written outside the window


@needs_native
def test_geometry_resample_serves_bilinear_natively_and_falls_back(monkeypatch):
    """`geometry.resample` takes the C kernel for bilinear and gives torch's pixels either way."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (93, 71, 3), dtype=np.uint8)
    on, off = np.empty((40, 33, 3), np.uint8), np.empty((40, 33, 3), np.uint8)
    calls = []
    real = native._mod.resample
    monkeypatch.setattr(native, "_mod", type("M", (), {"resample": staticmethod(
        lambda *a, **k: (calls.append(1), real(*a, **k)))}))
    geometry.resample(src, on)
    assert calls, "the native kernel was not used for bilinear"
    monkeypatch.setattr(native, "ON", False)
    geometry.resample(src, off)
    assert len(calls) == 1 and np.array_equal(on, off)


@needs_native
def test_bad_arrays_are_refused_with_a_message():
    with pytest.raises(ValueError, match=r"\[height, width, 3\]"):
        native._mod.resample(np.zeros((4, 4, 4), np.uint8), np.zeros((2, 2, 3), np.uint8))
    with pytest.raises(ValueError, match="dst"):
        native._mod.resample(np.zeros((4, 4, 3), np.uint8), np.zeros((0, 2, 3), np.uint8))
    assert not native.resample(np.zeros((4, 4, 3), np.float32), np.zeros((2, 2, 3), np.uint8), True)
