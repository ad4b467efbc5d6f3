"""Per-sample colour and policy augmentations on uint8 HWC arrays, with torchvision's semantics.

Each op is a small frozen dataclass with torchvision's parameter names and defaults. It draws its
random parameters from the numpy Generator it is given (`rng=`: the Loader passes one seeded from the
sample's key, so results never depend on thread count) and applies them with OpenCV calls that
release the GIL (lookup tables, warpAffine, filter2D, cvtColor); the numpy left is a few
256-entry tables per image.

    ops = [RandomResizedCrop(224), RandomHorizontalFlip(), RandAugment(), RandomErasing()]

The pixel formulas follow torchvision's tensor path (torchvision.transforms.functional on uint8
tensors): blends truncate to uint8 like torchvision does; where OpenCV rounds instead (saturation,
blur, the sharpness kernel) results are within 1 of torchvision's (docs/transforms.md lists each op,
its definition and its tolerance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import cv2
import numpy as np

from .device import IMAGENET_MEAN, IMAGENET_STD
from .errors import ConfigError

Fill = int | float | Sequence[float] | None
INTERPOLATIONS = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR}
_ARANGE = np.arange(256, dtype=np.float32)


# ---- pixel kernels (torchvision.transforms.functional on uint8) --------------------------------
def _lut(img: np.ndarray, table: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Apply a 256-entry table (or 256 x 3, one per channel) to a uint8 HWC image."""
    table = np.ascontiguousarray(table, dtype=np.uint8)
    if table.ndim == 2:
        table = table.reshape(1, 256, 3)
    return cv2.LUT(img, table, dst=out)


def _blend_table(factor: float, other: float | np.ndarray) -> np.ndarray:
    """torchvision `_blend` as a table: clamp(factor * v + (1 - factor) * other, 0, 255), truncated."""
    f = np.float32(factor)
    vals = f * _ARANGE + (np.float32(1.0) - f) * np.asarray(other, np.float32)
    return np.clip(vals, 0, 255).astype(np.uint8)


def grayscale(img: np.ndarray) -> np.ndarray:
    """torchvision's rgb_to_grayscale on uint8: 0.2989 R + 0.587 G + 0.114 B in float32, truncated."""
    f = img.astype(np.float32)
    return (f[..., 0] * 0.2989 + f[..., 1] * 0.587 + f[..., 2] * 0.114).astype(np.uint8)


def adjust_brightness(img: np.ndarray, factor: float) -> np.ndarray:
    """F.adjust_brightness: blend with black, `factor` 0 gives black, 1 the original."""
    return _lut(img, _blend_table(factor, 0.0))


def adjust_contrast(img: np.ndarray, factor: float) -> np.ndarray:
    """F.adjust_contrast: blend with the mean grey level of the image."""
    mean = float(cv2.mean(grayscale(img))[0])
    return _lut(img, _blend_table(factor, mean))


def _blend(img: np.ndarray, other: np.ndarray, factor: float) -> np.ndarray:
    """torchvision `_blend` per pixel: factor * img + (1 - factor) * other in float32, clamped, truncated
    (numpy's ufuncs release the GIL on arrays this size)."""
    out = img.astype(np.float32)
    out *= np.float32(factor)
    out += np.float32(1.0 - float(factor)) * other.astype(np.float32)
    np.clip(out, 0, 255, out=out)
    return out.astype(np.uint8)


def adjust_saturation(img: np.ndarray, factor: float) -> np.ndarray:
    """F.adjust_saturation: blend with the grayscale image (0 gives grey, 1 the original)."""
    return _blend(img, grayscale(img)[..., None], factor)


def adjust_hue(img: np.ndarray, factor: float) -> np.ndarray:
    """F.adjust_hue: rotate the hue by `factor` turns (in [-0.5, 0.5]) in float HSV, truncate to uint8."""
    if not -0.5 <= factor <= 0.5:
        raise ConfigError(f"hue factor must be in [-0.5, 0.5], got {factor}")
    hsv = cv2.cvtColor(img.astype(np.float32) * np.float32(1 / 255), cv2.COLOR_RGB2HSV)  # H in degrees
    h = hsv[..., 0]
    h += np.float32(factor * 360.0)
    np.mod(h, 360.0, out=h)
    rgb = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
    rgb *= 255.0
    rgb += 1e-3  # float HSV round trips land a hair under integers: keep them (torchvision's float path does)
    return np.clip(rgb, 0, 255).astype(np.uint8)


_SHARPEN = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13.0


