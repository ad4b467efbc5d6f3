"""`stoker info` / `stoker verify`: every kind of damage is reported precisely."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.audit import describe, verify
from stoker.cli import main
from stoker.shards import MANIFEST_NAME, ShardWriter, shard_name

from test_shards import write_dataset


@pytest.fixture
def ds(tmp_path: Path) -> Path:
    write_dataset(tmp_path / "ds", [6, 4, 8])
    return tmp_path / "ds"


def test_intact_dataset_verifies(ds, capsys):
    report = verify(ds, decode=True, workers=2)
    assert report.ok and report.shards_checked == 3 and report.samples_decoded == 18
    assert main(["verify", str(ds), "--decode"]) == 0
    assert "3 shard(s) checked, 18 samples decoded: OK" in capsys.readouterr().out


def test_flipped_bit(ds, capsys):
    shard = ds / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[200] ^= 0x01
    shard.write_bytes(bytes(data))
    report = verify(ds)
    assert [p.where for p in report.problems] == ["shard-00001.arrow"]
    assert report.problems[0].what == "checksum mismatch" and report.problems[0].expected.startswith("sha256 ")
    assert main(["verify", str(ds)]) == 1
    out = capsys.readouterr().out
    assert "shard-00001.arrow: checksum mismatch (expected sha256" in out and "FAILED: 1 problem(s)" in out


def test_truncated_and_missing_shards_all_reported(ds):
    (ds / shard_name(0)).write_bytes((ds / shard_name(0)).read_bytes()[:50])
    (ds / shard_name(2)).unlink()
    report = verify(ds)
    by_shard = {p.where: p for p in report.problems}
    assert set(by_shard) == {"shard-00000.arrow", "shard-00002.arrow"}
    assert "truncated" in by_shard["shard-00000.arrow"].what and by_shard["shard-00000.arrow"].found == "50 bytes"
    assert by_shard["shard-00002.arrow"].what == "missing"


def test_edited_manifest(ds, capsys):
    obj = json.loads((ds / MANIFEST_NAME).read_text())
    obj["shards"][1]["rows"] += 1
    obj["num_samples"] += 1
    (ds / MANIFEST_NAME).write_text(json.dumps(obj))
    report = verify(ds)
    assert not report.ok and "holds 4 rows, the manifest expects 5" in str(report.problems[0])
    obj["shards"][1]["sha256"] = "0" * 64
    (ds / MANIFEST_NAME).write_text(json.dumps(obj))
    assert "checksum mismatch" in verify(ds).format()
    (ds / MANIFEST_NAME).write_text("[]")
    assert main(["verify", str(ds)]) == 1
    assert "stoker.json" in capsys.readouterr().out


def test_undecodable_sample_named_by_shard_row_and_key(tmp_path):
    root = tmp_path / "bad"
    root.mkdir()
    writer = ShardWriter(root, 0)
    writer.add("good.raw", bytes(12), "raw", 2, 2, 0)
    writer.add("broken.jpg", b"\xff\xd8\xff\xe0 not really", "jpeg", 4, 4, 1)
    from stoker.shards import Manifest, write_manifest
    write_manifest(root, Manifest(num_samples=2, shards=[writer.finish()]))
    assert verify(root).ok  # checksums are fine: the bytes are as packed
    report = verify(root, decode=True)
    assert [p.where for p in report.problems] == ["shard-00000.arrow row 1 (broken.jpg)"]


def test_not_a_dataset_is_a_clean_cli_error(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a stoker dataset" in err and "Traceback" not in err


def test_info(ds, capsys):
    info = describe(ds)
    assert info.samples == 18 and info.shards == 3 and info.classes == ["a", "b", "c", "d"]
    assert sum(info.class_counts.values()) == 18 and set(info.encodings) == {"jpeg", "raw"}
    assert info.height["min"] == 8 and info.height["max"] == 12
    assert main(["info", str(ds)]) == 0
    out = capsys.readouterr().out
    assert "18 in 3 shard(s)" in out and "4 classes" in out and "score: float64" in out
    assert main(["info", str(ds), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 18


def test_cli_pack_overwrite_and_quiet_output(tmp_path, capfd):
    from conftest import make_image_folder

    src = make_image_folder(tmp_path / "src")
    (src / "cat" / "broken.tif").write_bytes(b"II*\x00" + b"\xff" * 64)  # a TIFF libtiff complains about
    out = tmp_path / "out"
    assert main(["pack", str(src), str(out), "--no-progress", "--workers", "2"]) == 0
    captured = capfd.readouterr()
    assert "packed 12 images (1 skipped" in captured.out and captured.err == ""
    assert main(["pack", str(src), str(out), "--no-progress"]) == 2
    assert "--overwrite" in capfd.readouterr().err
    assert main(["pack", str(src), str(out), "--no-progress", "--overwrite"]) == 0
    assert describe(out).samples == 12
