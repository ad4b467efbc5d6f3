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
    from stoker import Loader, Targets, verify
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
    with Loader(good, 4, targets=Targets(masks="mask"), order="sequential", workers=1) as loader, \
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


# ---------------------------------------------------------------- item 15: labels outside the class list

def _hf_parquet(path: Path, labels: list, names: list) -> Path:
    datasets = pytest.importorskip("datasets")
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    imgs = photos(len(labels))
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in imgs], "label": labels},
                                    features=feats)
    ds.to_parquet(str(path))
    return path


def test_hf_no_label_minus_one_is_skipped_and_the_pack_opens(tmp_path: Path) -> None:
    src = _hf_parquet(tmp_path / "train.parquet", [0, -1, 1, 2, -1, 1], ["cat", "dog", "fox"])
    summary = pack(src, tmp_path / "out", options=ONE_WORKER, progress=False)
    assert summary.packed == 4 and summary.skipped == 2
    assert all("-1" in reason and "no label" in reason for reason in skipped(tmp_path / "out").values())
    with open_dataset(tmp_path / "out") as ds:
        assert sorted(ds.labels.tolist()) == [0, 1, 1, 2] and ds.classes == ["cat", "dog", "fox"]
    everything_unlabelled = _hf_parquet(tmp_path / "test.parquet", [-1, -1], ["cat", "dog"])
    with pytest.raises(SourceError, match="label_column=None"):
        pack(everything_unlabelled, tmp_path / "out2", options=ONE_WORKER, progress=False)


