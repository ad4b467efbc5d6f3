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

The Loader's workers use them through one small protocol, `Target`, with one class per kind
(`Boxes`, `InstanceMasks`, `LabelMap`): `read` a sample's stored value while the batch is planned,
`place` it in the sample's output (`Placement`) on a worker thread, `collate` a batch of them. A new
kind of target is one such class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import cv2
import numpy as np

from .._torch import torch
from .. import codecs
from ..errors import ImageError
from .geometry import Plan, crop_window


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


def fill_even_odd(xs: np.ndarray, ys: np.ndarray, starts: np.ndarray, ends: np.ndarray, out: np.ndarray) -> None:
    """Set to 1 the pixels of ``out`` (uint8 [H, W]) whose centre lies inside the closed polygons
    ``(xs[a:b], ys[a:b])`` for each ``a, b`` of ``starts, ends`` (pixel-edge coordinates), combined
    even-odd (a polygon inside another is a hole, a self-crossing one alternates).

    A scanline fill without sorting: each edge toggles, on every pixel row whose centre it crosses,
    the parity from the first pixel centre right of the crossing; a running XOR along each row gives
    the inside. Cost O(V + C + H*W) for V vertices and C row crossings (C <= V*H), so a self-crossing
    outline costs what it crosses, where cv2.fillPoly grows super-linearly in V (8 s for 10k
    self-crossing vertices at 480 rows, 0.14 s here). Centre-inside is pycocotools' rule too: the
    masks agree with its ``annToMask`` far better than cv2.fillPoly's, which also fills the outline."""
    h, w = out.shape
    idx = np.arange(len(xs))
    nxt = idx + 1
    nxt[ends - 1] = starts   # each polygon's last vertex joins its first
    keep = np.zeros(len(xs), bool)
    for a, b in zip(starts, ends):
        keep[a:b] = b - a >= 3
    x0, y0, x1, y1 = xs[keep], ys[keep], xs[nxt[keep]], ys[nxt[keep]]
    # rows i whose centre i + 0.5 lies in [min(y0, y1), max(y0, y1)): half-open, so a vertex counts once
    lo = np.clip(np.ceil(np.minimum(y0, y1) - 0.5), 0, h).astype(np.int64)
    hi = np.clip(np.ceil(np.maximum(y0, y1) - 0.5), 0, h).astype(np.int64)
    counts = np.maximum(hi - lo, 0)
    if not counts.sum():
        return
    edge = np.repeat(np.arange(len(x0)), counts)
    row = lo[edge] + (np.arange(len(edge)) - np.repeat(np.cumsum(counts) - counts, counts))
    yc = row + 0.5
    t = (yc - y0[edge]) / (y1[edge] - y0[edge])
    xc = x0[edge] + t * (x1[edge] - x0[edge])
    col = np.clip(np.floor(xc - 0.5) + 1, 0, w).astype(np.int64)   # first centre j + 0.5 > xc
    toggles = np.bincount(row * (w + 1) + col, minlength=h * (w + 1)).reshape(h, w + 1)
    out[np.cumsum(toggles[:, :w], axis=1, dtype=np.int64) & 1 == 1] = 1


def polygons_through(points: np.ndarray | Sequence[float], lengths: Sequence[int], owners: Sequence[int],
                     count: int, image_size: Sequence[int], box: Sequence[float], size: Sequence[int],
                     flip: bool) -> np.ndarray:
    """Instance masks uint8 ``[count, H, W]`` (0/1) in the output of one sample's plan.

    ``points`` are the polygons' vertices flattened (x, y, x, y, ... as fractions of the image width and
    height, pixel-edge coordinates as in COCO), ``lengths`` the vertex count of each polygon, ``owners``
    the instance (box row, ``0 <= owner < count``) each polygon belongs to; ``image_size`` is the stored
    (height, width). Vertices go through the same mapping as boxes, then each instance's polygons are
    filled together (:func:`fill_even_odd`: a pixel is in when its centre lies inside the outline, so
    an edge can sit one pixel from the box's edge; polygons of one instance combine even-odd, so a hole
    given as a second polygon stays empty). An instance cropped away gives an empty mask in its row.
    The work grows with the vertices and the output rows they cross, never faster (the "coco" source
    bounds vertices per polygon and per image when packing).
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
    ends = np.cumsum(np.asarray(lengths, np.int64))
    starts = ends - np.asarray(lengths, np.int64)
    owners = np.asarray(owners, np.int64)
    for k in np.unique(owners):
        a, b = starts[owners == k], ends[owners == k]
        pick = np.concatenate([np.arange(s, e) for s, e in zip(a, b)])
        local_ends = np.cumsum(b - a)
        fill_even_odd(x[pick], y[pick], local_ends - (b - a), local_ends, masks[k])
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


# ---- one class per kind of target ---------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where one sample's output comes from: its plan's `box` (top, left, height, width in source
    pixels), output `size` (height, width), `flip`, and the stored image `height` and `width`, pixels."""

    box: np.ndarray
    size: np.ndarray
    flip: bool
    height: int
    width: int

    @classmethod
    def of(cls, plan: Plan, row: int, height: int, width: int) -> Placement:
        return cls(plan.box[row], plan.size[row], bool(plan.flip[row]), height, width)


