"""The AutoAugment family on uint8 HWC arrays, per sample on the worker threads: RandAugment,
TrivialAugmentWide and AutoAugment (ImageNet policy), with torchvision's op lists, magnitude tables,
signs and sampling (torchvision.transforms.autoaugment; docs/transforms.md cites the tables).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._torch import torch
from ..errors import ConfigError
from .colour import _check_interpolation, _RandomOp
from . import pixels
from .pixels import Fill, affine, rotate


#: policy op -> (kernel in pixels.py, and in gpu.py under the same name; how the magnitude becomes its argument)
PIXEL_OPS = {"Brightness": ("adjust_brightness", "factor"), "Color": ("adjust_saturation", "factor"),
             "Contrast": ("adjust_contrast", "factor"), "Sharpness": ("adjust_sharpness", "factor"),
             "Posterize": ("posterize", "bits"), "Solarize": ("solarize", "threshold"),
             "AutoContrast": ("autocontrast", None), "Equalize": ("equalize", None), "Invert": ("invert", None)}


def colour_args(arg: str | None, magnitude: Any) -> tuple:
    """The kernel's arguments for a magnitude (a float, or one per sample as a tensor): enhancements take
    the factor 1 + m, posterize whole bits, solarize the threshold 255 * m, in float64 as torchvision
    computes it (255 * float32(0.93333334) is 238.0000017: a value of 238 stays)."""
    if arg is None:
        return ()
    if arg == "factor":
        return (1.0 + magnitude,)
    if arg == "bits":
        return (magnitude.long() if hasattr(magnitude, "long") else int(magnitude),)
    return (magnitude.double() * 255.0 if hasattr(magnitude, "double") else 255.0 * float(magnitude),)


def apply_op(img: np.ndarray, name: str, magnitude: float, interpolation: str = "nearest",
             fill: Fill = None) -> np.ndarray:
    """One op of the AutoAugment family, by torchvision's name, with its signed magnitude."""
    if name == "Identity":
        return img
    if name == "ShearX":  # shear angle atan(magnitude) about the top-left corner
        return affine(img, shear=(math.degrees(math.atan(magnitude)), 0.0), center=(0.0, 0.0),
                      interpolation=interpolation, fill=fill)
    if name == "ShearY":
        return affine(img, shear=(0.0, math.degrees(math.atan(magnitude))), center=(0.0, 0.0),
                      interpolation=interpolation, fill=fill)
    if name == "TranslateX":
        return affine(img, translate=(int(magnitude), 0), interpolation=interpolation, fill=fill)
    if name == "TranslateY":
        return affine(img, translate=(0, int(magnitude)), interpolation=interpolation, fill=fill)
    if name == "Rotate":
        return rotate(img, magnitude, interpolation=interpolation, fill=fill)
    if name in PIXEL_OPS:
        kernel, arg = PIXEL_OPS[name]
        return getattr(pixels, kernel)(img, *colour_args(arg, magnitude))
    raise ConfigError(f"unknown augmentation op {name!r}")


def _linspace(start: float, end: float, n: int) -> np.ndarray:
    """torch.linspace's float32 values themselves: numpy's differ in the last bit for some bins, and
    TranslateX/Y truncate (bin 15 of TrivialAugmentWide's 0..32 is 15.999999, a 15-pixel shift)."""
    return torch.linspace(start, end, n, dtype=torch.float32).numpy()


def _posterize_bits(n: int, span: int) -> np.ndarray:
    return (8 - np.round(np.arange(n, dtype=np.float32) / np.float32((n - 1) / span))).astype(np.int64)


def _table(num_bins: int, *, shear: float, translate: tuple[float, float], rotate: float, enhance: float,
           posterize_span: int) -> dict[str, tuple[np.ndarray | None, bool]]:
    """The 13 ops the three policies share, with their magnitude ranges (each linspace from 0)."""
    return {
        "ShearX": (_linspace(0.0, shear, num_bins), True),
        "ShearY": (_linspace(0.0, shear, num_bins), True),
        "TranslateX": (_linspace(0.0, translate[0], num_bins), True),
        "TranslateY": (_linspace(0.0, translate[1], num_bins), True),
        "Rotate": (_linspace(0.0, rotate, num_bins), True),
        **{name: (_linspace(0.0, enhance, num_bins), True) for name in ("Brightness", "Color", "Contrast", "Sharpness")},
        "Posterize": (_posterize_bits(num_bins, posterize_span), False),
        "Solarize": (_linspace(1.0, 0.0, num_bins), False),  # a fraction of 255, as torchvision v2
        "AutoContrast": (None, False),
        "Equalize": (None, False),
    }


@functools.lru_cache(maxsize=256)
def augmentation_space(kind: str, num_bins: int, height: int, width: int) -> dict[str, tuple[np.ndarray | None, bool]]:
    """op name -> (magnitudes per bin, or None for no magnitude; signed), as torchvision defines them
    for "randaugment", "autoaugment" (the same table with Invert, no Identity) and "trivialaugmentwide".
    Cached (it is asked for once per sample): treat the result as read-only."""
    if kind == "trivialaugmentwide":
        table = _table(num_bins, shear=0.99, translate=(32.0, 32.0), rotate=135.0, enhance=0.99, posterize_span=6)
    else:
        table = _table(num_bins, shear=0.3, translate=(150.0 / 331.0 * width, 150.0 / 331.0 * height), rotate=30.0,
                       enhance=0.9, posterize_span=4)
    space: dict[str, tuple[np.ndarray | None, bool]] = {} if kind == "autoaugment" else {"Identity": (None, False)}
    space.update(table)
    if kind == "autoaugment":
        space["Invert"] = (None, False)
    return space


