"""LMDB source: environments written with the ``lmdb`` package, values as PyTorch/Caffe pipelines wrote them."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import smooth_rgb
from formats_helpers import CORRUPT_JPEG, pack_and_read, photos, skipped

from stoker import codecs
from stoker.errors import SourceError
from stoker.sources import open_source

lmdb = pytest.importorskip("lmdb", reason="the lmdb package is not installed; pip install 'stoker[lmdb]'")


def _write(path: Path, records: dict[bytes, bytes]) -> Path:
    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for key, value in records.items():
            txn.put(key, value)
    env.close()
    return path


def _datum_class() -> type:
    """Caffe's Datum message, built with the protobuf runtime from its .proto definition."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="caffe_datum.proto", package="caffe", syntax="proto2")
    msg = proto.message_type.add(name="Datum")
    F = descriptor_pb2.FieldDescriptorProto
    for name, number, kind in [("channels", 1, F.TYPE_INT32), ("height", 2, F.TYPE_INT32),
                               ("width", 3, F.TYPE_INT32), ("data", 4, F.TYPE_BYTES), ("label", 5, F.TYPE_INT32),
                               ("encoded", 7, F.TYPE_BOOL)]:
        msg.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    msg.field.add(name="float_data", number=6, type=F.TYPE_FLOAT, label=F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.Datum"))


def test_encoded_values_with_labels_file(tmp_path: Path) -> None:
    imgs = photos(5)
    env = _write(tmp_path / "train.lmdb", {
        b"000": imgs[0], b"001": imgs[1], b"002": CORRUPT_JPEG, b"003": imgs[3], b"004": imgs[4],
        b"__len__": pickle.dumps(5)})   # converter metadata: ignored, never unpickled
    (env / "labels.txt").write_text("000 3\n001 1\n002 0\n003 2\n")   # 004 has no label
    src = open_source(env)
    assert src.kind == "lmdb" and src.label_type == "int64"
    rows, manifest = pack_and_read(env, tmp_path / "out")
    assert {k: (r["image"], r["label"]) for k, r in rows.items()} == {
        "000": (imgs[0], 3), "001": (imgs[1], 1), "003": (imgs[3], 2)}
    reasons = skipped(tmp_path / "out")
    assert set(reasons) == {"002", "004"} and "no label" in reasons["004"]
    assert manifest["num_samples"] == 3


def test_class_folders_in_keys_and_multi_label_file(tmp_path: Path) -> None:
    imgs = photos(3, seed=1)
    env = _write(tmp_path / "e", {b"dog/1.jpg": imgs[0], b"cat/2.jpg": imgs[1], b"dog/3.jpg": imgs[2]})
    src = open_source(tmp_path / "e" / "data.mdb")
    assert src.classes == ["cat", "dog"] and [(i.key, i.label) for i in src.items] == [
        ("cat/2.jpg", 0), ("dog/1.jpg", 1), ("dog/3.jpg", 1)]
    (env / "labels.txt").write_text("dog/1.jpg 1 4\ncat/2.jpg 0\ndog/3.jpg 2 3 4\n")
    rows, manifest = pack_and_read(env, tmp_path / "out")
    assert manifest["label_type"] == "list<int64>"
    assert {k: r["label"] for k, r in rows.items()} == {"dog/1.jpg": [1, 4], "cat/2.jpg": [0], "dog/3.jpg": [2, 3, 4]}


def test_caffe_datum_encoded_and_raw(tmp_path: Path) -> None:
    Datum = _datum_class()
    imgs = photos(2, seed=2)
    rgb = smooth_rgb(np.random.default_rng(3), 70, 90)
    raw = Datum(channels=3, height=70, width=90, data=rgb[:, :, ::-1].transpose(2, 0, 1).tobytes(), label=7)
    env = _write(tmp_path / "caffe", {
        b"00000000_a.jpg": Datum(data=imgs[0], label=5, encoded=True).SerializeToString(),
        b"00000001_b.jpg": Datum(data=imgs[1], label=2, encoded=True).SerializeToString(),
        b"00000002_c": raw.SerializeToString()})
    src = open_source(env)
    assert [i.label for i in src.items] == [5, 2, 7]
    assert codecs.decode_pillow_rgb(src.items[2].read(), "c").tolist() == rgb.tolist()   # BGR planes -> RGB
    rows, _ = pack_and_read(env, tmp_path / "out", )
    assert rows["00000000_a.jpg"]["image"] == imgs[0] and rows["00000001_b.jpg"]["label"] == 2
    assert rows["00000002_c"]["label"] == 7 and rows["00000002_c"]["encoding"] in ("png", "jpeg", "raw")


def test_pickled_values_are_refused_with_the_reason(tmp_path: Path) -> None:
    env = _write(tmp_path / "pickled", {b"0": pickle.dumps((photos(1)[0], 3))})
    with pytest.raises(SourceError, match="key '0' is a Python pickle; stoker never unpickles .*runs whatever code"):
        open_source(env)
