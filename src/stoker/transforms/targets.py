"""Boxes and masks that follow the planned geometry (crop, resize, flip) of their image.

A sample's plan (`geometry.plan_ops`) says which source region `box` = (top, left, height, width),
in source pixels, becomes the output of `size` (height, width), mirrored when `flip`. The image is
resampled with that mapping (`geometry.crop_resize_into`); a box or a mask goes through the same one:

    x_out = (x_src - left) * out_w / width         (then x_out -> out_w - x_out when flipped)
    y_out = (y_src - top) * out_h / height

Boxes are `[k, 4]` (x0, y0, x1, y1) in pixel-edge coordinates (COCO's `[x, y, w, h]` converts with
`xywh_to_xyxy`), clipped to the output; a box that leaves the crop keeps its row with zero width or
height, so per-box labels stay aligned (drop them with `visible(boxes)`). Label-map masks are resampled
with nearest neighbour through the same crop window as the image (`mask_through`, the ignore id where
the geometry pads) and batched by `stack_label_maps`; instance masks
stored as polygons (what the "coco" source packs) have their vertices moved by the mapping above and
are filled at the output size (`polygons_through`), so they need no resampling at all. The image's crop window is rounded to
whole pixels of the (possibly DCT-scaled) decoded image, so a box edge can sit up to one output
pixel from the drawn edge (tests/test_augment_targets.py draws boxes into images to check it).
"""

from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np

from .._torch import torch
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


def mask_through(mask: np.ndarray, box: Sequence[float], size: Sequence[int], flip: bool,
                 fill: int = 0) -> np.ndarray:
    """A mask (HxW, any integer or bool dtype: class ids, instance ids) in the output of one sample's plan:
    the image's crop window, resampled with nearest neighbour, ``fill`` outside the image (where the
    geometry pads: a CenterCrop larger than the image; 255, the usual ignore id, for label maps)."""
    h, w = mask.shape[:2]
    out = np.full((int(size[0]), int(size[1])) + mask.shape[2:], fill, dtype=mask.dtype)
    win = crop_window(box, h, w, h, w, out.shape[0], out.shape[1])
    sy0, sy1, sx0, sx1 = win.src
    ty0, ty1, tx0, tx1 = win.dst
    src = mask[sy0:sy1, sx0:sx1]
    as_u8 = src.view(np.uint8) if src.dtype == np.bool_ else src
    resized = cv2.resize(np.ascontiguousarray(as_u8), (tx1 - tx0, ty1 - ty0), interpolation=cv2.INTER_NEAREST_EXACT)
    out[ty0:ty1, tx0:tx1] = resized.view(np.bool_) if src.dtype == np.bool_ else resized.reshape(
        out[ty0:ty1, tx0:tx1].shape)
    return out[:, ::-1].copy() if flip else out


#: sub-pixel bits for cv2.fillPoly: vertices are placed to 1/16 pixel
_SHIFT = 4


def polygons_through(points: np.ndarray | Sequence[float], lengths: Sequence[int], owners: Sequence[int],
                     count: int, image_size: Sequence[int], box: Sequence[float], size: Sequence[int],
                     flip: bool) -> np.ndarray:
    """Instance masks uint8 ``[count, H, W]`` (0/1) in the output of one sample's plan.

    ``points`` are the polygons' vertices flattened (x, y, x, y, ... as fractions of the image width and
    height, pixel-edge coordinates as in COCO), ``lengths`` the vertex count of each polygon, ``owners``
    the instance (box row, ``0 <= owner < count``) each polygon belongs to; ``image_size`` is the stored
    (height, width). Vertices go through the same mapping as boxes, then each instance's polygons are
    filled together (cv2.fillPoly at 1/16 pixel: a pixel is in when its centre lies inside or on the
    outline, rounded to whole pixels, so an edge can sit one pixel from the box's edge; polygons of one instance combine
    even-odd, so a hole given as a second polygon stays empty). An instance cropped away gives an empty
    mask in its row.
    """
    out_h, out_w = int(size[0]), int(size[1])
    masks = np.zeros((count, out_h, out_w), np.uint8)
    xy = np.asarray(points, np.float64).reshape(-1, 2)
    if not len(xy):
        return masks
    img_h, img_w = float(image_size[0]), float(image_size[1])
    top, left, height, width = (float(v) for v in box)
    x = (xy[:, 0] * img_w - left) * (out_w / max(width, 1e-9))
    y = (xy[:, 1] * img_h - top) * (out_h / max(height, 1e-9))
    if flip:
        x = out_w - x
    # pixel-edge coordinates -> cv2's pixel-centre coordinates, fixed point
    fixed = np.round(np.stack([x - 0.5, y - 0.5], axis=1) * (1 << _SHIFT))
    fixed = np.clip(fixed, -(1 << 24), 1 << 24).astype(np.int32)
    ends = np.cumsum(np.asarray(lengths, np.int64))
    starts = ends - np.asarray(lengths, np.int64)
    owners = np.asarray(owners, np.int64)
    for k in np.unique(owners):
        polys = [fixed[a:b] for a, b, o in zip(starts, ends, owners) if o == k and b - a >= 3]
        if polys:
            cv2.fillPoly(masks[k], polys, 1, lineType=cv2.LINE_8, shift=_SHIFT)
    return masks


def stack_label_maps(rows: Sequence[np.ndarray]) -> torch.Tensor | list[np.ndarray]:
    """A batch's label maps as one tensor ``[B, H, W]`` when their sizes agree (uint8 when every map
    is uint8, else int32), else the list as it is (images of different sizes, ``pad=True``)."""
    out = stack_label_map_arrays(rows)
    return torch.from_numpy(out) if isinstance(out, np.ndarray) else out


def stack_label_map_arrays(rows: Sequence[np.ndarray]) -> np.ndarray | list[np.ndarray]:
    """`stack_label_maps` as one numpy array (NumPy output)."""
    if not rows or any(r.shape != rows[0].shape for r in rows):
        return list(rows)
    dtype = np.uint8 if all(r.dtype == np.uint8 for r in rows) else np.int32
    return np.stack([r.astype(dtype, copy=False) for r in rows])


def pad_batch(rows: Sequence[np.ndarray | torch.Tensor], fill: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length targets of a batch (boxes ``[k, 4]``, masks ``[k, H, W]``, ...) as one tensor
    ``[B, K, ...]`` padded with ``fill`` (K the longest row, at least 1), plus ``sizes`` int64 ``[B]``:
    row ``i`` holds ``sizes[i]`` real entries. Every row must agree on the shape after its first axis."""
    tensors = [torch.as_tensor(r) for r in rows]
    if not tensors:
        raise ValueError("pad_batch needs at least one row")
    tail = tensors[0].shape[1:]
    bad = [i for i, t in enumerate(tensors) if t.shape[1:] != tail]
    if bad:
        raise ValueError(f"pad_batch: row {bad[0]} has shape {tuple(tensors[bad[0]].shape)}, row 0 has "
                         f"{tuple(tensors[0].shape)}; rows may differ only in their first axis")
    sizes = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    out = torch.full((len(tensors), max(1, int(sizes.max())), *tail), fill, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, :t.shape[0]] = t
    return out, sizes
