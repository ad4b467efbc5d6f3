"""Batched augmentations on `[B, 3, H, W]` tensors, on any device: per-sample parameters as tensors,
a handful of kernels per batch and no per-sample Python loop.

The same ops as the per-sample ones of `colour.py` and `policy.py` (torchvision's definitions and
parameter names), for heavy policies to run on the GPU after the upload instead of on the worker
threads. In a Loader's transforms they follow the per-sample ops and run on the device thread:

    Loader(src, 256, device="cuda", transforms=[RandomResizedCrop(224), RandomHorizontalFlip(),
                                                gpu.RandAugment(), gpu.Normalize(), gpu.RandomErasing(0.25),
                                                Mixup(0.8, 1.0, num_classes=1000)])

`BatchAugment(ops, mix).over(loader)` runs the same over a Loader's uint8 batches from outside it.

Colour and policy ops take uint8 images (0..255) and keep them uint8 between ops, truncating like
torchvision's tensor path; `Normalize` turns them into float; `RandomErasing` works on the normalized
batch, as torchvision's does. Parameters are drawn in numpy from `(seed, epoch, batch index)` and
copied to the device once per op (through pinned memory, never blocking the host), so the result is
the same on any device and on resume. A policy op
runs each of its 14 kinds once per batch on the samples that drew it (`index_select` / `index_copy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from .._torch import torch
from ..device.stage import IMAGENET_MEAN, IMAGENET_STD, all_levels, host_to_device, normalize_by_table
from ..errors import ConfigError
from . import colour, pixels, policy
from .kinds import BATCH, stage_of
from .mixing import Mixup, batch_rng

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


# ---- batched transforms: params(rng, n, h, w) in numpy, apply(x, params) on the device ----------
@dataclass(frozen=True)
class ColorJitter:
    """Batched torchvision ColorJitter: per-sample factors and per-sample order of the four ops."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = False

    brightness: Any = 0
    contrast: Any = 0
    saturation: Any = 0
    hue: Any = 0
    ranges: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", colour.ColorJitter(self.brightness, self.contrast, self.saturation,
                                                           self.hue).ranges)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(rng.random((n, 4)), axis=1)  # a uniform permutation per sample
        factors = np.full((n, 4), np.nan, np.float32)
        for k, r in enumerate(self.ranges):
            if r is not None:
                factors[:, k] = rng.uniform(r[0], r[1], n)
        return order, factors

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "ColorJitter")
        order, factors = params
        fns = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
        for step in range(4):
            for fn_id in range(4):
                if self.ranges[fn_id] is None:
                    continue
                rows = np.nonzero(order[:, step] == fn_id)[0]
                if len(rows) == 0:
                    continue
                idx = host_to_device(rows, x.device)
                f = host_to_device(factors[rows, fn_id], x.device)
                x = x.index_copy(0, idx, fns[fn_id](x.index_select(0, idx), f))
        return x


@dataclass(frozen=True)
class RandAugment:
    """Batched torchvision RandAugment (num_ops=2, magnitude=9, num_magnitude_bins=31 by default)."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = True

    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: pixels.Fill = None

    def __post_init__(self) -> None:
        policy.RandAugment(self.num_ops, self.magnitude, self.num_magnitude_bins, self.interpolation, self.fill)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        space = policy.augmentation_space("randaugment", self.num_magnitude_bins, h, w)
        names = list(space)
        choice = rng.integers(len(names), size=(n, self.num_ops))
        flip = rng.integers(2, size=(n, self.num_ops)).astype(bool)
        table = np.array([0.0 if space[s][0] is None else float(space[s][0][self.magnitude]) for s in names])
        signed = np.array([space[s][1] for s in names])
        mags = np.where(signed[choice] & flip, -table[choice], table[choice])
        ids = np.array([_OP_ID[s] for s in names])[choice]
        return ids, mags

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "RandAugment")
        return run_policy(x, params[0], params[1], self.interpolation, self.fill)


@dataclass(frozen=True)
class TrivialAugmentWide:
    """Batched torchvision TrivialAugmentWide: one op and one magnitude bin per sample."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = True

    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: pixels.Fill = None

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        space = policy.augmentation_space("trivialaugmentwide", self.num_magnitude_bins, h, w)
        names = list(space)
        choice = rng.integers(len(names), size=n)
        bins = rng.integers(self.num_magnitude_bins, size=n)
        flip = rng.integers(2, size=n).astype(bool)
        mags = np.array([0.0 if space[names[c]][0] is None else float(space[names[c]][0][b])
                         for c, b in zip(choice, bins)])
        signed = np.array([space[s][1] for s in names])[choice]
        mags = np.where(signed & flip, -mags, mags)
        return np.array([_OP_ID[s] for s in names])[choice][:, None], mags[:, None]

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "TrivialAugmentWide")
        return run_policy(x, params[0], params[1], self.interpolation, self.fill)


