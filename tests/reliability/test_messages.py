"""Messages that must say something true and useful: sizes that differ print differently, and no
advice to do what the user already did."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from stoker import Loader, Workers
from stoker.errors import ConfigError, SampleError
from stoker.shards import MANIFEST_NAME


def test_sizes_that_differ_never_print_alike() -> None:
    from stoker._system import format_bytes
    need, free = 21_474_836, 21_000_000   # both "0.02 GB" before
    assert format_bytes(need) != format_bytes(free)
    assert "21,474,836 bytes" in format_bytes(need) and "MiB" in format_bytes(need)
    assert format_bytes(10) == "10 bytes"


def test_staging_room_message_tells_the_sizes_apart(small_pack: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.staging import stage
    need = sum(f.stat().st_size for f in small_pack.glob("shard-*.arrow"))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    with pytest.raises(ConfigError) as caught:
        stage(small_pack, tmp_path / "shm" / "copy")
    assert f"{need:,} bytes" in str(caught.value) and f"{need - 1:,} bytes" in str(caught.value)


def _all_images_garbage(packed: Path) -> None:
    """Every stored image replaced by bytes of the same length that are no image (offsets, keys and
    labels unchanged), the checksums made to agree: only decoding can tell."""
    manifest = json.loads((packed / MANIFEST_NAME).read_text())
    for shard in manifest["shards"]:
        path = packed / shard["file"]
        table = pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()
        images = [b"\x00" * len(b) for b in table.column("image").to_pylist()]
        table = table.set_column(table.schema.get_field_index("image"), table.schema.field("image"),
                                 pa.array(images, table.schema.field("image").type))
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        data = path.read_bytes()
        shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (packed / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_skip_errors_do_not_advise_skipping(small_pack: Path) -> None:
    _all_images_garbage(small_pack)
    with Loader(small_pack, 4, workers=Workers(num_threads=1, on_error="skip")) as loader, pytest.raises(SampleError) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert "replacement samples failed as well" in message
    assert "Workers(on_error='skip')" not in message and "re-pack" in message.lower()
    with Loader(small_pack, 4, workers=1) as loader, pytest.raises(SampleError) as caught:
        next(iter(loader))
    assert "Pass workers=stoker.Workers(on_error='skip')" in str(caught.value)  # the advice where it applies