def adjust_sharpness(img: np.ndarray, factor: float) -> np.ndarray:
    """F.adjust_sharpness: blend with a 3x3 smoothed copy (border pixels kept); 0 blurs, 2 sharpens."""
    if img.shape[0] <= 2 or img.shape[1] <= 2:
        return img
    degenerate = img.copy()
    inner = cv2.filter2D(img, -1, _SHARPEN, borderType=cv2.BORDER_REFLECT_101)
    degenerate[1:-1, 1:-1] = inner[1:-1, 1:-1]
    return _blend(img, degenerate, factor)


def posterize(img: np.ndarray, bits: int) -> np.ndarray:
    """F.posterize: keep the `bits` high bits of each channel."""
    if not 0 <= bits <= 8:
        raise ConfigError(f"posterize bits must be in [0, 8], got {bits}")
    return _lut(img, (np.arange(256) & (0xFF << (8 - int(bits)) & 0xFF)).astype(np.uint8))


def solarize(img: np.ndarray, threshold: float) -> np.ndarray:
    """F.solarize: invert every value >= `threshold`."""
    v = np.arange(256)
    return _lut(img, np.where(v >= threshold, 255 - v, v).astype(np.uint8))


def invert(img: np.ndarray) -> np.ndarray:
    """F.invert: 255 - value."""
    return cv2.bitwise_not(img)


def autocontrast(img: np.ndarray) -> np.ndarray:
    """F.autocontrast: stretch each channel so its min becomes 0 and its max 255 (float32, truncated)."""
    extremes = [cv2.minMaxLoc(ch)[:2] for ch in cv2.split(img)]  # numpy's strided min/max is 100x slower
    lo = np.array([e[0] for e in extremes], np.float32)
    hi = np.array([e[1] for e in extremes], np.float32)
    flat = hi == lo
    scale = np.where(flat, np.float32(1), np.float32(255) / np.where(flat, 1, hi - lo)).astype(np.float32)
    lo = np.where(flat, np.float32(0), lo)
    table = np.clip((_ARANGE[:, None] - lo[None, :]) * scale[None, :], 0, 255).astype(np.uint8)
    return _lut(img, table)


def equalize(img: np.ndarray) -> np.ndarray:
    """F.equalize (PIL's ImageOps.equalize): per-channel histogram equalisation, integer arithmetic."""
    tables = np.empty((256, 3), np.uint8)
    for c in range(3):
        hist = cv2.calcHist([img], [c], None, [256], [0, 256]).ravel().astype(np.int64)
        nonzero = hist[hist != 0]
        step = int(nonzero[:-1].sum()) // 255
        if step == 0:
            tables[:, c] = np.arange(256)
            continue
        lut = (np.cumsum(hist) + step // 2) // step
        tables[:, c] = np.clip(np.concatenate(([0], lut[:-1])), 0, 255)
    return _lut(img, tables)


def _fill_value(fill: Fill) -> tuple[float, float, float]:
    if fill is None:
        return (0.0, 0.0, 0.0)
    if isinstance(fill, (int, float)):
        return (float(fill),) * 3
    vals = [float(f) for f in fill]
    return (vals[0],) * 3 if len(vals) == 1 else (vals[0], vals[1], vals[2])


def inverse_affine_matrix(center: tuple[float, float], angle: float, translate: tuple[float, float],
                          scale: float, shear: tuple[float, float]) -> list[float]:
    """torchvision's `_get_inverse_affine_matrix` (output -> input coordinates, degrees)."""
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    cx, cy = center
    tx, ty = translate
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d / scale, -b / scale, 0.0, -c / scale, a / scale, 0.0]
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty)
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty)
    m[2] += cx
    m[5] += cy
    return m


def affine(img: np.ndarray, angle: float = 0.0, translate: tuple[float, float] = (0.0, 0.0), scale: float = 1.0,
           shear: tuple[float, float] = (0.0, 0.0), center: tuple[float, float] | None = None,
           interpolation: str = "nearest", fill: Fill = None) -> np.ndarray:
    """F.affine on the tensor path: `center` in pixels from the top-left corner (default: the image
    centre); coordinates are pixel centres, as torchvision's sampling grid uses."""
    h, w = img.shape[:2]
    # torchvision works in coordinates relative to the image centre, with pixel i's centre at i + 0.5 - w/2
    c_rel = (0.0, 0.0) if center is None else (center[0] - w * 0.5, center[1] - h * 0.5)
    m = inverse_affine_matrix(c_rel, -angle, translate, scale, shear)
    # output index (x, y) -> relative (x + 0.5 - w/2) -> m -> input relative -> index (- 0.5 + w/2)
    ox, oy = 0.5 - w * 0.5, 0.5 - h * 0.5
    mat = np.array([[m[0], m[1], m[0] * ox + m[1] * oy + m[2] - ox],
                    [m[3], m[4], m[3] * ox + m[4] * oy + m[5] - oy]], np.float64)
    return cv2.warpAffine(img, mat, (w, h), flags=INTERPOLATIONS[interpolation] | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_CONSTANT, borderValue=_fill_value(fill))