@dataclass(frozen=True)
class AutoAugment:
    """Batched torchvision AutoAugment, ImageNet policy: a sub-policy per sample, each op kept when
    its uniform draw is <= its probability."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = True

    policy: str = "imagenet"
    interpolation: str = "nearest"
    fill: pixels.Fill = None

    def __post_init__(self) -> None:
        policy.AutoAugment(self.policy, self.interpolation, self.fill)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        space = policy.augmentation_space("autoaugment", 10, h, w)
        table = [[(_OP_ID[name], p, 0.0 if bin_ is None or space[name][0] is None else float(space[name][0][bin_]),
                   space[name][1]) for name, p, bin_ in sub] for sub in policy.IMAGENET_POLICY]
        t = np.array(table, dtype=np.float64)  # [25, 2, (op, prob, magnitude, signed)]
        pol = rng.integers(len(policy.IMAGENET_POLICY), size=n)
        probs = rng.random((n, 2))
        signs = rng.integers(2, size=(n, 2))
        chosen = t[pol]  # [n, 2, 4]
        keep = probs <= chosen[..., 1]
        ids = np.where(keep, chosen[..., 0], -1).astype(np.int64)
        mags = np.where((chosen[..., 3] > 0) & (signs == 0), -chosen[..., 2], chosen[..., 2])
        return ids, mags

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "AutoAugment")
        return run_policy(x, params[0], params[1], self.interpolation, self.fill)


@dataclass(frozen=True)
class GaussianBlur:
    """Batched torchvision GaussianBlur: a sigma per sample, one grouped separable convolution."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = False

    kernel_size: Any
    sigma: Any = (0.1, 2.0)

    def __post_init__(self) -> None:
        ref = colour.GaussianBlur(self.kernel_size, self.sigma)
        object.__setattr__(self, "kernel_size", ref.kernel_size)
        object.__setattr__(self, "sigma", ref.sigma)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
        return rng.uniform(self.sigma[0], self.sigma[1], n).astype(np.float32)

    def apply(self, x: torch.Tensor, sigma: np.ndarray) -> torch.Tensor:
        _check_uint8(x, "GaussianBlur")
        n, c, h, w = x.shape
        s = host_to_device(sigma, x.device).repeat_interleave(c).view(-1, 1)
        out = x.float().reshape(1, n * c, h, w)
        kx, ky = self.kernel_size
        for k, dim in ((kx, 3), (ky, 2)):
            pos = torch.linspace(-(k - 1) * 0.5, (k - 1) * 0.5, k, device=x.device).view(1, -1)
            ker = torch.exp(-0.5 * (pos / s) ** 2)
            ker = ker / ker.sum(1, keepdim=True)
            if dim == 3:
                out = F.conv2d(F.pad(out, (k // 2, k // 2, 0, 0), mode="reflect"), ker.view(n * c, 1, 1, k),
                               groups=n * c)
            else:
                out = F.conv2d(F.pad(out, (0, 0, k // 2, k // 2), mode="reflect"), ker.view(n * c, 1, k, 1),
                               groups=n * c)
        return _u8(out.round_()).view(n, c, h, w)


@dataclass(frozen=True)
class RandomGrayscale:
    """Batched torchvision RandomGrayscale: the luma on all three channels, with probability `p`."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = False

    p: float = 0.1

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
        return rng.random(n) < self.p

    def apply(self, x: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
        _check_uint8(x, "RandomGrayscale")
        m = _col(host_to_device(mask, x.device))
        return torch.where(m, _gray(x).expand_as(x), x)


@dataclass(frozen=True)
class Normalize:
    """torchvision Normalize after ToTensor: `(x / 255 - mean) / std` per channel, as float32
    (mean/std in 0..1 units; "imagenet" for ImageNet's)."""

    stage = BATCH
    takes = "any"
    gives = "float"
    moves_pixels = False

    mean: Any = "imagenet"
    std: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.mean, str):
            if self.mean != "imagenet":
                raise ConfigError(f"Normalize: the only named statistics are 'imagenet', got {self.mean!r}")
            object.__setattr__(self, "mean", IMAGENET_MEAN)
            object.__setattr__(self, "std", IMAGENET_STD)
        if self.std is None or len(self.mean) != len(self.std) or min(self.std) <= 0:
            raise ConfigError(f"Normalize needs mean and std with one positive std per channel, got "
                              f"mean={self.mean}, std={self.std}")

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> None:
        return None

    def apply(self, x: torch.Tensor, params: None = None) -> torch.Tensor:
        std = torch.tensor(self.std, dtype=torch.float64)
        scale = (1.0 / std / (255.0 if x.dtype == torch.uint8 else 1.0)).float().view(1, -1, 1, 1)
        shift = (torch.tensor(self.mean, dtype=torch.float64) / std).float().view(1, -1, 1, 1)
        if x.device.type == "cpu" and x.dtype == torch.uint8 and x.dim() == 4:
            out = torch.empty(x.shape, dtype=torch.float32)
            if normalize_by_table(x, all_levels(x.shape[1]).float().mul_(scale).add_(-shift), out):
                return out
        # (x / 255 - mean) / std, in place on the float copy
        return x.float().mul_(host_to_device(scale, x.device)).add_(host_to_device(-shift, x.device))


@dataclass(frozen=True)
class RandomErasing:
    """Batched torchvision RandomErasing on the normalized float batch (in place on the CPU; value 0 = the mean colour,
    "random" = N(0, 1) per pixel), p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3)."""

    stage = BATCH
    takes = "float"
    moves_pixels = False

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: Any = 0

    def __post_init__(self) -> None:
        colour.RandomErasing(self.p, self.scale, self.ratio, self.value)  # the same checks
        object.__setattr__(self, "value", colour._erase_value(self.value))

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, int]:
        """[n, 4] (top, left, h, w), h = 0 where nothing is erased. torchvision's 10 tries,
        vectorised: the first try that fits, then a uniform position."""
        apply = rng.random(n) < self.p
        area = h * w * rng.uniform(self.scale[0], self.scale[1], (n, 10))
        lr = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        aspect = np.exp(rng.uniform(lr[0], lr[1], (n, 10)))
        eh = np.rint(np.sqrt(area * aspect)).astype(np.int64)  # Python's round() is half-even as well
        ew = np.rint(np.sqrt(area / aspect)).astype(np.int64)
        ok = (eh < h) & (ew < w)
        first = np.argmax(ok, axis=1)
        found = ok[np.arange(n), first] & apply
        eh, ew = eh[np.arange(n), first] * found, ew[np.arange(n), first] * found
        top = np.floor(rng.random(n) * (h - eh + 1)).astype(np.int64)
        left = np.floor(rng.random(n) * (w - ew + 1)).astype(np.int64)
        return np.stack([top, left, eh, ew], 1), int(rng.integers(1 << 62))

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, int]) -> torch.Tensor:
        boxes, seed = params
        if not x.dtype.is_floating_point:
            raise ConfigError("RandomErasing (batched) works on the normalized float batch, as torchvision's; put "
                              "it after Normalize, or use stoker.augment_colour.RandomErasing on uint8 samples")
        n, c, h, w = x.shape
        if x.device.type == "cpu":  # on the CPU a slice per erased box beats full-batch masks
            for k in np.nonzero(boxes[:, 2] > 0)[0]:
                t, l_, bh, bw = (int(v) for v in boxes[k])
                if self.value == "random":
                    gen = torch.Generator().manual_seed(seed + int(k))
                    x[k, :, t:t + bh, l_:l_ + bw] = torch.randn((c, bh, bw), generator=gen).to(x.dtype)
                else:
                    x[k, :, t:t + bh, l_:l_ + bw] = torch.tensor(self._values(c), dtype=x.dtype).view(c, 1, 1)
            return x
        b = host_to_device(boxes, x.device)
        ys = torch.arange(h, device=x.device).view(1, h, 1)
        xs = torch.arange(w, device=x.device).view(1, 1, w)
        t, l_, bh, bw = (b[:, k].view(n, 1, 1) for k in range(4))
        inside = ((ys >= t) & (ys < t + bh) & (xs >= l_) & (xs < l_ + bw)).unsqueeze(1)
        if self.value == "random":
            # drawn on the batch's device: the same for a seed on one kind of device (CPU and CUDA
            # generators differ; the erased boxes do not)
            gen = torch.Generator(device=x.device).manual_seed(seed)
            fill = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32).to(x.dtype)
        else:
            fill = host_to_device(torch.tensor(self._values(c), dtype=x.dtype), x.device).view(1, c, 1, 1)
        return torch.where(inside, fill, x)

    def _values(self, c: int) -> tuple[float, ...]:
        return tuple(self.value[:c]) if len(self.value) >= c else tuple(self.value) * c


