"""TFRecord files of ``tf.train.Example`` records (kind "tfrecord"), read without TensorFlow.

The ImageNet / TF-Slim layout by default: the image in the ``image/encoded`` feature, the label in
``image/class/label`` (TF-Slim's ImageNet labels run 1..1000, 0 being "background": they are kept
as written). Other features become typed extra columns (``image/filename`` -> string, ...).
``label_column`` / ``image_column`` name other features. One file, or a folder of them (ImageNet's
``train-00000-of-01024`` has no file ending: files are recognized by their first record's framing).

Each record is framed as ``length (u64) | masked CRC32C of length | data | masked CRC32C of data``;
both checksums are verified. A record whose data checksum fails is skipped and logged; a damaged
length ends the readable part of that file (nothing after it can be framed), which is logged too.
Gzip-compressed files (``.gz``, or the gzip magic bytes) are decompressed one file at a time,
streamed to a temporary file on disk and bounded (:class:`~stoker.sources.base.Inflated`); a
truncated or damaged ``.gz`` keeps the records before the damage and logs the rest, as an
uncompressed file does.

Why a small reader here rather than a package: TensorFlow is gigabytes; the ``tfrecord`` package
does not verify checksums and copies every record. This reader gives each image's byte range inside
the file, so packing reads just the image bytes, with no copy of the record and no protobuf runtime.
CRC32C comes from the ``crc32c`` package (C, GB/s): ``pip install 'stoker[tfrecord]'``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import SourceError
from ..storage.local import open_regular
from .protobuf import fields as _fields
from .protobuf import varint as _varint
from .base import (GzipMembers, Source, SourceItem, SourceOptions, describe_labels, inflated,
                   optional_module, scandir, type_any_labels)

SUFFIXES = (".tfrecord", ".tfrecords", ".tfrec")
DEFAULT_IMAGE = ("image/encoded", "image")
DEFAULT_LABEL = ("image/class/label", "label")
_HEADER = struct.Struct("<QI")
_MASK_DELTA = 0xA282EAD8


# ---------------------------------------------------------------- checksums

def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c_py(data: bytes) -> int:
    """CRC32C in pure Python: only for the 8-byte length header when detecting files."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(crc: int) -> int:
    """TFRecord's masking of a CRC32C value."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def _crc32c_fn() -> Any:
    return optional_module("crc32c", "tfrecord", "checking TFRecord checksums").crc32c


# ---------------------------------------------------------------- framing

class TFRecordFrame(NamedTuple):
    index: int    # record number in the file, from 0
    start: int    # byte offset of the record's data in the (decompressed) file
    end: int


class TFRecordDamage(NamedTuple):
    index: int
    offset: int   # byte offset of the record's header
    reason: str
    fatal: bool   # True: the rest of the file cannot be framed


def iter_records(buf: Any, crc: Any) -> Iterator[TFRecordFrame | TFRecordDamage]:
    """Frame the records of a TFRecord buffer (bytes or mmap), checking both checksums."""
    pos, index, size = 0, 0, len(buf)
    while pos < size:
        if size - pos < _HEADER.size:
            yield TFRecordDamage(index, pos, f"truncated: {size - pos} bytes left where a record header needs 12", True)
            return
        length, length_crc = _HEADER.unpack_from(buf, pos)
        if masked_crc(crc(buf[pos:pos + 8])) != length_crc:
            yield TFRecordDamage(index, pos, "length checksum mismatch: the rest of the file cannot be framed", True)
            return
        start, end = pos + 12, pos + 12 + length
        if end + 4 > size:
            yield TFRecordDamage(index, pos, f"truncated: the record says {length} bytes, the file ends first", True)
            return
        (data_crc,) = struct.unpack_from("<I", buf, end)
        if masked_crc(crc(buf[start:end])) != data_crc:
            yield TFRecordDamage(index, pos, "data checksum mismatch (corrupted record)", False)
        else:
            yield TFRecordFrame(index, start, end)
        pos, index = end + 4, index + 1


def looks_like_tfrecord(path: Path) -> bool:
    """True when the file starts with a TFRecord header whose length checksum is right."""
    try:
        with open_regular(path) as fh:
            head = fh.read(12)
    except OSError:
        return False
    if len(head) < 12:
        return False
    _, length_crc = _HEADER.unpack(head)
    return masked_crc(crc32c_py(head[:8])) == length_crc


# ---------------------------------------------------------------- tf.train.Example

class Feature(NamedTuple):
    kind: str      # "bytes", "float" or "int64"
    values: list   # bytes: (start, end) offsets into the buffer; else numbers


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _list_values(buf: Any, kind: str, start: int, end: int) -> list:
    values: list = []
    for number, wire, value in _fields(buf, start, end):
        if number != 1:
            continue
        if kind == "bytes" and wire == 2:
            values.append(value)
        elif kind == "int64" and wire == 0:
            values.append(_signed64(value))
        elif kind == "int64" and wire == 2:   # packed
            pos, stop = value
            while pos < stop:
                v, pos = _varint(buf, pos)
                values.append(_signed64(v))
        elif kind == "float" and wire == 5:
            values.append(struct.unpack("<f", value)[0])
        elif kind == "float" and wire == 2:   # packed
            values.extend(struct.unpack(f"<{(value[1] - value[0]) // 4}f", buf[value[0]:value[1]]))
        else:
            raise ValueError(f"unexpected wire type {wire} in a {kind} list")
    return values


_KINDS = {1: "bytes", 2: "float", 3: "int64"}


def parse_example(buf: Any, start: int, end: int) -> dict[str, Feature]:
    """The features of one serialized ``tf.train.Example`` at ``buf[start:end]``.
    Raises ValueError when the bytes are not one."""
    try:
        features: dict[str, Feature] = {}
        for number, wire, span in _fields(buf, start, end):
            if number != 1 or wire != 2:
                continue
            for entry_no, entry_wire, entry in _fields(buf, *span):   # Features.feature map entries
                if entry_no != 1 or entry_wire != 2:
                    continue
                name, feature = None, Feature("bytes", [])
                for kv_no, kv_wire, kv in _fields(buf, *entry):
                    if kv_no == 1 and kv_wire == 2:
                        name = bytes(buf[kv[0]:kv[1]]).decode("utf-8")
                    elif kv_no == 2 and kv_wire == 2:
                        for f_no, f_wire, f_span in _fields(buf, *kv):
                            if f_no in _KINDS and f_wire == 2:
                                feature = Feature(_KINDS[f_no], _list_values(buf, _KINDS[f_no], *f_span))
                if name is None:
                    raise ValueError("a feature without a name")
                features[name] = feature
        return features
    except (IndexError, UnicodeDecodeError, ValueError, struct.error) as exc:
        raise ValueError(f"malformed protobuf ({exc})") from None


# ---------------------------------------------------------------- the source

def _is_gzip(path: Path) -> bool:
    try:
        with open_regular(path) as fh:
            return fh.read(2) == b"\x1f\x8b"
    except OSError as exc:
        raise SourceError(f"cannot read TFRecord file {path}: {exc.strerror or exc}", path=path) from None


def _is_tfrecord_name(name: str) -> bool:
    lower = name.lower().removesuffix(".gz")
    return lower.endswith(SUFFIXES)


def detect(path: Path) -> bool:
    """A ``.tfrecord``/``.tfrec``/``.tfrecords`` file (maybe ``.gz``), a file that starts with a
    valid TFRecord header, or a folder whose visible files all are such."""
    if path.is_file():
        return _is_tfrecord_name(path.name) or looks_like_tfrecord(path)
    if not path.is_dir():
        return False
    files = [e for e in scandir(path) if not e.name.startswith(".")]
    if not files or any(not e.is_file() for e in files):
        return False
    return all(_is_tfrecord_name(e.name) or looks_like_tfrecord(Path(e.path)) for e in files)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(Path(e.path) for e in scandir(path) if e.is_file() and not e.name.startswith("."))
    if not files:
        raise SourceError(f"{path} holds no TFRecord files", path=path)
    return files


def _pick(names: set[str], wanted: str | None, defaults: tuple[str, ...]) -> str | None:
    """The feature to use: the one the caller named, else the first default present."""
    if wanted is not None:
        return wanted
    return next((n for n in defaults if n in names), None)


def _python_values(feature: Feature, buf: Any) -> Feature:
    """The feature with bytes values decoded as text (None: not short UTF-8 text)."""
    if feature.kind != "bytes":
        return feature
    return Feature("bytes", [_text(buf, s) for s in feature.values])


def _text(buf: Any, span: tuple[int, int]) -> str | None:
    if span[1] - span[0] > 4096:   # a second image or a mask, not a field of text
        return None
    try:
        return bytes(buf[span[0]:span[1]]).decode("utf-8")
    except UnicodeDecodeError:
        return None


class _Listing:
    """One pass over the files: items, label values and other feature values per record."""

    def __init__(self) -> None:
        self.items: list[SourceItem] = []
        self.labels: list[list | None] = []
        self.features: list[dict[str, Feature]] = []
        self.skipped: list[dict[str, str]] = []


def _open_buffer(file: Path, gz: bool, skipped: list[dict[str, str]]) -> Any:
    """The file's records as a buffer: the file memory-mapped, or its decompressed copy (on disk,
    bounded; see :class:`~stoker.sources.base.Inflated`) mapped, keeping what decompressed before
    any damage, which is logged in `skipped` as an uncompressed file's truncation is."""
    try:
        if gz:
            content = inflated(file)
            lost = content.skip_record(f"{file.name}/*")
            if lost is not None:
                skipped.append(lost)
            if not content.size:
                return b""
            return mmap.mmap(content.fileno(), content.size, access=mmap.ACCESS_READ)
        if not file.stat().st_size:
            return b""
        with open_regular(file) as fh:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise SourceError(f"cannot read TFRecord file {file}: {exc}", path=file) from None


