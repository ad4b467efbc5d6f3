"""Compressed and declared sizes in archives (tar, .tar.gz, .tfrecord.gz), written with tarfile, gzip,
GNU tar and the tfrecord package, then damaged: listing stays bounded in memory, a truncated
compressed file keeps its good records like an uncompressed one does."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

from stoker.packing import SKIPPED_NAME, PackOptions, pack

from .rhelpers import jpeg_bytes, run_child, smooth_rgb

ZEROS_MB = 300   # decompressed size of the bombs below; their files are ~300 KB


def _photos(n: int) -> list[bytes]:
    rng = np.random.default_rng(3)
    return [jpeg_bytes(smooth_rgb(rng, 48, 64)) for _ in range(n)]


def _gzip_with_zeros(path: Path, head: bytes, zeros_mb: int) -> Path:
    """`head` then `zeros_mb` MiB of zeros, gzip-compressed in pieces (never all in memory)."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9) as gz:
        gz.write(head)
        block = bytes(1 << 20)
        for _ in range(zeros_mb):
            gz.write(block)
    return path


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _skipped(out: Path) -> dict[str, str]:
    lines = (out / SKIPPED_NAME).read_text().splitlines()
    return {json.loads(line)["key"]: json.loads(line)["reason"] for line in lines}


def _peak_listing_mb(src: Path) -> tuple[float, str]:
    """(peak RSS in MB of a child that lists `src`, its output): the memory one listing needs."""
    code = f"""
import resource
from stoker.sources import open_source
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
src = open_source({str(src)!r})
print(len(src.items), [s["reason"] for s in src.skipped])
print("PEAK", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""
    proc = run_child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.split("PEAK")[1]), proc.stdout


def test_tar_gz_bomb_is_bounded_and_keeps_what_came_first(tmp_path: Path) -> None:
    imgs = _photos(2)
    head = _tar_bytes([("a.jpg", imgs[0]), ("a.cls", b"1"), ("b.jpg", imgs[1]), ("b.cls", b"0")])
    bomb = _gzip_with_zeros(tmp_path / "bomb.tar.gz", head[:-1024], ZEROS_MB)   # members, then zeros
    assert bomb.stat().st_size < 1 << 20
    peak, out = _peak_listing_mb(bomb)
    assert peak < 100, f"listing a {bomb.stat().st_size // 1024} KB .tar.gz grew by {peak:.0f} MB"
    assert out.startswith("2 ") and "decompression bomb" in out


@pytest.fixture
def tfrecord_writer():
    return pytest.importorskip("tfrecord.writer", reason="pip install 'stoker[test-formats]'")


def _tfrecord_bytes(tfrecord_writer, path: Path, images: list[bytes]) -> bytes:
    pytest.importorskip("crc32c", reason="pip install 'stoker[tfrecord]'")
    writer = tfrecord_writer.TFRecordWriter(str(path))
    for i, img in enumerate(images):
        writer.write({"image/encoded": (img, "byte"), "image/class/label": (i, "int")})
    writer.close()
    return path.read_bytes()


def test_tfrecord_gz_bomb_is_bounded(tmp_path: Path, tfrecord_writer) -> None:
    records = _tfrecord_bytes(tfrecord_writer, tmp_path / "plain.tfrecord", _photos(2))
    bomb = _gzip_with_zeros(tmp_path / "bomb.tfrecord.gz", records, ZEROS_MB)
    peak, out = _peak_listing_mb(bomb)
    assert peak < 100, f"listing a {bomb.stat().st_size // 1024} KB .tfrecord.gz grew by {peak:.0f} MB"
    assert out.startswith("2 ") and "decompression bomb" in out


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to write a sparse member")
def test_sparse_label_member_costs_its_sample_not_the_machine(tmp_path: Path) -> None:
    folder = tmp_path / "members"
    folder.mkdir()
    imgs = _photos(2)
    (folder / "a.jpg").write_bytes(imgs[0])
    (folder / "a.cls").write_bytes(b"0")
    (folder / "b.jpg").write_bytes(imgs[1])
    with open(folder / "b.txt", "wb") as fh:   # a label declaring 3 GB, stored as a sparse member
        fh.truncate(3 << 30)
    tar = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(tar), "-C", str(folder), "a.jpg", "a.cls", "b.jpg", "b.txt"],
                   check=True)
    (folder / "b.txt").unlink()
    assert tar.stat().st_size < 1 << 20
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from stoker.sources import open_source
src = open_source({str(tar)!r})
print([i.key for i in src.items], [(s["key"], s["reason"]) for s in src.skipped])
"""
    proc = run_child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "['a.jpg']" in proc.stdout and "b.txt is a sparse file" in proc.stdout


def test_oversized_label_member_is_skipped(tmp_path: Path) -> None:
    imgs = _photos(2)
    tar = tmp_path / "big.tar"
    tar.write_bytes(_tar_bytes([("a.jpg", imgs[0]), ("a.cls", b"1"), ("b.jpg", imgs[1]),
                                ("b.txt", b"7 " * (1 << 20))]))
    pack(tar, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    reasons = _skipped(tmp_path / "out")
    assert list(reasons) == ["b.jpg"] and "more than the 1,048,576 a target may" in reasons["b.jpg"]


def test_truncated_tar_gz_keeps_its_good_samples(tmp_path: Path) -> None:
    imgs = _photos(4)
    members = [(f"s{i}.{ext}", data) for i, img in enumerate(imgs) for ext, data in (("jpg", img), ("cls", b"1"))]
    whole = gzip.compress(_tar_bytes(members))
    for name, cut in (("t.tar.gz", len(whole) * 3 // 4), ("t2.tar.gz", len(whole) - 4)):
        (tmp_path / name).write_bytes(whole[:cut])
        out = tmp_path / f"out-{name}"
        summary = pack(tmp_path / name, out, options=PackOptions(workers=1), progress=False)
        assert summary.packed >= 2, name   # the samples before the cut
        reasons = _skipped(out)
        assert "the gzip stream is damaged" in reasons[f"{name}/*"]


def test_truncated_tfrecord_gz_keeps_its_good_records(tmp_path: Path, tfrecord_writer) -> None:
    records = _tfrecord_bytes(tfrecord_writer, tmp_path / "plain.tfrecord", _photos(4))
    whole = gzip.compress(records)
    path = tmp_path / "t.tfrecord.gz"
    path.write_bytes(whole[: len(whole) * 3 // 4])
    summary = pack(path, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert summary.packed >= 2
    reasons = _skipped(tmp_path / "out")
    assert "the gzip stream is damaged" in reasons["t.tfrecord.gz/*"]
    assert any("truncated" in r for k, r in reasons.items() if k != "t.tfrecord.gz/*")


def test_compressed_files_that_fit_still_pack(tmp_path: Path) -> None:
    imgs = _photos(3)
    tar = tmp_path / "fine.tar.gz"
    tar.write_bytes(gzip.compress(_tar_bytes([(f"s{i}.jpg", img) for i, img in enumerate(imgs)])))
    summary = pack(tar, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert summary.packed == 3 and summary.skipped == 0