class BatchAugment:
    """Batched ops (and optionally Mixup/CutMix) run on whole batches, their randomness a pure
    function of (seed, epoch, batch index): deterministic on any device, and resumable."""

    def __init__(self, ops: Sequence[Any], mix: Mixup | None = None, seed: int = 0) -> None:
        dtype = "uint8"   # what the batch is before each op: the ops declare what they take and give
        for k, op in enumerate(ops):
            if stage_of(op) != BATCH or getattr(op, "mixes_labels", False):
                raise ConfigError(f"batch op #{k} ({op!r}) is not a batched op; use the ones in stoker.transforms.gpu")
            takes = getattr(op, "takes", "any")
            if takes == "float" and dtype == "uint8":
                raise ConfigError(f"{type(op).__name__} (batched) works on the normalized batch, as torchvision's "
                                  f"RandomErasing does: put a Normalize before it")
            if takes == "uint8" and dtype == "float":
                raise ConfigError(f"{type(op).__name__} works on uint8 images: put it before Normalize")
            dtype = getattr(op, "gives", None) or dtype
        self.ops, self.mix, self.seed = list(ops), mix, int(seed)

    def __call__(self, images: torch.Tensor, labels: Any = None, *, epoch: int = 0, batch: int = 0,
                 seed: int | None = None) -> Any:
        """Augment one batch (`images` [B, 3, H, W]; a [B, H, W, 3] batch is viewed as NCHW).
        Returns images, or (images, soft targets) when a Mixup is set."""
        x = images.permute(0, 3, 1, 2) if images.ndim == 4 and images.shape[-1] == 3 and images.shape[1] != 3 \
            else images
        n, _, h, w = x.shape
        seed = self.seed if seed is None else int(seed)
        rng = batch_rng(seed, epoch, batch, tag=_TAG_BATCH_AUG)
        for op in self.ops:
            x = op.apply(x, op.params(rng, n, h, w))
        if self.mix is None:
            return x
        if labels is None:
            raise ConfigError("BatchAugment with mix= needs the labels: call it as batch_aug(images, labels, ...)")
        return self.mix(x, labels, seed=seed, epoch=epoch, batch=batch)

    def over(self, loader: Any) -> Iterator[tuple]:
        """Iterate a stoker Loader, augmenting each batch under the loader's seed (not `self.seed`),
        epoch and batch index: a resumed loader continues exactly."""
        it = iter(loader)
        epoch, start = loader.epoch, loader.state_dict()["batch"]
        for b, batch in enumerate(it, start):
            out = self(batch[0], batch[1], epoch=epoch, batch=b, seed=loader.seed)
            yield (*out, *batch[2:]) if isinstance(out, tuple) else (out, *batch[1:])
