"""Transforms: torchvision's sampling and geometry, planned in source coordinates."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from PIL import Image

from stoker.errors import ConfigError, UserTransformError
from stoker.order import sample_keys, uniforms
from stoker.transforms import (CenterCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop, Resize,
                               crop_resize_into, decode_minimums)


def tv_rrc_params(rng: random.Random, height: int, width: int, scale: tuple[float, float],
                  ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params, line by line, on Python's RNG."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = rng.randint(0, height - h)
            j = rng.randint(0, width - w)
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def stoker_rrc_params(n: int, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
                      seed: int = 0) -> np.ndarray:
    op = RandomResizedCrop(7, scale=scale, ratio=ratio)
    pipe = Pipeline([op])
    u = uniforms(sample_keys(seed, 0, np.arange(n)), pipe.draws)
    plan = pipe.plan(np.full(n, height), np.full(n, width), u)
    return np.rint(plan.box).astype(np.int64)  # top, left, h, w (integers at source scale)


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    values = np.union1d(a, b)
    fa = np.searchsorted(np.sort(a), values, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), values, side="right") / len(b)
    return float(np.abs(fa - fb).max())


CASES = [
    (375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),  # ImageNet-like
    (64, 64, (0.08, 1.0), (3 / 4, 4 / 3)),  # small: rounding matters
    (100, 400, (0.2, 1.0), (3 / 4, 4 / 3)),  # wide: about half the samples take the fallback
    (30, 30, (0.9, 1.0), (0.5, 2.0)),  # tiny with a wide ratio range
]


@pytest.mark.parametrize("height,width,scale,ratio", CASES)
def test_random_resized_crop_matches_torchvision_distribution(height: int, width: int, scale: tuple,
                                                             ratio: tuple) -> None:
    n = 20_000
    rng = random.Random(1234)
    ref = np.array([tv_rrc_params(rng, height, width, scale, ratio) for _ in range(n)])
    ours = stoker_rrc_params(n, height, width, scale, ratio)
    # Critical two-sample KS distance at alpha = 1e-3 is 1.95 * sqrt(2 / n) ~ 0.0195.
    for k, name in enumerate(["top", "left", "height", "width"]):
        d = ks_statistic(ref[:, k], ours[:, k])
        assert d < 0.0195, f"{name}: KS distance {d:.4f}"
    assert ((ours[:, 0] >= 0) & (ours[:, 0] + ours[:, 2] <= height)).all()
    assert ((ours[:, 1] >= 0) & (ours[:, 1] + ours[:, 3] <= width)).all()
    # How often the central fallback is taken matches too (a proportion test, ~5 sigma).
    fb = tv_rrc_params(random.Random(0), height, width, (9.0, 9.5), ratio)  # always falls back
    p_ref, p_ours = (ref == fb).all(1).mean(), (ours == fb).all(1).mean()
    sigma = math.sqrt(max(p_ref * (1 - p_ref), 1e-4) * 2 / n)
    assert abs(p_ref - p_ours) < 5 * sigma + 1e-3


@pytest.mark.parametrize("height,width,expected", [
    (100, 400, (0, 133, 100, 133)),  # too wide: full height, widest allowed ratio, centred
    (400, 100, (133, 0, 133, 100)),  # too tall: full width
    (100, 120, (0, 0, 100, 120)),  # ratio inside the range: the whole image
])
def test_random_resized_crop_fallback_is_torchvision_central_crop(height: int, width: int, expected: tuple) -> None:
    # A scale above 1 can never fit, so every sample takes the fallback after 10 tries.
    assert tv_rrc_params(random.Random(0), height, width, (1.5, 2.0), (3 / 4, 4 / 3)) == expected
    ours = stoker_rrc_params(50, height, width, (1.5, 2.0), (3 / 4, 4 / 3))
    assert (ours == np.array(expected)).all()


def test_resize_and_center_crop_geometry() -> None:
    pipe = Pipeline([Resize(256), CenterCrop(224)])
    plan = pipe.plan(np.array([300, 400, 256]), np.array([400, 300, 256]), np.zeros((3, 1)))
    assert (plan.size == 224).all()
    # 300x400 -> 256x341 (torchvision truncates the long side); crop at top 16, left round(58.5) = 58.
    s = 300 / 256
    assert np.allclose(plan.box[0], [16 * s, 58 * (400 / 341), 224 * s, 224 * (400 / 341)])
    assert np.allclose(plan.box[1], [58 * (400 / 341), 16 * s, 224 * (400 / 341), 224 * s])
    assert np.allclose(plan.box[2], [16, 16, 224, 224])
    assert Pipeline([Resize(256)]).output_size(300, 400) == (256, 341)
    assert Pipeline([Resize(256)]).output_size(400, 300) == (341, 256)
    assert Pipeline([Resize((10, 20))]).fixed_size == (10, 20)
    assert Pipeline([Resize(256), CenterCrop(224)]).fixed_size == (224, 224)
    assert Pipeline([Resize(256)]).fixed_size is None


def smooth(h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, h)[:, None, None]
    x = np.linspace(0, 1, w)[None, :, None]
    img = 60 + 120 * np.sin(3 * x + rng.uniform(0, 3, 3)) * np.cos(2 * y) + 60 * x * y
    return np.clip(img, 0, 255).astype(np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 99.0 if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def test_val_pipeline_matches_pil_resize_then_crop() -> None:
    img = smooth(300, 400)
    ours = Pipeline([Resize(256), CenterCrop(224)]).apply(img)
    ref = np.asarray(Image.fromarray(img).resize((341, 256), Image.BILINEAR))[16:240, 58:282]
    assert ours.shape == (224, 224, 3)
    assert psnr(ours, ref) > 35


def test_center_crop_pads_with_zeros_like_torchvision() -> None:
    img = smooth(20, 30)
    out = Pipeline([CenterCrop(40)]).apply(img)
    assert out.shape == (40, 40, 3)
    assert np.array_equal(out[10:30, 5:35], img)
    assert out[:10].max() == 0 and out[30:].max() == 0 and out[:, :5].max() == 0 and out[:, 35:].max() == 0


def test_flip_mirrors_exactly() -> None:
    img = smooth(90, 120)
    u = uniforms(sample_keys(0, 0, np.array([5])), 23)[0]
    base = Pipeline([RandomResizedCrop(48), RandomHorizontalFlip(p=0.0)]).apply(img, u)
    flipped = Pipeline([RandomResizedCrop(48), RandomHorizontalFlip(p=1.0)]).apply(img, u)
    assert np.array_equal(flipped, base[:, ::-1])
    flips = Pipeline([RandomHorizontalFlip()]).plan(np.full(4000, 10), np.full(4000, 10),
                                                    uniforms(sample_keys(1, 0, np.arange(4000)), 1)).flip
    assert 0.47 < flips.mean() < 0.53


def identity(img: np.ndarray) -> np.ndarray:
    return img


@pytest.mark.parametrize("ops", [
    [RandomHorizontalFlip(p=1.0), RandomResizedCrop(40)],
    [Resize(64), RandomHorizontalFlip(p=1.0), CenterCrop(48)],
    [RandomResizedCrop(80, scale=(0.5, 1.0)), RandomHorizontalFlip(p=1.0), CenterCrop((50, 60))],
])
def test_planned_composition_matches_step_by_step(ops: list) -> None:
    # A leading callable forces the step-by-step array path; the planned path resizes once.
    img = smooth(120, 160, seed=3)
    planned = Pipeline(ops)
    stepwise = Pipeline([identity, *ops])
    assert not planned.tail and len(stepwise.tail) == len(ops) + 1
    for k in range(5):
        u = uniforms(sample_keys(2, 0, np.array([k])), planned.draws)[0]
        a, b = planned.apply(img, u), stepwise.apply(img, u)
        assert a.shape == b.shape
        assert psnr(a, b) > 30, f"sample {k}: {psnr(a, b):.1f} dB"


def test_user_callables_get_a_per_sample_rng() -> None:
    def noise(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        img += rng.integers(0, 2, size=img.shape, dtype=np.uint8)
        return img

    pipe = Pipeline([CenterCrop(8), noise])
    img = np.zeros((10, 10, 3), np.uint8)
    a, b, c = pipe.apply(img, key=1), pipe.apply(img, key=1), pipe.apply(img, key=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_user_callable_must_return_an_image() -> None:
    with pytest.raises(UserTransformError, match=r"returned a float32 array of shape \(4, 4, 3\); expected a uint8"):
        Pipeline([lambda img: img.astype(np.float32)]).apply(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ConfigError, match="transform #0"):
        Pipeline([42])


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ConfigError, match="RandomResizedCrop"):
        RandomResizedCrop(10, scale=(1.0, 0.5))
    with pytest.raises(ConfigError, match="p must be"):
        RandomHorizontalFlip(p=2)
    with pytest.raises(ConfigError, match="CenterCrop"):
        CenterCrop((1, 2, 3))


def test_decode_minimums_keep_output_resolution() -> None:
    # A 1000x1000 crop of a 2000x3000 image into 224x224: the crop needs >= 224x224 of the decoded image,
    # twice that for the antialiasing filter (AA_HEADROOM), so the image >= 896x1344.
    assert decode_minimums(np.array([0, 0, 1000, 1000.0]), 224, 224, 2000, 3000) == (896, 1344)
    assert decode_minimums(np.array([0, 0, 1000, 1000.0]), 224, 224, 2000, 3000, headroom=1.0) == (448, 672)
    # Enlarging never asks for more than the image has.
    assert decode_minimums(np.array([0, 0, 50, 50.0]), 224, 224, 100, 100) == (100, 100)


def test_crop_resize_into_writes_in_place_and_maps_scaled_sources() -> None:
    img = smooth(200, 200)
    half = np.ascontiguousarray(Image.fromarray(img).reduce(2))
    dst_full = np.zeros((50, 50, 3), np.uint8)
    dst_half = np.zeros((50, 50, 3), np.uint8)
    box = np.array([20.0, 40.0, 100.0, 100.0])
    crop_resize_into(img, box, dst_full, False, 200, 200)
    crop_resize_into(half, box, dst_half, False, 200, 200)  # the same box on a half-size decode
    assert psnr(dst_full, dst_half) > 35
