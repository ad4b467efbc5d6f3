"""The generated ImageNet-like data: photo-like content, ImageNet's size statistics, determinism."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from stoker.errors import ConfigError
from stoker.tools.synth import (
    cached_imagenet_like,
    make_imagenet_like,
    make_tiny_jpegs,
    sample_size,
    synth_image,
)


@pytest.fixture(scope="module")
def hundred(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_imagenet_like(tmp_path_factory.mktemp("inet") / "set", 100, classes=5, seed=0, workers=2)


def _neighbour_correlation(plane: np.ndarray) -> float:
    a = plane[:, :-1].astype(np.float64).ravel()
    b = plane[:, 1:].astype(np.float64).ravel()
    return float(np.corrcoef(a, b)[0, 1])


def test_synth_image_is_photo_like_not_noise_or_flat() -> None:
    img = synth_image(np.random.default_rng(3), 300, 400)
    assert img.shape == (300, 400, 3) and img.dtype == np.uint8 and img.flags.c_contiguous
    grey = img.mean(axis=2)
    assert grey.std() > 20                      # not flat colour
    assert _neighbour_correlation(grey) > 0.3   # neighbours related: not white noise
    # Smooth regions and busy regions side by side: local contrast varies over the image.
    tiles = grey[:288, :384].reshape(9, 32, 12, 32).transpose(0, 2, 1, 3).reshape(108, -1)
    local = np.abs(np.diff(tiles, axis=1)).mean(axis=1)
    assert local.max() > 2.5 * local.min()
    white = np.random.default_rng(0).integers(0, 256, (300, 400)).astype(np.uint8)
    assert abs(_neighbour_correlation(white)) < 0.05   # the check above can tell noise apart


def test_synth_image_depends_only_on_the_generator_state() -> None:
    a = synth_image(np.random.default_rng(7), 64, 80, label=3)
    b = synth_image(np.random.default_rng(7), 64, 80, label=3)
    c = synth_image(np.random.default_rng(8), 64, 80, label=3)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_sample_size_statistics() -> None:
    rng = np.random.default_rng(0)
    sizes = np.array([sample_size(rng) for _ in range(4000)])
    heights, widths = sizes[:, 0], sizes[:, 1]
    short = sizes.min(axis=1)
    assert short.min() >= 250 and short.max() <= 500
    assert 380 < widths.mean() < 420 and 335 < heights.mean() < 365     # about 400x350
    ratios = np.round(sizes.max(axis=1) / short, 1)
    assert len(set(ratios.tolist())) >= 4                             # mixed aspect ratios
    portrait = (heights > widths).mean()
    assert 0.1 < portrait < 0.35                                      # mostly landscape, some portrait


def test_hundred_images_match_imagenet_statistics(hundred: Path) -> None:
    files = sorted(hundred.glob("class_*/img_*.jpg"))
    assert len(files) == 100
    assert {f.parent.name for f in files} == {f"class_{c:03d}" for c in range(5)}
    sizes = np.array([f.stat().st_size for f in files])
    assert 85_000 < sizes.mean() < 115_000, f"mean file size {sizes.mean():.0f} bytes"
    dims, dc_steps = [], []
    for f in files:
        with Image.open(f) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert JpegImagePlugin.get_sampling(im) == 2          # 4:2:0
            dims.append(im.size)
            dc_steps.append(im.quantization[0][0])
    w, h = np.array(dims).T
    assert np.minimum(w, h).min() >= 250 and np.minimum(w, h).max() <= 500
    assert 360 < w.mean() < 440 and 315 < h.mean() < 390
    # IJG scaling of the luma DC step (16): quality 95 -> 2, quality 85 -> 5.
    assert set(dc_steps) <= {2, 3, 4, 5} and len(set(dc_steps)) >= 2


def test_same_seed_same_bytes_whatever_the_workers(tmp_path: Path) -> None:
    # 40 images: more than one chunk, so workers=3 really runs a pool of processes.
    a = make_imagenet_like(tmp_path / "a", 40, classes=3, seed=11, workers=1)
    b = make_imagenet_like(tmp_path / "b", 40, classes=3, seed=11, workers=3)
    c = make_imagenet_like(tmp_path / "c", 6, classes=3, seed=12, workers=2)
    names = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert names == sorted(p.relative_to(b) for p in b.rglob("*.jpg"))
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    assert {p.read_bytes() for p in a.rglob("*.jpg")}.isdisjoint(p.read_bytes() for p in c.rglob("*.jpg"))
    assert not list(tmp_path.rglob("*.tmp"))


def test_list_layout_writes_train_txt(tmp_path: Path) -> None:
    listing = make_imagenet_like(tmp_path / "l", 5, classes=2, seed=0, workers=2, layout="list")
    assert listing == tmp_path / "l" / "train.txt"
    lines = listing.read_text().splitlines()
    assert len(lines) == 5
    for line in lines:
        rel, label = line.rsplit(" ", 1)
        assert (listing.parent / rel).is_file() and int(label) in (0, 1)


def test_tiny_jpegs_decode_at_the_size_asked_in_both_layouts(tmp_path: Path) -> None:
    root = make_tiny_jpegs(tmp_path / "t", 10, classes=3, size=(24, 40))
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 10 and len({f.parent for f in files}) == 3
    for f in files:
        with Image.open(io.BytesIO(f.read_bytes())) as im:
            assert im.size == (40, 24)
            im.load()
    listing = make_tiny_jpegs(tmp_path / "tl", 4, layout="list")
    assert len(listing.read_text().splitlines()) == 4


def test_cached_set_is_generated_once(tmp_path: Path) -> None:
    root = cached_imagenet_like(tmp_path, 3, classes=1, seed=5, workers=1)
    first = {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    assert len(first) == 3 and (tmp_path / f"{root.name}.complete").exists()
    again = cached_imagenet_like(tmp_path, 3, classes=1, seed=5, workers=1)
    assert again == root and {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")} == first


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"n": 2, "classes": 0}, {"n": 2, "layout": "csv"}])
def test_bad_arguments_are_config_errors(tmp_path: Path, kwargs: dict) -> None:
    n = kwargs.pop("n")
    with pytest.raises(ConfigError):
        make_imagenet_like(tmp_path / "x", n, **kwargs)
    with pytest.raises(ConfigError):
        synth_image(np.random.default_rng(0), 0, 10)
