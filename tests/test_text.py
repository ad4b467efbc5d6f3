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
from formats_helpers import photos
from stoker import Loader, Targets, Workers
from stoker.errors import ConfigError, SampleError
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
    assert len(calls) == len(batches) == N // 8
    for (_, _, extras), texts in zip(batches, calls):
        assert extras["txt"] == texts and extras["input_ids"].shape == (8, 6) and "attention_mask" in extras


@pytest.mark.parametrize("tokenizer, match", [
    (lambda texts: [1, 2], "must return a mapping with 'input_ids' and 'attention_mask'"),
    (lambda texts: {"input_ids": [1], "attention_mask": [1]}, "rows of 'input_ids' for 8 captions"),
    (lambda texts: 1 / 0, "failed on a batch of 8 captions: ZeroDivisionError"),
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
    with pytest.raises(ConfigError, match=r"column 'n' holds int64 values; name a string column"):
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
    bad = dict(doc, annotations=[{"id": 1, "image_id": 0, "caption": 7}])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(stoker.errors.SourceError, match="needs a 'caption' string"):
        stoker.pack(str(tmp_path / "bad.json"), str(tmp_path / "bad"), progress=False, root=tmp_path / "images")
