"""Geometric transforms with torchvision's names and semantics, planned before any pixel is touched.

A list such as `[RandomResizedCrop(224), RandomHorizontalFlip()]` or `[Resize(256), CenterCrop(224)]`
compiles into a *plan* per sample: a crop box in source coordinates (floats), an output size and a
mirror flag, plus the region the resampling filter reads (`clip`) and the size it becomes (`grid`).
Plans are computed for a whole batch at once in numpy from the stored image sizes, so the JPEG decoder
can be asked for just enough resolution (DCT scaling, `decode_minimums`) and the crop is resampled
once, straight into its row of the batch (`crop_resize_into`).

Resampling is torchvision's own: `torch.nn.functional.interpolate` on the uint8 image, antialiased
bilinear by default (the triangle filter whose support widens with the shrink factor, as PIL and
`antialias=True` compute it; libtorch's uint8 kernel releases the GIL). Bilinear goes through the
C copy of that kernel (`native.resample`, the same pixels) where the extension is built. `Resize(256)` then
`CenterCrop(224)` resamples the whole image to 256 on the short side and cuts the centre, as
torchvision does, so the filter sees the same pixels at the crop's edges (`resampling`).
`crop_window` is the rounding, clamping and padding maths of the GPU decode path and the label maps.

Each op declares itself planned geometry (`stage = "plan"`, `transforms/kinds.py`): `plan(state, u)`
moves a `PlanState` (the crop box so far, the logical size, the flip, and what the resampling reads)
with its draws, and `fixed_size(size)` says its output size when that does not depend on the image.
`plan_ops` only runs them in order, so a new geometric op is one class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import cv2
import numpy as np

from .. import native
from .._torch import HAVE_TORCH, torch
from ..errors import ConfigError
from .kinds import ENGINE_CENTER, ENGINE_COVER, ENGINE_FLIP, ENGINE_RESIZE, ENGINE_RRC, PLAN

Size = tuple[int, int]
#: torchvision's InterpolationMode values a resize can take (`interpolation=`); PIL-only filters
#: (lanczos, box, hamming) have no uint8 tensor kernel and are refused.
INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic")


def _check_resampling(op: Any) -> None:
    if op.interpolation not in INTERPOLATIONS:
        raise ConfigError(f"{type(op).__name__}: interpolation must be one of {INTERPOLATIONS}, got "
                          f"{op.interpolation!r}")
    if not isinstance(op.antialias, bool):
        raise ConfigError(f"{type(op).__name__}: antialias must be True or False, got {op.antialias!r}")


def _pair(size: int | Sequence[int], name: str) -> Size:
    if isinstance(size, (int, np.integer)):
        pair = (int(size), int(size))
    else:
        seq = tuple(int(s) for s in size)
        if len(seq) == 1:
            seq = (seq[0], seq[0])
        if len(seq) != 2:
            raise ConfigError(f"{name}: size must be an int or (height, width), got {size!r}")
        pair = (seq[0], seq[1])
    if min(pair) < 1:
        raise ConfigError(f"{name}: size must be positive, got {size!r}")
    return pair


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision.transforms.RandomResizedCrop: a random area fraction in `scale` and aspect ratio
    (log-uniform) in `ratio`, 10 tries, then the central-crop fallback; resized to `size` (pixels)
    with `interpolation` ("bilinear", "bicubic", "nearest", "nearest-exact"), antialiased when
    shrinking unless `antialias=False` (torchvision's defaults)."""

    size: Any
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: str = "bilinear"
    antialias: bool = True
    draws = 22  # 10 tries x (area, log-ratio) + (top, left)
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _pair(self.size, "RandomResizedCrop"))
        _check_resampling(self)
        if self.scale[0] > self.scale[1] or self.ratio[0] > self.ratio[1] or self.ratio[0] <= 0:
            raise ConfigError(f"RandomResizedCrop: scale and ratio must be (min, max) with min <= max and "
                              f"ratio > 0, got scale={self.scale}, ratio={self.ratio}")

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        top, left, ch, cw = _plan_rrc(self, state.lh, state.lw, u)
        state.crop(top, left, ch, cw, np.full(state.n, self.size[0]), np.full(state.n, self.size[1]))
        state.resample(self)   # the crop is what gets resampled

    def fixed_size(self, size: Size | None) -> Size | None:
        return self.size

    def engine_args(self) -> tuple[int, tuple[float, ...]]:
        """Its row of the native engine's program (`kinds.engine_program`): opcode, parameters."""
        return ENGINE_RRC, (*self.size, *self.scale, math.log(self.ratio[0]), math.log(self.ratio[1]), *self.ratio)


