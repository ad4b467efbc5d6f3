"""Flipped bits outside the image bytes of a shard: a ShardError naming the shard at open time,
never a segfault, a raw Arrow/Python exception or silently different keys, labels or sizes.

Every damaged dataset is opened in a child process: before record batches were validated, a
flipped bit in the encoding dictionary's offsets made ``open_dataset`` read past the mapping
(exit 139). The slow test runs the whole fuzz (benchmarks/fuzz_bitflips.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from .rhelpers import run_child

from stoker import open_dataset
from stoker.errors import ShardError
from stoker.shards import MANIFEST_NAME

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("stoker_fuzz_bitflips", BENCHMARKS / "fuzz_bitflips.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzz():
    return _fuzz_module()


@pytest.fixture
def dataset(tmp_path, fuzz) -> Path:
    """24 samples (JPEG and raw encodings), int labels, a string and an int extra column, 2 shards."""
    return fuzz.build_dataset(tmp_path)


def _buffer_offset(shard: Path, locate) -> int:
    """File offset of the buffer ``locate(first record batch)`` returns."""
    with pa.memory_map(str(shard), "r") as mm:
        base = mm.read_buffer(1).address
        mm.seek(0)
        buf = locate(pa.ipc.open_file(mm).get_batch(0))
        return buf.address - base


def _flip(path: Path, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


_OPEN_AND_READ = """
import sys
from stoker import open_dataset
from stoker.errors import StokerError
try:
    with open_dataset(sys.argv[1]) as ds:
        for i in range(len(ds)):
            s = ds.sample(i)
            [ds.extra(i, c) for c in ds.extra_columns]
        ds.encodings, ds.labels, ds.heights
except StokerError as exc:
    print("STOKER", type(exc).__name__, exc)
else:
    print("READ")
