"""stoker's resampling against torchvision 0.28 itself (tests/torchvision_helpers.py imports it).

Real photographs: the JPEG photographs of Pillow's test corpus (`../shared/corpora/pillow-test-images`),
decoded by Pillow as torchvision's ImageFolder does. On the exact path (full-size decode) each resize
matches torchvision within 1 on >= 99.9% of values; on the default path (DCT-scaled region decode)
crops are statistically indistinguishable from torchvision's (per-image std and mean gradient).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import stoker
from stoker.transforms import CenterCrop, Pipeline, RandomResizedCrop, Resize, crop_resize_into
from torchvision_helpers import chw, differing, hwc, images_hwc, v2, v2_functional

#: the photographs among Pillow's test images (flowers, a portrait, a building, an aeroplane, mountains,
#: a beach, coins, a cabin in snow, a field)
PHOTOS = ("flower.jpg", "flower2.jpg", "hopper.jpg", "iptc.jpg", "exif_gps_typeerror.jpg", "exif-72dpi-int.jpg",
          "icc_profile_big.jpg", "xmp_test.jpg", "sugarshack_bad_mpo_header.jpg", "junk_jpeg_header.jpg")


def photos(corpus: Path) -> dict[str, np.ndarray]:
    out = {}
    for name in PHOTOS:
        with Image.open(corpus / name) as im:
            out[name] = np.asarray(im.convert("RGB"))
    return out


@pytest.fixture(scope="module")
def corpus_photos() -> dict[str, np.ndarray]:
    from conftest import CORPUS_MISSING, PILLOW_CORPUS

    if not PILLOW_CORPUS.is_dir():
        pytest.skip(CORPUS_MISSING)
    return photos(PILLOW_CORPUS)


def stoker_apply(ops: list, img: np.ndarray) -> np.ndarray:
    """stoker's planned geometry on a full-size image (no DCT scaling): the exact path."""
    pipe = Pipeline(ops)
    return pipe.apply(img)