class Target(Protocol):
    """A kind of per-sample target that follows its image through the planned geometry.

    `read` runs while a batch is planned (on the thread that plans it: small columns only); `place`
    on a worker thread (decoding, filling, resampling), raising ValueError for bad data (the sample
    then fails as any sample does, or is replaced under on_error="skip"); `collate` makes the batch's
    value of `column` in the third batch item."""

    column: str

    def read(self, ds: Any, index: int) -> Any: ...

    def place(self, raw: Any, ds: Any, index: int, at: Placement) -> Any: ...

    def collate(self, rows: list[Any]) -> Any: ...


@dataclass(frozen=True)
class Boxes:
    """A column of boxes (x0, y0, x1, y1 as fractions of the stored image, flattened): float32
    [k, 4] in the output's pixels (`boxes_through`); a batch is a list of them."""

    column: str

    def read(self, ds: Any, index: int) -> Any:
        return ds.extra(index, self.column)

    def place(self, raw: Any, ds: Any, index: int, at: Placement) -> np.ndarray:
        frac = np.asarray(raw if raw is not None else (), np.float64).reshape(-1, 4)
        w, h = float(at.width), float(at.height)
        return boxes_through(frac * (w, h, w, h), at.box, at.size, at.flip)

    def collate(self, rows: list[Any]) -> list[Any]:
        return list(rows)


@dataclass(frozen=True)
class InstanceMasks:
    """A column of polygons (with its `_points` and `_box` companions, as the coco source packs them):
    instance masks uint8 [k, H, W] in the output's pixels (`polygons_through`). With `count_from` (a
    box column) k is its number of boxes, so mask rows line up with box rows."""

    column: str
    count_from: str | None = None

    def read(self, ds: Any, index: int) -> tuple:
        """(points, lengths, owners, instance count)."""
        lengths = ds.extra(index, self.column + "_points") or ()
        owners = ds.extra(index, self.column + "_box") or ()
        if self.count_from is not None:
            count = len(ds.extra(index, self.count_from) or ()) // 4
        else:
            count = max(owners, default=-1) + 1
        return ds.extra(index, self.column) or (), lengths, owners, count

    def place(self, raw: tuple, ds: Any, index: int, at: Placement) -> np.ndarray:
        points, lengths, owners, count = raw
        if len(owners) != len(lengths) or sum(lengths) * 2 != len(points) or max(owners, default=-1) >= count:
            raise ValueError(f"polygon columns disagree: {len(points)} coordinates, {len(lengths)} polygons "
                             f"of {sum(lengths)} vertices, owners up to {max(owners, default=-1)} for {count} "
                             f"instances")
        return polygons_through(points, lengths, owners, count, (at.height, at.width), at.box, at.size, at.flip)

    def collate(self, rows: list[Any]) -> list[Any]:
        return list(rows)


@dataclass(frozen=True)
class LabelMap:
    """A binary column of label-map PNGs (class ids per pixel, the image's size): the image's crop
    window, nearest neighbour, flipped with it, `ignore_index` where the geometry pads (`mask_through`);
    a batch is one tensor [B, H, W] when the sizes agree (`stack_label_maps`)."""

    column: str
    ignore_index: int = 255

    def read(self, ds: Any, index: int) -> None:
        return None   # the PNG is read and decoded by the worker thread (place)

    def place(self, raw: None, ds: Any, index: int, at: Placement) -> np.ndarray:
        data = ds.extra(index, self.column)
        if data is None:
            raise ValueError(f"no label map in column {self.column!r}")
        try:
            ids = codecs.decode_label_map(data, f"label map {self.column!r}")
        except ImageError as exc:  # the sample's key, not the column's name, is what the error must name
            raise ValueError(f"its label map {self.column!r}: {exc.reason}; re-pack the dataset") from None
        if ids.shape != (at.height, at.width):
            raise ValueError(f"label map {self.column!r} is {ids.shape[1]}x{ids.shape[0]}, the image "
                             f"{at.width}x{at.height}; re-pack the dataset")
        if ids.dtype == np.uint8 and self.ignore_index > 255:
            ids = ids.astype(np.int32)
        return mask_through(ids, at.box, at.size, at.flip, fill=self.ignore_index)

    def collate(self, rows: list[Any]) -> torch.Tensor | list[np.ndarray]:
        return stack_label_maps(rows)


class TargetRows(list):
    """A batch's values of one target column, row by row: None until a worker thread places the row
    (the device thread's CPU fallback may fill a row twice: it is placed once); `raw` holds what was
    read while planning."""

    def __init__(self, target: Target, raw: list[Any]) -> None:
        super().__init__([None] * len(raw))
        self.target, self.raw = target, raw

    def place(self, row: int, ds: Any, index: int, at: Placement) -> None:
        if self[row] is None:
            self[row] = self.target.place(self.raw[row], ds, index, at)

    def collate(self) -> Any:
        return self.target.collate(list(self))
