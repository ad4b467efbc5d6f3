"""Damaged packed datasets: a clear error naming the shard or manifest (at open time where cheap,
at read time otherwise), never a crash; `verify` finds every one.

Mid-training damage runs in child processes: a shard that shrinks under a memory map raises
SIGBUS on the next access to a lost page, which Python cannot catch. The reader stats a shard
before each read and raises ShardError when its file was deleted, replaced or resized.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from .rhelpers import run_child

from stoker import open_dataset, verify
from stoker.errors import DatasetError, IncompletePackError, ManifestError, ShardError
from stoker.shards import MANIFEST_NAME


def _shards(root: Path) -> list[str]:
    return [s["file"] for s in json.loads((root / MANIFEST_NAME).read_text())["shards"]]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_small_pack_has_several_shards(small_pack):
    assert len(_shards(small_pack)) >= 3
    assert verify(small_pack, decode=True).ok


# name -> (damage(root, shard path), error raised by open_dataset or None when only verify finds it)
def _truncate(root, p): os.truncate(p, p.stat().st_size // 2)
def _grow(root, p): p.write_bytes(p.read_bytes() + b"\0" * 10)
def _delete(root, p): p.unlink()
def _flip_image_bytes(root, p): _flip(p, p.stat().st_size // 2)
def _flip_footer(root, p): _flip(p, p.stat().st_size - 12)
def _not_arrow(root, p): p.write_bytes(os.urandom(p.stat().st_size))
def _zero(root, p): p.write_bytes(b"\0" * p.stat().st_size)
def _swap(root, p):  # another shard of the same dataset under this name: wrong size or rows
    other = root / _shards(root)[1]
    shutil.copyfile(other, p)


SHARD_DAMAGE = {
    "truncated": (_truncate, ShardError),
    "grown": (_grow, ShardError),
    "deleted": (_delete, ShardError),
    "bit-flipped image bytes": (_flip_image_bytes, None),
    "bit-flipped footer": (_flip_footer, ShardError),
    "not Arrow": (_not_arrow, ShardError),
    "zeroed": (_zero, ShardError),
    "replaced by another shard": (_swap, ShardError),
}


@pytest.mark.parametrize("damage", sorted(SHARD_DAMAGE))
def test_damaged_shard_names_the_shard(small_pack, damage):
    fn, error = SHARD_DAMAGE[damage]
    name = _shards(small_pack)[0]
    fn(small_pack, small_pack / name)
    if error is None:  # the Arrow structure is intact: only the checksum can tell
        open_dataset(small_pack).close()
    else:
        with pytest.raises(error, match=name):
            open_dataset(small_pack)
    with pytest.raises(ShardError, match=name):
        open_dataset(small_pack, verify=True)
    report = verify(small_pack)
    assert not report.ok and any(p.where == name for p in report.problems), report.format()


def _edit(key: str, value):
    def fn(obj):
        obj[key] = value
    return fn


def _edit_shard(key: str, value):
    def fn(obj):
        obj["shards"][0][key] = value
    return fn


MANIFEST_DAMAGE = {
    "not JSON": (None, ManifestError),
    "empty": (b"", ManifestError),
    "a JSON list": (b"[1, 2]", ManifestError),
    "num_samples off by one": (lambda o: o.update(num_samples=o["num_samples"] + 1), ManifestError),
    "rows edited": (lambda o: (o["shards"][0].update(rows=o["shards"][0]["rows"] + 1),
                               o.update(num_samples=o["num_samples"] + 1)), ShardError),
    "bytes edited": (_edit_shard("bytes", 12345), ShardError),
    "sha256 edited": (_edit_shard("sha256", "0" * 64), None),
    "shard path ../": (_edit_shard("file", "../shard-00000.arrow"), ManifestError),
    "absolute shard path": (_edit_shard("file", "/etc/passwd"), ManifestError),
    "shard in a subfolder": (_edit_shard("file", "sub/shard-00000.arrow"), ManifestError),
    "unknown shard": (_edit_shard("file", "shard-99999.arrow"), ShardError),
    "format removed": (lambda o: o.pop("format"), ManifestError),
    "newer format version": (_edit("format_version", 99), ManifestError),
    "label_type unknown": (_edit("label_type", "pickle"), ManifestError),
    "label_type changed": (_edit("label_type", "string"), ShardError),
    "extra column added": (_edit("extra_columns", {"weight": "float64"}), ShardError),
    "manifest deleted": ("delete", IncompletePackError),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_damaged_manifest(small_pack, damage):
    edit, error = MANIFEST_DAMAGE[damage]
    path = small_pack / MANIFEST_NAME
    if edit is None:
        path.write_bytes(path.read_bytes()[:-20] + b"}}{")
    elif isinstance(edit, bytes):
        path.write_bytes(edit)
    elif edit == "delete":
        path.unlink()
    else:
        obj = json.loads(path.read_text())
        edit(obj)
        path.write_text(json.dumps(obj))
    if error is None:
        open_dataset(small_pack).close()  # cheap open does not hash; verify does
    else:
        with pytest.raises(error) as info:
            open_dataset(small_pack)
        assert str(small_pack) in str(info.value)
        assert info.value.path is not None
    report = verify(small_pack)
    assert not report.ok, f"verify must flag: {damage}"


_MIDTRAIN_CHILD = r"""
import json, os, shutil, sys, time
from pathlib import Path
from stoker import Loader, RandomResizedCrop
import stoker
from stoker.errors import SampleError, ShardError
root, action, on_error = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
names = [s["file"] for s in json.loads((root / "stoker.json").read_text())["shards"]]
victim = root / names[1]
ld = Loader(root, 4, transforms=[RandomResizedCrop(16)], order="sequential", timeout=30, workers=stoker.Workers(num_threads=2, prefetch=1, on_error=on_error))
it = iter(ld)
next(it)
time.sleep(0.3)  # the ring is full; workers wait for a slot
if action == "truncate":
    os.truncate(victim, 4096)
