"""Staging a packed dataset into memory-backed storage: verified copy, reuse, cleanup after crashes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stoker.errors import ConfigError, ShardError
from stoker.packing import PackOptions, pack
from stoker.reader import open_dataset
from stoker.staging import LOCK_NAME, MARK_NAME, remove, stage, stage_for_loader, sweep
from stoker.loader.options import Storage

SMALL_SHARDS = PackOptions(workers=1, shard_size=20_000)


@pytest.fixture
def packed(image_folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "packed"
    pack(image_folder, out, options=SMALL_SHARDS, progress=False)
    return out


def _samples(path: Path) -> list[tuple[str, bytes]]:
    with open_dataset(path, verify=True) as ds:
        return [(s.key, bytes(s.data)) for s in (ds.sample(i) for i in range(len(ds)))]


def test_stage_copies_verifies_and_reuses(packed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shm" / "train"
    with stage(packed, dest) as copy:
        assert not copy.reused and copy.path == dest
        assert _samples(dest) == _samples(packed)
        shard = next(dest.glob("shard-*.arrow"))
        mtime = shard.stat().st_mtime_ns
    assert dest.is_dir()  # persistent (the CLI's kind): kept after close
    with stage(packed, dest) as again:
        assert again.reused and shard.stat().st_mtime_ns == mtime  # not copied again
    remove(dest)
    assert not dest.exists()


def test_unfinished_copy_is_redone(packed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shm" / "train"
    stage(packed, dest).close()
    next(dest.glob("shard-*.arrow")).write_bytes(b"half")  # as if a copy died part-way
    with stage(packed, dest) as copy:
        assert not copy.reused
        assert _samples(dest) == _samples(packed)


def test_damaged_source_is_refused_and_nothing_left(packed: Path, tmp_path: Path) -> None:
    shard = sorted(packed.glob("shard-*.arrow"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    dest = tmp_path / "shm" / "train"
    with pytest.raises(ShardError, match=rf"{shard.name}: does not match the manifest"):
        stage(packed, dest)
    assert not dest.exists()


def test_last_user_removes_a_loader_copy(packed: Path, tmp_path: Path) -> None:
    root = tmp_path / "shm"
    a = stage_for_loader(packed, root)
    b = stage_for_loader(packed, root)  # a second rank on the node: shares the copy
    assert b.reused and a.path == b.path
    assert sweep(root) == []  # held: never swept
    a.close()
    assert b.path.is_dir()
    b.close()
    assert not b.path.exists()


def test_crashed_runs_copies_are_reused_or_swept(packed: Path, image_folder: Path, tmp_path: Path) -> None:
    root = tmp_path / "shm"
    crash = textwrap.dedent(f"""
        import os
        from stoker.staging import stage_for_loader
        copy = stage_for_loader({str(packed)!r}, {str(root)!r})
        print(copy.path, flush=True)
        os._exit(1)  # killed mid-training: no close(), no cleanup
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, env=env, timeout=120)
    left = Path(out.stdout.strip())
    assert left.is_dir() and (left / MARK_NAME).exists() and (left / LOCK_NAME).exists()
    # the same dataset again: the crashed run's finished copy is reused, not copied twice
    with stage_for_loader(packed, root) as copy:
        assert copy.reused and copy.path == left
    assert not left.exists()
    # a crashed copy of another dataset is swept by the next Loader(stage=...)
    subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, env=env, timeout=120)
    other = tmp_path / "other"
    pack(image_folder, other, options=PackOptions(workers=1, shard_size=50_000), progress=False)
    with stage_for_loader(other, root) as copy:
        assert sorted(p.name for p in root.iterdir()) == [copy.path.name]


def test_stage_needs_room(packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10))
    with pytest.raises(ConfigError, match=r"bytes\), only 10 bytes are free"):
        stage(packed, tmp_path / "shm" / "train")
    with pytest.raises(ConfigError, match="the staging destination is the dataset itself"):
        stage(packed, packed)


def test_cli_stage_copies_reuses_and_removes(packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from stoker.cli import main

    dest = tmp_path / "shm" / "train"
    assert main(["stage", str(packed), str(dest)]) == 0
    assert "copied and verified into" in capsys.readouterr().out
    assert main(["stage", str(packed), str(dest)]) == 0
    assert "reused the finished copy" in capsys.readouterr().out
    assert _samples(dest) == _samples(packed)
    assert main(["stage", "--sweep", str(dest.parent)]) == 0 and dest.exists()  # persistent: not swept
    assert main(["stage", "--remove", str(dest)]) == 0 and not dest.exists()
    assert main(["stage", str(packed)]) == 2
    assert "usage: stoker stage DATASET DEST" in capsys.readouterr().err


def test_loader_stage_argument(packed: Path, tmp_path: Path) -> None:
    from stoker import Loader, RandomResizedCrop

    root = tmp_path / "shm"
    plain = Loader(packed, 4, seed=1, transforms=[RandomResizedCrop(24)], workers=2)
    with Loader(packed, 4, seed=1, transforms=[RandomResizedCrop(24)], workers=2, storage=Storage(stage=root)) as staged:
        assert str(staged.dataset.path).startswith(str(root))
        for (a, la), (b, lb) in zip(staged, plain):
            assert a.equal(b) and la.equal(lb)
    assert list(root.iterdir()) == []  # the last user removed the copy
    plain.close()
