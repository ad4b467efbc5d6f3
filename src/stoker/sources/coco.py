"""COCO detection annotations (kind "coco"): an instances JSON with `images`, `annotations`, `categories`.

One sample per image (in image id order), with two typed extra columns for the shards:

- ``boxes`` (list<float64>): the image's boxes flattened, 4 numbers each, ``x0, y0, x1, y1`` as
  fractions of the image's width and height (COCO's pixel ``[x, y, width, height]`` over the image's
  listed ``width``/``height``), so a pack that shrinks the image (``max_side``) keeps them right; the
  Loader's ``boxes=`` turns them into pixels of each transformed sample;
- ``box_labels`` (list<int64>): each box's class, an index into the categories sorted by id (the
  contiguous labels DALI's COCO reader and torchvision's detection references use);

plus ``iscrowd`` flags in ``box_crowd`` (list<int64>). Image paths (``file_name``) resolve against
``root`` (default: the JSON's folder), and no path may leave it. Images without annotations are kept,
with empty lists. The sample label is unused (``-1``). Boxes refer to the pixel grid as stored: an
image with an EXIF orientation other than 1 is turned upright by the pack, its boxes are not.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..errors import SourceError
from .base import ListedPaths, Source, SourceItem, SourceOptions, check_unique, listing_root, read_text

SUFFIXES = (".json",)
EXTRA_COLUMNS = {"boxes": "list<float64>", "box_labels": "list<int64>", "box_crowd": "list<int64>"}


def detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in SUFFIXES


def _load(listing: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_text(listing))
    except json.JSONDecodeError as exc:
        raise SourceError(f"{listing}: not valid JSON ({exc}); expected a COCO instances file", path=listing) from exc
    missing = [k for k in ("images", "annotations", "categories") if not isinstance(doc.get(k), list)]
    if missing:
        raise SourceError(f"{listing}: a COCO instances file needs lists 'images', 'annotations' and "
                          f"'categories'; missing or not a list: {', '.join(missing)}", path=listing)
    return doc


def open_coco(listing: Path, options: SourceOptions) -> Source:
    root, _ = listing_root(listing, options, "coco")
    # Annotation files are often downloaded, not written by the user: every image path must stay
    # inside the image folder (``root``), so a '../' or absolute file_name is refused.
    check = ListedPaths(root, listing, root)
    doc = _load(listing)
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
    items, keys = [], []
    for n, img in enumerate(sorted(doc["images"], key=lambda i: i["id"]), start=1):
        if "file_name" not in img or not img.get("width") or not img.get("height"):
            raise SourceError(f"{listing}: image entry {img.get('id')!r} needs 'file_name', 'width' and 'height'",
                              path=listing)
        w, h = float(img["width"]), float(img["height"])
        key, full = check(str(img["file_name"]), n)
        anns = per_image.get(img["id"], [])
        boxes = [float(v) for a in anns for v in (a["bbox"][0] / w, a["bbox"][1] / h, (a["bbox"][0] + a["bbox"][2]) / w,
                                                    (a["bbox"][1] + a["bbox"][3]) / h)]
        extras = {"boxes": boxes, "box_labels": [index[a["category_id"]] for a in anns],
                  "box_crowd": [int(a.get("iscrowd", 0)) for a in anns]}
        items.append(SourceItem(key=key, path=full, label=None, extras=extras))
        keys.append((key, n))
    if not items:
        raise SourceError(f"{listing} lists no images", path=listing)
    check_unique(keys, listing)
    names = [str(c.get("name", c["id"])) for c in categories]
    return Source(items=items, classes=None, label_type="none", extra_columns=dict(EXTRA_COLUMNS), root=root,
                  description=f"COCO {listing} ({len(items)} images, {len(doc['annotations'])} boxes, "
                              f"{len(names)} categories: {', '.join(names[:5])}{'...' if len(names) > 5 else ''})",
                  kind="coco")
