"""shards + reader: the on-disk format, zero-copy reads, O(1) lookup, damaged datasets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from stoker import codecs
from stoker.errors import IncompletePackError, ManifestError, ShardError
from stoker.reader import open_dataset
from stoker.shards import MANIFEST_NAME, Manifest, ShardWriter, read_manifest, shard_name, write_manifest

from conftest import smooth_rgb


def write_dataset(root: Path, rows_per_shard: list[int], *, extras: bool = True) -> list[bytes]:
    """A packed dataset with the given row counts per shard; returns every stored image."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    extra_columns = {"score": "float64", "tag": "string"} if extras else {}
    infos, images, n = [], [], 0
    for s, rows in enumerate(rows_per_shard):
        writer = ShardWriter(root, s, label_type="int64", extra_columns=extra_columns)
        for _ in range(rows):
            h, w = 8 + n % 5, 10 + n % 7
            if n % 3:
                image, enc = codecs.encode_jpeg(smooth_rgb(rng, h, w), 90), "jpeg"
            else:
                image, enc = rng.integers(0, 256, (h, w, 3), dtype=np.uint8).tobytes(), "raw"
            writer.add(f"img/{n:05d}.jpg", image, enc, h, w, n % 4, {"score": n / 2, "tag": f"t{n}"})
            images.append(image)
            n += 1
        infos.append(writer.finish())
    write_manifest(root, Manifest(num_samples=n, shards=infos, classes=["a", "b", "c", "d"],
                                  extra_columns=extra_columns, pack_options={"test": True}))
    return images


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    write_dataset(tmp_path / "ds", [7, 5, 9])
    return tmp_path / "ds"


def test_round_trip_zero_copy(tmp_path):
    images = write_dataset(tmp_path / "ds", [7, 5, 9])
    with open_dataset(tmp_path / "ds") as ds:
        assert len(ds) == 21 and ds.classes == ["a", "b", "c", "d"]
        assert ds.labels.dtype == np.int64 and list(ds.labels[:5]) == [0, 1, 2, 3, 0]
        for i, expected in enumerate(images):
            s = ds.sample(i)
            assert bytes(s.data) == expected and s.key == f"img/{i:05d}.jpg" and s.label == i % 4
            assert (s.height, s.width) == (8 + i % 5, 10 + i % 7)
            img = codecs.decode_rgb(s.data, s.encoding, s.key, height=s.height, width=s.width)
            assert img.shape == (s.height, s.width, 3)
            assert ds.extra(i, "score") == i / 2 and ds.extra(i, "tag") == f"t{i}"
        block = ds._blocks[0]
        assert np.shares_memory(ds.sample(0).data, block.img_data)  # a view of the mapped shard


def test_shards_are_plain_arrow(dataset_dir):
    with pa.memory_map(str(dataset_dir / shard_name(1))) as mm:
        table = pa.ipc.open_file(mm).read_all()
    assert table.num_rows == 5
    assert table.column_names[:6] == ["key", "image", "encoding", "height", "width", "label"]
    assert set(table.column("encoding").to_pylist()) <= {"jpeg", "raw"}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.data())
def test_row_to_shard_arithmetic(tmp_path_factory, rows, data):
    root = tmp_path_factory.mktemp("prop")
    write_dataset(root, rows, extras=False)
    starts = np.cumsum([0] + rows)
    with open_dataset(root) as ds:
        assert len(ds) == sum(rows)
        if not len(ds):
            return
        i = data.draw(st.integers(-len(ds), len(ds) - 1))
        j = i % len(ds)
        shard = int(np.searchsorted(starts, j, side="right") - 1)
        assert ds.location(i) == (shard_name(shard), j - starts[shard])
        s = ds.sample(i)
        assert (s.index, s.key, s.shard, s.row) == (j, f"img/{j:05d}.jpg", shard_name(shard), j - starts[shard])
        with pytest.raises(IndexError, match="out of range"):
            ds.sample(len(ds))