def test_labels_past_the_class_list_fail_the_pack_naming_the_sample(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    imgs = photos(3)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        dt = h5py.vlen_dtype(np.dtype("uint8"))
        images = f.create_dataset("images", (3,), dtype=dt)
        for i, b in enumerate(imgs):
            images[i] = np.frombuffer(b, np.uint8)
        f.create_dataset("labels", data=np.array([0, 1, 3]))
        f.attrs["classes"] = ["a", "b"]   # shorter than the labels say
    with pytest.raises(SourceError, match=r"label 3, but the class list names only 2 classes") as caught:
        pack(tmp_path / "d.h5", tmp_path / "out", options=ONE_WORKER, progress=False)
    assert "/2" in str(caught.value) or "d.h5" in str(caught.value)
    assert not (tmp_path / "out" / "stoker.json").exists()


def test_non_text_class_names_become_text(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": [7, 9]}}
    table = pa.table({"image": pa.array([{"bytes": b, "path": None} for b in photos(2)]), "label": [0, 1]})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, tmp_path / "train.parquet")
    pack(tmp_path / "train.parquet", tmp_path / "out", options=ONE_WORKER, progress=False)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.classes == ["7", "9"] and ds.labels.tolist() == [0, 1]
    features["label"]["names"] = [{"a": 1}, "b"]
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(SourceError, match="class name 0"):
        pack(tmp_path / "bad.parquet", tmp_path / "out2", options=ONE_WORKER, progress=False)


# ---------------------------------------------------------------- item 19: extras named like built-in columns

def test_img2dataset_webdataset_shards_pack_with_their_json(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    imgs = photos(3)
    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        for i, b in enumerate(imgs):  # img2dataset's layout: jpg, txt caption, json with key/width/height
            meta = {"url": f"http://example.com/{i}.jpg", "caption": f"photo {i}", "key": f"{i:09d}",
                    "status": "success", "width": 48, "height": 40, "original_width": 480, "original_height": 400,
                    "exif": "{}", "sha256": "0" * 64}
            sink.write({"__key__": f"{i:09d}", "jpg": b, "txt": f"photo {i}", "json": json.dumps(meta).encode()})
    out = tmp_path / "out"
    pack(tmp_path / "00000.tar", out, options=ONE_WORKER, progress=False, label_column=None)
    with open_dataset(out) as ds:
        extras = ds.manifest.extra_columns
        assert {"source_key", "source_width", "source_height", "url", "caption"} <= set(extras)
        assert ds.extra(0, "source_key") == "000000000" and ds.extra(0, "source_width") == 48
    pack(tmp_path / "00000.tar", tmp_path / "few", options=ONE_WORKER, progress=False, label_column=None,
         columns=["caption", "source_width"])
    with open_dataset(tmp_path / "few") as ds:
        assert ds.manifest.extra_columns == {"caption": "string", "source_width": "int64"}
    with pytest.raises(SourceError, match="no extra column"):
        pack(tmp_path / "00000.tar", tmp_path / "bad", options=ONE_WORKER, progress=False, columns=["nope"])


def test_tfrecord_tutorial_layout_packs(tmp_path: Path) -> None:
    tfrecord = pytest.importorskip("tfrecord")
    imgs = photos(3)
    path = tmp_path / "images.tfrecords"
    writer = tfrecord.TFRecordWriter(str(path))
    for i, b in enumerate(imgs):  # tensorflow.org's TFRecord tutorial: height, width, depth, label, image_raw
        writer.write({"height": (40, "int"), "width": (48, "int"), "depth": (3, "int"), "label": (i % 2, "int"),
                      "image_raw": (b, "byte")})
    writer.close()
    out = tmp_path / "out"
    pack(path, out, options=ONE_WORKER, progress=False, image_column="image_raw")
    with open_dataset(out) as ds:
        assert ds.labels.tolist() == [0, 1, 0]
        assert {"source_height", "source_width", "depth"} <= set(ds.manifest.extra_columns)


def test_hf_parquet_with_width_and_height_columns_packs(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    imgs = photos(3)
    table = pa.table({"image": pa.array([{"bytes": b, "path": None} for b in imgs]), "label": [0, 1, 0],
                      "width": [480, 640, 320], "height": [400, 480, 240], "caption": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "train.parquet")
    pack(tmp_path / "train.parquet", tmp_path / "out", options=ONE_WORKER, progress=False)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.heights.tolist() == [40, 40, 40]  # the stored images' sizes
        assert [ds.extra(i, "source_width") for i in range(3)] == [480, 640, 320]


# ---------------------------------------------------------------- item 18: integers above int64

def test_integers_above_int64_in_extras_and_labels(tmp_path: Path) -> None:
    imgs = photos(3)
    (tmp_path / "img").mkdir()
    for i, b in enumerate(imgs):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(b)
    (tmp_path / "list.csv").write_text("path,label,id\n" + "".join(
        f"img/{i}.jpg,{i % 2},{2**70 + i if i == 1 else i}\n" for i in range(3)))
    pack(tmp_path / "list.csv", tmp_path / "out", options=ONE_WORKER, progress=False)
    with open_dataset(tmp_path / "out") as ds:
        assert [ds.extra(i, "id") for i in range(3)] == ["0", str(2**70 + 1), "2"]
    wds = pytest.importorskip("webdataset")
    with wds.TarWriter(str(tmp_path / "s.tar")) as sink:
        for i, b in enumerate(imgs):
            sink.write({"__key__": f"{i:04d}", "jpg": b, "cls": i % 2,
                        "json": json.dumps({"big": 2**64 if i == 2 else i}).encode()})
    pack(tmp_path / "s.tar", tmp_path / "out2", options=ONE_WORKER, progress=False)
    with open_dataset(tmp_path / "out2") as ds:
        assert ds.extra(2, "big") == str(2**64)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"image": pa.array(imgs, pa.binary()), "label": pa.array([0, 2**63 + 5, 1], pa.uint64())})
    pq.write_table(table, tmp_path / "u64.parquet")
    summary = pack(tmp_path / "u64.parquet", tmp_path / "out3", options=ONE_WORKER, progress=False)
    assert summary.packed == 2 and "64-bit" in next(iter(skipped(tmp_path / "out3").values()))


# ---------------------------------------------------------------- item 16: one bad Caffe Datum

def test_one_bad_caffe_datum_costs_one_sample(tmp_path: Path) -> None:
    lmdb = pytest.importorskip("lmdb")
    pytest.importorskip("google.protobuf")
    from test_source_lmdb import _datum_class
    Datum = _datum_class()
    rgb = smooth_rgb(np.random.default_rng(1), 8, 6)
    records = {
        b"00000000": Datum(channels=3, height=8, width=6, data=rgb[:, :, ::-1].transpose(2, 0, 1).tobytes(),
                           label=1).SerializeToString(),
        b"00000001": Datum(channels=1, height=-2, width=-2, data=b"\0" * 4, label=0).SerializeToString(),
        b"00000002": Datum(data=photos(1)[0], label=2, encoded=True).SerializeToString(),
    }
    env = lmdb.open(str(tmp_path / "db"), map_size=16 << 20)
    with env.begin(write=True) as txn:
        for key, value in records.items():
            txn.put(key, value)
    env.close()
    summary = pack(tmp_path / "db", tmp_path / "out", options=ONE_WORKER, progress=False)
    assert summary.packed == 2 and summary.skipped == 1
    assert "-2" in skipped(tmp_path / "out")["00000001"]


# ---------------------------------------------------------------- item 18: errors naming the file, not tracebacks

@pytest.mark.parametrize("info", ["[]", '{"features": [1, 2]}'])
def test_hf_save_to_disk_with_a_damaged_dataset_info(tmp_path: Path, info: str) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in photos(2)], "label": [0, 1]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.ClassLabel(names=["a", "b"])}))
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "saved" / "dataset_info.json").write_text(info)
    try:
        pack(tmp_path / "saved", tmp_path / "out", options=ONE_WORKER, progress=False)
    except SourceError as exc:
        assert "dataset_info.json" in str(exc)
        return
    with open_dataset(tmp_path / "out") as packed:  # class names come from the Arrow schema's metadata
        assert packed.labels.tolist() == [0, 1]


