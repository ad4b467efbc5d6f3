"""TFRecord source: files written by the ``tfrecord`` package (tf.train.Example, TF-Slim layout)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import pytest
from formats_helpers import CORRUPT_JPEG, pack_and_read, photos, skipped

from stoker.errors import SourceError
from stoker.sources import open_source
from stoker.sources.tfrecord import iter_records, masked_crc, parse_example

tfrecord_writer = pytest.importorskip("tfrecord.writer", reason="the tfrecord package (writer) is not installed; "
                                      "pip install 'stoker[test-formats]'")
crc32c = pytest.importorskip("crc32c", reason="crc32c is not installed; pip install 'stoker[tfrecord]'")


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = tfrecord_writer.TFRecordWriter(str(path))
    for rec in records:
        writer.write(rec)
    writer.close()
    return path


def _slim(image: bytes, label: int, name: str) -> dict:
    """The ImageNet / TF-Slim feature layout (image/encoded, image/class/label, ...)."""
    return {"image/encoded": (image, "byte"), "image/class/label": (label, "int"),
            "image/filename": (name.encode(), "byte"), "image/format": (b"JPEG", "byte"),
            "image/height": (72, "int"), "image/object/bbox/xmin": ([0.25, 0.5][: label % 3], "float")}


def _records(path: Path) -> list[tuple[int, int]]:
    """(header offset, data length) of each record, read with struct (independent of stoker)."""
    out, pos, data = [], 0, path.read_bytes()
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        out.append((pos, length))
        pos += 16 + length
    return out


def test_imagenet_layout_round_trip_with_damage(tmp_path: Path) -> None:
    """Two shard files named like ImageNet's (no file ending): every good record packs byte for
    byte with its label and typed extras; a checksum failure and an undecodable image are skipped
    and logged, nothing else is lost."""
    imgs = photos(8)
    folder = tmp_path / "tfr"
    _write(folder / "train-00000-of-00002", [_slim(imgs[i], i + 1, f"n{i}.JPEG") for i in range(4)])
    _write(folder / "train-00001-of-00002", [_slim(imgs[i] if i != 6 else CORRUPT_JPEG, i + 1, f"n{i}.JPEG")
                                             for i in range(4, 8)])
    # flip one byte inside record 2 of the first file: its data checksum no longer matches
    first = folder / "train-00000-of-00002"
    offset, length = _records(first)[2]
    raw = bytearray(first.read_bytes())
    raw[offset + 12 + length // 2] ^= 0xFF
    first.write_bytes(bytes(raw))

    src = open_source(folder)
    assert src.kind == "tfrecord" and src.label_type == "int64"
    assert src.extra_columns == {"image/filename": "string", "image/format": "string", "image/height": "int64",
                                 "image/object/bbox/xmin": "list<float64>"}
    rows, manifest = pack_and_read(folder, tmp_path / "out")
    expected = {f"train-0000{i // 4}-of-00002/{i % 4}": i for i in range(8) if i not in (2, 6)}
    assert set(rows) == set(expected)
    for key, i in expected.items():
        row = rows[key]
        assert row["image"] == imgs[i] and row["encoding"] == "jpeg"
        assert row["label"] == i + 1 and row["image/filename"] == f"n{i}.JPEG" and row["image/height"] == 72
        assert row["image/object/bbox/xmin"] == [0.25, 0.5][: (i + 1) % 3]
    assert manifest["label_type"] == "int64" and manifest["num_samples"] == 6
    reasons = skipped(tmp_path / "out")
    assert set(reasons) == {"train-00000-of-00002/2", "train-00001-of-00002/2"}
    assert "checksum" in reasons["train-00000-of-00002/2"]


def test_gzip_records_and_a_damaged_length_end_that_file_only(tmp_path: Path) -> None:
    imgs = photos(5, seed=1)
    plain = _write(tmp_path / "plain.tfrecord", [_slim(imgs[i], i, f"{i}.jpg") for i in range(3)])
    zipped = tmp_path / "data" / "a.tfrecord.gz"
    zipped.parent.mkdir()
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    broken = _write(tmp_path / "data" / "b.tfrecord", [_slim(imgs[i], i, f"{i}.jpg") for i in range(3, 5)])
    raw = bytearray(broken.read_bytes())
    raw[_records(broken)[1][0]] ^= 0x01   # the second record's length: nothing after it can be framed
    broken.write_bytes(bytes(raw))

    rows, _ = pack_and_read(tmp_path / "data", tmp_path / "out")
    assert {k: r["image"] for k, r in rows.items()} == {
        "a.tfrecord.gz/0": imgs[0], "a.tfrecord.gz/1": imgs[1], "a.tfrecord.gz/2": imgs[2], "b.tfrecord/0": imgs[3]}
    assert "length checksum" in skipped(tmp_path / "out")["b.tfrecord/1"]


def test_feature_names_string_and_multi_labels(tmp_path: Path) -> None:
    imgs = photos(4, seed=2)
    path = _write(tmp_path / "x.tfrec", [
        {"jpeg": (imgs[i], "byte"), "species": ([b"dog", b"cat", b"cat", b"owl"][i], "byte"),
         "tags": ([[1, 3], [2], [], [0, 1, 2]][i], "int")} for i in range(4)])
    src = open_source(path, image_column="jpeg", label_column="species")
    assert src.classes == ["cat", "dog", "owl"] and [i.label for i in src.items] == [1, 0, 0, 2]
    assert src.extra_columns == {"tags": "list<int64>"}
    multi = open_source(path, image_column="jpeg", label_column="tags")
    assert multi.label_type == "list<int64>" and [i.label for i in multi.items] == [[1, 3], [2], [], [0, 1, 2]]
    rows, manifest = pack_and_read(path, tmp_path / "out", image_column="jpeg", label_column="tags")
    assert manifest["label_type"] == "list<int64>" and rows["x.tfrec/3"]["label"] == [0, 1, 2]
    with pytest.raises(SourceError, match="no image feature 'image/encoded'.*'jpeg'.*--image-column"):
        open_source(path)
    with pytest.raises(SourceError, match="no label feature 'nope'.*--label-column"):
        open_source(path, image_column="jpeg", label_column="nope")


def test_parser_against_protobuf_encodings() -> None:
    """Packed and unpacked repeated fields, negative int64s and unknown fields all decode."""
    example_pb2 = pytest.importorskip("tfrecord.example_pb2")
    ex = example_pb2.Example(features=example_pb2.Features(feature={
        "i": example_pb2.Feature(int64_list=example_pb2.Int64List(value=[-5, 0, 2**40])),
        "f": example_pb2.Feature(float_list=example_pb2.FloatList(value=[1.5, -2.0])),
        "b": example_pb2.Feature(bytes_list=example_pb2.BytesList(value=[b"xy", b""])),
    }))
    data = ex.SerializeToString()
    feats = parse_example(data, 0, len(data))
    assert feats["i"].values == [-5, 0, 2**40] and feats["f"].values == [1.5, -2.0]
    assert [data[a:b] for a, b in feats["b"].values] == [b"xy", b""]
    # unpacked int64 (field 1, wire type 0) as older writers emit, inside an Int64List
    unpacked = bytes([0x08, 0x07, 0x08, 0x09])
    feature = bytes([0x1A, len(unpacked)]) + unpacked
    entry = bytes([0x0A, 1]) + b"k" + bytes([0x12, len(feature)]) + feature
    features = bytes([0x0A, len(entry)]) + entry
    msg = bytes([0x0A, len(features)]) + features + bytes([0x10, 0x01])   # + an unknown varint field
    assert parse_example(msg, 0, len(msg))["k"].values == [7, 9]
    with pytest.raises(ValueError, match="malformed"):
        parse_example(data[:-3], 0, len(data) - 3)


def test_record_framing_checks_both_checksums() -> None:
    def frame(payload: bytes, good: bool = True) -> bytes:
        head = struct.pack("<Q", len(payload))
        crc = masked_crc(crc32c.crc32c(payload)) ^ (0 if good else 1)
        return head + struct.pack("<I", masked_crc(crc32c.crc32c(head))) + payload + struct.pack("<I", crc)

    buf = frame(b"one") + frame(b"two", good=False) + frame(b"three") + b"\x01\x02"
    got = list(iter_records(buf, crc32c.crc32c))
    assert [type(r).__name__ for r in got] == ["TFRecordFrame", "TFRecordDamage", "TFRecordFrame", "TFRecordDamage"]
    assert buf[got[2].start:got[2].end] == b"three" and got[3].fatal and "truncated" in got[3].reason


def test_loader_reads_tfrecords_without_packing(tmp_path: Path) -> None:
    from stoker import Loader
    from stoker.transforms import Resize

    imgs = photos(5, seed=6)
    _write(tmp_path / "t" / "a.tfrecord", [_slim(imgs[i], i, f"{i}.jpg") for i in range(5)])
    with Loader(tmp_path / "t", 5, transforms=[Resize((32, 32))], order="sequential", workers=1) as loader:
        (images, labels), = list(loader)
    assert images.shape == (5, 3, 32, 32) and labels.tolist() == [0, 1, 2, 3, 4]


def test_resume_from_gzip_records_matches_an_uninterrupted_run(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C in the middle of packing records read from a gzip stream, then --resume: the same
    shards and the same skipped.jsonl (listing-time skips included) as one uninterrupted run."""
    import stoker.pack_work as packmod
    from stoker.packing import PackOptions, pack

    imgs = photos(12, seed=9)
    plain = _write(tmp_path / "p.tfrecord", [_slim(imgs[i] if i != 5 else CORRUPT_JPEG, i, f"{i}.jpg")
                                              for i in range(12)])
    raw = bytearray(plain.read_bytes())
    offset, length = _records(plain)[8]
    raw[offset + 12 + length // 2] ^= 0xFF   # record 8 fails its checksum while listing
    src = tmp_path / "src" / "a.tfrecord.gz"
    src.parent.mkdir()
    src.write_bytes(gzip.compress(bytes(raw)))
    opts = PackOptions(workers=1, shard_size=3 * len(imgs[0]))
    pack(src, tmp_path / "full", options=opts, progress=False)

    calls = {"n": 0}
    real = packmod._process_one

    def interrupted(item, options):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return real(item, options)

    monkeypatch.setattr(packmod, "_process_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack(src, tmp_path / "cut", options=opts, progress=False)
    monkeypatch.undo()
    summary = pack(src, tmp_path / "cut", options=opts, progress=False, resume=True)
    assert summary.packed == 10 and summary.skipped == 2
    for name in ["skipped.jsonl", *sorted(p.name for p in (tmp_path / "full").glob("shard-*.arrow"))]:
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
