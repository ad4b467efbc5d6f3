"""The few pieces of the protobuf wire format that TFRecord's ``tf.train.Example`` and Caffe's
``Datum`` (in LMDB) need: varints and a field iterator. No protobuf runtime and no generated code:
values come back as offsets into the caller's buffer, so large byte fields are never copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["fields", "varint"]


def varint(buf: Any, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def fields(buf: Any, pos: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value): an int for varints, (start, end) for length-delimited,
    the raw 4 or 8 bytes for fixed32/fixed64."""
    while pos < end:
        tag, pos = varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 2:
            length, pos = varint(buf, pos)
            value, pos = (pos, pos + length), pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > end:
            raise ValueError("a field runs past the end of its message")
        yield number, wire, value