elif action == "truncate-zero":
    os.truncate(victim, 0)
elif action == "delete":
    victim.unlink()
elif action == "replace-rename":
    tmp = root / ".new"; shutil.copyfile(root / names[0], tmp); os.replace(tmp, victim)
elif action == "rewrite-in-place":
    data = (root / names[0]).read_bytes()
    with open(victim, "r+b") as f:
        f.truncate(0); f.write(data)
elif action == "flip-in-place":
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2); b = f.read(64); f.seek(-64, 1); f.write(bytes(x ^ 0xFF for x in b))
result = {"batches": 1, "error": None}
try:
    for _ in it:
        result["batches"] += 1
except SampleError as exc:
    result.update(error=str(exc), shard=exc.shard, cause=type(exc.__cause__).__name__)
result["skipped"] = ld.stats.skipped
ld.close()
print(json.dumps(result))
"""

SHARD_CHANGES = ("truncate", "truncate-zero", "delete", "replace-rename", "rewrite-in-place")


@pytest.mark.parametrize("action", SHARD_CHANGES)
def test_shard_changed_mid_epoch_raises_not_crashes(small_pack, action):
    proc = run_child(_MIDTRAIN_CHILD, str(small_pack), action, "raise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    victim = _shards(small_pack)[1] if action != "delete" else None
    assert got["error"] is not None, f"{action}: the loader must not read on silently: {got}"
    assert got["cause"] == "ShardError" and "shard-00001.arrow" in got["error"], got
    assert got["shard"] == "shard-00001.arrow"
    del victim


def test_shard_truncated_mid_epoch_skip_mode_completes(small_pack):
    proc = run_child(_MIDTRAIN_CHILD, str(small_pack), "truncate", "skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] is None and got["batches"] == 9 and got["skipped"] > 0, got


def test_shard_bitflipped_mid_epoch_no_crash_and_verify_finds_it(small_pack):
    proc = run_child(_MIDTRAIN_CHILD, str(small_pack), "flip-in-place", "raise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # image bytes flipped in place are undetectable without hashing: the epoch either finishes or
    # the sample fails to decode; either way no crash, and verify names the shard
    assert got["error"] is None or got["cause"] in ("CorruptImageError", "ShardError"), got
    report = verify(small_pack)
    assert [p.where for p in report.problems] == ["shard-00001.arrow"], report.format()


_DIRECT_READ_CHILD = r"""
import os, sys
from stoker import open_dataset
from stoker.errors import ShardError
ds = open_dataset(sys.argv[1])
last = len(ds) - 1
shard = ds.sample(last).shard
os.truncate(os.path.join(sys.argv[1], shard), 1024)
try:
    bytes(ds.sample(last).data)
except ShardError as exc:
    print("ShardError:", exc)
"""


def test_read_after_truncation_is_an_error_not_sigbus(small_pack):
    """The regression test of the reader's guard: without it this child dies of SIGBUS."""
    proc = run_child(_DIRECT_READ_CHILD, str(small_pack))
    assert proc.returncode == 0 and "ShardError:" in proc.stdout and ".arrow" in proc.stdout, proc.stderr


def test_verify_finds_all_damage_at_once(small_pack):
    names = _shards(small_pack)
    _truncate(small_pack, small_pack / names[0])
    _flip_image_bytes(small_pack, small_pack / names[1])
    _delete(small_pack, small_pack / names[2])
    report = verify(small_pack)
    assert sorted(p.where for p in report.problems) == sorted(names[:3]), report.format()


def test_open_errors_are_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset"):
        open_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="not a stoker dataset"):
        open_dataset(tmp_path / "empty")