def rotate(img: np.ndarray, angle: float, interpolation: str = "nearest", fill: Fill = None) -> np.ndarray:
    """F.rotate (expand=False): `angle` degrees counter-clockwise about the image centre."""
    h, w = img.shape[:2]
    m = inverse_affine_matrix((0.0, 0.0), -angle, (0.0, 0.0), 1.0, (0.0, 0.0))
    ox, oy = 0.5 - w * 0.5, 0.5 - h * 0.5
    mat = np.array([[m[0], m[1], m[0] * ox + m[1] * oy + m[2] - ox],
                    [m[3], m[4], m[3] * ox + m[4] * oy + m[5] - oy]], np.float64)
    return cv2.warpAffine(img, mat, (w, h), flags=INTERPOLATIONS[interpolation] | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_CONSTANT, borderValue=_fill_value(fill))


def gaussian_blur(img: np.ndarray, kernel_size: tuple[int, int], sigma: tuple[float, float]) -> np.ndarray:
    """F.gaussian_blur: separable Gaussian, `kernel_size` (kx, ky) odd, reflect padding."""
    return cv2.GaussianBlur(img, (int(kernel_size[0]), int(kernel_size[1])), sigmaX=float(sigma[0]),
                            sigmaY=float(sigma[1]), borderType=cv2.BORDER_REFLECT_101)


# ---- the policy ops (torchvision.transforms.autoaugment._apply_op) -----------------------------
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
    if name == "Brightness":
        return adjust_brightness(img, 1.0 + magnitude)
    if name == "Color":
        return adjust_saturation(img, 1.0 + magnitude)
    if name == "Contrast":
        return adjust_contrast(img, 1.0 + magnitude)
    if name == "Sharpness":
        return adjust_sharpness(img, 1.0 + magnitude)
    if name == "Posterize":
        return posterize(img, int(magnitude))
    if name == "Solarize":
        return solarize(img, magnitude)
    if name == "AutoContrast":
        return autocontrast(img)
    if name == "Equalize":
        return equalize(img)
    if name == "Invert":
        return invert(img)
    raise ConfigError(f"unknown augmentation op {name!r}")


def _linspace(start: float, end: float, n: int) -> np.ndarray:
    return np.linspace(start, end, n, dtype=np.float64).astype(np.float32)


def _posterize_bits(n: int, span: int) -> np.ndarray:
    return (8 - np.round(np.arange(n, dtype=np.float32) / np.float32((n - 1) / span))).astype(np.int64)


def augmentation_space(kind: str, num_bins: int, height: int, width: int) -> dict[str, tuple[np.ndarray | None, bool]]:
    """op name -> (magnitudes per bin, or None for no magnitude; signed), as torchvision defines them
    for "randaugment", "autoaugment" (the same table with Invert, no Identity) and "trivialaugmentwide"."""
    if kind == "trivialaugmentwide":
        return {
            "Identity": (None, False),
            "ShearX": (_linspace(0.0, 0.99, num_bins), True),
            "ShearY": (_linspace(0.0, 0.99, num_bins), True),
            "TranslateX": (_linspace(0.0, 32.0, num_bins), True),
            "TranslateY": (_linspace(0.0, 32.0, num_bins), True),
            "Rotate": (_linspace(0.0, 135.0, num_bins), True),
            "Brightness": (_linspace(0.0, 0.99, num_bins), True),
            "Color": (_linspace(0.0, 0.99, num_bins), True),
            "Contrast": (_linspace(0.0, 0.99, num_bins), True),
            "Sharpness": (_linspace(0.0, 0.99, num_bins), True),
            "Posterize": (_posterize_bits(num_bins, 6), False),
            "Solarize": (_linspace(255.0, 0.0, num_bins), False),
            "AutoContrast": (None, False),
            "Equalize": (None, False),
        }
    space: dict[str, tuple[np.ndarray | None, bool]] = {} if kind == "autoaugment" else {"Identity": (None, False)}
    space.update({
        "ShearX": (_linspace(0.0, 0.3, num_bins), True),
        "ShearY": (_linspace(0.0, 0.3, num_bins), True),
        "TranslateX": (_linspace(0.0, 150.0 / 331.0 * width, num_bins), True),
        "TranslateY": (_linspace(0.0, 150.0 / 331.0 * height, num_bins), True),
        "Rotate": (_linspace(0.0, 30.0, num_bins), True),
        "Brightness": (_linspace(0.0, 0.9, num_bins), True),
        "Color": (_linspace(0.0, 0.9, num_bins), True),
        "Contrast": (_linspace(0.0, 0.9, num_bins), True),
        "Sharpness": (_linspace(0.0, 0.9, num_bins), True),
        "Posterize": (_posterize_bits(num_bins, 4), False),
        "Solarize": (_linspace(255.0, 0.0, num_bins), False),
        "AutoContrast": (None, False),
        "Equalize": (None, False),
    })
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


