"""Helpers for the per-format source tests: photos to store, and shards read back with plain pyarrow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from conftest import jpeg_bytes, smooth_rgb

from stoker.packing import SKIPPED_NAME, PackOptions, pack

#: A JPEG header followed by garbage: listed like any image, refused when packed.
CORRUPT_JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"this is not image data " * 8
ONE_WORKER = PackOptions(workers=1)


def photos(n: int, seed: int = 0) -> list[bytes]:
    """``n`` small plain JPEGs (72x96, above the raw-pixel threshold) that pack keeps byte for byte."""
    rng = np.random.default_rng(seed)
    return [jpeg_bytes(smooth_rgb(rng, 72, 96)) for _ in range(n)]


def read_shards(out: Path) -> dict[str, dict[str, Any]]:
    """Every packed row, by key, read with nothing but pyarrow (what any Arrow user would do)."""
    manifest = json.loads((out / "stoker.json").read_text())
    rows: dict[str, dict[str, Any]] = {}
    for shard in manifest["shards"]:
        with pa.memory_map(str(out / shard["file"])) as source:
            table = pa.ipc.open_file(source).read_all()
        for row in table.to_pylist():
            rows[row["key"]] = row
    return rows


def skipped(out: Path) -> dict[str, str]:
    """key -> reason from ``skipped.jsonl``."""
    lines = (out / SKIPPED_NAME).read_text().splitlines()
    return {json.loads(line)["key"]: json.loads(line)["reason"] for line in lines}


def pack_and_read(src: Any, out: Path, **source_options: Any) -> tuple[dict[str, dict[str, Any]], dict]:
    """Pack ``src`` with one worker; return (rows by key, manifest)."""
    pack(src, out, options=ONE_WORKER, progress=False, **source_options)
    return read_shards(out), json.loads((out / "stoker.json").read_text())