def test_hf_image_struct_whose_bytes_are_a_struct(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    image = pa.array([{"bytes": {"data": b}, "path": None} for b in photos(2)])
    pq.write_table(pa.table({"image": image, "label": [0, 1]}), tmp_path / "t.parquet")
    with pytest.raises(SourceError, match="t.parquet"):
        pack(tmp_path / "t.parquet", tmp_path / "out", options=ONE_WORKER, progress=False)


def test_hdf5_uint64_label_above_int64(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "d.h5", "w") as f:
        images = f.create_dataset("images", (3,), dtype=h5py.vlen_dtype(np.dtype("uint8")))
        for i, b in enumerate(photos(3)):
            images[i] = np.frombuffer(b, np.uint8)
        f.create_dataset("labels", data=np.array([0, 2**63 + 1, 1], np.uint64))
        f.create_dataset("ids", data=np.array([1, 2, 2**64 - 1], np.uint64))
    summary = pack(tmp_path / "d.h5", tmp_path / "out", options=ONE_WORKER, progress=False)
    assert summary.packed == 2 and "64-bit" in next(iter(skipped(tmp_path / "out").values()))
    with open_dataset(tmp_path / "out") as ds:
        assert ds.labels.tolist() == [0, 1] and [ds.extra(i, "ids") for i in range(2)] == ["1", str(2**64 - 1)]


def test_coco_iscrowd_out_of_range(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(photos(1)[0])
    doc = {"images": [{"id": 1, "file_name": "a.jpg", "width": 48, "height": 40}],
           "annotations": [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [1, 1, 10, 10], "iscrowd": 2**70}],
           "categories": [{"id": 1, "name": "thing"}]}
    (tmp_path / "instances.json").write_text(json.dumps(doc))
    with pytest.raises(SourceError, match=r"annotation id 7 has iscrowd"):
        pack(tmp_path / "instances.json", tmp_path / "out", options=ONE_WORKER, progress=False,
             root=tmp_path / "images")


@pytest.mark.slow
def test_ray_workers_dying_again_and_again_say_resume() -> None:
    ray = pytest.importorskip("ray")
    import os
    from stoker.errors import StokerError
    from stoker.ray_engine import run_on_ray

    def die(task, options):  # a worker killed mid-task (out of memory, a node lost), on every retry
        os._exit(1)

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with pytest.raises(StokerError, match=r"resume=True \(--resume\)") as caught:
            list(run_on_ray(die, iter([1]), None, address=None, timeout=120))
        assert "WorkerCrashedError" in str(caught.value)
    finally:
        ray.shutdown()


def test_columns_flag_keeps_or_drops_extras(tmp_path: Path) -> None:
    from stoker.cli import main
    imgs = photos(2)
    (tmp_path / "img").mkdir()
    for i, b in enumerate(imgs):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(b)
    (tmp_path / "l.csv").write_text("path,label,width,caption\nimg/0.jpg,0,480,a\nimg/1.jpg,1,640,b\n")
    assert main(["pack", str(tmp_path / "l.csv"), str(tmp_path / "one"), "--columns", "source_width",
                 "--no-progress", "--quiet"]) == 0
    assert main(["pack", str(tmp_path / "l.csv"), str(tmp_path / "none"), "--columns", "", "--no-progress",
                 "--quiet"]) == 0
    with open_dataset(tmp_path / "one") as one, open_dataset(tmp_path / "none") as none:
        assert one.manifest.extra_columns == {"source_width": "int64"} and none.manifest.extra_columns == {}