@dataclass(frozen=True)
class Resize:
    """torchvision.transforms.Resize: an int resizes the shorter side to `size` keeping the aspect
    ratio (the longer side truncated to int); (height, width) resizes to exactly that.
    `interpolation` and `antialias` as in :class:`RandomResizedCrop`."""

    size: Any
    interpolation: str = "bilinear"
    antialias: bool = True
    draws = 0
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        _check_resampling(self)
        if isinstance(self.size, (int, np.integer)):
            if self.size < 1:
                raise ConfigError(f"Resize: size must be positive, got {self.size}")
            object.__setattr__(self, "size", int(self.size))
        else:
            seq = tuple(self.size)
            object.__setattr__(self, "size", int(seq[0]) if len(seq) == 1 else _pair(seq, "Resize"))

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        state.lh, state.lw = _resize_size(self.size, state.lh, state.lw)
        state.resample(self)

    def fixed_size(self, size: Size | None) -> Size | None:
        return self.size if not isinstance(self.size, int) else None

    def engine_args(self) -> tuple[int, tuple[float, ...]]:
        return ENGINE_RESIZE, (self.size, 0, 0) if isinstance(self.size, int) else (-1, *self.size)


@dataclass(frozen=True)
class CenterCrop:
    """torchvision.transforms.CenterCrop: the central `size` region; zero padding where the image is
    smaller than the crop."""

    size: Any
    draws = 0
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _pair(self.size, "CenterCrop"))

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        ch, cw = np.full(state.n, self.size[0]), np.full(state.n, self.size[1])
        top, left = _center_offsets(self.size[0], state.lh), _center_offsets(self.size[1], state.lw)
        state.crop(top, left, ch, cw, ch, cw)

    def fixed_size(self, size: Size | None) -> Size | None:
        return self.size

    def engine_args(self) -> tuple[int, tuple[float, ...]]:
        return ENGINE_CENTER, self.size


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """torchvision.transforms.RandomHorizontalFlip: mirror left-right with probability `p`."""

    p: float = 0.5
    draws = 1
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ConfigError(f"RandomHorizontalFlip: p must be in [0, 1], got {self.p}")

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        state.flip ^= u[:, 0] < self.p

    def fixed_size(self, size: Size | None) -> Size | None:
        return size

    def engine_args(self) -> tuple[int, tuple[float, ...]]:
        return ENGINE_FLIP, (self.p,)


@dataclass(frozen=True)
class CoverCrop:
    """Resize keeping the aspect ratio so the image covers `size` (height, width), then crop `size` out of
    it: at a random place (`crop="random"`, two draws) or the centre (`"center"`). What aspect-ratio buckets
    do to each image (`stoker.AspectBuckets`, SDXL-style training); `cover_crop` gives the resized size and
    the crop's top-left, which the batch hands out as conditioning."""

    size: Any
    crop: str = "random"
    interpolation: str = "bilinear"
    antialias: bool = True
    draws = 2   # top, left
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _pair(self.size, "CoverCrop"))
        _check_resampling(self)
        if self.crop not in ("random", "center"):
            raise ConfigError(f"CoverCrop: crop must be 'random' or 'center', got {self.crop!r}")

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        rh, rw, top, left = cover_crop(self.size, state.lh.astype(np.float64), state.lw.astype(np.float64), u,
                                       self.crop == "random")
        state.lh, state.lw = rh.astype(np.int64), rw.astype(np.int64)
        state.resample(self)
        oh, ow = np.full(state.n, self.size[0]), np.full(state.n, self.size[1])
        state.crop(top.astype(np.int64), left.astype(np.int64), oh, ow, oh, ow)

    def fixed_size(self, size: Size | None) -> Size | None:
        return self.size

    def engine_args(self) -> tuple[int, tuple[float, ...]]:
        return ENGINE_COVER, (*self.size, float(self.crop == "random"))


