"""Text beside the pixels: a WebDataset's `.txt` (written by the webdataset library itself) packed as the
`txt` column, several captions per image chosen per (seed, epoch, sample) at any thread count, a CSV text
column, and a batch-level tokenizer called once per batch; non-text values refused naming the column or
the sample."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import stoker
import pyarrow as pa
import pyarrow.parquet as pq

from formats_helpers import photos, skipped
from stoker import Loader, Targets, Workers
from stoker.errors import ConfigError, SampleError
from stoker.shards import Manifest, ShardWriter, write_manifest
from stoker.transforms import RandomResizedCrop
from test_source_webdataset import _write

N = 24


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("text")
    imgs = photos(N, seed=3)
    _write(root / "wds" / "s-000000.tar", [
        {"__key__": f"k{i:02d}", "jpg": imgs[i], "txt": f"a photo number {i}",
         "json": {"captions": [f"caption {i}.{j}" for j in range(3)]}} for i in range(N)])
    stoker.pack(str(root / "wds"), str(root / "pack"), progress=False, label_column=None)
    return root / "pack"


def _captions(ld: Loader, column: str) -> list[str]:
    return [c for _, _, extras in ld for c in extras[column]]


def test_a_webdatasets_txt_is_packed_as_text_and_handed_out(pack: Path) -> None:
    with Loader(pack, 8, transforms=[RandomResizedCrop(32)], targets=Targets(captions="txt"), seed=1) as ld:
        assert "txt" in ld.dataset.extra_columns and ld.dataset.column_types["txt"] == "string"
        order = ld.epoch_indices()
        got = _captions(ld, "txt")
    keys = [int(stoker.open_dataset(pack).sample(int(i)).key.split("k")[-1].split(".")[0]) for i in order]
    assert got == [f"a photo number {k}" for k in keys]


def test_one_of_several_captions_per_epoch_the_same_at_any_thread_count(pack: Path) -> None:
    def epochs(threads: int) -> list[list[str]]:
        with Loader(pack, 8, transforms=[RandomResizedCrop(32)], targets=Targets(captions="captions"), seed=4,
                    workers=Workers(num_threads=threads), order="sequential") as ld:
            return [_captions(ld, "captions") for _ in range(3)]

    one, two = epochs(1), epochs(2)
    assert one == two
    for epoch in one:
        assert all(c.startswith(f"caption {k}.") for k, c in enumerate(epoch))   # sequential: row k is sample k
    picks = [{c.split(".")[-1] for c in column} for column in zip(*one)]
    assert sum(len(p) > 1 for p in picks) >= N // 3   # epochs draw different captions for most samples


def test_the_tokenizer_runs_once_per_batch_on_the_batchs_captions(pack: Path) -> None:
    calls: list[list[str]] = []

    def tokenize(texts: list[str]) -> dict:
        calls.append(texts)
        ids = torch.zeros((len(texts), 6), dtype=torch.int64)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    with Loader(pack, 8, transforms=[RandomResizedCrop(32)], targets=Targets(captions="txt", tokenizer=tokenize),
                device="numpy") as ld:
        batches = list(ld)
        assert ld.stats.tokenize_s > 0
    assert len(calls) == len(batches) == N // 8
    for (_, _, extras), texts in zip(batches, calls):
        assert extras["txt"] == texts and extras["input_ids"].shape == (8, 6) and "attention_mask" in extras


@pytest.mark.parametrize("tokenizer, match", [
    (lambda texts: [1, 2], "must return a mapping with 'input_ids' and 'attention_mask'"),
    (lambda texts: {"input_ids": [1], "attention_mask": [1]}, "rows of 'input_ids' for 8 captions"),
    (lambda texts: 1 / 0, "failed on a batch of 8 captions: ZeroDivisionError"),
    (lambda texts: {"input_ids": 3, "attention_mask": 3}, r"returned a int \(no rows\) of 'input_ids'"),
])
def test_a_tokenizer_that_misbehaves_is_named(pack: Path, tokenizer, match: str) -> None:
    with Loader(pack, 8, targets=Targets(captions="txt", tokenizer=tokenizer), transforms=[RandomResizedCrop(32)]) as ld:
        with pytest.raises(ConfigError, match=match):
            next(iter(ld))


def test_a_csv_text_column_and_non_text_values(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rows = ["path,label,caption,n,bad"]
    for i, data in enumerate(photos(8, seed=5)):
        (src / f"{i}.jpg").write_bytes(data)
        bad = json.dumps(["fine", 3] if i == 5 else [f"x{i}"]).replace('"', '""')
        rows.append(f'{src / f"{i}.jpg"},{i % 2},"an image, {i}",{i},"{bad}"')
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    stoker.pack(str(tmp_path / "list.csv"), str(tmp_path / "pack"), progress=False)
    with Loader(tmp_path / "pack", 4, targets=Targets(captions="caption"), order="sequential",
                transforms=[RandomResizedCrop(16)]) as ld:
        assert _captions(ld, "caption") == [f"an image, {i}" for i in range(8)]
    with pytest.raises(ConfigError, match=r"column 'n' holds int64 values; name a string or list<string> column"):
        Loader(tmp_path / "pack", 4, targets=Targets(captions="n"))
    with Loader(tmp_path / "pack", 4, targets=Targets(captions="bad"), order="sequential",
                transforms=[RandomResizedCrop(16)]) as ld:
        it = iter(ld)
        assert next(it)[2]["bad"] == [f"x{i}" for i in range(4)]   # the first batch is whole
        with pytest.raises(SampleError, match=r"sample '.*5.jpg' .*Targets\(captions='bad'\) needs text"):
            next(it)
    with pytest.raises(ConfigError, match="pass it with captions="):
        Targets(tokenizer=len)


def test_a_coco_captions_file_packs_each_images_captions(tmp_path: Path) -> None:
    imgs = photos(4, seed=8)
    (tmp_path / "images").mkdir()
    for i, data in enumerate(imgs):
        (tmp_path / "images" / f"{i}.jpg").write_bytes(data)
    doc = {"images": [{"id": i, "file_name": f"{i}.jpg", "width": 10, "height": 10} for i in range(4)],
           "annotations": [{"id": 10 * i + j, "image_id": i, "caption": f" image {i}, caption {j} "}
                           for i in range(4) for j in range(i + 1)]}
    (tmp_path / "captions.json").write_text(json.dumps(doc))
    stoker.pack(str(tmp_path / "captions.json"), str(tmp_path / "pack"), progress=False, root=tmp_path / "images")
    with Loader(tmp_path / "pack", 4, targets=Targets(captions="captions"), order="sequential",
                transforms=[RandomResizedCrop(16)]) as ld:
        (_, _, extras), = list(ld)
    assert extras["captions"][0] == "image 0, caption 0"
    assert [c.split(",")[0] for c in extras["captions"]] == [f"image {i}" for i in range(4)]
    ds = stoker.open_dataset(tmp_path / "pack")
    assert ds.column_types == {"captions": "list<string>"}
    assert ds.extra(3, "captions") == [f"image 3, caption {j}" for j in range(4)]   # stripped, in the file's order
    ds.close()
    # an image no annotation captions is left out, with why; the others are packed
    uncaptioned = dict(doc, annotations=[a for a in doc["annotations"] if a["image_id"] != 2])
    (tmp_path / "some.json").write_text(json.dumps(uncaptioned))
    stoker.pack(str(tmp_path / "some.json"), str(tmp_path / "some"), progress=False, root=tmp_path / "images")
    assert len(stoker.open_dataset(tmp_path / "some")) == 3
    assert "no annotation captions it" in skipped(tmp_path / "some")["2.jpg"]
    for anns, match in (([{"id": 1, "image_id": 0, "caption": 7}], r"#0 \(id 1\) needs a 'caption' string; found 7"),
                        ([{"id": 1, "image_id": 0, "caption": "fine"}, ["not", "a", "dict"]],
                         r"#1 \(id None\) needs a 'caption' string; found \['not'")):
        (tmp_path / "bad.json").write_text(json.dumps(dict(doc, annotations=anns)))
        with pytest.raises(stoker.errors.SourceError, match=match):
            stoker.pack(str(tmp_path / "bad.json"), str(tmp_path / "bad"), progress=False, root=tmp_path / "images")


def test_a_webdatasets_json_list_of_strings_is_a_list_column(pack: Path) -> None:
    ds = stoker.open_dataset(pack)
    assert ds.column_types == {"captions": "list<string>", "txt": "string"}
    assert ds.extra(0, "captions") == ["caption 0.0", "caption 0.1", "caption 0.2"]
    ds.close()


def test_hugging_face_parquet_text_and_list_of_text_columns(tmp_path: Path) -> None:
    imgs = photos(6, seed=9)
    table = pa.table({"image": pa.array(imgs, pa.binary()), "text": [f"text {i}" for i in range(6)],
                      "sentences": pa.array([[f"s{i}.{j}" for j in range(i % 3 + 1)] for i in range(6)],
                                            pa.list_(pa.large_string())),
                      "n": list(range(6))})
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=4)
    stoker.pack(str(tmp_path / "train.parquet"), str(tmp_path / "pack"), progress=False, label_column=None)
    assert stoker.open_dataset(tmp_path / "pack").column_types == {
        "text": "string", "sentences": "list<string>", "n": "int64"}
    with Loader(tmp_path / "pack", 6, targets=Targets(captions="sentences"), columns=["text"], order="sequential",
                transforms=[RandomResizedCrop(16)], seed=2) as ld:
        (_, _, extras), = list(ld)
    assert extras["text"] == [f"text {i}" for i in range(6)]
    assert all(c.startswith(f"s{i}.") and int(c.split(".")[1]) <= i % 3 for i, c in enumerate(extras["sentences"]))
    assert extras["sentences"][0] == "s0.0" and extras["sentences"][3] == "s3.0"   # a single caption is that one


def _listed_pack(out: Path, n: int, corrupt: int, uncaptioned: tuple[int, ...] = ()) -> Path:
    """n samples, label i, captions [c{i}.0, c{i}.1] in a list<string> column, sample `corrupt` not a JPEG,
    the `uncaptioned` ones with an empty list or a null."""
    out.mkdir()
    w = ShardWriter(out, 0, label_type="int64", extra_columns={"caps": "list<string>"})
    for i, data in enumerate(photos(n, seed=11)):
        caps = ([] if i % 2 else None) if i in uncaptioned else [f"c{i}.0", f"c{i}.1"]
        w.add(f"k{i}", b"\xff\xd8\xff\xe0 not a jpeg" if i == corrupt else data, "jpeg", 72, 96, i, {"caps": caps})
    write_manifest(out, Manifest(num_samples=n, shards=[w.finish()], classes=None, label_type="int64",
                                 extra_columns={"caps": "list<string>"}))
    return out


def test_a_stand_in_under_on_error_skip_hands_out_its_own_caption(tmp_path: Path) -> None:
    pack = _listed_pack(tmp_path / "pack", 16, corrupt=5)
    with Loader(pack, 8, targets=Targets(captions="caps"), transforms=[RandomResizedCrop(16)], seed=3,
                workers=Workers(on_error="skip", num_threads=2)) as ld:
        rows = [(int(label), caption) for _, labels, extras in ld for label, caption in zip(labels, extras["caps"])]
    assert len(rows) == 16 and 5 not in [label for label, _ in rows]   # sample 5 was replaced
    assert all(caption in (f"c{label}.0", f"c{label}.1") for label, caption in rows)


def test_samples_without_text_fail_naming_them_or_stand_ins_under_on_error_skip(tmp_path: Path) -> None:
    pack = _listed_pack(tmp_path / "pack", 24, corrupt=-1, uncaptioned=(10, 13))
    with Loader(pack, 8, targets=Targets(captions="caps"), transforms=[RandomResizedCrop(16)], order="sequential",
                workers=Workers(num_threads=2)) as ld:
        it = iter(ld)
        assert next(it)[2]["caps"][:2] in (["c0.0", "c1.0"], ["c0.0", "c1.1"], ["c0.1", "c1.0"], ["c0.1", "c1.1"])
        with pytest.raises(SampleError, match=r"sample 'k10' \(shard .*, row 10\): Targets\(captions='caps'\) needs "
                                              r"text, the column holds None"):
            next(it)
    with pytest.raises(SampleError, match=r"sample 'k13' .* holds no caption \(an empty list\)"):
        with Loader(pack, 8, targets=Targets(captions="caps"), transforms=[RandomResizedCrop(16)],
                    sampling=stoker.Sampling(order="sequential", indices=list(range(11, 19)))) as ld:
            list(ld)

    def epoch(threads: int) -> list[tuple[int, str]]:
        with Loader(pack, 8, targets=Targets(captions="caps"), transforms=[RandomResizedCrop(16)], seed=5,
                    workers=Workers(on_error="skip", num_threads=threads)) as ld:
            return [(int(label), c) for _, labels, extras in ld for label, c in zip(labels, extras["caps"])]

    rows = epoch(2)
    assert rows == epoch(1) and len(rows) == 24 and not {10, 13} & {label for label, _ in rows}
    assert all(c in (f"c{label}.0", f"c{label}.1") for label, c in rows)   # a stand-in's own label and caption


def test_a_webdataset_txt_that_is_not_utf8_costs_only_its_caption(tmp_path: Path) -> None:
    imgs = photos(4, seed=12)
    _write(tmp_path / "wds" / "s-000000.tar", [
        {"__key__": f"k{i}", "jpg": imgs[i], "cls": i, "txt": b"\xff\xfe bad" if i == 2 else f"caption {i}"}
        for i in range(4)])
    stoker.pack(str(tmp_path / "wds"), str(tmp_path / "pack"), progress=False)
    ds = stoker.open_dataset(tmp_path / "pack")
    assert len(ds) == 4 and [ds.extra(i, "txt") for i in range(4)] == ["caption 0", "caption 1", None, "caption 3"]
    assert ds.labels.tolist() == [0, 1, 2, 3]
    ds.close()


def test_worker_processes_choose_the_captions_threads_do(pack: Path) -> None:
    def epoch(workers: Workers) -> list[str]:
        with Loader(pack, 8, transforms=[RandomResizedCrop(32)], targets=Targets(captions="captions"), seed=7,
                    workers=workers) as ld:
            return _captions(ld, "captions")

    assert epoch(Workers(num_threads=2, processes=1)) == epoch(Workers(num_threads=2))


def test_a_tokenizer_of_numpy_arrays_for_numpy_batches(pack: Path) -> None:
    def tokenize(texts: list[str]) -> dict:
        ids = np.array([[len(t), ord(t[0])] for t in texts], np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "lengths": ids[:, 0]}

    with Loader(pack, 8, transforms=[RandomResizedCrop(32)], targets=Targets(captions="txt", tokenizer=tokenize),
                device="numpy", order="sequential") as ld:
        images, _, extras = next(iter(ld))
    assert isinstance(images, np.ndarray) and extras["input_ids"].dtype == np.int64
    assert extras["lengths"].tolist() == [len(f"a photo number {i}") for i in range(8)]
