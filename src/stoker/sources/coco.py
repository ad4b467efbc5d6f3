"""COCO detection annotations (kind "coco"): an instances JSON with `images`, `annotations`, `categories`;
or a captions JSON (`images`, and `annotations` of `image_id` + `caption`, no categories): each image's
captions packed as the ``list<string>`` column ``captions`` (`Targets(captions="captions")` hands out one per
sample per epoch); an image that no annotation captions is left out, with a ``skipped.jsonl`` line.

One sample per image (in image id order), with two typed extra columns for the shards:

- ``boxes`` (list<float64>): the image's boxes flattened, 4 numbers each, ``x0, y0, x1, y1`` as
  fractions of the image's width and height (COCO's pixel ``[x, y, width, height]`` over the image's
  listed ``width``/``height``), so a pack that shrinks the image (``max_side``) keeps them right; the
  Loader's ``boxes=`` turns them into pixels of each transformed sample;
- ``box_labels`` (list<int64>): each box's class, an index into the categories sorted by id (the
  contiguous labels DALI's COCO reader and torchvision's detection references use);

plus ``iscrowd`` flags in ``box_crowd`` (list<int64>), and each box's ``segmentation`` as polygons in
three list columns: ``masks`` (list<float64>: every polygon's vertices, ``x, y`` as fractions of the
image, flattened), ``masks_points`` (list<int64>: vertices per polygon) and ``masks_box`` (list<int64>:
the box row each polygon outlines). Run-length (RLE) segmentations, COCO's crowd regions, are traced
into polygons here (OpenCV contours of the decoded mask). The Loader's ``masks=`` fills them at the
output size of each transformed sample (``transforms.targets.polygons_through``). Image paths (``file_name``) resolve against
``root`` (default: the JSON's folder), and no path may leave it. Images without annotations are kept,
with empty lists. The sample label is unused (``-1``). Boxes refer to the pixel grid as stored: an
image with an EXIF orientation other than 1 is turned upright by the pack, its boxes are not.

Values an annotation file may not be trusted with cost their image, never the pack nor the machine:
an image whose ``width``/``height`` is not a positive finite number, a box with a NaN or infinite
number or a negative width or height, a polygon with a non-finite vertex or more than
MAX_POLYGON_VERTICES vertices (more than MAX_IMAGE_VERTICES in one image), and an RLE whose ``size``
is not its image's or exceeds the pixel limit (``codecs.MAX_PIXELS``, checked before decoding) are
skipped with the reason in ``skipped.jsonl``. Contours traced from an RLE are simplified (Douglas-
Peucker, a growing tolerance from half a pixel) until they fit the vertex bound. Entries of the
wrong shape (a box of strings, a category without an id) still make the whole file a SourceError.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from .. import codecs
from ..errors import SourceError
from .base import ListedPaths, Source, SourceItem, SourceOptions, check_unique, listing_root, read_text

SUFFIXES = (".json",)
EXTRA_COLUMNS = {"boxes": "list<float64>", "box_labels": "list<int64>", "box_crowd": "list<int64>",
                 "masks": "list<float64>", "masks_points": "list<int64>", "masks_box": "list<int64>"}
#: vertices one polygon may have: filling costs grow with them (a bound on the Loader's per-sample work)
MAX_POLYGON_VERTICES = 4096
#: vertices all the polygons of one image may have together
MAX_IMAGE_VERTICES = 32768


class _BadImage(Exception):
    """One image entry (or one of its annotations) holds values that cannot be used: skipped."""


def detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in SUFFIXES


def _load(listing: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_text(listing))
    except json.JSONDecodeError as exc:
        raise SourceError(f"{listing}: not valid JSON ({exc}); expected a COCO instances file", path=listing) from exc
    if not isinstance(doc, dict):
        raise SourceError(f"{listing}: a COCO instances file is a JSON object, found {type(doc).__name__}", path=listing)
    needed = ("images", "annotations") if _is_captions(doc) else ("images", "annotations", "categories")
    missing = [k for k in needed if not isinstance(doc.get(k), list)]
    if missing:
        raise SourceError(f"{listing}: a COCO instances file needs lists 'images', 'annotations' and "
                          f"'categories'; missing or not a list: {', '.join(missing)}", path=listing)
    return doc


def _is_captions(doc: dict[str, Any]) -> bool:
    """A COCO captions file (captions_train2017.json): no categories, each annotation an image's caption."""
    anns = doc.get("annotations")
    return "categories" not in doc and isinstance(anns, list) and bool(anns) and isinstance(anns[0], dict) \
        and "caption" in anns[0]


