"""Faults while packing: disk full, files vanishing or unreadable after listing, kill -9.

The output is either resumable to exactly what an uninterrupted run writes, or refuses to open;
never a dataset that opens and silently misses samples.
"""

from __future__ import annotations

import errno
import json
import random
import signal
from pathlib import Path

import pytest

from .rhelpers import make_image_folder, run_child

from stoker import open_dataset
from stoker import pack_journal, shards
from stoker.storage import local
from stoker.errors import DatasetError, IncompletePackError
from stoker.packing import LOCK_NAME, SKIPPED_NAME, PackOptions, pack
from stoker.sources import base as source_base
from stoker.sources import open_source

OPTIONS = PackOptions(workers=1, shard_size=4096, raw_below=0)  # about 4 images a shard: many shards


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "src", n_per_class=8)


def _snapshot(out: Path) -> dict[str, bytes]:
    """Every file of a finished pack, byte for byte (what 'the exact result' means); the lock file
    only names the last pack that held it."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != LOCK_NAME}


@pytest.fixture
def reference(src: Path, tmp_path: Path) -> dict[str, bytes]:
    out = tmp_path / "reference"
    pack(src, out, options=OPTIONS, progress=False)
    snap = _snapshot(out)
    assert sum(n.endswith(".arrow") for n in snap) >= 4
    return snap


def _refuses_or_complete(out: Path, reference: dict[str, bytes]) -> None:
    """The interrupted output never opens as a partial dataset."""
    try:
        ds = open_dataset(out)
    except DatasetError:
        return
    with ds:
        assert _snapshot(out) == reference, "an interrupted pack opened as a dataset that differs"


@pytest.mark.parametrize("budget", [0, 3000, 9000, 20000])
def test_disk_full_then_resume(src, tmp_path, reference, monkeypatch, budget):
    """ENOSPC after `budget` bytes of shard data: pack fails with the OSError, the directory
    refuses to open, the temporary file is gone, and resume gives the uninterrupted result."""
    out = tmp_path / "out"
    written = [0]
    real_write = shards._HashingSink.write

    def full_disk(self, data):
        if written[0] + len(data) > budget:
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += len(data)
        return real_write(self, data)

    monkeypatch.setattr(shards._HashingSink, "write", full_disk)
    with pytest.raises(OSError) as info:
        pack(src, out, options=OPTIONS, progress=False)
    assert info.value.errno == errno.ENOSPC or "No space left" in str(info.value)
    assert not list(out.glob(".*.tmp")), "the half-written shard is removed"
    with pytest.raises(IncompletePackError, match="resume"):
        open_dataset(out)
    monkeypatch.setattr(shards._HashingSink, "write", real_write)
    pack(src, out, options=OPTIONS, progress=False, resume=True)
    assert _snapshot(out) == reference


@pytest.mark.parametrize("target", ["journal", "manifest"])
def test_disk_full_on_journal_or_manifest(src, tmp_path, reference, monkeypatch, target):
    out = tmp_path / "out"
    calls = [0]
    if target == "journal":
        real = pack_journal.append_line

        def fail(path, obj):
            calls[0] += 1
            if calls[0] == 3:  # header, shard 0, then the disk fills
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, obj)
        monkeypatch.setattr(pack_journal, "append_line", fail)
    else:
        real = local.atomic_write_bytes

        def fail(path, payload):
            if path.name == "stoker.json":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, payload)
        monkeypatch.setattr(local, "atomic_write_bytes", fail)
    with pytest.raises(OSError):
        pack(src, out, options=OPTIONS, progress=False)
    with pytest.raises(IncompletePackError):
        open_dataset(out)
    monkeypatch.undo()
    pack(src, out, options=OPTIONS, progress=False, resume=True)
    assert _snapshot(out) == reference


def test_files_vanish_or_become_unreadable_after_listing(src, tmp_path, monkeypatch):
    """Listed, then gone (deleted, replaced by a folder, permission denied): each is a skip with
    its reason in skipped.jsonl; the dataset holds exactly the others."""
    source = open_source(src)
    keys = [item.key for item in source.items]
    gone, folder, denied = keys[1], keys[5], keys[9]
    (src / gone).unlink()
    (src / folder).unlink()
    (src / folder).mkdir()
    real_read = source_base.read_bytes   # what SourceItem.read() calls for a file

    def read(path, *args, **kwargs):  # uid 0 reads a chmod 000 file anyway: simulate the denial
        if path is not None and Path(path).name == Path(denied).name and denied in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(source_base, "read_bytes", read)
    out = tmp_path / "out"
    summary = pack(source, out, options=PackOptions(workers=2), progress=False)
    skipped = {json.loads(line)["key"]: json.loads(line)["reason"]
               for line in (out / SKIPPED_NAME).read_text().splitlines()}
    assert set(skipped) == {gone, folder, denied}
    assert "not found" in skipped[gone]
    assert "directory" in skipped[folder]
    assert "permission denied" in skipped[denied]
    with open_dataset(out) as ds:
        assert len(ds) == summary.packed == len(keys) - 3
        assert sorted(ds.sample(i).key for i in range(len(ds))) == sorted(set(keys) - set(skipped))


_KILL_CHILD = r"""
import os, signal, sys
from pathlib import Path
from stoker import pack_journal, shards
from stoker.packing import PackOptions, pack
src, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
count = [0]
def tick():
    count[0] += 1
    if count[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
def wrap(obj, name):
    real = getattr(obj, name)
    def hooked(*a, **k):
        tick()
        out = real(*a, **k)
        tick()
        return out
    setattr(obj, name, hooked)
# every step that changes the output: shard data, fsync, rename, journal line, manifest
wrap(shards._HashingSink, "write"); wrap(os, "fsync"); wrap(os, "replace"); wrap(pack_journal, "append_line")
wrap(pack_journal, "remove")
pack(src, out, options=PackOptions(workers=1, shard_size=4096, raw_below=0), progress=False,
     resume=Path(out).exists())
print("steps", count[0])
"""


def test_kill_9_at_random_moments_then_resume(src, tmp_path, reference):
    """SIGKILL at seeded random steps (mid-write, between fsync and rename, mid-journal, around the
    manifest); twice in a row for some. Each time: it refuses to open or is complete, and a
    resume (itself killable) ends byte-identical to an uninterrupted pack."""
    dry = run_child(_KILL_CHILD, str(src), str(tmp_path / "dry"), "0")
    steps = int(dry.stdout.split()[-1])
    assert steps > 20
    rng = random.Random(6)
    for trial in range(6):
        out = tmp_path / f"killed-{trial}"
        kills = sorted(rng.sample(range(1, steps), 2 if trial % 2 else 1))
        for k in kills:
            proc = run_child(_KILL_CHILD, str(src), str(out), str(k), expect_signal=signal.SIGKILL)
            assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-2000:]
            _refuses_or_complete(out, reference)
        proc = run_child(_KILL_CHILD, str(src), str(out), "0")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert _snapshot(out) == reference, f"trial {trial}, killed at steps {kills}"