# ---- the transforms --------------------------------------------------------------------------
def _default_rng(rng: np.random.Generator | None) -> np.random.Generator:
    return np.random.default_rng() if rng is None else rng


def _check_interpolation(name: str, interpolation: str) -> None:
    if interpolation not in INTERPOLATIONS:
        raise ConfigError(f"{name}: interpolation must be one of {sorted(INTERPOLATIONS)}, got {interpolation!r}")


class _RandomOp:
    """Shared protocol: `params(rng, height, width)` draws, `apply(img, params)` applies, and calling
    the op does both (the Loader calls it with `rng=` seeded from the sample's key)."""

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


@dataclass(frozen=True)
class RandAugment(_RandomOp):
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

    def apply(self, img: np.ndarray, params: list[tuple[str, float]]) -> np.ndarray:
        for name, m in params:
            img = apply_op(img, name, m, self.interpolation, self.fill)
        return img


@dataclass(frozen=True)
class TrivialAugmentWide(_RandomOp):
    """torchvision.transforms.TrivialAugmentWide: one op drawn uniformly from 14, a magnitude bin
    drawn uniformly from `num_magnitude_bins`, sign flipped with probability 1/2; wider ranges than
    RandAugment (shear 0.99, translate 32 px, rotate 135 degrees, enhancements 0.99, posterize to 2 bits)."""

    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: Fill = None

    def __post_init__(self) -> None:
        _check_interpolation("TrivialAugmentWide", self.interpolation)

    def params(self, rng: np.random.Generator, height: int, width: int) -> tuple[str, float]:
        space = augmentation_space("trivialaugmentwide", self.num_magnitude_bins, height, width)
        names = list(space)
        name = names[int(rng.integers(len(names)))]
        mags, signed = space[name]
        m = float(mags[int(rng.integers(len(mags)))]) if mags is not None else 0.0
        if signed and rng.integers(2):
            m = -m
        return name, m

    def apply(self, img: np.ndarray, params: tuple[str, float]) -> np.ndarray:
        return apply_op(img, params[0], params[1], self.interpolation, self.fill)


@dataclass(frozen=True)
class AutoAugment(_RandomOp):
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

    def apply(self, img: np.ndarray, params: list[tuple[str, float]]) -> np.ndarray:
        for name, m in params:
            img = apply_op(img, name, m, self.interpolation, self.fill)
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
class RandomErasing(_RandomOp):
    """torchvision.transforms.RandomErasing on uint8: with probability `p`, a rectangle of area fraction
    uniform in `scale` and log-uniform aspect ratio in `ratio` (10 tries) is set to `value`.

    `value` is in uint8 units here (torchvision erases after Normalize, where 0 is the mean colour:
    pass `value=(124, 116, 104)` for ImageNet's mean, or use the batched version after normalisation,
    `augment_gpu.RandomErasing`). `"random"` fills with per-pixel normal noise of the `mean`/`std`
    (0..1 units) the batch is later normalised with, i.e. torchvision's N(0, 1) after Normalize."""

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

    p: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ConfigError(f"RandomGrayscale: p must be in [0, 1], got {self.p}")

    def params(self, rng: np.random.Generator, height: int, width: int) -> bool:
        return bool(rng.random() < self.p)

    def apply(self, img: np.ndarray, params: bool) -> np.ndarray:
        return cv2.cvtColor(grayscale(img), cv2.COLOR_GRAY2RGB) if params else img


CPU_OPS = (ColorJitter, RandAugment, TrivialAugmentWide, AutoAugment, RandomErasing, GaussianBlur, RandomGrayscale)
