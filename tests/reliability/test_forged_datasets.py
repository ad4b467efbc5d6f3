"""Edited or forged datasets (well-formed Arrow, checksums recomputed to match): a stoker error
naming the manifest or shard, from open_dataset, the Loader, ``verify`` and ``stoker info`` alike,
never a raw ValueError, RecursionError, IndexError or ArrowTypeError; and ``verify --decode``
compares each decoded size with the stored one (crops are planned from it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from stoker import Loader, Resize, open_dataset, verify
import stoker
from stoker.errors import DatasetError, ManifestError, ShardError
from stoker.packing import PackOptions, pack
from stoker.shards import MANIFEST_NAME, columns_digest

from .rhelpers import make_image_folder


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("forged")
    src = make_image_folder(base / "src", n_per_class=3)
    out = base / "packed"
    pack(src, out, options=PackOptions(workers=1, raw_below=0), progress=False)   # JPEG only
    return out


def _forge(packed: Path, tmp_path: Path, table=None, manifest=None) -> Path:
    """A copy of ``packed`` with shard 0's table and/or the manifest rewritten, every size and
    checksum in the manifest recomputed so only the content checks can tell."""
    out = tmp_path / "forged"
    shutil.copytree(packed, out)
    m = json.loads((out / MANIFEST_NAME).read_text())
    if table is not None:
        shard = out / m["shards"][0]["file"]
        t = table(pa.ipc.open_file(pa.BufferReader(shard.read_bytes())).read_all())
        with pa.OSFile(str(shard), "wb") as fh, pa.ipc.new_file(fh, t.schema) as writer:
            writer.write_table(t)
        raw = shard.read_bytes()
        m["shards"][0].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest(),
                              columns_sha256=columns_digest(t.combine_chunks().to_batches()))
    text = json.dumps(m) if manifest is None else manifest(m)
    (out / MANIFEST_NAME).write_text(text)
    return out


def _column(name: str, values: pa.Array):
    def edit(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index(name)
        return t.set_column(i, pa.field(name, values.type, nullable=t.schema.field(i).nullable), values)
    return edit


def _bad_utf8_key(t: pa.Table) -> pa.Table:
    keys = t.column("key").combine_chunks()
    data = bytearray(keys.buffers()[2].to_pybytes())
    data[0] = 0xFF
    forged = pa.Array.from_buffers(pa.string(), len(keys), [None, keys.buffers()[1], pa.py_buffer(bytes(data))])
    return _column("key", forged)(t)


FORGERIES = {
    "pack_options is a string": (None, lambda m: json.dumps({**m, "pack_options": "abc"}), ManifestError),
    "100k-deep JSON": (None, lambda m: "[" * 100_000 + "]" * 100_000, ManifestError),
    "int64 height column": (lambda t: _column("height", t.column("height").cast(pa.int64()))(t), None, ShardError),
    "labels past the classes": (lambda t: _column("label", pa.array([99] * len(t), pa.int64()))(t), None, ShardError),
    "negative label": (lambda t: _column("label", pa.array([-3] * len(t), pa.int64()))(t), None, ShardError),
    "key not UTF-8": (_bad_utf8_key, None, ShardError),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_dataset_is_a_stoker_error_everywhere(packed, tmp_path, name):
    table, manifest, error = FORGERIES[name]
    root = _forge(packed, tmp_path, table, manifest)
    with pytest.raises(error):
        open_dataset(root)
    with pytest.raises(DatasetError):
        Loader(root, 4, transforms=[Resize((16, 16))], workers=stoker.Workers(num_threads=1, on_error="skip"))
    report = verify(root, decode=True)
    assert not report.ok and report.problems
    proc = subprocess.run([sys.executable, "-m", "stoker.cli", "info", str(root)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error:" in proc.stderr


def test_verify_decode_compares_decoded_sizes_with_the_stored_ones(packed, tmp_path):
    def swap_sizes(t: pa.Table) -> pa.Table:   # each JPEG still decodes, to the true size
        t = _column("height", pa.array([h + 8 for h in t.column("height").to_pylist()], pa.int32()))(t)
        return t
    root = _forge(packed, tmp_path, swap_sizes)
    assert verify(root).ok   # checksums agree: the forgery is consistent
    report = verify(root, decode=True)
    assert not report.ok
    first = report.problems[0]
    assert "decodes to a size other than the stored one" in first.what
    assert first.expected != first.found
