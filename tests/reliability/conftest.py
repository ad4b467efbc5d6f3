"""Fixtures of the reliability suite (helpers live in rhelpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .rhelpers import hostile_files, make_image_folder, write_files


@pytest.fixture
def hostile_folder(tmp_path: Path) -> tuple[Path, dict[str, tuple[bytes, str | None]]]:
    files = hostile_files()
    return write_files(tmp_path / "hostile", files), files


@pytest.fixture
def small_pack(tmp_path: Path) -> Path:
    """A packed dataset of 36 small JPEGs in 3 shards of 12 (labels 0..2)."""
    from stoker.packing import PackOptions, pack

    src = make_image_folder(tmp_path / "src", n_per_class=12, sizes=((32, 32),))
    out = tmp_path / "packed"
    one = len((src / "cat" / "000.jpg").read_bytes())
    pack(src, out, options=PackOptions(workers=1, shard_size=one * 11, raw_below=0), progress=False)
    return out