def open_tfrecord(path: Path, options: SourceOptions) -> Source:
    crc = _crc32c_fn()
    files = _files(path)
    out = _Listing()
    names: list[str | None] = [None, None]   # image and label feature names, from the first record
    for file in files:
        gz = _is_gzip(file)
        buf = _open_buffer(file, gz, out.skipped)
        try:
            _list_file(file, buf, GzipMembers(file) if gz else None, crc, options, names, out)
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()
    if not out.items:
        raise SourceError(f"no readable tf.train.Example records with an image in {path} "
                          f"({len(out.skipped)} damaged or incomplete)", path=path)
    return _finish(path, files, out, names[1])


def _list_file(file: Path, buf: Any, store: GzipMembers | None, crc: Any, options: SourceOptions,
               names: list[str | None], out: _Listing) -> None:
    for rec in iter_records(buf, crc):
        key = f"{file.name}/{rec.index}"
        where = f"{file}:byte {rec.offset if isinstance(rec, TFRecordDamage) else rec.start - 12}"
        if isinstance(rec, TFRecordDamage):
            out.skipped.append({"key": key, "path": where, "reason": rec.reason})
            continue
        try:
            features = parse_example(buf, rec.start, rec.end)
        except ValueError as exc:
            out.skipped.append({"key": key, "path": where, "reason": f"not a tf.train.Example: {exc}"})
            continue
        if names[0] is None:
            names[0] = _pick(set(features), options.image_column, DEFAULT_IMAGE)
            # label_column="label" is the everywhere-default: here it means TF-Slim's name, or "label"
            wanted = None if options.label_column == "label" else options.label_column
            names[1] = None if options.label_column is None else _pick(set(features), wanted, DEFAULT_LABEL)
            if wanted is not None and wanted not in features:
                raise SourceError(f"{file} record {rec.index}: no label feature {wanted!r}; its features are "
                                  f"{sorted(features)}; pass label_column= (--label-column)", path=file)
            if names[0] is None or names[0] not in features:
                raise SourceError(f"{file} record {rec.index}: no image feature "
                                  f"{options.image_column or DEFAULT_IMAGE[0]!r}; its features are "
                                  f"{sorted(features)}; pass image_column= (--image-column)", path=file)
        image = features.pop(names[0], None)
        if image is None or image.kind != "bytes" or len(image.values) != 1:
            out.skipped.append({"key": key, "path": where,
                                "reason": f"feature {names[0]!r} is missing or not one bytes value"})
            continue
        lo, hi = image.values[0]
        out.items.append(SourceItem(key=key, path=None, label=None, container=None if store else file,
                                    offset=lo, size=hi - lo, store=store))
        label = features.pop(names[1], None) if names[1] else None
        out.labels.append(None if label is None else _python_values(label, buf).values)
        out.features.append({n: _python_values(f, buf) for n, f in features.items()})


