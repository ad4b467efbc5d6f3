"""Pixel kernels on uint8 HWC arrays: torchvision.transforms.functional's formulas, in OpenCV calls
that release the GIL (lookup tables, warpAffine, GaussianBlur) and numpy ufuncs.

Blends follow torchvision's tensor path exactly (float32 arithmetic, clamped and truncated to uint8);
where OpenCV rounds instead (warpAffine's bilinear mode, GaussianBlur, the sharpness kernel) results
are within 1 of torchvision's. docs/transforms.md lists each kernel with its definition.
"""

from __future__ import annotations

import math
from typing import Sequence

import cv2
import numpy as np

from ..errors import ConfigError

Fill = int | float | Sequence[float] | None
INTERPOLATIONS = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR}
_ARANGE = np.arange(256, dtype=np.float32)


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
    hsv[..., 0] += np.float32((factor * 360.0) % 360.0)  # in [0, 720): HSV2RGB wraps it into [0, 360)
    rgb = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
    # x * 255 truncated, as torchvision's `.to(uint8)`: round(x * 255 - 0.5), with 1e-3 of slack because
    # float HSV round trips land a hair under integers (torchvision's float path keeps them)
    return cv2.convertScaleAbs(rgb, alpha=255.0, beta=-0.5 + 1e-3)


_SHARPEN = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13.0


def adjust_sharpness(img: np.ndarray, factor: float) -> np.ndarray:
    """F.adjust_sharpness: blend with a 3x3 smoothed copy (border pixels kept); 0 blurs, 2 sharpens.
    Blended as torchvision does, x + (1 - factor) * (smoothed - x): a flat patch stays exactly as it was
    (factor * x + (1 - factor) * x can land just below x and truncate one lower)."""
    if img.shape[0] <= 2 or img.shape[1] <= 2:
        return img
    out = img.astype(np.float32)
    inner = out[1:-1, 1:-1]
    smoothed = cv2.filter2D(img, -1, _SHARPEN, borderType=cv2.BORDER_REFLECT_101)[1:-1, 1:-1].astype(np.float32)
    smoothed -= inner
    smoothed *= np.float32(1.0 - float(factor))
    inner += smoothed
    np.clip(out, 0, 255, out=out)
    return out.astype(np.uint8)


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