def within_one(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    assert ours.shape == theirs.shape, what
    worst, share = differing(ours, theirs)
    assert share <= 0.001, f"{what}: {share:.4%} of values differ by more than 1 (max {worst})"


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest", "nearest-exact"])
@pytest.mark.parametrize("antialias", [True, False])
def test_resize_and_center_crop_match_torchvision(corpus_photos: dict, interpolation: str, antialias: bool) -> None:
    tv, F = v2(), v2_functional()
    mode = tv.InterpolationMode(interpolation)
    for name, img in corpus_photos.items():
        x = chw(img)
        for ops, ref in (
            ([Resize(256, interpolation, antialias)], tv.Resize(256, mode, antialias=antialias)),
            ([Resize(256, interpolation, antialias), CenterCrop(224)],
             tv.Compose([tv.Resize(256, mode, antialias=antialias), tv.CenterCrop(224)])),
            ([Resize((160, 200), interpolation, antialias)], tv.Resize((160, 200), mode, antialias=antialias)),
            ([CenterCrop(300), Resize(100, interpolation, antialias)],
             tv.Compose([tv.CenterCrop(300), tv.Resize(100, mode, antialias=antialias)])),
        ):
            within_one(stoker_apply(ops, img), hwc(ref(x)), f"{name} {ops}")
        h, w = img.shape[:2]
        for top, left, bh, bw in ((0, 0, h, w), (h // 5, w // 7, h // 2, w // 3), (3, 5, 150, 101)):
            ours = np.empty((224, 224, 3), np.uint8)
            crop_resize_into(img, (top, left, bh, bw), ours, False, h, w, interpolation=interpolation,
                             antialias=antialias)
            theirs = F.resized_crop(x, top, left, bh, bw, [224, 224], mode, antialias=antialias)
            within_one(ours, hwc(theirs), f"{name} resized_crop {(top, left, bh, bw)}")


def test_resize_matches_torchvision_pil_path(corpus_photos: dict) -> None:
    """torchvision's classic path (PIL images from ImageFolder): PIL's own antialiased bilinear."""
    tv = v2()
    ref = tv.Compose([tv.Resize(256), tv.CenterCrop(224)])
    for name, img in corpus_photos.items():
        theirs = np.asarray(ref(Image.fromarray(img)))
        within_one(stoker_apply([Resize(256), CenterCrop(224)], img), theirs, name)


def test_center_crop_padding_matches_torchvision(corpus_photos: dict) -> None:
    tv = v2()
    img = corpus_photos["flower2.jpg"]  # 300 x 225
    for ops, ref in (([CenterCrop((260, 340))], tv.CenterCrop((260, 340))),
                     ([Resize(128), CenterCrop(160)], tv.Compose([tv.Resize(128), tv.CenterCrop(160)]))):
        within_one(stoker_apply(ops, img), hwc(ref(chw(img))), str(ops))


def _loader_images(folder: Path, ops: list, quality: str, epochs: int = 1) -> np.ndarray:
    out = []
    with stoker.Loader(stoker.open_loose(folder), 8, transforms=ops, order="sequential", seed=5,
                       workers=stoker.Workers(num_threads=2, decode_quality=quality)) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            out.extend(images_hwc(images) for images, _ in loader)
    return np.concatenate(out)


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory: pytest.TempPathFactory, corpus_photos: dict) -> Path:
    """The photographs re-saved as plain baseline JPEGs (quality 92), what a packed dataset holds."""
    root = tmp_path_factory.mktemp("photos") / "photo"
    root.mkdir()
    for name, img in corpus_photos.items():
        Image.fromarray(img).save(root / name, quality=92)
    return root.parent


def test_loader_exact_path_matches_torchvision(photo_folder: Path) -> None:
    """Through the Loader with decode_quality="exact": Resize(256)+CenterCrop(224) as torchvision's
    Compose on Pillow-decoded images, within 1 on >= 99.9% of values."""
    tv = v2()
    ours = _loader_images(photo_folder, [Resize(256), CenterCrop(224)], "exact")
    ref = tv.Compose([tv.Resize(256), tv.CenterCrop(224)])
    files = sorted((photo_folder / "photo").iterdir())
    theirs = np.stack([hwc(ref(chw(np.asarray(Image.open(f).convert("RGB"))))) for f in files])
    within_one(ours, theirs, "Loader exact Resize(256)+CenterCrop(224)")


def test_loader_default_path_is_torchvisions_where_the_decode_is_full_size(photo_folder: Path) -> None:
    """The default decode_quality: Resize(256)+CenterCrop(224) gives torchvision's pixels (within 1) on
    every photograph not large enough to be DCT-scaled, and stays close on the one that is."""
    from stoker import codecs
    from stoker.transforms import decode_minimums

    tv = v2()
    ours = _loader_images(photo_folder, [Resize(256), CenterCrop(224)], "accurate")
    ref = tv.Compose([tv.Resize(256), tv.CenterCrop(224)])
    pipe = Pipeline([Resize(256), CenterCrop(224)])
    scaled = 0
    for got, f in zip(ours, sorted((photo_folder / "photo").iterdir())):
        img = np.asarray(Image.open(f).convert("RGB"))
        h, w = img.shape[:2]
        box = pipe.plan(np.array([h]), np.array([w]), np.zeros((1, 1))).box[0]
        theirs = hwc(ref(chw(img)))
        worst, share = differing(got, theirs)
        if codecs.jpeg_scale_eighths(h, w, *decode_minimums(box, 224, 224, h, w)) == 8:
            assert share <= 0.001, f"{f.name}: {share:.3%} of values differ by more than 1 (max {worst})"
        else:
            scaled += 1
            mean = np.abs(got.astype(np.int16) - theirs).mean()
            assert mean < 4, f"{f.name} (DCT-scaled): mean |difference| {mean:.2f}"
    assert 0 < scaled < len(ours)  # both kinds are checked


def ks_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov test, asymptotic p-value (what scipy.stats.ks_2samp gives for
    samples this large)."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    d = np.abs(np.searchsorted(a, grid, side="right") / len(a) - np.searchsorted(b, grid, side="right") / len(b)).max()
    if d == 0:
        return 1.0
    n = len(a) * len(b) / (len(a) + len(b))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    return float(min(1.0, max(0.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101)))))


def crop_statistics(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per image: the standard deviation of its values and its mean absolute horizontal + vertical gradient."""
    f = images.astype(np.float32)
    grad = np.abs(np.diff(f, axis=1)).mean(axis=(1, 2, 3)) + np.abs(np.diff(f, axis=2)).mean(axis=(1, 2, 3))
    return f.std(axis=(1, 2, 3)), grad


def test_fast_path_is_indistinguishable_from_torchvision(photo_folder: Path) -> None:
    """The default path (DCT-scaled region decode, then the antialiased remainder): RandomResizedCrop(224)
    crops have torchvision's distribution of sharpness (mean gradient) and contrast (std), 270 crops each."""
    import torch

    tv = v2()
    epochs = 30
    ours = _loader_images(photo_folder, [RandomResizedCrop(224)], "accurate", epochs=epochs)
    torch.manual_seed(0)
    rrc = tv.RandomResizedCrop(224)
    pil = [Image.open(f).convert("RGB") for f in sorted((photo_folder / "photo").iterdir())]
    theirs = np.stack([np.asarray(rrc(im)) for _ in range(epochs) for im in pil])
    for what, a, b in zip(("std", "mean gradient"), crop_statistics(ours), crop_statistics(theirs)):
        p = ks_pvalue(a, b)
        assert p > 0.05, f"{what}: KS p = {p:.3g} (stoker mean {a.mean():.3f}, torchvision {b.mean():.3f})"
