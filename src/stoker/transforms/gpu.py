"""The kernels of the batched augmentations (`batch_ops`) on `[B, 3, H, W]` tensors, on any device:
per-sample parameters as tensors, a handful of kernels per batch and no per-sample Python loop.

The same ops as the per-sample ones of `colour.py` and `policy.py` (torchvision's definitions and
parameter names), for heavy policies to run on the GPU after the upload instead of on the worker
threads. In a Loader's transforms they follow the per-sample ops and run on the device thread:

    Loader(src, 256, device="cuda", transforms=[RandomResizedCrop(224), RandomHorizontalFlip(),
                                                stoker.batch.RandAugment(), stoker.Normalize(),
                                                stoker.batch.RandomErasing(0.25), Mixup(0.8, 1.0, num_classes=1000)])

`BatchAugment(ops, mix).over(loader)` runs the same over a Loader's uint8 batches from outside it.

Colour and policy ops take uint8 images (0..255) and keep them uint8 between ops, truncating like
torchvision's tensor path; `Normalize` turns them into float; `RandomErasing` works on the normalized
batch, as torchvision's does. Parameters are drawn in numpy from `(seed, epoch, batch index)` and
copied to the device once per op (through pinned memory, never blocking the host), so the result is
the same on any device and on resume. A policy op
runs each of its 14 kinds once per batch on the samples that drew it (`index_select` / `index_copy`).
"""

from __future__ import annotations

import numpy as np

from .._tensors import host_to_device
from .._torch import torch
from ..errors import ConfigError
from . import pixels, policy

F = torch.nn.functional

_TAG_BATCH_AUG = 6  # the batch ops' own random stream (order.py uses 1-4, mixing 5)
OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
       "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert")
_OP_ID = {name: k for k, name in enumerate(OPS)}


def _col(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def _u8(x: torch.Tensor) -> torch.Tensor:
    """float 0..255 -> uint8 by clamping and truncating, as torchvision's `.to(uint8)` after a blend."""
    return x.clamp_(0, 255).to(torch.uint8)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """[n, 1, H, W] uint8 luma, torchvision's rgb_to_grayscale (0.2989, 0.587, 0.114, truncated)."""
    f = x.float()
    return (0.2989 * f[:, 0:1] + 0.587 * f[:, 1:2] + 0.114 * f[:, 2:3]).to(torch.uint8)


def _blend(x: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    r = _col(ratio)
    return _u8(r * x.float() + (1.0 - r) * other.float())


def adjust_brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, torch.zeros_like(x[:, :1]), f)


def adjust_contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, _gray(x).float().mean(dim=(1, 2, 3), keepdim=True), f)


def adjust_saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, _gray(x), f)


def _rgb2hsv(rgb: torch.Tensor) -> torch.Tensor:
    r, g, b = rgb.unbind(1)
    maxc, minc = rgb.amax(1), rgb.amin(1)
    eqc = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(eqc, ones, maxc)
    crd = torch.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return torch.stack((h, s, maxc), 1)


def _hsv2rgb(hsv: torch.Tensor) -> torch.Tensor:
    h, s, v = hsv.unbind(1)
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int64) % 6
    p = (v * (1.0 - s)).clamp(0.0, 1.0)
    q = (v * (1.0 - s * f)).clamp(0.0, 1.0)
    t = (v * (1.0 - s * (1.0 - f))).clamp(0.0, 1.0)
    mask = i.unsqueeze(1) == torch.arange(6, device=i.device).view(-1, 1, 1)  # [n, 6, H, W]
    a1 = torch.stack((v, q, p, p, t, v), 1)
    a2 = torch.stack((t, v, v, q, p, p), 1)
    a3 = torch.stack((p, p, t, v, v, q), 1)
    pick = torch.stack((a1, a2, a3), 1)  # [n, 3, 6, H, W]
    return (pick * mask.unsqueeze(1)).sum(2)


