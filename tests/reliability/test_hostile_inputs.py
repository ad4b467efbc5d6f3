"""One hostile input costs that input, never the pack: a skip line in ``skipped.jsonl`` (or, for
the syntax of a list, a SourceError naming the line), never a traceback.

Before these were handled, each of them stopped ``pack`` with a raw Python exception: a valid JPEG
whose name is not UTF-8 (UnicodeEncodeError while writing the key column, and again on every
``resume``), a list label too large for int64 (OverflowError), a NUL byte in a CSV path
(ValueError). Truncated tars and members claiming 8 GiB are covered here too.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from stoker.errors import SourceError
from stoker.packing import PackOptions, pack

from .rhelpers import make_image_folder


def _skipped(out: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]


@pytest.mark.skipif(os.name != "posix", reason="file names as raw bytes are POSIX")
def test_a_name_that_is_not_utf8_is_skipped_and_resume_agrees(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    jpeg = (src / "cat" / "000.jpg").read_bytes()
    with open(os.path.join(os.fsencode(src / "cat"), b"caf\xe9.jpg"), "wb") as fh:
        fh.write(jpeg)
    out = tmp_path / "out"
    summary = pack(src, out, options=PackOptions(workers=1), progress=False)
    assert (summary.packed, summary.skipped) == (6, 1)
    (skip,) = _skipped(out)
    assert skip["key"] == "cat/caf\\xe9.jpg" and "not valid UTF-8" in skip["reason"] and "rename" in skip["reason"]
    again = pack(src, out, options=PackOptions(workers=1), progress=False, resume=True)
    assert (again.packed, again.skipped) == (6, 1)


def test_a_label_too_large_for_int64_names_the_line(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    (src / "l.txt").write_text("cat/000.jpg 0\ncat/001.jpg 99999999999999999999999\n")
    with pytest.raises(SourceError, match=r"l\.txt line 2: label '99999999999999999999999' does not fit"):
        pack(src / "l.txt", tmp_path / "out", options=PackOptions(workers=1), progress=False)


def test_a_nul_byte_in_a_csv_path_is_a_skip(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    (src / "l.csv").write_text("path,label\ncat/000.jpg,0\ncat/0\x0001.jpg,1\ndog/000.jpg,1\n")
    out = tmp_path / "out"
    summary = pack(src / "l.csv", out, options=PackOptions(workers=1), progress=False)
    assert (summary.packed, summary.skipped) == (2, 1)
    (skip,) = _skipped(out)
    assert skip["key"] == "cat/0\x0001.jpg" and "NUL byte" in skip["reason"]


def _tar(path: Path, jpeg: bytes, n: int) -> None:
    with tarfile.open(path, "w") as tf:
        for i in range(n):
            for name, data in ((f"{i:03d}.jpg", jpeg), (f"{i:03d}.cls", b"1")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("damage", ["truncated", "member claims 8 GiB"])
def test_a_damaged_tar_costs_its_damaged_part(tmp_path, damage):
    jpeg = (make_image_folder(tmp_path / "img", n_per_class=1) / "cat" / "000.jpg").read_bytes()
    shards = tmp_path / "tars"
    shards.mkdir()
    _tar(shards / "a.tar", jpeg, 3)
    _tar(shards / "b.tar", jpeg, 3)
    raw = bytearray((shards / "b.tar").read_bytes())
    if damage == "truncated":
        del raw[512 + len(jpeg) + 512 + 700:]
    else:
        header = tarfile.TarInfo("001.jpg")
        header.size = 8 << 30
        at = 3 * 512 + (len(jpeg) + 511) // 512 * 512  # after 000.jpg and 000.cls
        raw[at:at + 512] = header.tobuf(format=tarfile.GNU_FORMAT)[:512]
    (shards / "b.tar").write_bytes(bytes(raw))
    out = tmp_path / "out"
    summary = pack(shards, out, options=PackOptions(workers=1), progress=False)
    assert summary.packed >= 4 and summary.skipped >= 1
    assert all("b.tar" in s["path"] for s in _skipped(out))


_COCO = {"images": [{"id": 1, "file_name": "cat/000.jpg", "width": 40, "height": 40}],
         "annotations": [{"id": 1, "image_id": 1, "bbox": [1, 2, 3, 4], "category_id": 7}],
         "categories": [{"id": 7, "name": "x"}]}
HOSTILE_COCO = {
    "100k-deep JSON": "[" * 100_000 + "]" * 100_000,
    "a category without an id": {**_COCO, "categories": [{"name": "x"}]},
    "an annotation that is a number": {**_COCO, "annotations": [5]},
    "an image that is a string": {**_COCO, "images": ["a"]},
    "a box of strings": {**_COCO, "annotations": [{**_COCO["annotations"][0], "bbox": ["a", 2, 3, 4]}]},
    "a width that is text": {**_COCO, "images": [{**_COCO["images"][0], "width": "w"}]},
    "a list as a category id": {**_COCO, "categories": [{"id": [1], "name": "x"}]},
}


@pytest.mark.parametrize("name", list(HOSTILE_COCO))
def test_a_malformed_coco_file_is_a_source_error_naming_it(tmp_path, name):
    """COCO annotation files are usually downloaded: a wrong shape is a SourceError, not a raw
    KeyError/TypeError/RecursionError from inside the parse."""
    src = make_image_folder(tmp_path / "src", n_per_class=1)
    doc = HOSTILE_COCO[name]
    (src / "instances.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(SourceError, match=r"instances\.json"):
        pack(src / "instances.json", tmp_path / "out", options=PackOptions(workers=1), progress=False, kind="coco")


def test_a_webdataset_json_nested_too_deeply_is_a_skip(tmp_path):
    jpeg = (make_image_folder(tmp_path / "img", n_per_class=1) / "cat" / "000.jpg").read_bytes()
    shards = tmp_path / "tars"
    shards.mkdir()
    with tarfile.open(shards / "a.tar", "w") as tf:
        for i, meta in enumerate([b'{"label": 1}', b"[" * 100_000 + b"]" * 100_000, b'{"label": 0}']):
            for name, data in ((f"{i:03d}.jpg", jpeg), (f"{i:03d}.json", meta)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    summary = pack(shards, out, options=PackOptions(workers=1), progress=False)
    assert (summary.packed, summary.skipped) == (2, 1)
    (skip,) = _skipped(out)
    assert skip["key"] == "a.tar/001.jpg" and "not JSON" in skip["reason"]
