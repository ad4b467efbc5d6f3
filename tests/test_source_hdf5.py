"""HDF5 source: files written with h5py (encoded bytes or pixel arrays, plus a label dataset)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import smooth_rgb
from formats_helpers import CORRUPT_JPEG, pack_and_read, photos, skipped

from stoker import codecs
from stoker.errors import SourceError
from stoker.sources import open_source

h5py = pytest.importorskip("h5py", reason="h5py is not installed; pip install 'stoker[hdf5]'")


def test_encoded_images_labels_and_extras(tmp_path: Path) -> None:
    imgs = photos(5)
    imgs[3] = CORRUPT_JPEG
    path = tmp_path / "train.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("images", (5,), dtype=h5py.vlen_dtype(np.uint8))
        for i, blob in enumerate(imgs):
            ds[i] = np.frombuffer(blob, np.uint8)
        labels = f.create_dataset("labels", data=np.array([2, 0, 1, 1, 2], np.int64))
        labels.attrs["classes"] = ["cat", "dog", "owl"]
        f.create_dataset("weight", data=np.linspace(0, 1, 5))
        f.create_dataset("source", data=np.array([b"a", b"b", b"c", b"d", b"e"]))
    src = open_source(path)
    assert src.kind == "hdf5" and src.classes == ["cat", "dog", "owl"]
    assert src.extra_columns == {"source": "string", "weight": "float64"}
    rows, manifest = pack_and_read(path, tmp_path / "out")
    assert {k: (r["image"], r["label"], r["source"]) for k, r in rows.items()} == {
        f"images/{i}": (imgs[i], [2, 0, 1, 1, 2][i], "abcde"[i]) for i in (0, 1, 2, 4)}
    assert list(skipped(tmp_path / "out")) == ["images/3"]
    assert manifest["classes"] == ["cat", "dog", "owl"]


def test_pixel_arrays_and_multi_label_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    pixels = np.stack([smooth_rgb(rng, 70, 80) for _ in range(3)])
    path = tmp_path / "pix.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=pixels)
        f.create_dataset("y", data=np.array([[1, 4, -1], [0, -1, -1], [2, 3, 4]]))
    src = open_source(path)
    assert src.label_type == "list<int64>" and [i.label for i in src.items] == [[1, 4], [0], [2, 3, 4]]
    assert codecs.decode_pillow_rgb(src.items[1].read(), "x/1").tolist() == pixels[1].tolist()
    rows, _ = pack_and_read(path, tmp_path / "out")
    assert {k: r["label"] for k, r in rows.items()} == {"x/0": [1, 4], "x/1": [0], "x/2": [2, 3, 4]}
    assert {r["height"] for r in rows.values()} == {70}


def test_named_datasets_and_errors(tmp_path: Path) -> None:
    imgs = photos(2, seed=4)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        grp = f.create_group("train")
        grp.create_dataset("jpeg", data=np.array([np.void(imgs[1])]))   # fixed-size opaque elements
        grp.create_dataset("species", data=np.array([b"owl"]))
        f.create_dataset("other", data=np.zeros(7))
    src = open_source(path, image_column="train/jpeg", label_column="train/species")
    assert src.classes == ["owl"] and src.items[0].read() == imgs[1]
    with pytest.raises(SourceError, match="no image dataset 'pics'.*--image-column"):
        open_source(path, image_column="pics")
    with pytest.raises(SourceError, match="label dataset 'other' has 7 elements for 1 images"):
        open_source(path, image_column="train/jpeg", label_column="other")