def adjust_hue(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    hsv = _rgb2hsv(x.float() / 255.0)
    hsv[:, 0] = torch.remainder(hsv[:, 0] + f.view(-1, 1, 1), 1.0)
    # back to uint8 as torchvision's to_dtype does it, x 255.999 truncated: the HSV round trip lands a hair
    # under integers, which x 255 truncated drops by one (at a zero shift, on about a quarter of the pixels,
    # and on CUDA, which divides through a reciprocal, on other pixels than on the CPU)
    return _u8(_hsv2rgb(hsv) * 255.999)


def adjust_sharpness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] <= 2 or x.shape[-2] <= 2:
        return x
    k = torch.ones(3, 3)
    k[1, 1] = 5.0  # on the host: one element set on a GPU tensor is a blocking copy
    k = host_to_device(k / k.sum(), x.device).expand(3, 1, 3, 3)
    out = x.float()
    inner = out[..., 1:-1, 1:-1]
    # torchvision's blend, x + (1 - f) * (smoothed - x): a flat patch stays exactly as it was
    inner.add_(F.conv2d(out, k, groups=3).round_().sub_(inner).mul_((1.0 - _col(f)).float()))
    return _u8(out)


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    mask = ((0xFF << (8 - bits.long())) & 0xFF).to(torch.uint8)
    return x & _col(mask)


def solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return torch.where(x.float() >= _col(threshold), 255 - x, x)


def invert(x: torch.Tensor) -> torch.Tensor:
    return 255 - x


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    f = x.float()
    lo, hi = f.amin(dim=(2, 3), keepdim=True), f.amax(dim=(2, 3), keepdim=True)
    scale = 255.0 / (hi - lo)
    bad = ~torch.isfinite(scale)
    lo = torch.where(bad, torch.zeros_like(lo), lo)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    return _u8((f - lo) * scale)


def equalize(x: torch.Tensor) -> torch.Tensor:
    """torchvision's equalize for every (sample, channel) at once: one histogram, one cumsum, one gather.

    On a GPU the histogram is an index_add into 256 bins per row, not torch.bincount, whose CUDA kernel
    reads the input's min and max back to the host (two syncs per call); on the CPU bincount has no
    such cost and is about 5x faster than index_add."""
    n, c, h, w = x.shape
    rows = n * c
    flat = x.reshape(rows, -1).long()
    keys = (flat + 256 * torch.arange(rows, device=x.device).view(-1, 1)).view(-1)
    if x.device.type == "cpu":
        hist = torch.bincount(keys, minlength=rows * 256).view(rows, 256)
    else:
        ones = torch.ones((), dtype=torch.int64, device=x.device).expand_as(keys)   # no [B*C*H*W] buffer
        hist = torch.zeros(rows * 256, dtype=torch.int64, device=x.device).index_add_(0, keys, ones).view(rows, 256)
    # the count of the last non-empty bin, to leave out of the step as torchvision does
    last = 255 - torch.argmax((hist.flip(1) > 0).to(torch.uint8), dim=1)
    step = (hist.sum(1) - hist.gather(1, last.view(-1, 1)).squeeze(1)) // 255
    safe = step.clamp(min=1).view(-1, 1)
    lut = (hist.cumsum(1) + safe // 2) // safe
    lut = torch.cat((torch.zeros_like(lut[:, :1]), lut[:, :-1]), 1).clamp(0, 255)
    out = lut.gather(1, flat).to(torch.uint8)
    out = torch.where((step == 0).view(-1, 1), flat.to(torch.uint8), out)
    return out.view(n, c, h, w)


def affine_theta(inv: np.ndarray, h: int, w: int) -> np.ndarray:
    """[n, 2, 3] `affine_grid` thetas from torchvision-style inverse matrices [n, 6] (pixels, relative
    to the image centre): normalized coordinates are relative coordinates over (w/2, h/2)."""
    theta = np.empty((len(inv), 2, 3), np.float32)
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 0, 2] = inv[:, 0], inv[:, 1] * h / w, inv[:, 2] * 2.0 / w
    theta[:, 1, 0], theta[:, 1, 1], theta[:, 1, 2] = inv[:, 3] * w / h, inv[:, 4], inv[:, 5] * 2.0 / h
    return theta


