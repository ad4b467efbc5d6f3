"""Damaged LMDB environments, written with the lmdb package: a truncated data.mdb must be an error
naming the file, never SIGBUS (listing runs in a child process, so a crash fails only this test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .rhelpers import jpeg_bytes, run_child, smooth_rgb

lmdb = pytest.importorskip("lmdb", reason="lmdb is not installed; pip install 'stoker[lmdb]'")


def _environment(folder: Path, n: int = 40) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    env = lmdb.open(str(folder), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(f"img{i:03d}".encode(), jpeg_bytes(smooth_rgb(rng, 48, 64)))
    env.close()
    return folder / "data.mdb"


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_data_mdb_is_an_error_not_sigbus(tmp_path: Path, keep: float) -> None:
    data = _environment(tmp_path / "env")
    size = data.stat().st_size
    with open(data, "r+b") as fh:
        fh.truncate(int(size * keep) // 4096 * 4096)
    code = f"""
from stoker.errors import SourceError
from stoker.packing import PackOptions, pack
from stoker.loose import open_loose
for what in ("pack", "loose"):
    try:
        if what == "pack":
            pack({str(data.parent)!r}, {str(tmp_path / "out")!r}, options=PackOptions(workers=1), progress=False)
        else:
            open_loose({str(data.parent)!r})
        print(what, "NO ERROR")
    except SourceError as exc:
        print(what, "REFUSED", exc)
"""
    proc = run_child(code)   # a SIGBUS fails the test here, naming the signal
    assert proc.returncode == 0, proc.stderr[-3000:]
    for what in ("pack", "loose"):
        assert f"{what} REFUSED {data}: the LMDB file is truncated" in proc.stdout, proc.stdout


def test_whole_environment_still_packs(tmp_path: Path) -> None:
    from stoker.packing import PackOptions, pack

    data = _environment(tmp_path / "env", n=5)
    summary = pack(data.parent, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert summary.packed == 5
