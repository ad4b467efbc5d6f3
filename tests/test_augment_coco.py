"""COCO instances JSON -> pack -> Loader(boxes=...): each box still frames the object drawn under it
after the pack's resize and the Loader's crop, resize and flip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import write_image
from stoker.errors import ConfigError, SourceError
from stoker.loader import Loader
from stoker.packing import PackOptions, pack
from stoker.sources import open_source
from stoker.transforms import ColorJitter, RandAugment, RandomHorizontalFlip, RandomResizedCrop, Resize
from stoker.transforms.targets import visible
from stoker.loader.options import Targets

def runs_of(mask: np.ndarray) -> list[int]:
    """COCO RLE runs of a 0/1 mask: column-major, alternating 0 and 1, starting with 0."""
    flat = mask.ravel(order="F").astype(np.int8)
    edges = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate(([0], edges, [flat.size]))
    runs = np.diff(bounds).tolist()
    return [0, *runs] if flat[0] == 1 else runs


def rle_string(counts: list[int]) -> str:
    """pycocotools' rleToString, written out: each run minus the run two before (after the second),
    5 bits a character from the low end, 0x20 to continue, offset by 48."""
    out = []
    for i, x in enumerate(counts):
        x = x - counts[i - 2] if i > 2 else x
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = (x != -1) if c & 0x10 else (x != 0)
            out.append(chr((c | 0x20 if more else c) + 48))
    return "".join(out)


def segmentation(k: int, x: int, y: int, bw: int, bh: int, h: int, w: int):
    """Box k's outline three ways: a polygon (k=0), a compressed RLE (k=1), an uncompressed RLE (k=2)."""
    if k == 0:
        return [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]
    mask = np.zeros((h, w), np.uint8)
    mask[y:y + bh, x:x + bw] = 1
    runs = runs_of(mask)
    return {"size": [h, w], "counts": rle_string(runs) if k == 1 else runs}