def open_coco(listing: Path, options: SourceOptions) -> Source:
    """The samples of a COCO instances file. Annotation files are often downloaded: any entry of
    the wrong shape (a category without an id, a box of strings, 100,000 nested brackets) is a
    SourceError naming the file, not a Python exception from deep inside the parse."""
    try:
        return _open_coco(listing, options)
    except SourceError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, RecursionError) as exc:
        raise SourceError(f"{listing}: not a well-formed COCO instances file ({type(exc).__name__}: {exc}); "
                          "expected 'images' (id, file_name, width, height), 'annotations' (image_id, "
                          "category_id, bbox of 4 numbers) and 'categories' (id, name) entries", path=listing) from None


#: images checked for presence before a pack starts: all of them missing means the image folder is elsewhere
PROBE_IMAGES = 8


def _check_image_folder(listing: Path, items: list[SourceItem], options: SourceOptions) -> None:
    """COCO keeps its images beside the annotations folder (train2017/ next to annotations/): with no
    ``root``, the first images missing means the folder is elsewhere; say so rather than skip them all."""
    if options.root is not None or any(item.path.exists() for item in items[:PROBE_IMAGES]):
        return
    raise SourceError.spelled(
        f"{listing}: its images are not in {items[0].path.parent} (no {items[0].path.name}, nor the next "
        f"{min(len(items), PROBE_IMAGES) - 1}); pass {{root}} with the image folder, e.g. "
        f"{{root_example}}", {"root": ("root=", "--root"),
                              "root_example": ('root="coco/train2017"', "--root coco/train2017")}, path=listing)


def _open_coco(listing: Path, options: SourceOptions) -> Source:
    root, _ = listing_root(listing, options, "coco")
    # Annotation files are often downloaded, not written by the user: every image path must stay
    # inside the image folder (``root``), so a '../' or absolute file_name is refused.
    check = ListedPaths(root, listing, root)
    doc = _load(listing)
    if _is_captions(doc):
        return _open_captions(listing, options, root, check, doc)
    categories = sorted(doc["categories"], key=lambda c: c["id"])
    index = {c["id"]: k for k, c in enumerate(categories)}
    per_image: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for n, ann in enumerate(doc["annotations"]):
        bbox = ann.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4) or ann.get("category_id") not in index:
            raise SourceError(f"{listing}: annotation #{n} (id {ann.get('id')!r}) needs a 4-number 'bbox' and a "
                              f"'category_id' listed in 'categories'; found {bbox!r}, {ann.get('category_id')!r}",
                              path=listing)
        per_image[ann.get("image_id")].append(ann)
    items, keys, skipped = [], [], []
    for n, img in enumerate(sorted(doc["images"], key=lambda i: i["id"]), start=1):
        if "file_name" not in img or img.get("width") is None or img.get("height") is None:
            raise SourceError(f"{listing}: image entry {img.get('id')!r} needs 'file_name', 'width' and 'height'",
                              path=listing)
        key, full = check(str(img["file_name"]), n)
        keys.append((key, n))
        anns = per_image.get(img["id"], [])
        try:
            w, h = _size(img)
            extras = {"boxes": _boxes(anns, w, h), "box_labels": [index[a["category_id"]] for a in anns],
                      "box_crowd": [_crowd(a, listing) for a in anns],
                      **_polygons(anns, w, h, listing)}
        except _BadImage as exc:
            skipped.append({"key": key, "path": f"{listing}: image id {img.get('id')!r}",
                            "reason": f"{exc}; the image is left out (fix its entry in the annotation file)"})
            continue
        items.append(SourceItem(key=key, path=full, label=None, extras=extras))
    check_unique(keys, listing)
    if not items:
        raise SourceError(f"{listing} lists no usable images ({len(skipped)} refused"
                          f"{': ' + skipped[0]['reason'] if skipped else ''})", path=listing)
    _check_image_folder(listing, items, options)
    names = [str(c.get("name", c["id"])) for c in categories]
    return Source(items=items, classes=None, label_type="none", extra_columns=dict(EXTRA_COLUMNS), root=root,
                  description=f"COCO {listing} ({len(items)} images, {len(doc['annotations'])} boxes, "
                              f"{len(names)} categories: {', '.join(names[:5])}{'...' if len(names) > 5 else ''})",
                  kind="coco", skipped=skipped)