def warp(x: torch.Tensor, inv: np.ndarray, interpolation: str = "nearest", fill: pixels.Fill = None) -> torch.Tensor:
    """torchvision's tensor affine (grid_sample, align_corners=False) with one matrix per sample."""
    n, _, h, w = x.shape
    theta = host_to_device(affine_theta(inv, h, w), x.device)
    grid = F.affine_grid(theta, [n, 3, h, w], align_corners=False)
    f = x.float()
    fillv = pixels._fill_value(fill)
    if any(fillv):
        f = torch.cat((f, torch.ones_like(f[:, :1])), 1)
    out = F.grid_sample(f, grid, mode=interpolation, padding_mode="zeros", align_corners=False)
    if any(fillv):
        out, mask = out[:, :3], out[:, 3:]
        fill_t = host_to_device(torch.tensor(fillv), x.device).view(1, 3, 1, 1)
        out = torch.where(mask < 0.5, fill_t, out) if interpolation == "nearest" else out * mask + (1 - mask) * fill_t
    return _u8(out.round_() if interpolation == "bilinear" else out)


def _geometry_matrices(name: str, mags: np.ndarray, h: int, w: int) -> np.ndarray:
    """Inverse matrices [n, 6] of one geometric policy op for signed magnitudes `mags` [n]: the closed
    forms of `augment_pixels.inverse_affine_matrix` for each op (shears about the top-left corner with
    tan(atan(m)) = m, translations by int(m) pixels, rotations by m degrees about the centre)."""
    m = np.asarray(mags, np.float64)
    one, zero = np.ones_like(m), np.zeros_like(m)
    if name == "ShearX":
        cols = (one, m, m * h * 0.5, zero, one, zero)
    elif name == "ShearY":
        cols = (one, zero, zero, m, one, m * w * 0.5)
    elif name == "TranslateX":
        cols = (one, zero, -np.trunc(m), zero, one, zero)
    elif name == "TranslateY":
        cols = (one, zero, zero, zero, one, -np.trunc(m))
    else:  # Rotate
        r = np.radians(m)
        cols = (np.cos(r), -np.sin(r), zero, np.sin(r), np.cos(r), zero)
    return np.stack(cols, 1)


def apply_policy_op(x: torch.Tensor, name: str, mags: np.ndarray, interpolation: str = "nearest",
                    fill: pixels.Fill = None) -> torch.Tensor:
    """One policy op on a sub-batch with one signed magnitude per sample (uint8 in and out)."""
    if name == "Identity":
        return x
    if name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"):
        return warp(x, _geometry_matrices(name, mags, x.shape[2], x.shape[3]), interpolation, fill)
    if name in policy.PIXEL_OPS:
        kernel, arg = policy.PIXEL_OPS[name]
        m = host_to_device(np.asarray(mags, np.float32), x.device)
        return globals()[kernel](x, *policy.colour_args(arg, m))
    raise ConfigError(f"unknown augmentation op {name!r}")


def run_policy(x: torch.Tensor, op_ids: np.ndarray, mags: np.ndarray, interpolation: str, fill: pixels.Fill) -> torch.Tensor:
    """Apply per-sample op sequences: `op_ids` int [n, k] into OPS (-1: skip), `mags` float [n, k]."""
    for step in range(op_ids.shape[1]):
        for op in np.unique(op_ids[:, step]):
            if op < 0 or OPS[op] == "Identity":
                continue
            rows = np.nonzero(op_ids[:, step] == op)[0]
            idx = host_to_device(rows, x.device)
            x = x.index_copy(0, idx, apply_policy_op(x.index_select(0, idx), OPS[op], mags[rows, step],
                                                     interpolation, fill))
    return x


def _check_uint8(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3:
        raise ConfigError(f"{name} works on uint8 [B, 3, H, W] batches (before Normalize), got {x.dtype} "
                          f"{tuple(x.shape)}; put it before Normalize, or load with device=... and no normalize")