def make_coco(root: Path, n: int = 12, seed: int = 0) -> Path:
    """n JPEGs of varied sizes, each with 1-3 boxes on black, box k lighting channel k only (so boxes may
    overlap and each stays visible in its own channel), their outlines as segmentations, and their
    instances JSON."""
    rng = np.random.default_rng(seed)
    images, anns = [], []
    for i in range(n):
        h, w = (int(v) for v in rng.integers(120, 260, 2))
        img = np.zeros((h, w, 3), np.uint8)
        for k in range(int(rng.integers(1, 4))):
            bw, bh = int(rng.integers(30, w // 2)), int(rng.integers(30, h // 2))
            x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
            img[y:y + bh, x:x + bw, k] = 255
            anns.append({"id": len(anns) + 1, "image_id": i + 10, "category_id": [3, 7, 9][k],
                         "bbox": [x, y, bw, bh], "iscrowd": int(k > 0), "area": bw * bh,
                         "segmentation": segmentation(k, x, y, bw, bh, h, w)})
        write_image(root / "images" / f"{i:03d}.jpg", img, quality=95)
        images.append({"id": i + 10, "file_name": f"{i:03d}.jpg", "height": h, "width": w})
    cats = [{"id": c, "name": name} for c, name in ((9, "blue"), (3, "red"), (7, "green"))]
    out = root / "instances.json"
    out.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return out


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("coco")
    ann = make_coco(root)
    packed = root / "packed"
    pack(ann, packed, root=root / "images", options=PackOptions(max_side=160, workers=1), progress=False)
    return ann, packed


def test_coco_source_lists_images_boxes_and_labels(coco):
    ann, _ = coco
    src = open_source(ann, root=ann.parent / "images")
    assert src.kind == "coco" and len(src) == 12 and src.extra_columns["boxes"] == "list<float64>"
    first = src.items[0]
    assert len(first.extras["boxes"]) == 4 * len(first.extras["box_labels"])
    assert set(first.extras["box_labels"]) <= {0, 1, 2}  # category ids 3, 7, 9 -> 0, 1, 2
    assert all(0.0 <= v <= 1.0 for v in first.extras["boxes"])
    bad = ann.parent / "bad.json"
    bad.write_text(json.dumps({"images": []}))
    with pytest.raises(SourceError, match="annotations"):
        open_source(bad)


def test_boxes_follow_pack_resize_crop_and_flip(coco):
    _, packed = coco
    loader = Loader(packed, 4, transforms=[RandomResizedCrop(96, scale=(0.3, 1.0)), RandomHorizontalFlip(),
                                           ColorJitter(0.2, 0.2)],
                    columns=("box_labels",), seed=3, targets=Targets(boxes="boxes"), workers=2)
    checked = 0
    for images, _, extras in loader:
        for img, boxes, labels in zip(images.permute(0, 2, 3, 1).numpy(), extras["boxes"], extras["box_labels"]):
            assert boxes.dtype == np.float32 and boxes.shape == (len(labels), 4)
            for (x0, y0, x1, y1), label in zip(boxes[visible(boxes)], np.asarray(labels)[visible(boxes)]):
                if x1 - x0 < 6 or y1 - y0 < 6:
                    continue
                inner = img[int(np.ceil(y0)) + 1:int(y1) - 1, int(np.ceil(x0)) + 1:int(x1) - 1].reshape(-1, 3)
                # labels index the categories sorted by id (3, 7, 9), which box k = channel k was given
                share = (inner[:, label] > 128).mean()
                assert share > 0.95, (share, label, (x0, y0, x1, y1))
                ys, xs = np.nonzero(img[:, :, label] > 128)  # and the lit pixels are framed by the box
                lit = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
                assert np.abs(lit - np.array([x0, y0, x1, y1])).max() <= 2.0, (lit, (x0, y0, x1, y1))
                checked += 1
    assert checked > 10
    again = Loader(packed, 4, transforms=[RandomResizedCrop(96, scale=(0.3, 1.0)), RandomHorizontalFlip(),
                                          ColorJitter(0.2, 0.2)], seed=3, targets=Targets(boxes="boxes"), workers=1)
    a = [b for batch in Loader(packed, 4, transforms=[RandomResizedCrop(96, scale=(0.3, 1.0)), RandomHorizontalFlip(),
                                                       ColorJitter(0.2, 0.2)], seed=3, targets=Targets(boxes="boxes"), workers=2)
         for b in batch[2]["boxes"]]
    b = [b for batch in again for b in batch[2]["boxes"]]
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) == 12


def test_ops_that_move_pixels_are_refused_with_boxes(coco):
    _, packed = coco
    with pytest.raises(ConfigError, match="RandAugment would move pixels"):
        Loader(packed, 4, transforms=[Resize((64, 64)), RandAugment()], targets=Targets(boxes="boxes"))


def test_rle_counts_decode_pycocotools_strings():
    from stoker.sources.coco import rle_counts, rle_decode

    rng = np.random.default_rng(5)
    for _ in range(50):
        h, w = (int(v) for v in rng.integers(1, 40, 2))
        mask = (rng.random((h, w)) < rng.random()).astype(np.uint8)
        runs = runs_of(mask)
        assert rle_counts(rle_string(runs)) == runs
        assert np.array_equal(rle_decode({"size": [h, w], "counts": rle_string(runs)}), mask)
    with pytest.raises(ValueError, match="add up"):
        rle_decode({"size": [4, 4], "counts": [3, 2]})


def test_masks_follow_pack_resize_crop_and_flip(coco):
    """Polygons, compressed and uncompressed RLEs all come out as instance masks that cover the pixels
    their object lit after the pack's resize and the Loader's crop, resize and flip."""
    _, packed = coco
    transforms = [RandomResizedCrop(96, scale=(0.3, 1.0)), RandomHorizontalFlip()]
    loader = Loader(packed, 4, transforms=transforms, columns=("box_labels",),
                    seed=4, targets=Targets(boxes="boxes", masks="masks"), workers=2)
    checked = 0
    for images, _, extras in loader:
        assert set(extras) == {"boxes", "masks", "box_labels"}
        for img, boxes, masks, labels in zip(images.permute(0, 2, 3, 1).numpy(), extras["boxes"], extras["masks"], extras["box_labels"]):
            assert masks.dtype == np.uint8 and masks.shape == (len(labels), 96, 96)
            for box, mask, label in zip(boxes, masks, labels):
                lit = img[:, :, label] > 128
                if lit.sum() < 40:
                    continue
                # JPEG edges and the whole-pixel crop window: agreement except along the outline
                iou = (lit & (mask > 0)).sum() / (lit | (mask > 0)).sum()
                assert iou > 0.85, (iou, label, box)
                ys, xs = np.nonzero(mask)   # the mask sits inside its (transformed) box
                assert xs.min() >= box[0] - 1 and xs.max() + 1 <= box[2] + 1, (xs.min(), xs.max(), box)
                assert ys.min() >= box[1] - 1 and ys.max() + 1 <= box[3] + 1, (ys.min(), ys.max(), box)
                checked += 1
    assert checked > 10
    # the same epoch again, one thread, no boxes (every box has a segmentation: the same rows)
    plain = Loader(packed, 4, transforms=transforms, seed=4, targets=Targets(masks="masks"), workers=1)
    again = [m for batch in plain for m in batch[2]["masks"]]
    first = [m for batch in Loader(packed, 4, transforms=transforms, seed=4, targets=Targets(boxes="boxes", masks="masks"), workers=2) for m in batch[2]["masks"]]
    assert len(again) == 12 and all(np.array_equal(a, b) for a, b in zip(again, first))


def test_masks_need_their_polygon_columns(coco, tmp_path):
    _, packed = coco
    with pytest.raises(ConfigError, match="masks_points"):
        Loader(packed, 4, transforms=[Resize((64, 64))], targets=Targets(masks="boxes"))
    with pytest.raises(ConfigError, match="RandAugment would move pixels"):
        Loader(packed, 4, transforms=[Resize((64, 64)), RandAugment()], targets=Targets(masks="masks"))


def test_variable_size_images_batch_padded_with_their_sizes(coco):
    """Resize(64) keeps each image's aspect ratio: with pad=True the batch is as large as the largest
    output, each image top-left in its row, zeros elsewhere, its size in extras["sizes"]; boxes and
    masks are in that image's own pixels."""
    _, packed = coco
    with pytest.raises(ConfigError, match=r"pass targets=stoker\.Targets\(pad=True\)"):
        Loader(packed, 4, transforms=[Resize(64)])
    with pytest.raises(ConfigError, match="hide the column 'sizes'"):
        Loader(packed, 4, transforms=[Resize(64)], columns=("sizes",), targets=Targets(pad=True))
    from stoker.reader import open_dataset

    ds = open_dataset(packed)
    short = np.minimum(ds.heights, ds.widths)
    want_h = np.where(ds.heights <= ds.widths, 64, (64 * ds.heights / ds.widths).astype(int))
    want_w = np.where(ds.widths <= ds.heights, 64, (64 * ds.widths / ds.heights).astype(int))
    assert (short > 0).all()
    ds.close()
    for device in (None, "cpu"):
        loader = Loader(packed, 5, transforms=[Resize(64), RandomHorizontalFlip()], 
                        columns=("box_labels",), order="sequential", device=device, targets=Targets(pad=True, boxes="boxes", masks="masks"), workers=2)
        assert loader.output_size == (int(want_h.max()), int(want_w.max()))
        seen = 0
        for images, _, extras in loader:
            x = images.permute(0, 2, 3, 1).numpy()
            sizes = extras["sizes"]
            assert sizes.dtype == torch.int64 and sizes.shape == (len(x), 2)
            for img, (h, w), boxes, masks, labels in zip(x, sizes.tolist(), extras["boxes"], extras["masks"],
                                                         extras["box_labels"]):
                assert (h, w) == (want_h[seen], want_w[seen])
                assert not img[h:].any() and not img[:, w:].any()   # the padding is zero
                assert masks.shape == (len(labels), h, w)
                for box, mask, label in zip(boxes, masks, labels):
                    lit = img[:h, :w, label] > 128
                    assert box[2] <= w and box[3] <= h
                    if lit.sum() >= 40:   # small objects at 64 px: the one-pixel outline weighs more
                        iou = (lit & (mask > 0)).sum() / (lit | (mask > 0)).sum()
                        assert iou > 0.75, (iou, box)
                seen += 1
        assert seen == 12
