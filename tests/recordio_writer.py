"""An MXNet RecordIO writer written from the format's specification, for tests and benchmarks.

MXNet (the reference writer) installs only on old Pythons, so tests cannot import it. This
writer follows dmlc-core's ``RecordIOWriter::WriteRecord`` (magic word, length with the part flag
in its upper 3 bits, records split wherever their data holds the magic word at an aligned offset,
zero padding to 4 bytes) and ``mxnet.recordio.pack`` (the ``IfQQ`` IRHeader, a float32 label vector
when the label is a list), and is checked byte for byte against files MXNet 1.9.1 wrote
(``tests/fixtures/recordio``, ``test_source_recordio.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)


def pack(label: float | Sequence[float], image: bytes, id: int = 0, id2: int = 0) -> bytes:
    """``mxnet.recordio.pack(IRHeader(0, label, id, id2), image)``."""
    if isinstance(label, (int, float)):
        return struct.pack("<IfQQ", 0, label, id, id2) + image
    vector = struct.pack(f"<{len(label)}f", *label)
    return struct.pack("<IfQQ", len(label), 0.0, id, id2) + vector + image


def part(flag: int, data: bytes) -> bytes:
    """One part: magic, length with ``flag`` in its upper 3 bits, data (no padding)."""
    return MAGIC_BYTES + struct.pack("<I", flag << 29 | len(data)) + data


def frame(record: bytes) -> bytes:
    """The bytes ``MXRecordIO.write(record)`` appends to a file."""
    out, start = [], 0
    for i in range(0, len(record) - 3, 4):
        if record[i:i + 4] == MAGIC_BYTES:
            out.append(part(1 if start == 0 else 2, record[start:i]))
            start = i + 4
    out.append(part(3 if start else 0, record[start:]))
    out.append(b"\0" * (-len(record) % 4))
    return b"".join(out)


class RecordWriter:
    """``MXIndexedRecordIO(idx, rec, "w")`` (``index=True``) or ``MXRecordIO(rec, "w")``."""

    def __init__(self, path: Path, index: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rec = open(self.path, "wb")
        self._idx = open(self.path.with_suffix(".idx"), "w") if index else None

    def write(self, record: bytes, key: int | str | None = None) -> int:
        """Append one packed record (under ``key`` in the .idx); returns its byte offset."""
        offset = self._rec.tell()
        self._rec.write(frame(record))
        if self._idx is not None:
            self._idx.write(f"{key}\t{offset}\n")
        return offset

    def append(self, raw: bytes) -> None:
        """Bytes as they are, no framing (damaged files for tests)."""
        self._rec.write(raw)

    def close(self) -> None:
        self._rec.close()
        if self._idx is not None:
            self._idx.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_rec(path: Path, records: Sequence[tuple[float | Sequence[float], bytes]], index: bool = True) -> Path:
    """A ``.rec`` (and ``.idx``) of ``(label, image)`` records, keys and ids 0.. as ``im2rec`` writes."""
    with RecordWriter(path, index) as w:
        for key, (label, image) in enumerate(records):
            w.write(pack(label, image, key), key)
    return path
