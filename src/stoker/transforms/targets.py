"""Boxes and masks that follow the planned geometry (crop, resize, flip) of their image.

A sample's plan (`geometry.plan_ops`) says which source region `box` = (top, left, height, width),
in source pixels, becomes the output of `size` (height, width), mirrored when `flip`. The image is
resampled with that mapping (`geometry.crop_resize_into`); a box or a mask goes through the same one:

    x_out = (x_src - left) * out_w / width         (then x_out -> out_w - x_out when flipped)
    y_out = (y_src - top) * out_h / height

Boxes are `[k, 4]` (x0, y0, x1, y1) in pixel-edge coordinates (COCO's `[x, y, w, h]` converts with
`xywh_to_xyxy`), clipped to the output; a box that leaves the crop keeps its row with zero width or
height, so per-box labels stay aligned (drop them with `visible(boxes)`). Masks are resampled with
nearest neighbour through the same crop window as the image. The image's crop window is rounded to
whole pixels of the (possibly DCT-scaled) decoded image, so a box edge can sit up to one output
pixel from the drawn edge (tests/test_augment_targets.py draws boxes into images to check it).
"""

from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np

from .geometry import crop_window


def xywh_to_xyxy(boxes: np.ndarray | Sequence[float]) -> np.ndarray:
    """COCO `[x, y, width, height]` rows to `[x0, y0, x1, y1]`, float32 [k, 4]."""
    b = np.asarray(boxes, np.float32).reshape(-1, 4)
    return np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], axis=1)


def boxes_through(boxes: np.ndarray, box: Sequence[float], size: Sequence[int], flip: bool) -> np.ndarray:
    """Boxes [k, 4] (x0, y0, x1, y1, source pixels) in the output of one sample's plan, float32, clipped."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    top, left, height, width = (float(v) for v in box)
    out_h, out_w = int(size[0]), int(size[1])
    sx, sy = out_w / max(width, 1e-9), out_h / max(height, 1e-9)
    x = (b[:, [0, 2]] - left) * sx
    y = (b[:, [1, 3]] - top) * sy
    if flip:
        x = out_w - x[:, ::-1]
    x = np.clip(x, 0, out_w)
    y = np.clip(y, 0, out_h)
    return np.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], axis=1).astype(np.float32)


def visible(boxes: np.ndarray) -> np.ndarray:
    """bool [k]: boxes with a positive width and height (still in the picture)."""
    return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])


def mask_through(mask: np.ndarray, box: Sequence[float], size: Sequence[int], flip: bool) -> np.ndarray:
    """A mask (HxW, any integer or bool dtype: class ids, instance ids) in the output of one sample's plan:
    the image's crop window, resampled with nearest neighbour, zero outside the image."""
    h, w = mask.shape[:2]
    out = np.zeros((int(size[0]), int(size[1])) + mask.shape[2:], dtype=mask.dtype)
    win = crop_window(box, h, w, h, w, out.shape[0], out.shape[1])
    sy0, sy1, sx0, sx1 = win.src
    ty0, ty1, tx0, tx1 = win.dst
    src = mask[sy0:sy1, sx0:sx1]
    as_u8 = src.view(np.uint8) if src.dtype == np.bool_ else src
    resized = cv2.resize(np.ascontiguousarray(as_u8), (tx1 - tx0, ty1 - ty0), interpolation=cv2.INTER_NEAREST_EXACT)
    out[ty0:ty1, tx0:tx1] = resized.view(np.bool_) if src.dtype == np.bool_ else resized.reshape(
        out[ty0:ty1, tx0:tx1].shape)
    return out[:, ::-1].copy() if flip else out