"""


# where the bit goes: (what is damaged, buffer locator, byte inside the buffer (-1: last), bit mask)
FLIPS = {
    "encoding dictionary offsets": (lambda b: b.column("encoding").dictionary.buffers()[1], -2, 0x40),
    "string extra column offsets": (lambda b: b.column("caption").buffers()[1], -2, 0x40),
    "key offsets": (lambda b: b.column("key").buffers()[1], 7, 0x10),
    "image offsets": (lambda b: b.column("image").buffers()[1], 13, 0x01),
    "label value": (lambda b: b.column("label").buffers()[1], 8, 0x04),
    "height value": (lambda b: b.column("height").buffers()[1], 0, 0x02),
    "key bytes": (lambda b: b.column("key").buffers()[2], 2, 0x01),
}


@pytest.mark.parametrize("damage", sorted(FLIPS))
def test_flipped_bit_is_a_shard_error_at_open(dataset, damage):
    locate, byte, mask = FLIPS[damage]
    shard = dataset / json.loads((dataset / MANIFEST_NAME).read_text())["shards"][0]["file"]
    with pa.memory_map(str(shard), "r") as mm:
        size = locate(pa.ipc.open_file(mm).get_batch(0)).size
    _flip(shard, _buffer_offset(shard, locate) + (byte % size), mask)
    proc = run_child(_OPEN_AND_READ, str(dataset))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("STOKER ShardError"), (damage, proc.stdout, proc.stderr[-2000:])
    assert shard.name in proc.stdout


def test_manifest_without_columns_checksum_still_opens_and_validates(dataset):
    """Manifests written before the small-columns checksum existed open as before; record batch
    validation still refuses broken offsets in them."""
    manifest = json.loads((dataset / MANIFEST_NAME).read_text())
    assert all("columns_sha256" in s for s in manifest["shards"])
    for entry in manifest["shards"]:
        del entry["columns_sha256"]
    (dataset / MANIFEST_NAME).write_text(json.dumps(manifest))
    with open_dataset(dataset) as ds:
        assert len(ds) == 24 and ds.extra(3, "caption").startswith("caption number 3")
    shard = dataset / manifest["shards"][0]["file"]
    locate = FLIPS["encoding dictionary offsets"][0]
    _flip(shard, _buffer_offset(shard, locate) + 6, 0x40)
    proc = run_child(_OPEN_AND_READ, str(dataset))
    assert proc.stdout.startswith("STOKER ShardError") and "record batch" in proc.stdout, proc.stdout
    # and in this process: an error, not a crash
    with pytest.raises(ShardError, match="record batch 0 is damaged"):
        open_dataset(dataset)


@pytest.mark.slow
def test_bitflip_fuzz_no_crash_no_foreign_error_no_silent_change(tmp_path, fuzz):
    """300 random one-bit flips in non-image bytes, each run through open, Loader, verify and
    verify --decode in a child process (a segfault or hang counts, never stops the run)."""
    pristine = fuzz.build_dataset(tmp_path / "build")
    flips = fuzz.plan_flips(pristine, 300, seed=7)
    summary = fuzz.summarize(fuzz.run_flips(pristine, flips, tmp_path))
    assert summary["crash or hang"] == 0, summary
    assert summary["non-stoker exception"] == 0, summary
    assert summary["silent"] == 0, summary
    assert summary["caught by verify"] == 300, summary
    assert summary["caught by open"] > 100, summary  # the rest are flips in padding: no value changes
    shutil.rmtree(tmp_path / "build")


#: the library each source format's file is written with (the fuzz's builder imports it)
SOURCE_WRITERS = {"lmdb": "lmdb", "tfrecord": "tfrecord.writer", "hdf5": "h5py", "parquet": "pyarrow.parquet",
                  "targz": "tarfile"}


@pytest.mark.parametrize("kind", sorted(SOURCE_WRITERS))
def test_bitflips_in_a_source_formats_own_file(tmp_path, fuzz, kind):
    """A few random one-bit flips anywhere in an LMDB data.mdb, a TFRecord, an HDF5, a Parquet or a
    .tar.gz file, each listed, packed and read loose in a child: no crash, no hang, nothing but stoker
    errors (the 500-flip runs are in docs/reliability.md: `fuzz_bitflips.py --source all`)."""
    pytest.importorskip(SOURCE_WRITERS[kind], reason="pip install 'stoker[test-formats]'")
    if kind == "tfrecord":
        pytest.importorskip("crc32c", reason="pip install 'stoker[tfrecord]'")
    src, target = fuzz.build_source(kind, tmp_path / "build")
    flips = fuzz.plan_source_flips(target, 6, seed=11)
    summary = fuzz.summarize_sources(fuzz.run_flips(src, flips, tmp_path / "work", source=kind))
    assert summary["crash or hang"] == 0 and summary["non-stoker exception"] == 0, summary
    assert summary["flips"] == 6, summary


def test_hdf5_flips_that_broke_h5pys_object_walk_are_source_errors(tmp_path, fuzz):
    """Flips the 500-flip run found in the HDF5 file's object headers and local heap: h5py raised
    KeyError and RuntimeError from its object walk; each is a SourceError naming the file now."""
    pytest.importorskip("h5py", reason="pip install 'stoker[hdf5]'")
    src, target = fuzz.build_source("hdf5", tmp_path / "build")
    flips = [(target.name, offset, bit) for offset, bit in ((1730, 1), (1434, 3), (1169, 4), (132, 1), (1164, 3))]
    results = fuzz.run_flips(src, flips, tmp_path / "work", source="hdf5")
    summary = fuzz.summarize_sources(results)
    assert summary["crash or hang"] == 0 and summary["non-stoker exception"] == 0, summary
    assert summary["caught by pack"] >= 3, results


def test_parquet_flips_in_data_pages_are_source_errors(tmp_path, fuzz):
    """Flips the 500-flip run found in the Parquet file's data pages (a corrupt snappy block, a page
    header thrift cannot read): pyarrow's OSError escaped the listing; a SourceError naming the file now."""
    src, target = fuzz.build_source("parquet", tmp_path / "build")
    flips = [(target.name, offset, bit) for offset, bit in ((6339, 4), (6203, 3), (6302, 4), (19321, 3))]
    results = fuzz.run_flips(src, flips, tmp_path / "work", source="parquet")
    summary = fuzz.summarize_sources(results)
    assert summary["crash or hang"] == 0 and summary["non-stoker exception"] == 0, summary
    assert summary["caught by pack"] == 4, results
