"""Against torchvision itself, where it imports (a GPU host's CUDA build): stoker's per-sample kernels on
uint8 HWC arrays give torchvision's tensor-path pixels for the same fixed parameters, within the
tolerances docs/transforms.md states. Skipped where torchvision cannot be imported (the CPU test
machines, where it raises a RuntimeError rather than an ImportError); tests/test_augment_cpu.py checks
the same kernels against torchvision's formulas written out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoker.transforms import pixels


def _torchvision_functional():
    try:
        from torchvision.transforms import functional
    except Exception as exc:  # ImportError, or the RuntimeError of a torchvision built for another torch
        pytest.skip(f"torchvision does not import here: {type(exc).__name__}: {exc}")
    return functional


@pytest.fixture(scope="module")
def F():
    return _torchvision_functional()


@pytest.fixture(scope="module")
def img() -> np.ndarray:
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, 64 * 48 * 3).reshape(48, 64, 3)
    return np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)


def _tv(F, name: str, img: np.ndarray, *args) -> np.ndarray:
    out = getattr(F, name)(torch.from_numpy(img).permute(2, 0, 1).contiguous(), *args)
    return out.permute(1, 2, 0).numpy()


CASES = [  # (stoker kernel, torchvision function, argument, tolerance in levels)
    ("adjust_brightness", "adjust_brightness", 0.3, 0), ("adjust_brightness", "adjust_brightness", 1.7, 0),
    ("adjust_contrast", "adjust_contrast", 0.5, 1), ("adjust_contrast", "adjust_contrast", 1.6, 1),
    ("adjust_saturation", "adjust_saturation", 0.4, 0), ("adjust_saturation", "adjust_saturation", 1.9, 0),
    ("adjust_hue", "adjust_hue", -0.23, 1), ("adjust_hue", "adjust_hue", 0.37, 1),
    ("adjust_sharpness", "adjust_sharpness", 0.1, 1), ("adjust_sharpness", "adjust_sharpness", 1.9, 1),
    ("posterize", "posterize", 3, 0), ("solarize", "solarize", 128.0, 0),
]


@pytest.mark.parametrize("ours, theirs, arg, tol", CASES)
def test_fixed_parameters_give_torchvisions_pixels(F, img, ours, theirs, arg, tol) -> None:
    diff = np.abs(getattr(pixels, ours)(img, arg).astype(np.int16) - _tv(F, theirs, img, arg).astype(np.int16))
    assert diff.max() <= tol, (ours, arg, int(diff.max()))


@pytest.mark.parametrize("name", ["invert", "autocontrast", "equalize"])
def test_parameterless_ops_give_torchvisions_pixels(F, img, name) -> None:
    diff = np.abs(getattr(pixels, name)(img).astype(np.int16) - _tv(F, name, img).astype(np.int16))
    assert diff.max() <= (1 if name == "autocontrast" else 0), (name, int(diff.max()))


def test_gaussian_blur_and_rotation(F, img) -> None:
    ours = pixels.gaussian_blur(img, (5, 7), (1.3, 1.3))
    theirs = _tv(F, "gaussian_blur", img, [5, 7], [1.3, 1.3])
    assert np.abs(ours.astype(np.int16) - theirs.astype(np.int16)).max() <= 1
    same = pixels.rotate(img, 17.0) == _tv(F, "rotate", img, 17.0)
    assert same.mean() > 0.99   # nearest neighbour: the same source pixel except at exact .5 ties