#: torchvision's AutoAugmentPolicy.IMAGENET: 25 sub-policies of two (op, probability, magnitude bin).
IMAGENET_POLICY: tuple[tuple[tuple[str, float, int | None], tuple[str, float, int | None]], ...] = (
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, None)),
    (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
    (("Equalize", 0.0, None), ("Equalize", 0.8, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, None)),
    (("Color", 0.4, 0), ("Equalize", 0.6, None)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
)


class _Policy(_RandomOp):
    """A policy's params are a list of (op name, signed magnitude), applied in order."""

    interpolation: str
    fill: Fill

    def apply(self, img: np.ndarray, params: list[tuple[str, float]]) -> np.ndarray:
        for name, m in params:
            img = apply_op(img, name, m, self.interpolation, self.fill)
        return img


@dataclass(frozen=True)
class RandAugment(_Policy):
    """torchvision.transforms.RandAugment: `num_ops` ops drawn uniformly (with replacement) from 14
    (Identity, ShearX/Y, TranslateX/Y, Rotate, Brightness, Color, Contrast, Sharpness, Posterize,
    Solarize, AutoContrast, Equalize), each at bin `magnitude` of `num_magnitude_bins`, its sign
    flipped with probability 1/2 for signed ops."""

    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: Fill = None

    def __post_init__(self) -> None:
        _check_interpolation("RandAugment", self.interpolation)
        if not 0 <= self.magnitude < self.num_magnitude_bins:
            raise ConfigError(f"RandAugment: magnitude must be in [0, num_magnitude_bins={self.num_magnitude_bins}), "
                              f"got {self.magnitude}")
        if self.num_ops < 0:
            raise ConfigError(f"RandAugment: num_ops must be >= 0, got {self.num_ops}")

    def params(self, rng: np.random.Generator, height: int, width: int) -> list[tuple[str, float]]:
        space = augmentation_space("randaugment", self.num_magnitude_bins, height, width)
        names = list(space)
        chosen = []
        for _ in range(self.num_ops):
            name = names[int(rng.integers(len(names)))]
            mags, signed = space[name]
            m = float(mags[self.magnitude]) if mags is not None else 0.0
            if signed and rng.integers(2):
                m = -m
            chosen.append((name, m))
        return chosen


@dataclass(frozen=True)
class TrivialAugmentWide(_Policy):
    """torchvision.transforms.TrivialAugmentWide: one op drawn uniformly from 14, a magnitude bin
    drawn uniformly from `num_magnitude_bins`, sign flipped with probability 1/2; wider ranges than
    RandAugment (shear 0.99, translate 32 px, rotate 135 degrees, enhancements 0.99, posterize to 2 bits)."""

    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: Fill = None

    def __post_init__(self) -> None:
        _check_interpolation("TrivialAugmentWide", self.interpolation)

    def params(self, rng: np.random.Generator, height: int, width: int) -> list[tuple[str, float]]:
        space = augmentation_space("trivialaugmentwide", self.num_magnitude_bins, height, width)
        names = list(space)
        name = names[int(rng.integers(len(names)))]
        mags, signed = space[name]
        m = float(mags[int(rng.integers(len(mags)))]) if mags is not None else 0.0
        if signed and rng.integers(2):
            m = -m
        return [(name, m)]



@dataclass(frozen=True)
class AutoAugment(_Policy):
    """torchvision.transforms.AutoAugment with the ImageNet policy: one of 25 sub-policies drawn
    uniformly; each of its two ops runs when a uniform draw is <= its probability, with the
    magnitude of its bin (10 bins) negated when a fair coin says so for signed ops."""

    policy: str = "imagenet"
    interpolation: str = "nearest"
    fill: Fill = None

    def __post_init__(self) -> None:
        _check_interpolation("AutoAugment", self.interpolation)
        if str(getattr(self.policy, "value", self.policy)).lower() != "imagenet":
            raise ConfigError(f"AutoAugment: only policy='imagenet' is built in, got {self.policy!r}; for "
                              f"CIFAR10/SVHN pass torchvision's AutoAugment itself as a transform")

    def params(self, rng: np.random.Generator, height: int, width: int) -> list[tuple[str, float]]:
        policy_id = int(rng.integers(len(IMAGENET_POLICY)))
        probs = rng.random(2)
        signs = rng.integers(2, size=2)
        space = augmentation_space("autoaugment", 10, height, width)
        chosen = []
        for i, (name, p, bin_) in enumerate(IMAGENET_POLICY[policy_id]):
            if probs[i] <= p:
                mags, signed = space[name]
                m = float(mags[bin_]) if bin_ is not None and mags is not None else 0.0
                if signed and signs[i] == 0:
                    m = -m
                chosen.append((name, m))
        return chosen
