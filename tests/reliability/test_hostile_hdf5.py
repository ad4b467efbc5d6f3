"""Forged HDF5 files, written with h5py: data outside the file, sizes declared but never stored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.errors import SourceError
from stoker.packing import PackOptions, pack
from stoker.loose import open_loose
from stoker.sources import open_source

from .rhelpers import run_child

h5py = pytest.importorskip("h5py", reason="h5py is not installed; pip install 'stoker[hdf5]'")

SECRET = b"aws_secret_access_key = AKIAEXAMPLEEXAMPLE0123456789abcdef\n" * 4   # 228 bytes = 1 x 4 x 19 x 3


def _refused_everywhere(path: Path, tmp_path: Path, match: str) -> None:
    with pytest.raises(SourceError, match=match):
        open_source(path)
    with pytest.raises(SourceError, match=match):
        open_loose(path)
    with pytest.raises(SourceError, match=match):
        pack(path, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert not any((tmp_path / "out").glob("*.arrow"))


def test_external_storage_is_refused_naming_the_dataset(tmp_path: Path) -> None:
    secret = tmp_path / "credentials"
    secret.write_bytes(SECRET)
    path = tmp_path / "innocent.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", shape=(1, 4, 19, 3), dtype=np.uint8, external=[(str(secret), 0, len(SECRET))])
        f.create_dataset("labels", data=np.array([0]))
    assert path.stat().st_size < 4096
    _refused_everywhere(path, tmp_path, rf"dataset 'images' keeps its data in external files \({secret}\)")


def test_external_labels_are_refused_too(tmp_path: Path) -> None:
    secret = tmp_path / "credentials"
    secret.write_bytes(SECRET[:16])
    path = tmp_path / "labels.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((2, 8, 8, 3), np.uint8))
        f.create_dataset("labels", shape=(2,), dtype=np.int64, external=[(str(secret), 0, 16)])
    _refused_everywhere(path, tmp_path, "dataset 'labels' keeps its data in external files")


def test_virtual_dataset_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("pixels", data=np.full((2, 8, 8, 3), 7, np.uint8))
    layout = h5py.VirtualLayout(shape=(2, 8, 8, 3), dtype=np.uint8)
    layout[:] = h5py.VirtualSource(str(other), "pixels", shape=(2, 8, 8, 3))
    path = tmp_path / "virtual.h5"
    with h5py.File(path, "w") as f:
        f.create_virtual_dataset("images", layout)
    _refused_everywhere(path, tmp_path, rf"dataset 'images' is a virtual dataset mapping other files \(.*elsewhere.h5\)")


def test_declared_giant_images_are_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "giant.h5"
    with h5py.File(path, "w") as f:   # 40000 x 40000 x 3 declared, chunked: a tiny file
        f.create_dataset("images", shape=(1, 40_000, 40_000, 3), dtype=np.uint8, chunks=(1, 1000, 1000, 3))
    assert path.stat().st_size < 4096
    _refused_everywhere(path, tmp_path, r"40000x40000 pixel arrays = 1,600,000,000 pixels each, above the limit")


def test_a_billion_declared_images_are_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "billion.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", shape=(10**9,), dtype=h5py.vlen_dtype(np.uint8), chunks=(4096,))
    assert path.stat().st_size < 4096
    # in a child under a 2 GB address-space limit: listing 10^9 entries must fail fast, not eat the machine
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from stoker.errors import SourceError
from stoker.sources import open_source
try:
    open_source({str(path)!r})
except SourceError as exc:
    print("REFUSED", exc)
"""
    proc = run_child(code, timeout=60)
    assert "REFUSED" in proc.stdout and "declares (1000000000,) elements, but part of it was never written" \
        in proc.stdout, proc.stderr[-2000:]


def test_images_partly_written_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "partial.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("images", shape=(100_000, 8, 8, 3), dtype=np.uint8, chunks=(16, 8, 8, 3))
        ds[:16] = 1   # one chunk of 6250 written
    with pytest.raises(SourceError, match="never written"):
        open_source(path)


def test_label_rows_declaring_huge_widths_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "wide.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((2, 8, 8, 3), np.uint8))
        f.create_dataset("labels", shape=(2, 10**8), dtype=np.int64, chunks=(1, 1 << 16), compression="gzip",
                         fillvalue=-1)
        f["labels"][:] = -1   # every chunk written (compressed -1s): 1.6 GB declared in a small file
    with pytest.raises(SourceError, match=r"dataset 'labels' declares 800,000,000 bytes per row"):
        open_source(path)


def test_ordinary_files_still_pack(tmp_path: Path) -> None:
    path = tmp_path / "fine.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.full((3, 8, 8, 3), 200, np.uint8), chunks=(1, 8, 8, 3), compression="gzip")
        f.create_dataset("labels", data=np.array([0, 1, 0]))
    summary = pack(path, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert summary.packed == 3 and summary.skipped == 0