#: the column a COCO captions file's captions are packed into: each image's captions, in the file's order
CAPTIONS_COLUMN = "captions"


def _open_captions(listing: Path, options: SourceOptions, root: Path, check: ListedPaths, doc: dict[str, Any]
                   ) -> Source:
    """A COCO captions file: one sample per captioned image, its captions (usually five) packed as the
    list<string> column `captions` (`Targets(captions="captions")` hands out one per epoch). A caption that is
    not a string is a SourceError naming the annotation; an image without captions is skipped, with why."""
    per_image: dict[Any, list[str]] = defaultdict(list)
    for n, ann in enumerate(doc["annotations"]):
        if not isinstance(ann, dict) or not isinstance(ann.get("caption"), str):
            found = ann.get("caption") if isinstance(ann, dict) else ann
            raise SourceError(f"{listing}: annotation #{n} (id {ann.get('id') if isinstance(ann, dict) else None!r}) "
                              f"needs a 'caption' string; found {found!r:.80}; fix or drop that annotation",
                              path=listing)
        per_image[ann.get("image_id")].append(ann["caption"].strip())
    items, keys, skipped = [], [], []
    for n, img in enumerate(sorted(doc["images"], key=lambda i: i["id"]), start=1):
        if "file_name" not in img:
            raise SourceError(f"{listing}: image entry {img.get('id')!r} needs a 'file_name'", path=listing)
        key, full = check(str(img["file_name"]), n)
        keys.append((key, n))
        if not per_image.get(img["id"]):
            skipped.append({"key": key, "path": f"{listing}: image id {img['id']!r}",
                            "reason": "no annotation captions it; an image + text pack holds captioned images"})
            continue
        items.append(SourceItem(key=key, path=full, label=None, extras={CAPTIONS_COLUMN: per_image[img["id"]]}))
    check_unique(keys, listing)
    if not items:
        raise SourceError(f"{listing} lists no captioned images ({len(doc['images'])} images, none with a caption "
                          "annotation)", path=listing)
    _check_image_folder(listing, items, options)
    return Source(items=items, classes=None, label_type="none", extra_columns={CAPTIONS_COLUMN: "list<string>"},
                  root=root, kind="coco", skipped=skipped,
                  description=f"COCO captions {listing} ({len(items)} images, {len(doc['annotations'])} captions)")


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, found {v!r}")
    return float(v)


def _size(img: dict[str, Any]) -> tuple[float, float]:
    try:
        w, h = float(img["width"]), float(img["height"])   # "640" as text has always been accepted
    except (TypeError, ValueError):
        w = h = math.nan
    if not (math.isfinite(w) and math.isfinite(h) and w > 0 and h > 0):
        raise _BadImage(f"its width x height {img['width']!r} x {img['height']!r} is not a positive size")
    return w, h


def _boxes(anns: list[dict[str, Any]], w: float, h: float) -> list[float]:
    """The image's boxes as fractions (x0, y0, x1, y1), refusing non-finite numbers and negative sizes."""
    out: list[float] = []
    for ann in anns:
        x, y, bw, bh = (_number(v) for v in ann["bbox"])
        if not all(math.isfinite(v) for v in (x, y, bw, bh)) or bw < 0 or bh < 0:
            raise _BadImage(f"annotation id {ann.get('id')!r} has the box {ann['bbox']!r} (x, y, width, height: "
                            "finite numbers, width and height not negative)")
        out.extend((x / w, y / h, (x + bw) / w, (y + bh) / h))
    return out


def _crowd(ann: dict[str, Any], listing: Path) -> int:
    """An annotation's ``iscrowd`` flag: 0 or 1 (COCO's only values), else a SourceError naming it."""
    flag = ann.get("iscrowd", 0)
    if flag not in (0, 1):   # True/False compare equal to 1/0
        raise SourceError(f"{listing}: annotation id {ann.get('id')!r} has iscrowd {flag!r:.40}; COCO's iscrowd is 0 "
                          "or 1", path=listing)
    return int(flag)


