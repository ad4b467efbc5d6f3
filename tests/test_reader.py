"""The reader on its own: packed shards built here with ShardWriter, and a loose folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import simplejpeg

from stoker.errors import DatasetClosedError, ImageError, SourceError
from stoker.loose import open_loose
from stoker.reader import PackedDataset, open_dataset
from stoker.shards import Manifest, ShardWriter, write_manifest

# (shard, rows): three shards, the middle one streamed as several record batches
LAYOUT = [4, 7, 3]


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * (10 + 3 * i)


@pytest.fixture()
def packed(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    root.mkdir()
    infos, i = [], 0
    for s, rows in enumerate(LAYOUT):
        writer = ShardWriter(root, s, label_type="int64", extra_columns={"weight": "float64", "tag": "string"},
                             batch_bytes=40 if s == 1 else 1 << 20)
        for _ in range(rows):
            writer.add(f"img/{i:03d}.raw", _payload(i), "raw" if i % 2 else "jpeg", 10 + i, 20 + i, i % 5,
                       {"weight": i / 2, "tag": f"t{i}"})
            i += 1
        infos.append(writer.finish())
    write_manifest(root, Manifest(num_samples=i, shards=infos, classes=[f"c{k}" for k in range(5)],
                                  extra_columns={"weight": "float64", "tag": "string"}))
    return root


def test_samples_are_zero_copy_views_with_their_metadata(packed: Path) -> None:
    with open_dataset(packed) as ds:
        assert isinstance(ds, PackedDataset) and len(ds) == sum(LAYOUT)
        for i in range(len(ds)):
            s = ds.sample(i)
            assert (s.index, s.key, s.height, s.width, s.label) == (i, f"img/{i:03d}.raw", 10 + i, 20 + i, i % 5)
            assert s.encoding == ("raw" if i % 2 else "jpeg")
            assert isinstance(s.data, np.ndarray) and not s.data.flags.owndata, "a view, not a copy"
            assert s.data.tobytes() == _payload(i)
        # two samples of one record batch view the same mapped buffer
        assert np.shares_memory(ds.sample(0).data.base, ds.sample(1).data.base)


def test_column_arrays_match_what_was_written(packed: Path) -> None:
    n = sum(LAYOUT)
    with open_dataset(packed) as ds:
        assert ds.labels.tolist() == [i % 5 for i in range(n)] and ds.labels.dtype == np.int64
        assert ds.heights.tolist() == [10 + i for i in range(n)] and ds.heights.dtype == np.int32
        assert ds.widths.tolist() == [20 + i for i in range(n)]
        assert ds.sizes.tolist() == [len(_payload(i)) for i in range(n)]
        assert ds.encodings.tolist() == ["raw" if i % 2 else "jpeg" for i in range(n)]
        assert not ds.labels.flags.writeable
        assert ds.classes == [f"c{k}" for k in range(5)]


def test_extra_columns_and_location(packed: Path) -> None:
    with open_dataset(packed) as ds:
        assert ds.extra_columns == ["weight", "tag"]
        assert ds.extra(5, "weight") == 2.5 and ds.extra(5, "tag") == "t5"
        with pytest.raises(KeyError, match="no extra column 'nope'"):
            ds.extra(0, "nope")
        # sample 4 is the first row of the second shard, sample 12 the second row of the third
        assert ds.location(4) == ("shard-00001.arrow", 0)
        assert ds.location(12) == ("shard-00002.arrow", 1)
        assert ds.location(-1) == ("shard-00002.arrow", 2)
        assert (ds.sample(12).shard, ds.sample(12).row) == ("shard-00002.arrow", 1)


@pytest.mark.parametrize("index", [sum(LAYOUT), -sum(LAYOUT) - 1, 10**9])
def test_out_of_range_index_is_an_index_error(packed: Path, index: int) -> None:
    with open_dataset(packed) as ds:
        with pytest.raises(IndexError, match=f"out of range for a dataset of {sum(LAYOUT)}"):
            ds.sample(index)
        with pytest.raises(IndexError):
            ds.location(index)


def test_negative_index_counts_from_the_end(packed: Path) -> None:
    with open_dataset(packed) as ds:
        assert ds.sample(-1).index == sum(LAYOUT) - 1


def test_closed_dataset_refuses_access(packed: Path) -> None:
    ds = open_dataset(packed)
    ds.close()
    with pytest.raises(DatasetClosedError, match="closed"):
        ds.sample(0)
    with pytest.raises(DatasetClosedError):
        ds.labels
    ds.close()  # idempotent


def test_empty_shard_is_skipped(tmp_path: Path) -> None:
    first = ShardWriter(tmp_path, 0)
    empty = ShardWriter(tmp_path, 1).finish()
    first.add("a", b"xy", "raw", 1, 1, 3)
    write_manifest(tmp_path, Manifest(num_samples=1, shards=[first.finish(), empty]))
    with open_dataset(tmp_path) as ds:
        assert len(ds) == 1 and ds.sample(0).label == 3 and ds.location(0) == ("shard-00000.arrow", 0)


def _jpeg(h: int, w: int, value: int) -> bytes:
    return simplejpeg.encode_jpeg(np.full((h, w, 3), value, np.uint8), quality=90)


def test_loose_reader_serves_the_same_interface(tmp_path: Path) -> None:
    for cls, sizes in (("cat", [(16, 24), (8, 8)]), ("dog", [(32, 16)])):
        (tmp_path / cls).mkdir()
        for k, (h, w) in enumerate(sizes):
            (tmp_path / cls / f"{k}.jpg").write_bytes(_jpeg(h, w, 40 * k))
    (tmp_path / "dog" / "1.jpg").write_bytes(b"not a jpeg")
    ds = open_loose(tmp_path)
    assert len(ds) == 4 and ds.classes == ["cat", "dog"] and ds.labels.tolist() == [0, 0, 1, 1]
    s = ds.sample(2)
    assert (s.key, s.encoding, s.height, s.width, s.label) == ("dog/0.jpg", "jpeg", 32, 16, 1)
    assert bytes(s.data) == (tmp_path / "dog" / "0.jpg").read_bytes()
    assert ds.location(0) == (str(tmp_path / "cat" / "0.jpg"), 0)
    with pytest.raises(ImageError, match="dog/1.jpg"):
        ds.sample(3)
    with pytest.raises(IndexError):
        ds.sample(4)


def test_loose_reader_csv_extras_and_unlabelled(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(_jpeg(8, 8, 1))
    (tmp_path / "b.jpg").write_bytes(_jpeg(8, 8, 2))
    (tmp_path / "list.csv").write_text("path,weight\na.jpg,0.5\nb.jpg,2\n")
    ds = open_loose(tmp_path / "list.csv", label_column=None)
    assert ds.extra_columns == ["weight"] and ds.extra(1, "weight") == 2.0
    assert ds.labels.tolist() == [-1, -1] and ds.sample(0).label == -1


def test_loose_reader_refuses_an_empty_source(tmp_path: Path) -> None:
    (tmp_path / "cls").mkdir()
    with pytest.raises(SourceError, match="no images"):
        open_loose(tmp_path)


def test_encodings_may_change_between_record_batches_of_one_shard(tmp_path: Path) -> None:
    """A shard streamed as several record batches, the first all jpeg, a later one png then raw:
    the writer extends the encoding dictionary (an IPC delta) instead of failing to write."""
    writer = ShardWriter(tmp_path, 0, batch_bytes=8)
    encodings = ["jpeg", "jpeg", "png", "raw", "jpeg", "png"]
    for i, enc in enumerate(encodings):
        writer.add(f"k{i}", b"0123456789", enc, 1, 1, i)
    write_manifest(tmp_path, Manifest(num_samples=len(encodings), shards=[writer.finish()]))
    with open_dataset(tmp_path, verify=True) as ds:
        assert [ds.sample(i).encoding for i in range(len(ds))] == encodings
        assert ds.encodings.tolist() == encodings


def test_a_dataset_indexes_like_a_torch_dataset(tmp_path: Path) -> None:
    from stoker.packing import pack

    for cls, values in (("cat", [10, 200]), ("dog", [90])):
        (tmp_path / "src" / cls).mkdir(parents=True)
        for k, v in enumerate(values):
            (tmp_path / "src" / cls / f"{k}.jpg").write_bytes(_jpeg(16, 24, v))
    pack(tmp_path / "src", tmp_path / "packed", progress=False)
    for ds in (open_dataset(tmp_path / "packed"), open_loose(tmp_path / "src")):
        with ds:
            assert len(ds) == 3
            items = [ds[i] for i in range(len(ds))]
            for (image, label), value, want in zip(items, [10, 200, 90], [0, 0, 1]):
                assert image.dtype == np.uint8 and image.shape == (16, 24, 3) and image.flags.writeable
                assert abs(int(image.mean()) - value) <= 2 and label == want and type(label) is int
            image, label = ds[-1]
            assert label == 1 and np.array_equal(image, items[2][0])
            with pytest.raises(IndexError):
                ds[3]
            with pytest.raises(TypeError, match=r"sampling=stoker\.Sampling\(indices=\[\.\.\.\]\) to stoker\.Loader"):
                ds[0:2]
