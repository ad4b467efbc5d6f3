"""Flipped bits in an MXNet RecordIO file: listing and reading never crash, hang, raise anything but
a StokerError, or allocate more than the file holds, and a flip in a record's framing costs that
record only (every other record keeps its key and bytes), with or without the ``.idx``.

All flips run in one child process (a segfault or a hang fails the test, never pytest).
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
from recordio_writer import MAGIC_BYTES, write_rec

from .rhelpers import jpeg_bytes, run_child, smooth_rgb

_FLIP_ALL = """
import json, sys, tracemalloc
from pathlib import Path
from stoker.errors import StokerError
from stoker.sources import open_source

plan = json.loads(Path(sys.argv[1]).read_text())
results = []
for case in plan["cases"]:
    pristine = Path(case["file"]).read_bytes()
    work = Path(case["work"])
    for offset, bit in case["flips"]:
        data = bytearray(pristine)
        data[offset] ^= 1 << bit
        work.write_bytes(bytes(data))
        tracemalloc.start()
        try:
            src = open_source(work, kind="recordio")
            items = {i.key: i.read() for i in src.items}
            outcome = {"items": {k: v.hex() for k, v in items.items()}, "skipped": [s["key"] for s in src.skipped],
                       "largest": max((i.size for i in src.items), default=0)}
        except StokerError as exc:
            outcome = {"stoker": type(exc).__name__}
        except Exception as exc:
            outcome = {"foreign": repr(exc)}
        outcome["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        results.append({"case": case["name"], "offset": offset, "bit": bit, **outcome})
print(json.dumps(results))
"""


def _records(data: bytes) -> list[tuple[int, list[int]]]:
    """(record offset, offsets of each of its part headers), framed with plain struct."""
    out, pos = [], 0
    while pos < len(data):
        heads, start = [], pos
        while True:
            (lrec,) = struct.unpack_from("<I", data, pos + 4)
            heads.append(pos)
            pos += 8 + (((lrec & ((1 << 29) - 1)) + 3) & ~3)
            if lrec >> 29 in (0, 3):
                break
        out.append((start, heads))
    return out


@pytest.fixture(scope="module")
def recordio_files(tmp_path_factory) -> tuple[Path, Path, list[bytes]]:
    """Six records, one of them split into three parts; one file with its .idx, one without."""
    import numpy as np
    rng = np.random.default_rng(11)
    images = [jpeg_bytes(smooth_rgb(rng, 20 + i, 24)) for i in range(6)]
    images[3] += b"\0" * (-(len(images[3]) + 24) % 4) + MAGIC_BYTES + b"abcd" + MAGIC_BYTES + b"end"
    root = tmp_path_factory.mktemp("rec")
    indexed = write_rec(root / "indexed" / "train.rec", [(float(i % 3), im) for i, im in enumerate(images)])
    scanned = write_rec(root / "scanned" / "train.rec", [(float(i % 3), im) for i, im in enumerate(images)],
                        index=False)
    return indexed, scanned, images


def _cases(indexed: Path, scanned: Path, flips: list[list[int]]) -> list[dict]:
    """One case per file: its flips are applied to a copy named train.rec (keys unchanged), with
    the .idx copied beside it where the file has one."""
    cases = []
    for name, path in (("indexed", indexed), ("scanned", scanned)):
        work = path.parent / "work" / path.name
        work.parent.mkdir(exist_ok=True)
        if path.with_suffix(".idx").exists():
            work.with_suffix(".idx").write_bytes(path.with_suffix(".idx").read_bytes())
        cases.append({"name": name, "file": str(path), "work": str(work), "flips": flips})
    return cases


def _run(cases: list[dict], tmp_path: Path) -> list[dict]:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"cases": cases}))
    proc = run_child(_FLIP_ALL, str(plan), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_framing_bit_flip_costs_only_its_record(recordio_files, tmp_path: Path) -> None:
    """Each bit of each part header (magic word, length, part flag): the record it belongs to is
    skipped (or, for a length bit flip that still frames, read with its own bytes cut or padded),
    every other record keeps its key and bytes, and no allocation grows with the lying length."""
    indexed, scanned, images = recordio_files
    data = indexed.read_bytes()
    records = _records(data)
    assert len(records) == 6 and len(records[3][1]) == 3
    flips = [[head + byte, bit] for _, heads in records for head in heads for byte in range(8) for bit in range(8)]
    cases = _cases(indexed, scanned, flips)
    owner = {head + byte: k for k, (_, heads) in enumerate(records) for head in heads for byte in range(8)}
    results = _run(cases, tmp_path)
    assert len(results) == 2 * len(flips)
    for r in results:
        assert "foreign" not in r and "stoker" not in r, r
        assert r["peak"] < 4 << 20, r   # a length of up to 512 MiB is never allocated
        damaged = f"train.rec/{owner[r['offset']]}"
        intact = {f"train.rec/{k}": im.hex() for k, im in enumerate(images) if f"train.rec/{k}" != damaged}
        assert {k: v for k, v in r["items"].items() if k != damaged} == intact, (r["case"], r["offset"], r["bit"])
        assert set(r["skipped"]) <= {damaged}, r
        assert damaged in r["skipped"] or damaged in r["items"], r


def test_random_bit_flips_anywhere_never_crash(recordio_files, tmp_path: Path) -> None:
    """400 random flips over the whole file (image bytes and IRHeaders too): listing finishes
    with items and skips, no other exception, no item larger than the file."""
    indexed, scanned, _ = recordio_files
    rng = random.Random(5)
    size = indexed.stat().st_size
    flips = [[rng.randrange(size), rng.randrange(8)] for _ in range(200)]
    cases = _cases(indexed, scanned, flips)
    results = _run(cases, tmp_path)
    assert len(results) == 400
    for r in results:
        assert "foreign" not in r, r
        assert r.get("largest", 0) <= size and r["peak"] < 4 << 20, r