def _polygons(anns: list[dict[str, Any]], w: float, h: float, listing: Path) -> dict[str, list]:
    """The three polygon columns of one image's annotations (see the module docstring)."""
    points: list[float] = []
    lengths: list[int] = []
    owners: list[int] = []
    for k, ann in enumerate(anns):
        seg = ann.get("segmentation")
        if isinstance(seg, dict):
            polys = _trace_rle(seg, listing, ann.get("id"), w, h)
        elif isinstance(seg, list):
            polys = [p for p in seg if isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0]
        elif seg is None:
            polys = []
        else:
            raise SourceError(f"{listing}: annotation id {ann.get('id')!r} has a 'segmentation' of type "
                              f"{type(seg).__name__}; expected a list of polygons or an RLE dict", path=listing)
        for poly in polys:
            xy = np.asarray(poly, np.float64).reshape(-1, 2)
            if len(xy) > MAX_POLYGON_VERTICES:
                raise _BadImage(f"annotation id {ann.get('id')!r} has a polygon of {len(xy):,} vertices, more than "
                                f"the {MAX_POLYGON_VERTICES:,} a polygon may have (simplify it)")
            if not np.isfinite(xy).all():
                raise _BadImage(f"annotation id {ann.get('id')!r} has a polygon with a NaN or infinite vertex")
            points.extend((xy / (w, h)).ravel().tolist())
            lengths.append(len(xy))
            owners.append(k)
    if len(points) // 2 > MAX_IMAGE_VERTICES:
        raise _BadImage(f"its polygons have {len(points) // 2:,} vertices together, more than the "
                        f"{MAX_IMAGE_VERTICES:,} one image may have")
    return {"masks": points, "masks_points": lengths, "masks_box": owners}


def rle_counts(counts: str | list[int]) -> list[int]:
    """An RLE's run lengths: an uncompressed list as is, or COCO's compressed string decoded (6-bit groups
    offset by 48, 5 value bits each, 0x20 continues, 0x10 the sign; runs after the second are stored as
    the difference to the run two before, as pycocotools' ``rleFrString``)."""
    if isinstance(counts, list):
        return [int(c) for c in counts]
    out: list[int] = []
    p = 0
    while p < len(counts):
        x, k, more = 0, 0, True
        while more:
            c = ord(counts[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(out) > 2:
            x += out[-2]
        out.append(x)
    return out


def rle_decode(seg: dict[str, Any]) -> np.ndarray:
    """A COCO RLE (``{"size": [h, w], "counts": ...}``) as a uint8 [h, w] mask: runs alternate 0 and 1,
    starting with 0, in column-major order."""
    h, w = (int(v) for v in seg["size"])
    runs = np.asarray(rle_counts(seg["counts"]), np.int64)
    if runs.sum() != h * w or (runs < 0).any():
        raise ValueError(f"the runs add up to {int(runs.sum())} pixels, the size {h}x{w} has {h * w}")
    values = np.arange(len(runs)) % 2
    return np.repeat(values.astype(np.uint8), runs).reshape((h, w), order="F")


def _rle_size(seg: dict[str, Any], ann_id: Any, w: float, h: float) -> None:
    """An RLE's declared size must be its image's (COCO's rule) and within the pixel limit, checked
    before decoding: a 60000x60000 RLE on a 160x120 image would decode 3.6 GB."""
    size = seg.get("size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in size)):
        return   # malformed: rle_decode says why, for the whole file
    rh, rw = size
    if (rh, rw) != (round(h), round(w)):
        raise _BadImage(f"annotation id {ann_id!r} has an RLE of size {rh}x{rw} (height x width) on an image "
                        f"listed as {round(h)}x{round(w)}; an RLE covers its image exactly")
    if rh * rw > codecs.MAX_PIXELS:
        raise _BadImage(f"annotation id {ann_id!r} has an RLE of {rh}x{rw} = {rh * rw:,} pixels, above the limit "
                        f"of {codecs.MAX_PIXELS:,}")


def _trace_rle(seg: dict[str, Any], listing: Path, ann_id: Any, w: float, h: float) -> list[list[float]]:
    _rle_size(seg, ann_id, w, h)
    try:
        mask = rle_decode(seg)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SourceError(f"{listing}: annotation id {ann_id!r} has an RLE segmentation that does not decode "
                          f"({type(exc).__name__}: {exc}); expected {{'size': [h, w], 'counts': ...}}",
                          path=listing) from exc
    contours, _ = cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    out = []
    for c in contours:
        epsilon = 0.5
        while len(c) > MAX_POLYGON_VERTICES:   # a ragged outline: simplified, within `epsilon` pixels
            c = cv2.approxPolyDP(c, epsilon, True)
            epsilon *= 2
        if len(c) >= 3:
            # contour points are pixel centres; +0.5 makes them the pixel-edge coordinates polygons use
            out.append((c.reshape(-1, 2).astype(np.float64) + 0.5).ravel().tolist())
    return out