def test_many_shards_open_by_mapping_each_once(tmp_path, monkeypatch):
    """Opening 200 shards maps each file once (zero-copy: no read of its bytes) and reading every sample
    maps nothing more: a count, where this was once a wall-clock bound that a busy machine broke."""
    import pyarrow as pa

    write_dataset(tmp_path / "ds", [2] * 200, extras=False)
    opened: list[str] = []
    real = pa.memory_map

    def counting(path, *args, **kwargs):
        opened.append(str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(pa, "memory_map", counting)
    monkeypatch.setattr(pa, "OSFile", lambda *a, **k: pytest.fail(f"a shard was read into memory: {a}"))
    with open_dataset(tmp_path / "ds") as ds:
        assert len(ds) == 400 and sorted(opened) == sorted(str(tmp_path / "ds" / shard_name(k)) for k in range(200))
        assert [ds.sample(i).row for i in range(400)] == [0, 1] * 200
    assert len(opened) == 200


def test_missing_manifest_messages(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="not a stoker dataset"):
        open_dataset(tmp_path / "empty")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / ".shard-00000.arrow.tmp").write_bytes(b"x")
    with pytest.raises(IncompletePackError, match="--resume"):
        open_dataset(tmp_path / "partial")
    with pytest.raises(ManifestError, match="no such dataset"):
        open_dataset(tmp_path / "nope")


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(num_samples=99), "num_samples"),
    (lambda m: m["shards"][0].update(file="../../etc/passwd.arrow"), "plain shard file name"),
    (lambda m: m["shards"][0].update(sha256="zz"), "sha256"),
    (lambda m: m.update(format_version=99), "newer than this stoker"),
    (lambda m: m.update(format="other"), "format"),
    (lambda m: m.update(label_type="pickle"), "label_type"),
])
def test_edited_manifest_is_refused(dataset_dir, edit, match):
    obj = json.loads((dataset_dir / MANIFEST_NAME).read_text())
    edit(obj)
    (dataset_dir / MANIFEST_NAME).write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match=match):
        read_manifest(dataset_dir)


def test_manifest_not_json(dataset_dir):
    (dataset_dir / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        open_dataset(dataset_dir)


def test_damaged_shards_named_at_open(dataset_dir):
    shard = dataset_dir / shard_name(1)
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ShardError, match=r"shard-00001.arrow: size is .* \(truncated\)"):
        open_dataset(dataset_dir)
    shard.write_bytes(b"\0" * len(data))
    with pytest.raises(ShardError, match="shard-00001.arrow: not a readable Arrow"):
        open_dataset(dataset_dir)
    shard.unlink()
    with pytest.raises(ShardError, match="shard-00001.arrow.*missing"):
        open_dataset(dataset_dir)


def test_bit_flip_found_by_checksum_on_verify_open(dataset_dir):
    shard = dataset_dir / shard_name(2)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="shard-00002.arrow: checksum mismatch"):
        open_dataset(dataset_dir, verify=True)


def test_writer_leaves_no_temp_files_and_aborts_cleanly(tmp_path):
    writer = ShardWriter(tmp_path, 0)
    writer.add("k", b"\xff\xd8", "jpeg", 1, 1, 0)
    assert writer.rows == 1 and writer.nbytes == 2
    info = writer.finish()
    assert info.rows == 1 and (tmp_path / info.file).exists()
    assert not list(tmp_path.glob(".*.tmp"))
    writer.add("k2", b"xx", "raw", 1, 1, 0)
    writer.abort()
    assert writer.rows == 0


def test_streamed_shard_spans_record_batches_and_hashes_what_is_on_disk(tmp_path):
    from stoker.shards import file_sha256

    writer = ShardWriter(tmp_path, 0, batch_bytes=100)
    payloads = [bytes([i]) * (30 + i) for i in range(40)]
    for i, payload in enumerate(payloads):
        writer.add(f"k{i}", payload, "raw", 1, 10 + i, i)
    info = writer.finish()
    assert info.sha256 == file_sha256(tmp_path / info.file) and info.bytes == (tmp_path / info.file).stat().st_size
    with pa.memory_map(str(tmp_path / info.file)) as mm:
        assert pa.ipc.open_file(mm).num_record_batches > 5
    write_manifest(tmp_path, Manifest(num_samples=40, shards=[info]))
    with open_dataset(tmp_path) as ds:
        assert [bytes(ds.sample(i).data) for i in range(40)] == payloads
        assert list(ds.labels) == list(range(40)) and ds.location(39) == (info.file, 39)
