"""Reads stay inside the source root: what a read opens is checked against what listing saw.

Before the fix, an image swapped for a symlink to a file outside the root after the folder was
listed was packed (time of check, time of use), and a ``.tar`` symlinked into a folder of shards
from elsewhere was packed too. A user's own list is trusted input: its paths go where they say.
"""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from stoker import Loader, Resize, open_loose
import stoker
from stoker.errors import SourceError
from stoker.packing import PackOptions, pack
from stoker.sources import open_source

from .rhelpers import make_image_folder


@pytest.fixture
def swapped(tmp_path):
    """A listed ImageFolder source, then one of its images swapped for a symlink to a file outside."""
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    secret = make_image_folder(tmp_path / "outside", n_per_class=1, classes=("s",)) / "s" / "000.jpg"
    source = open_source(src)
    victim = src / "cat" / "001.jpg"
    victim.unlink()
    victim.symlink_to(secret)
    return source


def test_a_file_swapped_for_a_symlink_after_listing_is_skipped_not_packed(tmp_path, swapped):
    out = tmp_path / "out"
    summary = pack(swapped, out, options=PackOptions(workers=1), progress=False)
    assert (summary.packed, summary.skipped) == (5, 1)
    (skip,) = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert skip["key"] == "cat/001.jpg" and "not the file that was listed" in skip["reason"]


def test_the_loose_loader_refuses_the_swapped_file_too(swapped):
    loader = Loader(open_loose(swapped), 3, transforms=[Resize((16, 16))], timeout=30.0, workers=stoker.Workers(num_threads=1, on_error="skip"))
    try:
        n = sum(len(labels) for _, labels in loader)
        assert loader.stats.skipped == 1 and n == 6   # the skipped place is filled by another sample
    finally:
        loader.close()


def test_a_symlink_inside_the_root_is_still_followed(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    (src / "cat" / "link.jpg").symlink_to(src / "dog" / "000.jpg")
    summary = pack(src, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert (summary.packed, summary.skipped) == (7, 0)


def test_a_tar_symlinked_into_a_folder_of_shards_from_elsewhere_is_refused(tmp_path):
    jpeg = (make_image_folder(tmp_path / "img", n_per_class=1) / "cat" / "000.jpg").read_bytes()
    shards, elsewhere = tmp_path / "shards", tmp_path / "elsewhere"
    for folder, name in ((shards, "a.tar"), (elsewhere, "evil.tar")):
        folder.mkdir()
        with tarfile.open(folder / name, "w") as tf:
            info = tarfile.TarInfo("000.jpg")
            info.size = len(jpeg)
            tf.addfile(info, io.BytesIO(jpeg))
    (shards / "b.tar").symlink_to(elsewhere / "evil.tar")
    with pytest.raises(SourceError, match=r"b\.tar is a symlink that points outside the shard folder"):
        pack(shards, tmp_path / "out", options=PackOptions(workers=1), progress=False)
