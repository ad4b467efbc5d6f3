"""WebDataset source: shard sets written by ``webdataset.TarWriter`` (brace patterns, lists, .tar.gz)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import smooth_rgb
from formats_helpers import CORRUPT_JPEG, pack_and_read, photos, skipped
from PIL import Image

from stoker.errors import SourceError
from stoker.sources import open_source

wds = pytest.importorskip("webdataset", reason="the webdataset package (writer) is not installed; "
                          "pip install 'stoker[test-formats]'")
pytest.importorskip("braceexpand", reason="braceexpand is not installed; pip install 'stoker[webdataset]'")


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(smooth_rgb(np.random.default_rng(seed), 64, 80)).save(buf, "PNG")
    return buf.getvalue()


def _write(path: Path, samples: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return path


def test_brace_pattern_gzip_shards_extensions_and_json_extras(tmp_path: Path) -> None:
    imgs = photos(6)
    shards = tmp_path / "shards"
    # shard 0 plain, shard 1 gzip-compressed (the writer compresses by file name), shard 2 plain
    _write(shards / "train-000000.tar", [
        {"__key__": "a0", "jpg": imgs[0], "cls": 2, "json": {"w": 0.5, "src": "x", "boxes": [1, 2]}},
        {"__key__": "a1", "jpeg": imgs[1], "cls": 0, "json": {"w": 1, "src": "y", "boxes": []}}])
    _write(shards / "train-000001.tar.gz", [
        {"__key__": "b0", "png": _png(3), "cls": 1, "json": {"w": 2.5, "src": "z", "boxes": [7]}},
        {"__key__": "b1", "jpg": CORRUPT_JPEG, "cls": 1, "json": {"w": 0, "src": "bad", "boxes": []}}])
    _write(shards / "train-000002.tar", [
        {"__key__": "c0", "webp": imgs[4], "cls": 3, "json": {"w": 3, "src": "q", "boxes": [0]}}])
    pattern = str(shards / "train-{000000..000002}.tar")
    with pytest.raises(SourceError, match="3 files but 1 do not exist"):
        open_source(pattern)   # the middle shard is .tar.gz, not .tar
    pattern = str(shards / "train-{000000,000001,000002}.tar*")
    with pytest.raises(SourceError, match="do not exist"):
        open_source(pattern)   # braces expand, globs do not

    files = [shards / "train-000000.tar", shards / "train-000001.tar.gz", shards / "train-000002.tar"]
    src = open_source(files)
    assert src.kind == "webdataset" and src.label_type == "int64"
    assert src.extra_columns == {"boxes": "list<int64>", "src": "string", "w": "float64"}
    rows, manifest = pack_and_read(files, tmp_path / "out")
    assert set(rows) == {"train-000000.tar/a0.jpg", "train-000000.tar/a1.jpeg", "train-000001.tar.gz/b0.png",
                         "train-000002.tar/c0.webp"}
    assert rows["train-000000.tar/a0.jpg"]["image"] == imgs[0]   # plain JPEG kept byte for byte
    assert rows["train-000000.tar/a1.jpeg"]["image"] == imgs[1]
    assert [rows[k]["label"] for k in sorted(rows)] == [2, 0, 1, 3]
    assert rows["train-000001.tar.gz/b0.png"]["w"] == 2.5 and rows["train-000001.tar.gz/b0.png"]["boxes"] == [7]
    assert rows["train-000000.tar/a1.jpeg"]["src"] == "y"
    assert "train-000001.tar.gz/b1.jpg" in skipped(tmp_path / "out")
    assert manifest["num_samples"] == 4

    # a brace pattern names the same shards
    gz_only = _write(shards / "more-000000.tar.gz", [{"__key__": "d0", "jpg": imgs[5], "cls": 1}])
    _write(shards / "more-000001.tar.gz", [{"__key__": "d1", "jpg": imgs[0], "cls": 0}])
    keys = [i.key for i in open_source(str(shards / "more-{000000..000001}.tar.gz")).items]
    assert keys == ["more-000000.tar.gz/d0.jpg", "more-000001.tar.gz/d1.jpg"]
    assert [i.key for i in open_source(gz_only).items] == ["d0.jpg"]


def test_json_and_txt_targets_multi_label(tmp_path: Path) -> None:
    imgs = photos(4, seed=5)
    folder = tmp_path / "wds"
    _write(folder / "p.tgz", [
        {"__key__": "s0", "jpg": imgs[0], "json": {"label": [1, 3], "score": 0.9}},
        {"__key__": "s1", "jpg": imgs[1], "json": {"label": [], "score": 0.1}},
        {"__key__": "s2", "jpg": imgs[2], "json": {"label": [2], "score": 0.5}}])
    src = open_source(folder)
    assert src.label_type == "list<int64>" and [i.label for i in src.items] == [[1, 3], [], [2]]
    rows, manifest = pack_and_read(folder, tmp_path / "out")
    assert rows["p.tgz/s0.jpg"]["label"] == [1, 3] and rows["p.tgz/s0.jpg"]["score"] == 0.9
    assert manifest["label_type"] == "list<int64>"

    named = _write(tmp_path / "n.tar", [{"__key__": f"t{i}", "jpg": imgs[i], "txt": name}
                                         for i, name in enumerate(["owl", "cat", "owl"])])
    src = open_source(named)
    assert src.classes == ["cat", "owl"] and [i.label for i in src.items] == [1, 0, 1]
    mixed = _write(tmp_path / "m.tar", [{"__key__": f"t{i}", "jpg": imgs[i], "txt": name}
                                         for i, name in enumerate(["owl", "3"])])
    with pytest.raises(SourceError, match=r"t0.jpg: label 'owl' is a name while .*t1.jpg has the number '3'"):
        open_source(mixed)


def test_truncated_tar_keeps_what_came_before(tmp_path: Path) -> None:
    imgs = photos(3, seed=7)
    tar = _write(tmp_path / "t.tar", [{"__key__": f"s{i}", "jpg": imgs[i], "cls": i} for i in range(3)])
    with tarfile.open(tar) as tf:
        last = tf.getmember("s2.jpg")
    tar.write_bytes(tar.read_bytes()[: last.offset_data + last.size // 2])   # cut inside the last image
    rows, _ = pack_and_read(tar, tmp_path / "out")
    assert {k: r["image"] for k, r in rows.items()} == {"s0.jpg": imgs[0], "s1.jpg": imgs[1]}
    reasons = skipped(tmp_path / "out")
    assert set(reasons) == {"s2.jpg", "t.tar/*"} and "shorter" in reasons["s2.jpg"]
    assert "damaged after 3 samples" in reasons["t.tar/*"]


def test_member_names_never_become_paths(tmp_path: Path) -> None:
    """An archive from elsewhere may name members '../../etc/x.jpg': they stay keys, read from the tar."""
    imgs = photos(1, seed=9)
    tar = _write(tmp_path / "evil.tar", [{"__key__": "../../outside/x", "jpg": imgs[0], "cls": 0}])
    src = open_source(tar)
    assert [i.key for i in src.items] == ["../../outside/x.jpg"] and src.items[0].path is None
    assert src.items[0].read() == imgs[0]