def _finish(path: Path, files: list[Path], out: _Listing, label_name: str | None) -> Source:
    items, raw, features = out.items, out.labels, out.features
    classes, label_type = None, "none"
    if any(r is not None for r in raw):
        for item, r in zip(items, raw):
            if r is None or any(v is None for v in r):
                out.skipped.append({"key": item.key, "path": item.where(),
                                    "reason": f"no usable {label_name!r} label while other records have one"})
        keep = [i for i, r in enumerate(raw) if r is not None and all(v is not None for v in r)]
        items, raw, features = [items[i] for i in keep], [raw[i] for i in keep], [features[i] for i in keep]
        labels, label_type, classes = _type_values(raw)
        items = [replace(i, label=lab) for i, lab in zip(items, labels)]
    extra_columns, extras = _extras(features)
    items = [replace(i, extras=e) for i, e in zip(items, extras)]
    what = describe_labels(classes, label_type)
    return Source(items=items, classes=classes, label_type=label_type, extra_columns=extra_columns,
                  root=path if path.is_dir() else path.parent, kind="tfrecord", skipped=out.skipped,
                  description=f"TFRecord {path} ({len(files)} files, {what}, {len(extra_columns)} extra columns)")


def _type_values(raw: list[list]) -> tuple[list, str, list[str] | None]:
    """Labels from feature values: one int -> int64, one float -> float64, several -> a list
    type, text -> class names (sorted) with indices."""
    multi = any(len(r) != 1 for r in raw)
    if all(isinstance(v, str) for r in raw for v in r):
        return type_any_labels([list(r) if multi else r[0] for r in raw])
    if all(isinstance(v, int) for r in raw for v in r):
        return ([list(r) for r in raw], "list<int64>", None) if multi else ([r[0] for r in raw], "int64", None)
    floats = [[float(v) for v in r] for r in raw]
    return (floats, "list<float64>", None) if multi else ([r[0] for r in floats], "float64", None)


