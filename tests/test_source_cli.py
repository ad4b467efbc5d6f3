"""`stoker pack` on each kind of source, as a user types it; errors name the CLI flags."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from formats_helpers import photos, read_shards

from stoker.cli import main


def test_train_txt_with_absolute_paths_and_root(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The list the field writes (`/home/data/images/1.JPEG 0`) packs as is; --root shortens keys."""
    imgs = photos(3)
    files = []
    for i, blob in enumerate(imgs):
        f = tmp_path / "images" / f"{i}.JPEG"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(blob)
        files.append(f)
    listing = tmp_path / "lists" / "train.txt"
    listing.parent.mkdir()
    listing.write_text("".join(f"{f} {i % 2}\n" for i, f in enumerate(files)))
    assert main(["pack", str(listing), str(tmp_path / "a"), "--no-progress", "--workers", "1"]) == 0
    rows = read_shards(tmp_path / "a")
    assert {k: (r["image"], r["label"]) for k, r in rows.items()} == {
        f.as_posix(): (imgs[i], i % 2) for i, f in enumerate(files)}
    assert main(["pack", str(listing), str(tmp_path / "b"), "--no-progress", "--root", str(tmp_path)]) == 0
    assert set(read_shards(tmp_path / "b")) == {f"images/{i}.JPEG" for i in range(3)}
    assert main(["pack", str(listing), str(tmp_path / "c"), "--no-progress", "--root", str(tmp_path / "lists")]) == 2
    assert "not under the root" in capsys.readouterr().err


def test_multi_label_list(tmp_path: Path) -> None:
    imgs = photos(2, seed=1)
    for i, blob in enumerate(imgs):
        (tmp_path / f"{i}.jpg").write_bytes(blob)
    (tmp_path / "train.txt").write_text("0.jpg 1 3 7\n1.jpg 2\n")
    assert main(["pack", str(tmp_path / "train.txt"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert {k: r["label"] for k, r in read_shards(tmp_path / "out").items()} == {"0.jpg": [1, 3, 7], "1.jpg": [2]}


def test_parquet_columns_by_flag_and_errors_name_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    imgs = photos(2, seed=2)
    pq.write_table(pa.table({"pic": imgs, "cls": ["b", "a"]}), tmp_path / "t.parquet")
    out = tmp_path / "out"
    # defaults: the first binary column holds the images; no 'label'/'labels'/ClassLabel column: unlabelled
    assert main(["pack", str(tmp_path / "t.parquet"), str(out), "--no-progress"]) == 0
    assert {r["label"] for r in read_shards(out).values()} == {-1}
    assert main(["pack", str(tmp_path / "t.parquet"), str(out), "--no-progress", "--overwrite",
                 "--image-column", "pic", "--label-column", "cls", "--kind", "hf"]) == 0
    assert {k: r["label"] for k, r in read_shards(out).items()} == {"t.parquet/0": 1, "t.parquet/1": 0}
    assert main(["pack", str(tmp_path / "t.parquet"), str(tmp_path / "o2"), "--no-progress",
                 "--image-column", "photo"]) == 2
    assert "no image column 'photo'" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "t.parquet"), str(tmp_path / "o3"), "--no-progress",
                 "--root", str(tmp_path)]) == 2
    assert "--root) only applies to list, csv and coco" in capsys.readouterr().err


def test_several_shards_and_a_brace_pattern(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset", reason="webdataset is not installed; pip install 'stoker[test-formats]'")
    pytest.importorskip("braceexpand", reason="braceexpand is not installed; pip install 'stoker[webdataset]'")
    imgs = photos(4, seed=3)
    for s in range(2):
        with wds.TarWriter(str(tmp_path / f"train-{s:06d}.tar")) as sink:
            for i in range(2):
                sink.write({"__key__": f"k{s}{i}", "jpg": imgs[2 * s + i], "cls": i})
    shards = [str(tmp_path / f"train-{s:06d}.tar") for s in range(2)]
    assert main(["pack", *shards, str(tmp_path / "a"), "--no-progress"]) == 0
    pattern = str(tmp_path / "train-{000000..000001}.tar")
    assert main(["pack", pattern, str(tmp_path / "b"), "--no-progress", "--kind", "webdataset"]) == 0
    assert read_shards(tmp_path / "a") == read_shards(tmp_path / "b")
    assert len(read_shards(tmp_path / "b")) == 4
