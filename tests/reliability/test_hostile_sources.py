"""Source files written by each format's own writer, then damaged or laid out as real tools lay them
out: never silent wrong data, never a traceback, never a pack that cannot be opened."""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker import open_dataset
from stoker.errors import ConfigError, SourceError
from stoker.order import make_pool
from stoker.packing import SKIPPED_NAME, PackOptions, pack

from .rhelpers import TESTS, jpeg_bytes, smooth_rgb

sys.path.insert(0, str(TESTS))
from formats_helpers import read_shards  # noqa: E402

ONE_WORKER = PackOptions(workers=1, raw_below=0)  # images kept byte for byte


def photos(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [jpeg_bytes(smooth_rgb(rng, 40, 48)) for _ in range(n)]


def skipped(out: Path) -> dict[str, str]:
    path = out / SKIPPED_NAME
    lines = path.read_text().splitlines() if path.exists() else []
    return {json.loads(line)["key"]: json.loads(line)["reason"] for line in lines}


# ---------------------------------------------------------------- item 10: Parquet row-group counts

def _parquet_with_rows_declared(path: Path, declared: int) -> list[bytes]:
    """A Parquet file of 2 row groups of 37 rows (image i has label i % 5), written by pyarrow, whose
    footer then claims `declared` rows for the first group (the column chunks still hold 37)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = photos(74)
    table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array([i % 5 for i in range(74)], pa.int64())})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=37)
    data = bytearray(buf.getvalue())
    footer_len = struct.unpack("<I", data[-8:-4])[0]
    start = len(data) - 8 - footer_len
    # Thrift compact: RowGroup field 3 (num_rows, i64) follows field 2 (total_byte_size, i64): 0x16 <zigzag 37>
    for pos in range(start, len(data) - 9):
        if data[pos] == 0x16 and data[pos + 1] == 37 * 2:
            forged = bytearray(data)
            forged[pos + 1] = declared * 2
            try:
                meta = pq.ParquetFile(io.BytesIO(bytes(forged))).metadata
                counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            except Exception:
                continue
            if counts == [declared, 37]:
                path.write_bytes(bytes(forged))
                return images
    raise AssertionError("could not find the row count in the footer")


@pytest.mark.parametrize("declared", [36, 38])
def test_parquet_forged_row_group_count_never_pairs_images_with_other_labels(tmp_path: Path,
                                                                              declared: int) -> None:
    path = tmp_path / "train-00000-of-00001.parquet"
    images = _parquet_with_rows_declared(path, declared)
    try:
        pack(path, tmp_path / "out", options=ONE_WORKER, progress=False)
    except SourceError as exc:
        assert str(path) in str(exc) and "row group 0" in str(exc)
        return
    for row in read_shards(tmp_path / "out").values():  # packed: each image with its own label
        assert row["label"] == images.index(row["image"]) % 5


# ---------------------------------------------------------------- item 11: WebDataset keys

def test_webdataset_same_shard_name_in_two_folders_keeps_every_sample(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    imgs = photos(4)
    shards = []
    for k, folder in enumerate(("part-a", "part-b")):
        (tmp_path / folder).mkdir()
        shards.append(tmp_path / folder / "shard-000000.tar")
        with wds.TarWriter(str(shards[-1])) as sink:
            for j in range(2):
                sink.write({"__key__": f"{j:04d}", "jpg": imgs[2 * k + j], "cls": 2 * k + j})
    pack(shards, tmp_path / "out", options=ONE_WORKER, progress=False)
    rows = read_shards(tmp_path / "out")
    assert len(rows) == 4
    assert sorted(r["label"] for r in rows.values()) == [0, 1, 2, 3]
    assert {r["image"] for r in rows.values()} == set(imgs)
    with pytest.raises(SourceError, match="listed twice"):
        pack([shards[0], shards[0]], tmp_path / "out2", options=ONE_WORKER, progress=False)


def test_webdataset_second_image_of_a_sample_is_logged(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    jpg, other = photos(2)
    png = io.BytesIO()
    from PIL import Image
    Image.fromarray(smooth_rgb(np.random.default_rng(5), 40, 48)).save(png, "PNG")
    with wds.TarWriter(str(tmp_path / "s.tar")) as sink:
        sink.write({"__key__": "0000", "jpg": jpg, "png": png.getvalue(), "cls": 0})
        sink.write({"__key__": "0001", "jpg": other, "cls": 1})
    pack(tmp_path / "s.tar", tmp_path / "out", options=ONE_WORKER, progress=False)
    assert len(read_shards(tmp_path / "out")) == 2
    log = skipped(tmp_path / "out")
    assert any("0000.png" in k for k in log), log
    assert "0000" in next(v for k, v in log.items() if "0000.png" in k)


# ---------------------------------------------------------------- item 12: weights

def test_weights_whose_sum_overflows_still_draw_by_their_proportions() -> None:
    pool = make_pool(50, weights=[1e308] * 50)
    draws = pool.draw(seed=0, epoch=0)
    assert len(set(draws.tolist())) > 20  # 50 equal weights: not the same sample every time
    skewed = make_pool(4, weights=[1e308, 1e308, 1e308, 0.0])
    counts = np.bincount(np.concatenate([skewed.draw(0, e) for e in range(200)]), minlength=4)
    assert counts[3] == 0 and min(counts[:3]) > 200
    with pytest.raises(ConfigError, match=r"weights\[2\] = inf"):
        make_pool(4, weights=[1.0, 1.0, float("inf"), 1.0])


# ---------------------------------------------------------------- item 14: truncated label maps

def _segmentation_folder(root: Path, n: int = 4) -> Path:
    from PIL import Image
    rng = np.random.default_rng(3)
    for i in range(n):
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "masks").mkdir(parents=True, exist_ok=True)
        Image.fromarray(smooth_rgb(rng, 64, 80)).save(root / "images" / f"{i:03d}.png")
        Image.fromarray(rng.integers(0, 5, (64, 80), dtype=np.uint8)).save(root / "masks" / f"{i:03d}.png")
    return root


def test_truncated_label_map_is_skipped_at_pack_and_named_by_verify_and_loader(tmp_path: Path) -> None:
    from stoker import Loader, verify
    from stoker.errors import SampleError
    src = _segmentation_folder(tmp_path / "ade")
    mask = src / "masks" / "002.png"
    mask.write_bytes(mask.read_bytes()[:-300])  # header and first rows intact, the rest cut off
    out = tmp_path / "out"
    summary = pack(src, out, options=ONE_WORKER, progress=False)
    assert summary.packed == 3 and summary.skipped == 1
    assert str(mask) in next(iter(skipped(out).values()))
    # a dataset packed before this check, holding the truncated map: verify --decode names the sample
    good = tmp_path / "good"
    src2 = _segmentation_folder(tmp_path / "ade2")
    pack(src2, good, options=ONE_WORKER, progress=False)
    from stoker.shards import read_manifest
    from stoker.storage import LocalStorage
    import pyarrow as pa
    manifest = read_manifest(LocalStorage(good))
    shard = good / manifest.shards[0].file
    table = pa.ipc.open_file(pa.BufferReader(shard.read_bytes())).read_all()
    maps = table.column("mask").to_pylist()
    row = table.column("key").to_pylist().index("images/002.png")
    maps[row] = maps[row][:-300]
    table = table.set_column(table.schema.get_field_index("mask"), "mask", pa.array(maps, table.schema.field("mask").type))
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    _rewrite_checksums(good, table)
    report = verify(good, decode=True)
    assert not report.ok and "images/002.png" in report.format() and "label map 'mask'" in report.format()
    with Loader(good, 4, masks="mask", order="sequential", num_threads=1) as loader, \
            pytest.raises(SampleError) as caught:
        list(loader)
    assert caught.value.key == "images/002.png" and "label map 'mask'" in str(caught.value)


def _rewrite_checksums(out: Path, table) -> None:
    """Make the manifest agree with an edited shard 0 (as a forger would), so only decoding can tell."""
    import hashlib
    from stoker.shards import columns_digest
    manifest = json.loads((out / "stoker.json").read_text())
    shard = manifest["shards"][0]
    data = (out / shard["file"]).read_bytes()
    shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                 columns_sha256=columns_digest(table.combine_chunks().to_batches()))
    (out / "stoker.json").write_text(json.dumps(manifest))