def _extras(features: list[dict[str, Feature]]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Typed extra columns from the remaining features: scalars of one kind become int64,
    float64 or string (short UTF-8 text); numeric lists become list columns. Features of mixed
    kinds, byte lists and bytes that are not text (a mask, a second image) are left out."""
    kinds: dict[str, set[str]] = {}
    longest: dict[str, int] = {}
    for f in features:
        for name, feat in f.items():
            kinds.setdefault(name, set()).add(feat.kind)
            longest[name] = max(longest.get(name, 0), len(feat.values))
    columns: dict[str, str] = {}
    for name, ks in sorted(kinds.items()):
        if len(ks) != 1:
            continue
        kind, scalar = next(iter(ks)), longest[name] <= 1
        if kind == "bytes" and scalar and all(v is not None for f in features if name in f for v in f[name].values):
            columns[name] = "string"
        elif kind == "int64":
            columns[name] = "int64" if scalar else "list<int64>"
        elif kind == "float":
            columns[name] = "float64" if scalar else "list<float64>"
    rows = []
    for f in features:
        row: dict[str, Any] = {}
        for name, type_name in columns.items():
            feat = f.get(name)
            values = [] if feat is None else feat.values
            if type_name.startswith("list"):
                row[name] = [float(v) for v in values] if "float" in type_name else list(values)
            elif not values:
                row[name] = None
            else:
                row[name] = float(values[0]) if type_name == "float64" else values[0]
        rows.append(row)
    return columns, rows
