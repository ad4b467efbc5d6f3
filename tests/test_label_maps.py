"""Semantic-segmentation label maps (one PNG of class ids per image, ADE20K / Cityscapes / VOC style):
packed from a CSV's mask column as a binary column, resized with nearest neighbour under max_side,
and moved by the Loader through each sample's exact crop window, resize and flip.

Alignment is checked on images drawn from their own label maps: each class region is painted in a
colour of its own, so after any transform the class an output pixel's colour names must be the id
the transformed label map holds there, except along region edges (resampling blends colours there)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import stoker
from stoker import CenterCrop, Loader, PackOptions, RandomHorizontalFlip, RandomResizedCrop, Resize
from stoker import codecs, pack_work, packing
from stoker.errors import ConfigError, SourceError
from stoker.sources import SourceItem
from stoker.transforms import Pipeline, crop_resize_into
from stoker.transforms.targets import mask_through
from stoker.loader.options import Targets, Workers

ROOT = Path(__file__).resolve().parents[1]
#: far-apart colours, one per class id (index = id)
COLOURS = np.array([[0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0], [0, 255, 255],
                    [255, 0, 255], [255, 255, 255]], np.uint8)


def label_map(h: int, w: int, rng: np.random.Generator, classes: int = len(COLOURS)) -> np.ndarray:
    """Rectangular regions of random class ids on a 3x3 grid, each cell at least a fifth of the image
    across (edges are a small share of pixels)."""
    ys = np.array([rng.integers(h // 5, 2 * h // 5), rng.integers(3 * h // 5, 4 * h // 5)])
    xs = np.array([rng.integers(w // 5, 2 * w // 5), rng.integers(3 * w // 5, 4 * w // 5)])
    ids = rng.integers(0, classes, (3, 3))
    rows = np.searchsorted(ys, np.arange(h), side="right")
    cols = np.searchsorted(xs, np.arange(w), side="right")
    return ids[rows[:, None], cols[None, :]].astype(np.uint8)


def write_dataset(folder: Path, n: int = 10, seed: int = 0, mode: str = "L", labels: bool = True) -> Path:
    """n PNG images painted from their label maps, the masks as PNG (mode L, P or I;16), and a CSV
    (path, mask[, label])."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "masks").mkdir(exist_ok=True)
    rows = []
    for i in range(n):
        h, w = int(rng.integers(60, 140)), int(rng.integers(60, 140))
        ids = label_map(h, w, rng)
        Image.fromarray(COLOURS[ids]).save(folder / "images" / f"{i:03d}.png")
        save_mask(ids, folder / "masks" / f"{i:03d}.png", mode)
        rows.append((f"images/{i:03d}.png", f"masks/{i:03d}.png", i % 3)[:3 if labels else 2])
    with open(folder / "train.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "mask", "label"][:3 if labels else 2])
        writer.writerows(rows)
    return folder / "train.csv"


def save_mask(ids: np.ndarray, path: Path, mode: str) -> None:
    if mode == "P":   # a palette PNG: indices into COLOURS, as VOC stores its masks
        img = Image.fromarray(ids.astype(np.uint8), "L")
        img.putpalette(COLOURS.ravel().tolist())
    elif mode == "I;16":   # ids above 255 (e.g. 1000 + class)
        img = Image.fromarray(ids.astype(np.uint16) + 1000)   # uint16: mode I;16
    else:
        img = Image.fromarray(ids.astype(np.uint8), "L")
    img.save(path)


def classify(image: np.ndarray) -> np.ndarray:
    """The class whose colour is nearest to each pixel."""
    d = ((image[..., None, :].astype(np.int32) - COLOURS.astype(np.int32)) ** 2).sum(-1)
    return d.argmin(-1)


def edges(ids: np.ndarray, width: int = 2) -> np.ndarray:
    """Pixels within `width` of a change of id (where resampling may blend two regions' colours)."""
    near = np.zeros(ids.shape, bool)
    padded = np.pad(ids, width, mode="edge")
    h, w = ids.shape
    for dy in range(-width, width + 1):
        for dx in range(-width, width + 1):
            near |= padded[width + dy:width + dy + h, width + dx:width + dx + w] != ids
    return near


def assert_aligned(image: np.ndarray, ids: np.ndarray, offset: int = 0, ignore: int | None = None,
                   width: int = 2, cover: float = 0.4) -> None:
    """Away from region edges (`width` output pixels: more where the crop is enlarged many times, since
    the image's interpolation blends colours over one source pixel), colours and ids name one class."""
    ids = ids.astype(np.int64) - offset
    seen = classify(image)
    real = ids != (ignore - offset if ignore is not None else -1)
    keep = ~edges(ids, width) & real
    wrong = keep & (seen != ids)
    assert keep.sum() > cover * real.sum(), "the check covers too few pixels to mean anything"
    assert not wrong.any(), f"{wrong.sum()} pixels away from any region edge disagree with the label map"


@settings(max_examples=60, deadline=None)
@given(st.integers(60, 220), st.floats(0.5, 2.0), st.integers(0, 2**32 - 1), st.sampled_from([None, 64, 100]))
def test_property_pack_resize_then_crop_and_flip_keep_the_map_on_its_image(h, aspect, seed, max_side):
    """The pack's work (image shrunk with Lanczos, its map with nearest neighbour) and then the Loader's
    (the image's crop window, resize and flip, the map through the same window) keep every pixel away
    from a region edge on the class its colour names."""
    rng = np.random.default_rng(seed)
    w = max(40, round(h * aspect))
    ids = label_map(h, w, rng)
    with tempfile.TemporaryDirectory() as tmp:
        mask_path = Path(tmp) / "m.png"
        Image.fromarray(ids).save(mask_path)
        buf = io.BytesIO()
        Image.fromarray(COLOURS[ids]).save(buf, "PNG")
        options = PackOptions(max_side=max_side, encoding="raw", raw_below=0)
        out = packing.normalize(buf.getvalue(), "img.png", options)
        stored = pack_work._label_map(SourceItem("img.png", None, None), mask_path, buf.getvalue(), out, options)
    image = np.frombuffer(out.image, np.uint8).reshape(out.height, out.width, 3)
    small = codecs.decode_label_map(stored, "m.png")
    assert small.shape == image.shape[:2]
    assert_aligned(image, small, width=3, cover=0.1)
    pipe = Pipeline([RandomResizedCrop(48, scale=(0.4, 1.0)), RandomHorizontalFlip()])
    plan = pipe.plan(np.array([out.height]), np.array([out.width]), rng.random((1, pipe.draws)))
    dst = np.empty((48, 48, 3), np.uint8)
    crop_resize_into(image, plan.box[0], dst, bool(plan.flip[0]), out.height, out.width)
    moved = mask_through(small, plan.box[0], plan.size[0], bool(plan.flip[0]), fill=255)
    enlarge = 48 / min(plan.box[0][2], plan.box[0][3])
    assert_aligned(dst, moved, width=math.ceil(3 * enlarge) + 1, cover=0.05)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("seg")
    listing = write_dataset(folder / "src")
    stoker.pack(listing, folder / "packed", mask_column="mask", progress=False,
                options=PackOptions(encoding="raw", workers=2))
    return listing, folder / "packed"


def test_pack_stores_the_mask_png_bytes_exactly(packed):
    listing, out = packed
    manifest = json.loads((out / "stoker.json").read_text())
    assert manifest["extra_columns"]["mask"] == "binary"
    ds = stoker.open_dataset(out)
    for i in range(len(ds)):
        key = ds.sample(i).key
        assert ds.extra(i, "mask") == (listing.parent / key.replace("images/", "masks/")).read_bytes()


@pytest.mark.parametrize("transforms", [
    [RandomResizedCrop(48), RandomHorizontalFlip()],
    [RandomResizedCrop((40, 56), scale=(0.2, 1.0)), RandomHorizontalFlip(p=1.0)],
    [Resize(50), CenterCrop(48)],
])
def test_label_maps_follow_crop_resize_and_flip(packed, transforms):
    _, out = packed
    seen = 0
    with Loader(out, 4, transforms=transforms, seed=3, targets=Targets(masks="mask"), workers=2) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for images, _, extras in loader:
                masks = extras["mask"]
                assert isinstance(masks, torch.Tensor) and masks.dtype == torch.uint8
                assert masks.shape == (images.shape[0], *images.shape[2:])
                for img, ids in zip(images.permute(0, 2, 3, 1).numpy(), masks.numpy()):
                    assert_aligned(img, ids)
                    seen += 1
    assert seen == 20


def test_padding_gets_the_ignore_index(packed):
    _, out = packed
    with Loader(out, 10, transforms=[CenterCrop(150)], order="sequential", targets=Targets(masks="mask", ignore_index=254), workers=1) as loader:
        images, _, extras = next(iter(loader))
    masks = extras["mask"].numpy()
    ds = stoker.open_dataset(out)
    for i, (img, ids) in enumerate(zip(images.permute(0, 2, 3, 1).numpy(), masks)):
        h, w = ds.sample(i).height, ds.sample(i).width
        ys, xs = np.nonzero(ids != 254)   # the image's own pixels: one h x w rectangle, centred
        top, left = ys.min(), xs.min()
        assert (ys.max() + 1 - top, xs.max() + 1 - left) == (h, w)
        assert abs(2 * top + h - 150) <= 1 and abs(2 * left + w - 150) <= 1
        assert (ids[top:top + h, left:left + w] != 254).all()
        assert_aligned(img, ids, ignore=254)


def test_max_side_resizes_the_mask_with_nearest_neighbour(packed, tmp_path):
    listing, _ = packed
    out = tmp_path / "small"
    stoker.pack(listing, out, mask_column="mask", progress=False, options=PackOptions(max_side=48, workers=1))
    ds = stoker.open_dataset(out)
    for i in range(len(ds)):
        s = ds.sample(i)
        assert max(s.height, s.width) == 48
        stored = np.asarray(Image.open(io.BytesIO(ds.extra(i, "mask"))))
        assert stored.shape == (s.height, s.width)
        original = np.asarray(Image.open(listing.parent / s.key.replace("images/", "masks/")))
        assert set(np.unique(stored)) <= set(np.unique(original))   # ids stay ids: nothing blended
    with Loader(out, 5, transforms=[RandomResizedCrop(32), RandomHorizontalFlip()],  targets=Targets(masks="mask"), workers=2) as loader:
        for images, _, extras in loader:
            for img, ids in zip(images.permute(0, 2, 3, 1).numpy(), extras["mask"].numpy()):
                assert_aligned(img, ids)


@pytest.mark.parametrize("mode, offset, dtype", [("P", 0, torch.uint8), ("I;16", 1000, torch.int32)])
def test_palette_and_16_bit_masks_give_class_ids(tmp_path, mode, offset, dtype):
    listing = write_dataset(tmp_path / "src", n=6, seed=5, mode=mode)
    stoker.pack(listing, tmp_path / "out", mask_column="mask", progress=False,
                options=PackOptions(encoding="raw", max_side=80, workers=1))
    with Loader(tmp_path / "out", 3, transforms=[RandomResizedCrop(40), RandomHorizontalFlip()],  targets=Targets(masks="mask"), workers=1) as loader:
        for images, _, extras in loader:
            masks = extras["mask"]
            assert masks.dtype == dtype
            for img, ids in zip(images.permute(0, 2, 3, 1).numpy(), masks.numpy()):
                assert_aligned(img, ids, offset=offset)


def test_mismatched_size_and_jpeg_masks_are_skipped_naming_the_files(tmp_path):
    listing = write_dataset(tmp_path / "src", n=4)
    folder = listing.parent
    Image.fromarray(np.zeros((10, 12), np.uint8)).save(folder / "masks" / "001.png")
    jpeg = folder / "masks" / "002.jpg"
    Image.open(folder / "masks" / "002.png").save(jpeg, quality=95)
    text = listing.read_text().replace("masks/002.png", "masks/002.jpg")
    listing.write_text(text)
    summary = stoker.pack(listing, tmp_path / "out", mask_column="mask", progress=False)
    assert summary.packed == 2 and summary.skipped == 2
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    reasons = {s["key"]: s["reason"] for s in skipped}
    assert "001.png" in reasons["images/001.png"] and "12x10" in reasons["images/001.png"]
    assert str(folder / "masks" / "001.png") in reasons["images/001.png"]
    assert "002.jpg" in reasons["images/002.png"] and "JPEG" in reasons["images/002.png"]
    assert "PNG" in reasons["images/002.png"]


def test_colour_masks_and_missing_cells_are_refused(tmp_path):
    listing = write_dataset(tmp_path / "src", n=3)
    rgb = listing.parent / "masks" / "000.png"
    Image.fromarray(np.zeros((*np.asarray(Image.open(rgb)).shape, 3), np.uint8)).save(rgb)
    summary = stoker.pack(listing, tmp_path / "out", mask_column="mask", progress=False)
    assert summary.skipped == 1
    assert "mode RGB" in (tmp_path / "out" / "skipped.jsonl").read_text()
    listing.write_text(listing.read_text().replace("masks/001.png", ""))
    with pytest.raises(SourceError, match="line 3: the mask column is empty"):
        stoker.pack(listing, tmp_path / "out2", mask_column="mask", progress=False)
    with pytest.raises(SourceError, match="no 'seg' column"):
        stoker.pack(listing, tmp_path / "out3", mask_column="seg", progress=False)


def test_same_seed_same_masks_whatever_the_threads(packed):
    _, out = packed

    def run(threads):
        with Loader(out, 3, transforms=[RandomResizedCrop(40), RandomHorizontalFlip()], 
                    seed=11, targets=Targets(masks="mask"), workers=threads) as loader:
            return [extras["mask"].clone() for _, _, extras in loader]
    one, three = run(1), run(3)
    assert len(one) == len(three) and all(torch.equal(a, b) for a, b in zip(one, three))


def test_a_replaced_sample_brings_its_own_mask(packed, tmp_path):
    """on_error='skip': the stand-in's image and mask arrive together (a broken mask is a failed sample)."""
    listing, _ = packed
    folder = listing.parent
    broken = tmp_path / "broken"
    (broken / "images").mkdir(parents=True)
    (broken / "masks").mkdir()
    rows = list(csv.reader(open(listing)))
    for path, mask, _ in rows[1:]:
        (broken / path).write_bytes((folder / path).read_bytes())
        (broken / mask).write_bytes((folder / mask).read_bytes())
    (broken / "train.csv").write_text(listing.read_text())
    stoker.pack(broken / "train.csv", tmp_path / "out", mask_column="mask", progress=False,
                options=PackOptions(encoding="raw", workers=1))
    # damage one mask inside the shard: the PNG keeps its size, its data no longer decodes
    ds = stoker.open_dataset(tmp_path / "out")
    victim = ds.extra(4, "mask")
    ds.close()
    shard = tmp_path / "out" / "shard-00000.arrow"
    blob = bytearray(shard.read_bytes())
    at = blob.find(victim)
    blob[at + 40:at + len(victim) - 20] = b"\x00" * (len(victim) - 60)
    shard.write_bytes(bytes(blob))
    with Loader(tmp_path / "out", 10, transforms=[RandomResizedCrop(40), RandomHorizontalFlip()], 
                order="sequential", targets=Targets(masks="mask"), workers=Workers(on_error="skip", num_threads=1)) as loader:
        images, labels, extras = next(iter(loader))
    assert loader.stats.skipped == 1
    for img, ids in zip(images.permute(0, 2, 3, 1).numpy(), extras["mask"].numpy()):
        assert_aligned(img, ids)
    with Loader(tmp_path / "out", 10, transforms=[RandomResizedCrop(40)], order="sequential", targets=Targets(masks="mask"), workers=1) as loader, pytest.raises(stoker.errors.SampleError, match="label map 'mask'"):
        next(iter(loader))


def test_ignore_index_is_checked(packed):
    with pytest.raises(ConfigError, match="ignore_index"):
        Loader(packed[1], 2, targets=Targets(masks="mask", ignore_index=-1))


def test_cli_pack_with_mask_column_and_max_side(packed, tmp_path):
    listing, _ = packed
    env = {"PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "pack", str(listing), str(tmp_path / "out"),
                           "--mask-column", "mask", "--max-side", "64", "--no-progress"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ds = stoker.open_dataset(tmp_path / "out")
    assert len(ds) == 10 and ds.manifest.extra_columns["mask"] == "binary"
    with pytest.raises(SourceError, match="CSV"):
        stoker.pack(listing.parent / "images", tmp_path / "x", mask_column="mask", progress=False)


def test_images_of_different_sizes_give_a_list_of_maps_their_own_size(packed):
    _, out = packed
    with Loader(out, 5, transforms=[Resize(40)], targets=Targets(masks="mask", pad=True), workers=2) as loader:
        for images, _, extras in loader:
            maps, sizes = extras["mask"], extras["sizes"]
            assert isinstance(maps, list) and len(maps) == len(images)
            for img, ids, (h, w) in zip(images.permute(0, 2, 3, 1).numpy(), maps, sizes.tolist()):
                assert ids.shape == (h, w) and ids.dtype == np.uint8
                assert_aligned(img[:h, :w], ids)


def test_info_and_verify_read_a_dataset_with_label_maps(packed):
    _, out = packed
    assert stoker.describe(out).extra_columns["mask"] == "binary"
    report = stoker.verify(out, decode=True)
    assert report.ok, report


def test_images_and_masks_folders_pair_by_path(packed, tmp_path):
    """kind "segmentation": images/<path> with masks/<path>.png; recognized by --kind auto."""
    listing, _ = packed
    src = tmp_path / "ade"
    for path, mask, _ in list(csv.reader(open(listing)))[1:]:
        name = Path(path).name
        sub = "a" if name < "005" else "b"
        (src / "images" / sub).mkdir(parents=True, exist_ok=True)
        (src / "masks" / sub).mkdir(parents=True, exist_ok=True)
        Image.open(listing.parent / path).save(src / "images" / sub / name.replace(".png", ".jpg"), quality=97)
        if name != "003.png":   # one image without its map
            (src / "masks" / sub / name).write_bytes((listing.parent / mask).read_bytes())
    summary = stoker.pack(src, tmp_path / "out", progress=False, options=PackOptions(max_side=100, workers=2))
    assert summary.packed == 9 and summary.skipped == 1
    skip = json.loads((tmp_path / "out" / "skipped.jsonl").read_text())
    assert skip["key"] == "images/a/003.jpg" and str(src / "masks" / "a" / "003.png") in skip["reason"]
    ds = stoker.open_dataset(tmp_path / "out")
    assert ds.manifest.extra_columns == {"mask": "binary"} and ds.manifest.pack_options["source_kind"] == "segmentation"
    with Loader(tmp_path / "out", 3, transforms=[RandomResizedCrop(40), RandomHorizontalFlip()],  targets=Targets(masks="mask"), workers=2) as loader:
        for images, _, extras in loader:
            for img, ids in zip(images.permute(0, 2, 3, 1).numpy(), extras["mask"].numpy()):
                assert_aligned(img, ids, width=3)   # JPEG images: a little ringing along the edges


def test_the_device_stage_hands_the_maps_on_with_their_images(packed):
    """device=...: the device thread builds the batch (NCHW images there); the maps stay one tensor,
    row for row with the images, the same as without a device stage."""
    _, out = packed
    kwargs = dict(transforms=[RandomResizedCrop(40), RandomHorizontalFlip()], targets=Targets(masks="mask"), workers=2,
                  seed=4)
    with Loader(out, 4, device="cpu", **kwargs) as on_device, Loader(out, 4, **kwargs) as plain:
        for (images, _, extras), (ref, _, ref_extras) in zip(on_device, plain):
            assert images.shape[1] == 3 and torch.equal(images, ref)
            assert isinstance(extras["mask"], torch.Tensor) and torch.equal(extras["mask"], ref_extras["mask"])
