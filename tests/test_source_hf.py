"""Hugging Face source: Parquet, Arrow and save_to_disk data written by ``datasets`` and pyarrow."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from formats_helpers import CORRUPT_JPEG, pack_and_read, photos, skipped

from stoker.errors import SourceError
from stoker.sources import open_source

datasets = pytest.importorskip("datasets", reason="the datasets package (writer) is not installed; "
                               "pip install 'stoker[test-formats]'")


def _dataset(imgs: list[bytes]) -> "datasets.Dataset":
    """Images with a ClassLabel, a Sequence(ClassLabel), a float and a string column."""
    features = datasets.Features({
        "image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "owl"]),
        "tags": datasets.Sequence(datasets.ClassLabel(names=["a", "b", "c"])),
        "score": datasets.Value("float32"), "caption": datasets.Value("string")})
    n = len(imgs)
    return datasets.Dataset.from_dict({
        "image": [{"bytes": b, "path": f"img{i}.jpg"} for i, b in enumerate(imgs)],
        "label": [i % 3 for i in range(n)], "tags": [[j for j in range(3) if (i >> j) & 1] for i in range(n)],
        "score": [i / 4 for i in range(n)], "caption": [f"photo {i}" for i in range(n)]}, features=features)


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_datasets_written_data_round_trip(tmp_path: Path, layout: str) -> None:
    imgs = photos(6)
    imgs[4] = CORRUPT_JPEG
    ds = _dataset(imgs)
    if layout == "parquet":
        (tmp_path / "data").mkdir()
        ds.select(range(3)).to_parquet(str(tmp_path / "data" / "train-00000-of-00002.parquet"))
        ds.select(range(3, 6)).to_parquet(str(tmp_path / "data" / "train-00001-of-00002.parquet"))
        src_path = tmp_path / "data"
        keys = [f"train-0000{i // 3}-of-00002.parquet/{i % 3}" for i in range(6)]
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        src_path = tmp_path / "saved"
        keys = [f"data-00000-of-00001.arrow/{i}" for i in range(6)]

    src = open_source(src_path)
    assert src.kind == "hf" and src.classes == ["cat", "dog", "owl"] and src.label_type == "int64"
    assert src.extra_columns == {"tags": "list<int64>", "score": "float64", "caption": "string"}
    rows, manifest = pack_and_read(src_path, tmp_path / "out")
    assert set(rows) == set(keys) - {keys[4]}
    for i, key in enumerate(keys):
        if i == 4:
            continue
        row = rows[key]
        assert row["image"] == imgs[i] and row["encoding"] == "jpeg"   # byte for byte
        assert row["label"] == i % 3 and row["tags"] == [j for j in range(3) if (i >> j) & 1]
        assert row["score"] == i / 4 and row["caption"] == f"photo {i}"
    assert manifest["classes"] == ["cat", "dog", "owl"]
    assert keys[4] in skipped(tmp_path / "out")

    multi = open_source(src_path, label_column="tags")   # Sequence(ClassLabel): multi-label with names
    assert multi.label_type == "list<int64>" and multi.classes == ["a", "b", "c"]
    assert [i.label for i in multi.items][:4] == [[], [0], [1], [0, 1]]


def test_plain_pyarrow_parquet_binary_images_string_labels(tmp_path: Path) -> None:
    imgs = photos(4, seed=3)
    table = pa.table({"jpg": pa.array(imgs + [None], pa.binary()),
                      "species": ["owl", "cat", "owl", "dog", "cat"], "idx": [10, 11, 12, 13, 14]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    src = open_source(tmp_path / "t.parquet", label_column="species")
    assert src.classes == ["cat", "dog", "owl"] and [i.label for i in src.items] == [2, 0, 2, 1]
    assert src.extra_columns == {"idx": "int64"} and [s["key"] for s in src.skipped] == ["t.parquet/4"]
    rows, manifest = pack_and_read(tmp_path / "t.parquet", tmp_path / "out", label_column="species")
    assert {k: (r["image"], r["label"], r["idx"]) for k, r in rows.items()} == {
        f"t.parquet/{i}": (imgs[i], [2, 0, 2, 1][i], 10 + i) for i in range(4)}
    assert "null" in skipped(tmp_path / "out")["t.parquet/4"]
    # an Arrow IPC file written by pyarrow reads the same way
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert [i.read() for i in open_source(tmp_path / "t.arrow", label_column="species").items] == imgs


def test_errors_name_the_fix(tmp_path: Path) -> None:
    imgs = photos(2, seed=4)
    ds = _dataset(imgs)
    dd = datasets.DatasetDict({"train": ds, "test": ds})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match="DatasetDict with splits .*train.*pass .*dd/"):
        open_source(tmp_path / "dd")
    assert len(open_source(tmp_path / "dd" / "train")) == 2
    ds.to_parquet(str(tmp_path / "x.parquet"))
    with pytest.raises(SourceError, match="no image column 'picture'.*--image-column"):
        open_source(tmp_path / "x.parquet", image_column="picture")
    with pytest.raises(SourceError, match="column 'caption' is string, not image bytes"):
        open_source(tmp_path / "x.parquet", image_column="caption")
    with pytest.raises(SourceError, match="no label column 'y'.*--label-column"):
        open_source(tmp_path / "x.parquet", label_column="y")
    assert open_source(tmp_path / "x.parquet", label_column=None).label_type == "none"


def test_path_only_images_are_not_read_from_disk(tmp_path: Path) -> None:
    """A table from elsewhere may name local files: stoker reads embedded bytes only."""
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(photos(1)[0])
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": photos(1, seed=8)[0], "path": "a.jpg"}, {"bytes": None, "path": str(secret)}], struct)
    pq.write_table(pa.table({"image": images, "label": [0, 1]}), tmp_path / "p.parquet")
    src = open_source(tmp_path / "p.parquet")
    assert [i.key for i in src.items] == ["p.parquet/0"]
    assert "only a path" in src.skipped[0]["reason"] and "embedded" in src.skipped[0]["reason"]
