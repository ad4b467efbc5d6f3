"""Geometric transforms with torchvision's names and semantics, planned before any pixel is touched.

A list such as `[RandomResizedCrop(224), RandomHorizontalFlip()]` or `[Resize(256), CenterCrop(224)]`
compiles into a *plan* per sample: a crop box in source coordinates (floats), an output size and a
mirror flag. Plans are computed for a whole batch at once in numpy from the stored image sizes, so the
JPEG decoder can be asked for just enough resolution (DCT scaling, `decode_minimums`) and the crop is
resized once, straight into its row of the batch (`crop_resize_into`). `crop_window` is the one home
of the rounding, clamping and padding maths, shared with the GPU decode path.

Each op declares itself planned geometry (`stage = "plan"`, `transforms/kinds.py`): `plan(state, u)`
moves a `PlanState` (the crop box so far, the logical size, the flip) with its draws, and
`fixed_size(size)` says its output size when that does not depend on the image. `plan_ops` only
runs them in order, so a new geometric op is one class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import cv2
import numpy as np

from ..errors import ConfigError
from .kinds import PLAN

Size = tuple[int, int]
#: Shrink factor from which resizing uses area averaging (antialiased) instead of bilinear.
AREA_FROM = 2.0


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
    (log-uniform) in `ratio`, 10 tries, then the central-crop fallback; resized to `size` (pixels)."""

    size: Any
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    draws = 22  # 10 tries x (area, log-ratio) + (top, left)
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _pair(self.size, "RandomResizedCrop"))
        if self.scale[0] > self.scale[1] or self.ratio[0] > self.ratio[1] or self.ratio[0] <= 0:
            raise ConfigError(f"RandomResizedCrop: scale and ratio must be (min, max) with min <= max and "
                              f"ratio > 0, got scale={self.scale}, ratio={self.ratio}")

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        top, left, ch, cw = _plan_rrc(self, state.lh, state.lw, u)
        state.crop(top, left, ch, cw, np.full(state.n, self.size[0]), np.full(state.n, self.size[1]))

    def fixed_size(self, size: Size | None) -> Size | None:
        return self.size


@dataclass(frozen=True)
class Resize:
    """torchvision.transforms.Resize: an int resizes the shorter side to `size` keeping the aspect
    ratio (the longer side truncated to int); (height, width) resizes to exactly that."""

    size: Any
    draws = 0
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        if isinstance(self.size, (int, np.integer)):
            if self.size < 1:
                raise ConfigError(f"Resize: size must be positive, got {self.size}")
            object.__setattr__(self, "size", int(self.size))
        else:
            seq = tuple(self.size)
            object.__setattr__(self, "size", int(seq[0]) if len(seq) == 1 else _pair(seq, "Resize"))

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        state.lh, state.lw = _resize_size(self.size, state.lh, state.lw)

    def fixed_size(self, size: Size | None) -> Size | None:
        return self.size if not isinstance(self.size, int) else None


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


@dataclass
class Plan:
    """Where each sample of a batch comes from: `box` float64 [n, 4] (top, left, height, width) in
    source pixels, `size` int64 [n, 2] (height, width) of the result, `flip` bool [n]."""

    box: np.ndarray
    size: np.ndarray
    flip: np.ndarray


class PlanState:
    """A batch's plan while its ops are composed: `box` float64 [n, 4] (top, left, height, width) in
    source pixels, the logical image (the box resampled to `lh` x `lw`, int64 [n], mirrored where
    `flip`). A geometric op's `plan` resizes the logical image (set `lh`, `lw`), flips it (`flip`) or
    crops it (`crop`)."""

    def __init__(self, heights: np.ndarray, widths: np.ndarray) -> None:
        self.lh = np.asarray(heights, dtype=np.int64).copy()
        self.lw = np.asarray(widths, dtype=np.int64).copy()
        self.n = len(self.lh)
        self.box = np.zeros((self.n, 4), dtype=np.float64)
        self.box[:, 2], self.box[:, 3] = self.lh, self.lw
        self.flip = np.zeros(self.n, dtype=bool)

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

    def result(self) -> Plan:
        return Plan(box=self.box, size=np.stack([self.lh, self.lw], axis=1), flip=self.flip)


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
    found = ok[np.arange(len(first)), first]
    rows = np.arange(len(first))
    w_t, h_t = w[rows, first].astype(np.int64), h[rows, first].astype(np.int64)
    top = np.floor(u[:, 20] * (lh - h_t + 1)).astype(np.int64)
    left = np.floor(u[:, 21] * (lw - w_t + 1)).astype(np.int64)
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
    is the box resampled to `size`, mirrored when `flip`."""
    state = PlanState(heights, widths)
    for op, off in zip(ops, offsets):
        op.plan(state, u[:, off:off + op.draws])
    return state.result()


def decode_minimums(box: Sequence[float], out_h: int, out_w: int, src_h: int, src_w: int) -> tuple[int, int]:
    """Smallest full-image (height, width), in pixels, whose version of `box` still has at least the
    output resolution: what to ask a DCT-scaling JPEG decoder for."""
    bh, bw = max(float(box[2]), 1e-9), max(float(box[3]), 1e-9)
    return min(src_h, math.ceil(src_h * out_h / bh - 1e-6)), min(src_w, math.ceil(src_w * out_w / bw - 1e-6))


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


def crop_resize_into(src: np.ndarray, box: Sequence[float], dst: np.ndarray, flip: bool,
                     full_h: int, full_w: int) -> None:
    """Resize the region `box` (top, left, height, width in a full_h x full_w image) of `src` into `dst`.

    `src` may be a DCT-scaled version of the full image: the box is mapped to its scale. Bilinear
    interpolation, or area averaging when shrinking by `AREA_FROM` or more (antialiased). Parts of
    the box outside the image become zeros (CenterCrop padding). The geometry is :func:`crop_window`."""
    win = crop_window(box, src.shape[0], src.shape[1], full_h, full_w, dst.shape[0], dst.shape[1])
    sy0, sy1, sx0, sx1 = win.src
    resize_window_into(src[sy0:sy1, sx0:sx1], win, dst, flip)


def resize_window_into(region: np.ndarray, win: CropWindow, dst: np.ndarray, flip: bool) -> None:
    """The second half of :func:`crop_resize_into`: `region` holds the source pixels `win.src` (cut
    from a decoded image, or decoded alone by a region decoder); resize them into `win.dst` of `dst`."""
    target = dst
    if win.padded:
        dst[...] = 0
        ty0, ty1, tx0, tx1 = win.dst
        target = dst[ty0:ty1, tx0:tx1]
    th, tw = target.shape[:2]
    # Measured (docs/decoding.md): after DCT scaling the shrink left is below 2x, where bilinear is
    # within ~0.5 dB of PIL's antialiased bilinear and 3-5x faster than area; area only beyond 2x.
    heavy = region.shape[0] >= AREA_FROM * th and region.shape[1] >= AREA_FROM * tw
    cv2.resize(region, (tw, th), dst=target, interpolation=cv2.INTER_AREA if heavy else cv2.INTER_LINEAR)
    if flip:
        cv2.flip(dst, 1, dst=dst)