def cover_crop(size: Size, lh: np.ndarray, lw: np.ndarray, u: np.ndarray, random: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`CoverCrop`'s numbers for images lh x lw (float64): the resized size (rh, rw: the aspect kept, each
    side at least `size`'s) and the crop's top-left in it, from the draws `u` [n, 2], all float64 holding
    integers (csrc/engine.c's plan_cover: the same double-precision steps). Few calls: a batch's
    conditioning is computed with it on the worker threads."""
    oh, ow = size
    scale = np.maximum(oh / lh, ow / lw)
    rh, rw = np.maximum(oh, np.rint(lh * scale)), np.maximum(ow, np.rint(lw * scale))
    if random:
        return rh, rw, np.floor(u[:, 0] * (rh - oh + 1)), np.floor(u[:, 1] * (rw - ow + 1))
    return rh, rw, (rh - oh) // 2, (rw - ow) // 2


@dataclass
class Plan:
    """Where each sample of a batch comes from: `box` float64 [n, 4] (top, left, height, width) in
    source pixels, `size` int64 [n, 2] (height, width) of the result, `flip` bool [n].

    `clip` float64 [n, 4] is the source region torchvision resamples (the crop before its resize, or the
    whole image for a `Resize`): the filter reads nothing outside it; `grid` int64 [n, 2] is the size it
    is resampled to, of which the result is the part `box` maps to. None: `clip` is `box`, `grid` `size`.
    `interpolation` and `antialias` are those of the op that resamples."""

    box: np.ndarray
    size: np.ndarray
    flip: np.ndarray
    clip: np.ndarray | None = None
    grid: np.ndarray | None = None
    interpolation: str = "bilinear"
    antialias: bool = True


class PlanState:
    """A batch's plan while its ops are composed: `box` float64 [n, 4] (top, left, height, width) in
    source pixels, the logical image (the box resampled to `lh` x `lw`, int64 [n], mirrored where
    `flip`). A geometric op's `plan` resizes the logical image (set `lh`, `lw`), flips it (`flip`) or
    crops it (`crop`)."""

    def __init__(self, heights: np.ndarray, widths: np.ndarray) -> None:
        self.lh = np.array(heights, dtype=np.int64)  # copies: the ops replace or change them
        self.lw = np.array(widths, dtype=np.int64)
        self.n = len(self.lh)
        # what the resampling reads (`clip`, source pixels) and the size it makes of it (`grid`)
        self.grid = _pairs(self.lh, self.lw)
        self.box = np.zeros((self.n, 4), dtype=np.float64)
        self.box[:, 2:4] = self.grid
        self.flip = np.zeros(self.n, dtype=bool)
        self.clip = self.box.copy()
        self.resampled, self.interpolation, self.antialias = False, "bilinear", True

    def resample(self, op: Any) -> None:
        """`op` (a Resize or RandomResizedCrop) resamples the logical image: the filter reads the box
        so far and makes the logical size of it, with the op's interpolation."""
        self.clip, self.grid = self.box.copy(), _pairs(self.lh, self.lw)
        self.resampled, self.interpolation, self.antialias = True, op.interpolation, op.antialias

    def crop(self, top: np.ndarray, left: np.ndarray, ch: np.ndarray, cw: np.ndarray, new_h: np.ndarray,
             new_w: np.ndarray) -> None:
        """Crop the logical image to rows top..top+ch, columns left..left+cw (pixels, may leave the
        image: padding), which becomes new_h x new_w."""
        box, lh, lw = self.box, self.lh, self.lw
        sy, sx = box[:, 2] / lh, box[:, 3] / lw
        left_src = np.where(self.flip, lw - left - cw, left)
        box[:, 0] += top * sy
        box[:, 1] += left_src * sx
        box[:, 2] = ch * sy
        box[:, 3] = cw * sx
        self.lh, self.lw = new_h.astype(np.int64), new_w.astype(np.int64)
        if not self.resampled:  # nothing resampled yet: the crop is what gets resampled
            self.clip, self.grid = self.box.copy(), _pairs(self.lh, self.lw)

    def result(self) -> Plan:
        return Plan(box=self.box, size=_pairs(self.lh, self.lw), flip=self.flip, clip=self.clip,
                    grid=self.grid, interpolation=self.interpolation, antialias=self.antialias)


def _pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int64 [n, 2] of columns `a`, `b`: `np.stack(axis=1)` in three C calls (planned once per batch)."""
    out = np.empty((len(a), 2), np.int64)
    out[:, 0], out[:, 1] = a, b
    return out


def _plan_rrc(op: RandomResizedCrop, lh: np.ndarray, lw: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, ...]:
    """Vectorised torchvision RandomResizedCrop.get_params on logical sizes (lh, lw)."""
    area = (lh * lw).astype(np.float64)[:, None]
    target = area * (op.scale[0] + (op.scale[1] - op.scale[0]) * u[:, 0:10])
    lr0, lr1 = math.log(op.ratio[0]), math.log(op.ratio[1])
    aspect = np.exp(lr0 + (lr1 - lr0) * u[:, 10:20])
    w = np.rint(np.sqrt(target * aspect))
    h = np.rint(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= lw[:, None]) & (h > 0) & (h <= lh[:, None])
    first = np.argmax(ok, axis=1)
    rows = np.arange(len(first))
    w_t, h_t = w[rows, first].astype(np.int64), h[rows, first].astype(np.int64)
    top = np.floor(u[:, 20] * (lh - h_t + 1)).astype(np.int64)
    left = np.floor(u[:, 21] * (lw - w_t + 1)).astype(np.int64)
    found = ok.any(axis=1)
    if found.all():  # the usual batch: no fallback to plan (planned once per batch)
        return top, left, h_t, w_t
    # Fallback after 10 failed tries: the central crop at the nearest allowed aspect ratio.
    in_ratio = lw / lh
    fw = np.where(in_ratio < op.ratio[0], lw, np.where(in_ratio > op.ratio[1], np.rint(lh * op.ratio[1]), lw))
    fh = np.where(in_ratio < op.ratio[0], np.rint(lw / op.ratio[0]), lh)
    fw, fh = fw.astype(np.int64), fh.astype(np.int64)
    h_out = np.where(found, h_t, fh)
    w_out = np.where(found, w_t, fw)
    top = np.where(found, top, (lh - fh) // 2)
    left = np.where(found, left, (lw - fw) // 2)
    return top, left, h_out, w_out


def _resize_size(size: int | Size, lh: np.ndarray, lw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(size, int):
        return np.full_like(lh, size[0]), np.full_like(lw, size[1])
    w_short = lw <= lh  # torchvision: the shorter side becomes `size`, the longer one is truncated
    short = np.where(w_short, lw, lh)
    long_ = np.where(w_short, lh, lw)
    new_long = (size * long_.astype(np.float64) / short).astype(np.int64)
    return np.where(w_short, new_long, size), np.where(w_short, size, new_long)


def _center_offsets(crop: int, have: np.ndarray) -> np.ndarray:
    pad = crop > have
    return np.where(pad, -((crop - have) // 2), np.rint((have - crop) / 2.0)).astype(np.int64)


def plan_ops(ops: Sequence[Any], offsets: Sequence[int], heights: np.ndarray, widths: np.ndarray,
             u: np.ndarray) -> Plan:
    """Compose planned geometric ops (each reading its `draws` columns of `u`, from its offset) into
    one crop box per sample (source coordinates), an output size and a mirror flag. The logical image
    is the box resampled to `size`, mirrored when `flip`.

    Several resizes in a row are fused into one resampling (of the last resize's region, clipped to it)."""
    state = PlanState(heights, widths)
    for op, off in zip(ops, offsets):
        op.plan(state, u[:, off:off + op.draws])
    return state.result()


#: The DCT-scaled decode keeps at least this many times the output resolution, so the antialiasing
#: filter does the last halving. Measured on the photographs of tests/test_torchvision_pixels.py (the
#: RandomResizedCrop(224) crops large enough to be DCT-scaled): with 1x they came out 3.4% less sharp than
#: torchvision's (mean gradient, KS p = 1e-9 over 403 crops; the scaled IDCT's low-pass adds to the
#: filter's), with 1.5x 1% (p = 0.002), with 2x indistinguishable (p = 0.24).
AA_HEADROOM = 2.0


def decode_minimums(box: Sequence[float], out_h: int, out_w: int, src_h: int, src_w: int,
                    headroom: float = AA_HEADROOM) -> tuple[int, int]:
    """Smallest full-image (height, width), in pixels, whose version of `box` still has `headroom`
    times the output resolution: what to ask a DCT-scaling JPEG decoder for."""
    bh, bw = max(float(box[2]), 1e-9), max(float(box[3]), 1e-9)
    return (min(src_h, math.ceil(src_h * out_h * headroom / bh - 1e-6)),
            min(src_w, math.ceil(src_w * out_w * headroom / bw - 1e-6)))


@dataclass(frozen=True)
class CropWindow:
    """Integer geometry of one crop: which source pixels are read and where they land in the output.

    `src` = (y0, y1, x0, x1): rows and columns of the source (possibly a DCT-scaled version of the
    full image) to read; `dst` = (y0, y1, x0, x1): the part of the output that receives them,
    resized; the rest of the output is zero. `padded` is True when the box leaves the image
    (CenterCrop larger than it), so `dst` is smaller than the output. Neither window is ever empty."""

    src: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]
    padded: bool


def crop_window(box: Sequence[float], src_h: int, src_w: int, full_h: int, full_w: int, out_h: int,
                out_w: int) -> CropWindow:
    """Where `box` (top, left, height, width in a full_h x full_w image, pixels) lies in a
    src_h x src_w version of that image, and which part of an out_h x out_w output it fills.

    The one place the rounding, clamping and padding maths live: the CPU path
    (:func:`crop_resize_into`) and the GPU path (``gpu_decode``) crop exactly the same pixels."""
    fy, fx = src_h / full_h, src_w / full_w
    y0, x0 = box[0] * fy, box[1] * fx
    y1, x1 = y0 + box[2] * fy, x0 + box[3] * fx
    ry0, rx0, ry1, rx1 = round(y0), round(x0), round(y1), round(x1)
    iy0, ix0 = min(src_h - 1, max(0, ry0)), min(src_w - 1, max(0, rx0))
    iy1, ix1 = min(src_h, max(iy0 + 1, ry1)), min(src_w, max(ix0 + 1, rx1))
    if not (ry0 < 0 or rx0 < 0 or ry1 > src_h or rx1 > src_w):
        return CropWindow((iy0, iy1, ix0, ix1), (0, out_h, 0, out_w), False)
    # The box leaves the image (CenterCrop larger than it): the part inside is resized into its
    # share of the output and the rest stays zero, as torchvision's padding does. A degenerate box
    # (no height or width) would divide by zero: treat it as a sliver.
    bh, bw = max(y1 - y0, 1e-9), max(x1 - x0, 1e-9)
    ty0 = min(out_h - 1, max(0, round((iy0 - y0) * out_h / bh)))
    tx0 = min(out_w - 1, max(0, round((ix0 - x0) * out_w / bw)))
    ty1 = max(ty0 + 1, min(out_h, round((iy1 - y0) * out_h / bh)))
    tx1 = max(tx0 + 1, min(out_w, round((ix1 - x0) * out_w / bw)))
    return CropWindow((iy0, iy1, ix0, ix1), (ty0, ty1, tx0, tx1), True)


@dataclass(frozen=True)
class Resampling:
    """Integer geometry of one sample's resampling, on a (possibly DCT-scaled) decoded image.

    `src` = (y0, y1, x0, x1): the pixels the filter reads (the plan's `clip`, inside the image), with
    `pad` = (top, bottom, left, right) rows and columns of zeros around them where the clip leaves the
    image (a `CenterCrop` larger than the image, before a resize: torchvision pads, then resizes);
    they are resampled to `size` (height, width) and placed with their top-left at `place` (y, x) of
    the output, which may be negative (only part of them is the output, as `CenterCrop` after `Resize`)
    or leave zeros around them (a `CenterCrop` larger than the resized image). Never empty."""

    src: tuple[int, int, int, int]
    size: tuple[int, int]
    place: tuple[int, int]
    pad: tuple[int, int, int, int] = (0, 0, 0, 0)


def _axis(b0: float, blen: float, c0: float, clen: float, g: int, s: int, f: float,
          trim: bool) -> tuple[int, ...]:
    """One axis of :func:`resampling`: source pixels (w0, w1), zeros before and after them, the
    resampled length and its placement in the output."""
    c0s, c1s = c0 * f, (c0 + clen) * f
    r0, r1 = round(c0s), round(c1s)
    w0 = min(s - 1, max(0, r0))
    w1 = min(s, max(w0 + 1, r1))
    out0 = round((b0 - c0) * g / max(clen, 1e-9))  # where the output starts in the grid
    pad0, pad1 = max(0, w0 - r0), max(0, r1 - w1)
    if pad0 or pad1:  # the clip leaves the image: pad it with zeros, resample all of it
        return w0, w1, pad0, pad1, g, -out0
    k = g / max(c1s - c0s, 1e-9)  # grid pixels per source pixel
    if trim:  # only the output's share of the clip, plus what the filter reads around it (bicubic: 2 taps)
        margin = 2.0 * max(1.0, 1.0 / k) + 1.0
        lo, hi = max(w0, math.floor(b0 * f - margin)), min(w1, math.ceil((b0 + blen) * f + margin))
        if hi > lo:
            w0, w1 = lo, hi
    g0 = round((w0 - c0s) * k)
    g1 = max(g0 + 1, round((w1 - c0s) * k))
    return w0, w1, 0, 0, g1 - g0, g0 - out0


def resampling(box: Sequence[float], src_h: int, src_w: int, full_h: int, full_w: int,
               clip: Sequence[float] | None = None, grid: Sequence[int] | None = None,
               size: Sequence[int] | None = None, trim: bool = False) -> Resampling:
    """Where the plan's `clip` (top, left, height, width in a full_h x full_w image, pixels) lies in a
    src_h x src_w version of that image, the size it is resampled to (its share of `grid`) and where
    the output (`box`, of `size`) lies in it. Without `clip`, the box itself is resampled to `size`.

    `trim`: read only the part of the clip the output needs (its box and the filter's reach), resampled
    to its share of the grid rounded to whole pixels: up to half an output pixel off torchvision's grid
    (the DCT-scaled path, which is not torchvision's pixels anyway), for less to decode and resample
    when a `CenterCrop` follows a `Resize`."""
    if clip is None or grid is None:
        clip, grid = box, size
    fy, fx = src_h / full_h, src_w / full_w
    y0, y1, top, bottom, rh, py = _axis(float(box[0]), float(box[2]), float(clip[0]), float(clip[2]), int(grid[0]),
                                        src_h, fy, trim)
    x0, x1, left, right, rw, px = _axis(float(box[1]), float(box[3]), float(clip[1]), float(clip[3]), int(grid[1]),
                                        src_w, fx, trim)
    return Resampling((y0, y1, x0, x1), (rh, rw), (py, px), (top, bottom, left, right))


_BILINEAR_AA = torch.ops.aten._upsample_bilinear2d_aa.out  # F.interpolate's kernel, with an out= (the batch row)


def _mode(interpolation: str, antialias: bool) -> tuple[str, dict[str, Any]]:
    if interpolation in ("bilinear", "bicubic"):
        return interpolation, {"align_corners": False, "antialias": antialias}
    return interpolation, {}


def resample(src: np.ndarray, dst: np.ndarray, interpolation: str = "bilinear", antialias: bool = True) -> None:
    """Resample the uint8 HWC image `src` into `dst` (its own height and width) exactly as torchvision's
    `resize(..., interpolation, antialias)` does on a uint8 tensor: the same libtorch kernels."""
    if src.shape[:2] == dst.shape[:2]:
        dst[...] = src
        return
    if interpolation == "bilinear" and native.resample(src, dst, antialias):  # the same pixels, no torch call
        return
    if not dst.flags.c_contiguous:  # a window of a row (padding): the kernels write whole channels-last images
        whole = np.empty(dst.shape, np.uint8)
        resample(src, whole, interpolation, antialias)
        dst[...] = whole
        return
    if not HAVE_TORCH:   # NumPy output without torch installed: Pillow's filters (below)
        _resample_pillow(src, dst, interpolation)
        return
    if not src.flags.writeable:   # raw pixels mapped from a shard (small): torch takes writable arrays only
        src = src.copy()
    # rows cut from a wider image: the uint8 kernels are fast only on dense channels-last memory
    x = torch.from_numpy((src if src.flags.c_contiguous else np.ascontiguousarray(src)).transpose(2, 0, 1)[None])
    out = torch.from_numpy(dst.transpose(2, 0, 1)[None])
    if antialias and interpolation == "bilinear":  # the common case: straight into the batch row, channels last
        _BILINEAR_AA(x, dst.shape[:2], False, None, None, out=out)
        return
    mode, kw = _mode(interpolation, antialias)
    out.copy_(torch.nn.functional.interpolate(x, size=list(dst.shape[:2]), mode=mode, **kw))


def _resample_pillow(src: np.ndarray, dst: np.ndarray, interpolation: str) -> None:
    """`resample` where torch is not installed (`Loader(device="numpy")`): Pillow's resize, whose bilinear
    and bicubic filters widen with the shrink as torchvision's antialiased ones do (torchvision's kernel
    follows PIL's), so the pixels agree within a level or two; `antialias=False` has no Pillow twin."""
    from PIL import Image

    filters = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
               "nearest": Image.Resampling.NEAREST, "nearest-exact": Image.Resampling.NEAREST}
    img = Image.fromarray(np.ascontiguousarray(src))
    dst[...] = np.asarray(img.resize((dst.shape[1], dst.shape[0]), filters[interpolation]))


def resample_region_into(region: np.ndarray, r: Resampling, dst: np.ndarray, flip: bool,
                         interpolation: str = "bilinear", antialias: bool = True) -> None:
    """`region` holds the source pixels `r.src` (cut from a decoded image, or decoded alone by a region
    decoder): resample them into `dst` as `r` says, zeros where nothing lands, mirrored when `flip`."""
    (rh, rw), (py, px) = r.size, r.place
    oh, ow = dst.shape[:2]
    if any(r.pad):
        top, bottom, left, right = r.pad
        region = cv2.copyMakeBorder(region, top, bottom, left, right, cv2.BORDER_CONSTANT, value=0)
    if (py, px) == (0, 0) and (rh, rw) == (oh, ow):
        resample(region, dst, interpolation, antialias)
    else:
        y0, y1, x0, x1 = max(py, 0), min(py + rh, oh), max(px, 0), min(px + rw, ow)
        if not (y0 == 0 and x0 == 0 and y1 == oh and x1 == ow):
            dst[...] = 0
        if y1 > y0 and x1 > x0:
            if y0 - py == 0 and x0 - px == 0 and (y1 - y0, x1 - x0) == (rh, rw):
                resample(region, dst[y0:y1, x0:x1], interpolation, antialias)
            else:
                whole = np.empty((rh, rw, 3), np.uint8)
                resample(region, whole, interpolation, antialias)
                dst[y0:y1, x0:x1] = whole[y0 - py:y1 - py, x0 - px:x1 - px]
    if flip:
        cv2.flip(dst, 1, dst=dst)


def crop_resize_into(src: np.ndarray, box: Sequence[float], dst: np.ndarray, flip: bool, full_h: int, full_w: int,
                     clip: Sequence[float] | None = None, grid: Sequence[int] | None = None,
                     interpolation: str = "bilinear", antialias: bool = True) -> None:
    """Resample the region `box` (top, left, height, width in a full_h x full_w image) of `src` into `dst`.

    `src` may be a DCT-scaled version of the full image: the box is mapped to its scale. `clip` and
    `grid` are the plan's (what torchvision resamples, and to which size; default: the box, to `dst`'s
    size). Parts of the box outside the image become zeros (CenterCrop padding)."""
    r = resampling(box, src.shape[0], src.shape[1], full_h, full_w, clip, grid, dst.shape[:2])
    y0, y1, x0, x1 = r.src
    resample_region_into(src[y0:y1, x0:x1], r, dst, flip, interpolation, antialias)
