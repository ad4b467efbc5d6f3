"""Per-sample colour and region ops on uint8 HWC arrays, on the worker threads: ColorJitter,
GaussianBlur, RandomGrayscale and RandomErasing, with torchvision's parameter names, defaults and
distributions.

Each op draws its parameters from the numpy Generator it is called with (`rng=`: the Loader passes
one seeded from the sample's key, so results never depend on thread count) in `params(rng, h, w)`
and applies them in `apply(img, params)` with the kernels of `pixels.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np

from .._tensors import IMAGENET_MEAN, IMAGENET_STD
from ..errors import ConfigError
from .kinds import SAMPLE
from .pixels import (INTERPOLATIONS, adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation,
                     gaussian_blur, grayscale)


def _default_rng(rng: np.random.Generator | None) -> np.random.Generator:
    return np.random.default_rng() if rng is None else rng


def _check_interpolation(name: str, interpolation: str) -> None:
    if interpolation not in INTERPOLATIONS:
        raise ConfigError(f"{name}: interpolation must be one of {sorted(INTERPOLATIONS)}, got {interpolation!r}")


class _RandomOp:
    """Shared protocol: `params(rng, height, width)` draws, `apply(img, params)` applies, and calling
    the op does both (the Loader calls it with `rng=` seeded from the sample's key). A per-sample op
    (`kinds.py`); each says whether it moves pixels."""

    stage = SAMPLE
    moves_pixels = True

    def params(self, rng: np.random.Generator, height: int, width: int) -> Any:
        raise NotImplementedError

    def apply(self, img: np.ndarray, params: Any) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        return self.apply(img, self.params(_default_rng(rng), img.shape[0], img.shape[1]))


def _jitter_range(name: str, value: Any, center: float = 1.0, bound: tuple[float, float] = (0.0, math.inf),
                  clip_first: bool = True) -> tuple[float, float] | None:
    """torchvision ColorJitter._check_input: a number v gives [center - v, center + v] (clipped at 0),
    a pair is taken as (min, max); a range equal to (center, center) disables the op (None)."""
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"ColorJitter: {name} must be non-negative, got {value}")
        lo, hi = center - float(value), center + float(value)
        if clip_first:
            lo = max(lo, 0.0)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        lo, hi = float(value[0]), float(value[1])
    else:
        raise ConfigError(f"ColorJitter: {name} must be a number or a (min, max) pair, got {value!r}")
    if not bound[0] <= lo <= hi <= bound[1]:
        raise ConfigError(f"ColorJitter: {name} values must lie in [{bound[0]}, {bound[1]}] with min <= max, "
                          f"got ({lo}, {hi})")
    return None if lo == hi == center else (lo, hi)


@dataclass(frozen=True)
class ColorJitter(_RandomOp):
    """torchvision.transforms.ColorJitter: brightness, contrast and saturation factors uniform in
    [max(0, 1 - v), 1 + v] (or a given (min, max)), hue uniform in [-hue, hue] (hue <= 0.5), applied
    in a random order (a uniform permutation of the four); 0 disables a component."""

    moves_pixels = False  # pixel values only: boxes and masks stay valid

    brightness: Any = 0
    contrast: Any = 0
    saturation: Any = 0
    hue: Any = 0
    ranges: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", (
            _jitter_range("brightness", self.brightness), _jitter_range("contrast", self.contrast),
            _jitter_range("saturation", self.saturation),
            _jitter_range("hue", self.hue, center=0.0, bound=(-0.5, 0.5), clip_first=False)))

    def params(self, rng: np.random.Generator, height: int, width: int) -> tuple:
        order = rng.permutation(4)
        factors = tuple(None if r is None else float(rng.uniform(r[0], r[1])) for r in self.ranges)
        return order, factors

    def apply(self, img: np.ndarray, params: tuple) -> np.ndarray:
        order, factors = params
        fns = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
        for k in order:
            if factors[k] is not None:
                img = fns[k](img, factors[k])
        return img


def _erase_value(value: Any) -> Any:
    if isinstance(value, str):
        if value != "random":
            raise ConfigError(f"RandomErasing: value must be a number, a 3-tuple or 'random', got {value!r}")
        return value
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    vals = tuple(float(v) for v in value)
    if len(vals) not in (1, 3):
        raise ConfigError(f"RandomErasing: value needs 1 or 3 numbers (one per channel), got {value!r}")
    return vals * 3 if len(vals) == 1 else vals


def erasing_params(rng: np.random.Generator, height: int, width: int, scale: tuple[float, float],
                   ratio: tuple[float, float]) -> tuple[int, int, int, int] | None:
    """torchvision RandomErasing.get_params: 10 tries of an area fraction uniform in `scale` and a
    log-uniform aspect ratio in `ratio`; (top, left, h, w) or None when no try fits."""
    area = height * width
    lr = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(lr[0], lr[1]))
        h = int(round(math.sqrt(erase_area * aspect)))
        w = int(round(math.sqrt(erase_area / aspect)))
        if not (h < height and w < width):
            continue
        return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    return None


@dataclass(frozen=True)
class SampleRandomErasing(_RandomOp):
    """torchvision.transforms.RandomErasing on uint8: with probability `p`, a rectangle of area fraction
    uniform in `scale` and log-uniform aspect ratio in `ratio` (10 tries) is set to `value`.

    `value` is in uint8 units here (torchvision erases after Normalize, where 0 is the mean colour:
    pass `value=(124, 116, 104)` for ImageNet's mean, or use the batched version after normalisation,
    `transforms.batch_ops.RandomErasing`). `"random"` fills with per-pixel normal noise of the `mean`/`std`
    (0..1 units) the batch is later normalised with, i.e. torchvision's N(0, 1) after Normalize."""

    moves_pixels = False  # pixel values only: boxes and masks stay valid

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: Any = 0
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ConfigError(f"RandomErasing: p must be in [0, 1], got {self.p}")
        if self.scale[0] > self.scale[1] or self.ratio[0] > self.ratio[1] or self.ratio[0] <= 0:
            raise ConfigError(f"RandomErasing: scale and ratio must be (min, max) with min <= max and ratio > 0, "
                              f"got scale={self.scale}, ratio={self.ratio}")
        object.__setattr__(self, "value", _erase_value(self.value))

    def params(self, rng: np.random.Generator, height: int, width: int) -> Any:
        if not rng.random() < self.p:
            return None
        box = erasing_params(rng, height, width, self.scale, self.ratio)
        if box is None or self.value != "random":
            return box
        noise = rng.standard_normal((box[2], box[3], 3), dtype=np.float32)
        return box, noise

    def apply(self, img: np.ndarray, params: Any) -> np.ndarray:
        if params is None:
            return img
        if self.value == "random":
            (i, j, h, w), noise = params
            vals = (np.asarray(self.mean, np.float32) + np.asarray(self.std, np.float32) * noise) * 255.0
            img[i:i + h, j:j + w] = np.clip(np.rint(vals), 0, 255).astype(np.uint8)
            return img
        i, j, h, w = params
        img[i:i + h, j:j + w] = np.clip(np.rint(self.value), 0, 255).astype(np.uint8)
        return img


@dataclass(frozen=True)
class GaussianBlur(_RandomOp):
    """torchvision.transforms.GaussianBlur: `kernel_size` (int or (kx, ky), odd), sigma uniform in
    (min, max) (a number gives that sigma), the same sigma on both axes, reflect padding."""

    moves_pixels = False  # pixel values only: boxes and masks stay valid

    kernel_size: Any
    sigma: Any = (0.1, 2.0)

    def __post_init__(self) -> None:
        ks = (self.kernel_size,) * 2 if isinstance(self.kernel_size, int) else tuple(self.kernel_size)
        if len(ks) != 2 or any(k <= 0 or k % 2 == 0 for k in ks):
            raise ConfigError(f"GaussianBlur: kernel_size must be odd and positive, got {self.kernel_size!r}")
        sig = (float(self.sigma),) * 2 if isinstance(self.sigma, (int, float)) else tuple(map(float, self.sigma))
        if len(sig) != 2 or not 0 < sig[0] <= sig[1]:
            raise ConfigError(f"GaussianBlur: sigma must be positive, a number or (min, max), got {self.sigma!r}")
        object.__setattr__(self, "kernel_size", (int(ks[0]), int(ks[1])))
        object.__setattr__(self, "sigma", sig)

    def params(self, rng: np.random.Generator, height: int, width: int) -> float:
        return float(rng.uniform(self.sigma[0], self.sigma[1]))

    def apply(self, img: np.ndarray, params: float) -> np.ndarray:
        return gaussian_blur(img, self.kernel_size, (params, params))


@dataclass(frozen=True)
class RandomGrayscale(_RandomOp):
    """torchvision.transforms.RandomGrayscale: with probability `p`, the luma copied to all 3 channels."""

    moves_pixels = False  # pixel values only: boxes and masks stay valid

    p: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ConfigError(f"RandomGrayscale: p must be in [0, 1], got {self.p}")

    def params(self, rng: np.random.Generator, height: int, width: int) -> bool:
        return bool(rng.random() < self.p)

    def apply(self, img: np.ndarray, params: bool) -> np.ndarray:
        return cv2.cvtColor(grayscale(img), cv2.COLOR_GRAY2RGB) if params else img
