"""FIFOs, devices and other non-regular files: only regular files are read, checked on the opened
descriptor, so each is a skip or a clear error at once, never a hang or a read without end.

Each scenario runs in a child process with a time limit (and an address-space limit where the
old behaviour was reading a device until MemoryError): before the fix, a FIFO listed as an image
blocked ``open()`` forever, past two Ctrl-Cs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import stoker

from .rhelpers import make_image_folder, run_child

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")

#: A FIFO blocks at once; every child here finishes in seconds when nothing blocks.
TIMEOUT_S = 60.0


def _list_with_fifo(tmp_path: Path) -> Path:
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    os.mkfifo(src / "p.jpg")
    lines = [f"{p.relative_to(src).as_posix()} {i % 2}" for i, p in enumerate(sorted(src.rglob("*.jpg")))
             if p.name != "p.jpg"]
    (src / "l.txt").write_text("\n".join(lines[:3] + ["p.jpg 0"] + lines[3:]) + "\n")
    return src / "l.txt"


def test_pack_skips_a_fifo_listed_as_an_image(tmp_path):
    listing = _list_with_fifo(tmp_path)
    out = tmp_path / "out"
    proc = run_child("import sys; from stoker.packing import PackOptions, pack; "
                     "print(pack(sys.argv[1], sys.argv[2], options=PackOptions(workers=2), progress=False))",
                     str(listing), str(out), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [s["key"] for s in skipped] == ["p.jpg"]
    assert "FIFO" in skipped[0]["reason"] and "regular file" in skipped[0]["reason"]
    assert json.loads((out / "stoker.json").read_text())["num_samples"] == 6


def test_a_character_device_is_refused_not_read_until_memory_runs_out(tmp_path):
    (tmp_path / "l.txt").write_text("zero 0\nurandom 1\n")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "from stoker import open_loose; from stoker.errors import ImageError\n"
            "ds = open_loose(sys.argv[1], root='/dev')\n"
            "for i in range(len(ds)):\n"
            "    try: ds.sample(i)\n"
            "    except ImageError as exc: print('REFUSED', exc)\n")
    proc = run_child(code, str(tmp_path / "l.txt"), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = proc.stdout.splitlines()
    assert len(refused) == 2 and all("character device" in line for line in refused), proc.stdout


def test_fifo_named_like_the_manifest_or_a_shard(small_pack):
    """A FIFO as stoker.json, or as a shard the manifest lists with 0 bytes: an error at once."""
    code = ("import sys; from stoker import open_dataset; from stoker.errors import DatasetError\n"
            "try: open_dataset(sys.argv[1])\n"
            "except DatasetError as exc: print(type(exc).__name__, exc)\n")
    manifest = json.loads((small_pack / "stoker.json").read_text())
    shard = small_pack / manifest["shards"][0]["file"]
    shard.unlink()
    os.mkfifo(shard)
    manifest["shards"][0]["bytes"] = 0
    (small_pack / "stoker.json").write_text(json.dumps(manifest))
    proc = run_child(code, str(small_pack), timeout=TIMEOUT_S)
    assert proc.stdout.startswith("ShardError") and "FIFO" in proc.stdout and shard.name in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]

    (small_pack / "stoker.json").unlink()
    os.mkfifo(small_pack / "stoker.json")
    proc = run_child(code, str(small_pack), timeout=TIMEOUT_S)
    assert proc.stdout.startswith("ManifestError") and "FIFO" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_loose_loader_skips_a_fifo_without_leaking_a_thread(tmp_path):
    listing = _list_with_fifo(tmp_path)
    code = ("import sys, threading, time\n"
            "import stoker\nfrom stoker import Loader, Resize\n"
            "before = threading.active_count()\n"
            "for attempt in range(3):\n"
            "    loader = Loader(sys.argv[1], 4, transforms=[Resize((16, 16))], "
            "timeout=10.0, workers=stoker.Workers(num_threads=2, on_error='skip'))\n"
            "    n = sum(len(labels) for _, labels in loader)\n"
            "    loader.close()\n"
            "    assert n == 7, n  # the FIFO's place is filled by another sample\n"
            "    assert loader.stats.skipped == 1, loader.stats.skipped\n"
            "deadline = time.monotonic() + 5\n"
            "while threading.active_count() > before and time.monotonic() < deadline: time.sleep(0.05)\n"
            "print('THREADS', before, threading.active_count())\n")
    proc = run_child(code, str(listing), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = proc.stdout.split()[-2:]
    assert before == after, proc.stdout


def test_a_file_growing_while_read_is_read_up_to_its_size_at_open(tmp_path, monkeypatch):
    """The read stops at the size fstat saw when the file was opened, whatever is appended later."""
    from stoker.storage import local

    path = tmp_path / "grows.jpg"
    path.write_bytes(b"x" * 1000)
    real_pread = os.pread

    def pread_then_grow(fd, n, pos):
        with open(path, "ab") as fh:  # another writer appends while we read
            fh.write(b"y" * 10_000)
        return real_pread(fd, n, pos)

    monkeypatch.setattr(local.os, "pread", pread_then_grow)
    from stoker.sources import read_bytes

    assert read_bytes(path) == b"x" * 1000
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("kind, name, needs", [
    ("webdataset", "x.tar", None), ("webdataset", "x.tar.gz", None), ("tfrecord", "x.tfrecord", None),
    ("hdf5", "x.h5", "h5py"), ("lmdb", "env/data.mdb", "lmdb"), ("auto", "x.tar", None)])
def test_a_fifo_as_a_container_file_is_refused_at_once(tmp_path, kind, name, needs):
    """Containers read by the formats themselves (tarfile, gzip, TFRecord framing, h5py, lmdb) are
    opened only when they are regular files; a FIFO named like one is a SourceError, not a hang."""
    if needs:
        pytest.importorskip(needs)
    fifo = tmp_path / name
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    src = fifo.parent if name.endswith("data.mdb") else fifo
    proc = run_child("import sys; from stoker.sources import open_source; from stoker.errors import SourceError\n"
                     "try: open_source(sys.argv[1], kind=sys.argv[2])\n"
                     "except SourceError as exc: print('REFUSED', exc)\n",
                     str(src), kind, timeout=TIMEOUT_S)
    assert proc.stdout.startswith("REFUSED") and "FIFO" in proc.stdout, proc.stdout + proc.stderr[-2000:]
