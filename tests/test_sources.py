"""Sources: ImageFolder, loose files, file lists, CSVs, tars; path safety and clear errors."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import jpeg_bytes, smooth_rgb

from stoker.errors import SourceError
from stoker.sources import open_source


def _jpeg(path: Path, seed: int = 0, size: tuple[int, int] = (16, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(jpeg_bytes(smooth_rgb(np.random.default_rng(seed), *size)))
    return path


def test_image_folder_order_and_labels_match_torchvision(tmp_path: Path) -> None:
    root = tmp_path / "train"
    for rel in ["b/2.jpg", "b/10.jpg", "a/z.png", "a/sub/x.jpg", "a/y.JPG", "C/1.jpg"]:
        _jpeg(root / rel)
    (root / "a" / "notes.txt").write_text("not an image")
    (root / "a" / ".hidden.jpg").write_bytes(b"")
    (root / ".ipynb_checkpoints").mkdir()
    src = open_source(root)
    assert src.kind == "folder"
    assert src.classes == ["C", "a", "b"]  # sorted by code point, like torchvision
    # torchvision: sorted(os.walk(class_dir)) then sorted file names
    assert [i.key for i in src.items] == ["C/1.jpg", "a/y.JPG", "a/z.png", "a/sub/x.jpg", "b/10.jpg", "b/2.jpg"]
    assert [i.label for i in src.items] == [0, 1, 1, 1, 2, 2]
    assert src.label_type == "int64"
    assert "3 classes" in src.description
    item = src.items[0]
    assert item.path == root / "C" / "1.jpg" and item.read() == (root / "C" / "1.jpg").read_bytes()


def test_loose_files_are_unlabelled(tmp_path: Path) -> None:
    _jpeg(tmp_path / "a.jpg")
    _jpeg(tmp_path / "b.png")
    src = open_source(tmp_path)
    assert src.kind == "files" and src.label_type == "none" and src.classes is None
    assert [i.key for i in src.items] == ["a.jpg", "b.png"]


def test_auto_refuses_mixed_folder(tmp_path: Path) -> None:
    _jpeg(tmp_path / "loose.jpg")
    _jpeg(tmp_path / "cls" / "x.jpg")
    with pytest.raises(SourceError, match="kind='folder'.*kind='files'"):
        open_source(tmp_path)
    assert [i.key for i in open_source(tmp_path, kind="files").items] == ["loose.jpg", "cls/x.jpg"]
    assert [i.key for i in open_source(tmp_path, kind="folder").items] == ["cls/x.jpg"]


def test_file_list_edge_cases(tmp_path: Path) -> None:
    _jpeg(tmp_path / "img dir" / "with space.jpg")
    _jpeg(tmp_path / "b.jpg")
    _jpeg(tmp_path / "sub" / "c.jpg")
    listing = tmp_path / "train.txt"
    listing.write_text("# header comment\n\nimg dir/with space.jpg 3\n   \nb.jpg\t0\n"
                       f"{tmp_path / 'sub' / 'c.jpg'} 7\n")
    src = open_source(listing)
    assert src.kind == "list" and src.label_type == "int64" and src.classes is None
    assert [(i.key, i.label) for i in src.items] == [("img dir/with space.jpg", 3), ("b.jpg", 0), ("sub/c.jpg", 7)]
    assert src.items[0].read() == (tmp_path / "img dir" / "with space.jpg").read_bytes()


def test_file_list_string_and_float_labels(tmp_path: Path) -> None:
    listing = tmp_path / "l.txt"
    listing.write_text("a.jpg zebra\nb.jpg ant\nc.jpg zebra\n")
    src = open_source(listing)
    assert src.classes == ["ant", "zebra"] and [i.label for i in src.items] == [1, 0, 1]
    listing.write_text("a.jpg 0.5\nb.jpg 2\n")
    src = open_source(listing)
    assert src.label_type == "float64" and [i.label for i in src.items] == [0.5, 2.0]


@pytest.mark.parametrize("text, line", [
    ("a.jpg 1\njustapath\n", 2),
    ("# c\n\na.jpg 1\nb.jpg 2\na.jpg 3\n", 5),   # duplicate
])
def test_file_list_malformed_line_is_named(tmp_path: Path, text: str, line: int) -> None:
    listing = tmp_path / "l.txt"
    listing.write_text(text)
    with pytest.raises(SourceError, match=f"line {line}") as info:
        open_source(listing)
    assert info.value.line == line and info.value.path == str(listing)


def test_list_is_trusted_absolute_and_outside_paths_work(tmp_path: Path) -> None:
    """A user's own list may name files anywhere (the train.txt the field writes); root= only
    decides what keys are relative to."""
    root = tmp_path / "data"
    _jpeg(root / "ok.jpg")
    outside = _jpeg(tmp_path / "elsewhere" / "1.JPEG")
    listing = root / "l.txt"
    listing.write_text(f"ok.jpg 0\n../elsewhere/1.JPEG 1\n{outside} 2\n")
    with pytest.raises(SourceError, match="line 3: .*already listed on line 2"):
        open_source(listing)   # the same file twice, once relative, once absolute
    listing.write_text(f"ok.jpg 0\n{outside} 1\n")
    src = open_source(listing)
    assert [(i.key, i.path, i.label) for i in src.items] == [
        ("ok.jpg", root / "ok.jpg", 0), (outside.as_posix(), outside, 1)]
    # root= makes keys relative to it, and relative paths resolve against it
    listing.write_text("elsewhere/1.JPEG 1\n")
    assert [i.key for i in open_source(listing, root=tmp_path).items] == ["elsewhere/1.JPEG"]
    listing.write_text(f"{outside} 1\n")
    with pytest.raises(SourceError, match="line 1: .*not under the root .*--root / root="):
        open_source(listing, root=root)
    # a folder source still refuses a symlink out of its tree
    os.symlink(outside, root / "link.jpg")
    with pytest.raises(SourceError, match="symlink"):
        open_source(root, kind="files")


def test_a_symlink_out_of_an_image_folder_names_the_way_for_a_trusted_tree(tmp_path: Path) -> None:
    """ImageFolder follows a link out of its tree; stoker's folder source refuses it (a downloaded tree must
    not make a pack read elsewhere), and the message names the way for a tree the user trusts: a file list
    of its images, which is read as written, the link included."""
    outside = _jpeg(tmp_path / "elsewhere" / "1.jpg")
    _jpeg(tmp_path / "train" / "cat" / "0.jpg")
    os.symlink(outside, tmp_path / "train" / "cat" / "1.jpg")
    with pytest.raises(SourceError, match=r"for a tree you trust, write its images to a file list"):
        open_source(tmp_path / "train")
    listing = tmp_path / "train.txt"
    listing.write_text("".join(f"{p.relative_to(tmp_path / 'train').as_posix()} 0\n"
                               for p in sorted((tmp_path / "train" / "cat").iterdir())))
    src = open_source(listing, root=tmp_path / "train")
    assert [i.key for i in src.items] == ["cat/0.jpg", "cat/1.jpg"]


def test_symlinks_inside_root_are_followed_once(tmp_path: Path) -> None:
    _jpeg(tmp_path / "a" / "x.jpg")
    os.symlink(tmp_path / "a", tmp_path / "a" / "loop")  # would loop forever if followed blindly
    src = open_source(tmp_path, kind="folder")
    assert [i.key for i in src.items] == ["a/x.jpg"]


def test_csv_with_typed_extras_and_string_labels(tmp_path: Path) -> None:
    for name in ["a.jpg", "b b.jpg", "c.jpg"]:
        _jpeg(tmp_path / "imgs" / name)
    table = tmp_path / "meta.csv"
    table.write_text('path,label,weight,count,note\nimgs/a.jpg,dog,0.5,3,"x, y"\n'
                     "imgs/b b.jpg,cat,,4,\n\nimgs/c.jpg,dog,2,5,z\n")
    src = open_source(table)
    assert src.kind == "csv" and src.classes == ["cat", "dog"]
    assert [i.label for i in src.items] == [1, 0, 1]
    assert src.extra_columns == {"weight": "float64", "count": "int64", "note": "string"}
    assert src.items[0].extras == {"weight": 0.5, "count": 3, "note": "x, y"}
    assert np.isnan(src.items[1].extras["weight"]) and src.items[1].extras["note"] == ""
    assert src.items[1].key == "imgs/b b.jpg"


def test_csv_errors(tmp_path: Path) -> None:
    table = tmp_path / "m.csv"
    table.write_text("file,cls\na.jpg,1\n")
    with pytest.raises(SourceError, match="no 'path' column"):
        open_source(table)
    table.write_text("path,label\na.jpg,1\nb.jpg,2,extra\n")
    with pytest.raises(SourceError, match="line 3: expected 2 fields"):
        open_source(table)
    table.write_text("path\na.jpg\n")
    src = open_source(table, label_column=None)
    assert src.label_type == "none" and src.items[0].label is None
    src = open_source(table, path_column="path", label_column=None)
    assert len(src) == 1


def test_missing_empty_and_unknown_sources(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        open_source(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no class folders and no images"):
        open_source(tmp_path / "empty")
    (tmp_path / "empty" / "cls").mkdir()
    with pytest.raises(SourceError, match="no images found"):
        open_source(tmp_path / "empty")
    (tmp_path / "l.txt").write_text("# nothing\n\n")
    with pytest.raises(SourceError, match="lists no images"):
        open_source(tmp_path / "l.txt")
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(SourceError, match="cannot read .*x.parquet as Parquet"):
        open_source(tmp_path / "x.parquet")
    (tmp_path / "x.zip").write_bytes(b"PK")
    with pytest.raises(SourceError, match="cannot tell .*kind=...: one of .*webdataset, tfrecord, hf, lmdb, hdf5"):
        open_source(tmp_path / "x.zip")
    with pytest.raises(SourceError, match="unknown source kind"):
        open_source(tmp_path, kind="zip")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder")
def test_unreadable_folder(tmp_path: Path) -> None:
    _jpeg(tmp_path / "cls" / "a.jpg")
    (tmp_path / "cls").chmod(0)
    try:
        with pytest.raises(SourceError, match="permission denied"):
            open_source(tmp_path)
    finally:
        (tmp_path / "cls").chmod(0o755)


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def test_tar_source_reads_members_by_offset(tmp_path: Path) -> None:
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    blobs = {}
    for t in range(2):
        with tarfile.open(shard_dir / f"part-{t}.tar", "w") as tf:
            for i in range(3):
                blob = jpeg_bytes(smooth_rgb(np.random.default_rng(10 * t + i), 8, 8))
                blobs[f"part-{t}.tar/s{i}.jpg"] = blob
                _add(tf, f"s{i}.jpg", blob)
                _add(tf, f"s{i}.cls", str(i % 2).encode())
    src = open_source(shard_dir)
    assert src.kind == "webdataset" and src.label_type == "int64"
    assert [i.key for i in src.items] == list(blobs)
    assert [i.label for i in src.items] == [0, 1, 0, 0, 1, 0]
    assert all(i.read() == blobs[i.key] for i in src.items)
    one = open_source(shard_dir / "part-1.tar")
    assert [i.key for i in one.items] == ["s0.jpg", "s1.jpg", "s2.jpg"]


def test_multi_label_cells_and_mixed_labels(tmp_path: Path) -> None:
    for name in ["a.jpg", "b.jpg", "c.jpg"]:
        _jpeg(tmp_path / name)
    table = tmp_path / "m.csv"
    table.write_text('path,label\na.jpg,"[1, 3]"\nb.jpg,2 5\nc.jpg,[]\n')
    src = open_source(table)
    assert src.label_type == "list<int64>" and [i.label for i in src.items] == [[1, 3], [2, 5], []]
    table.write_text("path,label\na.jpg,golden retriever\nb.jpg,cat\n")   # a name with a space stays one name
    assert open_source(table).classes == ["cat", "golden retriever"]
    table.write_text('path,label\na.jpg,"[""cat"", ""dog""]"\nb.jpg,dog\n')
    src = open_source(table)
    assert src.classes == ["cat", "dog"] and [i.label for i in src.items] == [[0, 1], [1]]
    listing = tmp_path / "l.txt"
    listing.write_text("a.jpg 3\nb.jpg cat\nc.jpg 4\n")
    with pytest.raises(SourceError, match=r"l.txt line 2: label 'cat' is a name while .*l.txt line 1 has the number '3'"):
        open_source(listing)
    listing.write_text("a.jpg 0.5\nb.jpg 2\n")   # ints and floats together: float regression targets
    assert [i.label for i in open_source(listing).items] == [0.5, 2.0]


def test_portable_items_carry_store_bytes_or_the_read_error(tmp_path: Path) -> None:
    """What `pack --engine ray` sends a worker: file items stay paths; a store's record travels
    as its bytes, or as the OSError reading it raised (so it is skipped with the same reason)."""
    import gzip
    import pickle

    from stoker.sources.base import GzipMembers, SourceItem

    good, bad = tmp_path / "good.gz", tmp_path / "bad.gz"
    good.write_bytes(gzip.compress(b"0123456789"))
    bad.write_bytes(gzip.compress(b"0123456789")[:12])   # cut inside the header: nothing decompresses
    file_item = SourceItem("a.jpg", tmp_path / "a.jpg", 0)
    assert file_item.portable() is file_item
    moved = pickle.loads(pickle.dumps(SourceItem("k", None, 1, offset=2, size=3, store=GzipMembers(good)).portable()))
    assert moved.read() == b"234" and moved.where() == f"{good}:k"
    broken = pickle.loads(pickle.dumps(SourceItem("k", None, 1, offset=2, size=3, store=GzipMembers(bad)).portable()))
    with pytest.raises(OSError, match="cannot decompress"):
        broken.read()
