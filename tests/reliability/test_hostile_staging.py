"""Staging against a hostile (or careless) user: a destination that is someone's folder, another
dataset's copy in use, a Loader that is never closed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stoker.errors import ConfigError
from stoker.packing import PackOptions, pack
from stoker.staging import MARK_NAME, remove, stage

from .rhelpers import make_image_folder, run_child


def _keepsakes(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes").mkdir(exist_ok=True)
    files = {"thesis.tex": b"years of work", "notes/todo.txt": b"buy milk", "shard-00000.arrow": b"mine, not a shard"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _intact(folder: Path, files: dict[str, bytes]) -> bool:
    return all((folder / name).read_bytes() == data for name, data in files.items())


def test_stage_refuses_someones_folder_and_deletes_nothing(small_pack: Path, tmp_path: Path) -> None:
    # `stoker stage packed ~/work`: a non-empty folder that staging did not make
    work = tmp_path / "work"
    files = _keepsakes(work)
    with pytest.raises(ConfigError, match=r"holds files .* not a stage stoker made"):
        stage(small_pack, work)
    assert _intact(work, files) and sorted(p.name for p in work.iterdir()) == ["notes", "shard-00000.arrow",
                                                                             "thesis.tex"]
    # `stoker stage data/packed data`: the folder that holds the dataset
    with pytest.raises(ConfigError, match="holds the dataset"):
        stage(small_pack, small_pack.parent)
    with pytest.raises(ConfigError, match="inside the dataset"):
        stage(small_pack, small_pack / "copy")
    assert not (small_pack / "copy").exists()
    (tmp_path / "a-file").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a folder"):
        stage(small_pack, tmp_path / "a-file")


def test_cli_stage_into_a_full_folder_exits_with_the_reason(small_pack: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    from stoker.cli import main

    work = tmp_path / "work"
    files = _keepsakes(work)
    assert main(["stage", str(small_pack), str(work)]) != 0
    assert "not a stage stoker made" in capsys.readouterr().err
    assert _intact(work, files)


def test_remove_deletes_only_what_staging_wrote(small_pack: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shm" / "train"
    stage(small_pack, dest).close()
    (dest / "results.csv").write_bytes(b"a user's file, saved into the copy")
    with stage(small_pack, dest) as copy:  # the finished copy is reused, the user's file left alone
        assert copy.reused
    remove(dest)
    assert sorted(p.name for p in dest.iterdir()) == ["results.csv"]


def test_stage_over_another_datasets_copy_in_use_fails_at_once(small_pack: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-packed"
    pack(make_image_folder(tmp_path / "other-src", n_per_class=2, sizes=((24, 24),)), other,
         options=PackOptions(workers=1), progress=False)
    dest = tmp_path / "shm" / "x"
    with stage(small_pack, dest):  # in use by this "process" (a shared lock, as another job's would be)
        started = time.monotonic()
        with pytest.raises(ConfigError, match=rf"holds a staged copy of {small_pack.resolve()} \(manifest sha256 [0-9a-f]{{12}}\.\.\.\), in use"):
            stage(other, dest, timeout=120)
        assert time.monotonic() - started < 60   # at once, not the 120 s timeout
        assert (dest / MARK_NAME).exists()
    with stage(other, dest) as copy:  # nobody uses it any more: replaced
        assert not copy.reused


@pytest.mark.parametrize("ending", ["del loader; import gc; gc.collect(); print(sorted(root.iterdir()))",
                                    "print('exiting without close()')"])
def test_loader_copy_released_without_close(small_pack: Path, tmp_path: Path, ending: str) -> None:
    root = tmp_path / "shm"
    code = f"""
from pathlib import Path
from stoker import Loader, Storage
root = Path({str(root)!r})
loader = Loader({str(small_pack)!r}, 4, storage=Storage(stage=root))
next(iter(loader))
assert len(list(root.iterdir())) == 1
{ending}
"""
    proc = run_child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(root.iterdir()) == []
