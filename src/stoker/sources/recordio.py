"""MXNet RecordIO files (kind "recordio"), read without MXNet: ``train.rec`` and its ``train.idx``.

ImageNet packed by ``im2rec`` and the InsightFace face sets (MS1MV2/MS1MV3, Glint360K, WebFace:
``train.rec`` + ``train.idx`` + ``property``) are distributed this way. The source is one ``.rec``
file (a ``.idx`` named instead means the ``.rec`` beside it) or a folder: every ``.rec`` in it.

Framing (dmlc-core's RecordIO): a record is one or more parts, each ``magic 0xced7230a (u32) |
lrec (u32) | data``, zero-padded to 4 bytes. ``lrec``'s low 29 bits are the data length, its upper
3 bits the part's place (0: the whole record; 1, 2, 3: first, middle, last part). The writer splits
a record wherever its data holds the magic word at a 4-byte aligned offset and drops that word;
reading puts it back. A record is an ``IRHeader`` (``<IfQQ``: flag, label, id, id2, 24 bytes),
then, when ``flag > 0``, a vector of ``flag`` float32 labels, then the image bytes, kept byte for
byte (a whole record is a plain file range; a split one is read part by part and rejoined).

Order and keys: with ``train.idx`` beside ``train.rec`` (``<key>\\t<byte offset>`` lines, as
``MXIndexedRecordIO`` writes them), the records it lists in its order, keyed ``train.rec/<key>``,
then the records in the bytes no listed record takes (an ``.idx`` cut short, or older than its
``.rec``), keyed ``train.rec/@<byte offset>`` and counted in the source description; an offset
listed twice is read once (the later keys are skipped), so no index makes the samples outgrow the
file; an empty ``.idx`` is an error naming it. Without one, a sequential scan of the file, keyed
``train.rec/<record number from 0>``.

Labels: scalar labels that are all whole numbers become int64 class ids, else float64. Label
vectors (``flag > 0``) become ``list<float64>`` rows, which the Loader hands out as soft targets
(:mod:`stoker.labels`), like a list line or CSV cell of floats; in a file that mixes both, a
scalar becomes a one-value row. ``label_column=None`` packs no labels.

InsightFace: a record 0 (``.idx`` key 0; without an ``.idx``, IRHeader id 0) with no image bytes
and a label ``[a, b]`` is that layout's header: the images are records ``1..a-1`` and records
``a..b-1`` are one per identity, each labelled with the ``[start, end)`` range of its images.
Neither the header nor the identity records are samples; what they say (images, identities), and
a ``property`` file beside the ``.rec`` (``<identities>,<height>,<width>``), go into the source
description, kept in the manifest (``pack_options.source``, shown by ``stoker info``). As
InsightFace's own reader does, an image labelled with a vector there is labelled by its first value.

Damage (RecordIO has no checksums; listing reads the 8-byte part headers, never image bytes): a
wrong magic word, a part flag out of place, a length past the end of the file, past the next
offset the ``.idx`` lists, or not ending where the next record header is, a split record whose
last part never comes, an IRHeader longer than its record: that record is skipped and logged
(``skipped.jsonl`` names its key and byte offset). A scan then goes on at the next aligned magic
word that starts a record (the writer never leaves one aligned inside data), naming the byte
range it could not read. A ``.idx`` offset outside the file or not on a record header skips that
key. Nothing is read past the file's end, so no record costs more memory than the file holds.
Without an ``.idx``, a length damaged to end exactly at a later record header looks sound (the
records between become the end of that image).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import SourceError
from ..storage.local import open_regular, read_regular
from .base import Source, SourceItem, SourceOptions, describe_labels, read_text, scandir

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)
IRHEADER = struct.Struct("<IfQQ")   # flag, label, id, id2 (MXNet packs 'IfQQ' natively: no padding)
SUFFIX = ".rec"
INDEX_SUFFIX = ".idx"
PROPERTY_FILE = "property"
_PART = struct.Struct("<II")
_LENGTH_MASK = (1 << 29) - 1
_WHOLE_LIMIT = 1 << 53   # a float32 label above this is no class id


# ---------------------------------------------------------------- framing

class Record(NamedTuple):
    offset: int                          # byte offset of its first part's header
    parts: tuple[tuple[int, int], ...]   # (data offset, data length) of each part
    end: int                             # the byte after its last part's padding


class Damage(NamedTuple):
    offset: int
    reason: str


class _Part(NamedTuple):
    magic: int
    flag: int     # 0: a whole record; 1, 2, 3: a split record's first, middle, last part
    length: int
    after: int    # the byte after its data and padding


def _part(buf: Any, pos: int) -> _Part | None:
    """The part header at ``pos``, or None where fewer than 8 bytes are left."""
    if pos < 0 or len(buf) - pos < _PART.size:
        return None
    magic, lrec = _PART.unpack_from(buf, pos)
    length = lrec & _LENGTH_MASK
    return _Part(magic, lrec >> 29, length, pos + _PART.size + ((length + 3) & ~3))


def is_head(buf: Any, pos: int) -> bool:
    """True when a record's first part starts at ``pos`` (magic word, part flag 0 or 1)."""
    p = _part(buf, pos)
    return p is not None and p.magic == MAGIC and p.flag in (0, 1)


def _is_continuation(buf: Any, pos: int) -> bool:
    p = _part(buf, pos)
    return p is not None and p.magic == MAGIC and p.flag in (2, 3)


def frame(buf: Any, pos: int, next_start: int | None = None) -> Record | Damage:
    """The record whose first part starts at ``pos``. It must end at the end of the file or at
    another record header; with ``next_start`` (the next record start an ``.idx`` lists), at
    that offset or before it. Only headers are read, never the data."""
    size, parts, at = len(buf), [], pos
    while True:
        if size - at < _PART.size:
            where = "where its header belongs" if not parts else f"after part {len(parts)}: its last part is missing"
            return Damage(pos, f"truncated: the file ends {where}")
        magic, lrec = _PART.unpack_from(buf, at)
        if magic != MAGIC:
            return Damage(pos, f"no RecordIO magic word at byte {at} (found {magic:#010x})")
        flag, length = lrec >> 29, lrec & _LENGTH_MASK
        if flag not in ((2, 3) if parts else (0, 1)):
            expected = "2 or 3 (a split record's next part)" if parts else "0 or 1 (a record's start)"
            return Damage(pos, f"part flag {flag} at byte {at} where {expected} belongs")
        if length > size - at - _PART.size:
            return Damage(pos, f"truncated: the part at byte {at} says {length} bytes, the file holds "
                               f"{size - at - _PART.size} after its header")
        parts.append((at + _PART.size, length))
        part_at, at = at, at + _PART.size + ((length + 3) & ~3)
        if flag in (0, 3):
            end = min(at, size)
            if next_start is not None and end > next_start:
                return Damage(pos, f"the part at byte {part_at} says {length} bytes, running past byte {next_start} "
                                   "where the .idx starts the next record: its length is damaged")
            if end < size and end != next_start and not is_head(buf, end) and not _damaged_head(buf, end):
                return Damage(pos, f"the part at byte {part_at} ({length} bytes, part flag {flag}) does not end at "
                                   "another record header: its length or part flag is damaged")
            return Record(pos, tuple(parts), end)


def _damaged_head(buf: Any, pos: int) -> bool:
    """True when the header at ``pos`` is itself damaged, so the record before it ended in the
    right place: the magic word but for at most 3 bits, a part flag above 3, or a flag of 2 or 3
    that its neighbour contradicts (a true last part (3) is followed by a record start or the end of
    the file, a true middle part (2) by another part; anything else is a record start whose flag
    was hit, not the rest of a record cut short)."""
    p = _part(buf, pos)
    if p is None:
        return False
    if p.magic != MAGIC:
        return (p.magic ^ MAGIC).bit_count() <= 3
    if p.flag not in (2, 3):
        return p.flag > 3
    if p.after > len(buf):
        return False
    if p.flag == 3:
        return not (p.after == len(buf) or is_head(buf, p.after))
    return not _is_continuation(buf, p.after)


def _find_magic(buf: Any, start: int, stop: int) -> int:
    """The first 4-byte aligned magic word in ``buf[start:stop]``, or -1. A sound file has none
    inside any part's data: the writer splits records there."""
    pos = start + (-start % 4)
    while True:
        found = buf.find(MAGIC_BYTES, pos, stop)
        if found < 0 or found % 4 == 0:
            return found
        pos = found + 1 + (-(found + 1) % 4)


def next_head(buf: Any, pos: int) -> int:
    """The first record header at or after ``pos`` (4-byte aligned), or the file's size. A part of
    a split record whose flag was hit (a first part followed by a record start, a whole record
    followed by the rest of a split one) is not taken for one."""
    while True:
        found = _find_magic(buf, pos, len(buf))
        if found < 0:
            return len(buf)
        if is_head(buf, found) and not _inside_split(buf, found):
            return found
        pos = found + 4


def _inside_split(buf: Any, pos: int) -> bool:
    p = _part(buf, pos)
    if p.after > len(buf):
        return False
    if p.flag == 1:
        return p.after == len(buf) or is_head(buf, p.after)
    return _is_continuation(buf, p.after) and not _damaged_head(buf, p.after)


def scan(buf: Any) -> Iterator[Record | Damage]:
    """Every record of a file in order; after damage, the scan resumes at the next header."""
    pos, size = 0, len(buf)
    while pos < size:
        rec = frame(buf, pos)
        if isinstance(rec, Record):
            yield rec
            pos = rec.end
        else:
            resume = next_head(buf, pos + 4)
            yield rec._replace(reason=f"{rec.reason}; bytes {pos}..{resume} could not be read")
            pos = resume


def rejoin(buf: Any, rec: Record) -> bytes:
    """The bytes of a record, its parts rejoined by the magic word the writer took out."""
    return MAGIC_BYTES.join(bytes(buf[s:s + n]) for s, n in rec.parts)


class Header(NamedTuple):
    flag: int
    label: float | tuple[float, ...]
    id: int
    image: int   # offset of the image bytes in the (rejoined) record
    size: int    # image bytes


def parse_header(data: Any, base: int, length: int) -> Header:
    """The IRHeader (and label vector) of the record at ``data[base:base + length]``.
    Raises ValueError when the record is too short for them."""
    if length < IRHEADER.size:
        raise ValueError(f"the {length}-byte record is shorter than its {IRHEADER.size}-byte IRHeader")
    flag, label, rid, _ = IRHEADER.unpack_from(data, base)
    head = IRHEADER.size + 4 * flag
    if head > length:
        raise ValueError(f"its IRHeader announces {flag} label values ({4 * flag} bytes), more than the "
                         f"{length - IRHEADER.size} bytes the record holds after it")
    if flag:
        label = struct.unpack_from(f"<{flag}f", data, base + IRHEADER.size)
    return Header(flag, label, rid, head, length - head)


# ---------------------------------------------------------------- split records

@dataclass
class _SplitRecords:
    """The images of records split into parts: read part by part (never past the file's size)
    and rejoined. ``records[i]``: the parts of item i's record and where its image starts."""

    path: Path
    records: list[tuple[tuple[tuple[int, int], ...], int]]

    @property
    def name(self) -> str:
        return str(self.path)

    def read(self, offset: int, size: int) -> bytes:
        parts, image = self.records[offset]
        first = parts[0][0]
        span = read_regular(self.path, first, parts[-1][0] + parts[-1][1] - first)   # one read for all parts
        data = MAGIC_BYTES.join(span[s - first:s - first + n] for s, n in parts)
        return data[image:image + size]


# ---------------------------------------------------------------- files, index, property

def _rec_for(path: Path) -> Path:
    return path.with_suffix(SUFFIX) if path.suffix.lower() == INDEX_SUFFIX else path


def _starts_like_recordio(path: Path) -> bool:
    try:
        with open_regular(path) as fh:
            return is_head(fh.read(_PART.size), 0)
    except OSError:
        return False


def detect(path: Path) -> bool:
    """A ``.rec`` file (or its ``.idx``), a file that starts with a RecordIO header, or a folder
    holding ``.rec`` files and no sub-folders."""
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == INDEX_SUFFIX:
            return _rec_for(path).is_file()
        return suffix == SUFFIX or _starts_like_recordio(path)
    if not path.is_dir():
        return False
    entries = [e for e in scandir(path) if not e.name.startswith(".")]
    return not any(e.is_dir() for e in entries) and any(e.name.lower().endswith(SUFFIX) for e in entries)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        rec = _rec_for(path)
        if not rec.is_file():
            raise SourceError(f"{path} is a RecordIO index; its records file {rec.name} is not beside it", path=path)
        return [rec]
    files = sorted(Path(e.path) for e in scandir(path)
                   if e.is_file() and not e.name.startswith(".") and e.name.lower().endswith(SUFFIX))
    if not files:
        raise SourceError(f"{path} holds no {SUFFIX} files", path=path)
    return files


def read_index(index: Path) -> list[tuple[str, int, int]]:
    """(key, byte offset, line number) of each line of an ``.idx`` file, in its order."""
    out: list[tuple[str, int, int]] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(read_text(index).splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or _integer(fields[1]) is None:
            raise SourceError(f"{index} line {number}: expected '<key><TAB><byte offset>', found {line.strip()!r}; "
                              "fix the line, or remove the .idx to scan the .rec file in order",
                              path=index, line=number)
        if fields[0] in seen:
            raise SourceError(f"{index} line {number}: key {fields[0]!r} is already listed on line {seen[fields[0]]}; "
                              "each record may appear once", path=index, line=number)
        seen[fields[0]] = number
        out.append((fields[0], int(fields[1]), number))
    return out


def _integer(text: str) -> int | None:
    try:
        return int(text) if text.isascii() else None
    except ValueError:
        return None


def read_property(path: Path) -> tuple[int, ...]:
    """The numbers of an InsightFace ``property`` file: ``<identities>,<height>,<width>``."""
    text = read_text(path).strip()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or len(values) > 3 or min(values) < 0:
        raise SourceError(f"{path}: expected '<identities>,<height>,<width>' (InsightFace's property file), "
                          f"found {text[:80]!r}; fix or remove it", path=path)
    return values


# ---------------------------------------------------------------- listing

class _Entry(NamedTuple):
    file: Path
    offset: int           # of the record's first header
    number: int | None    # the record's number for the InsightFace layout (.idx key, else IRHeader id)
    header: Header
    item: SourceItem

    @property
    def key(self) -> str:
        return self.item.key

    @property
    def where(self) -> str:
        return f"{self.file}:byte {self.offset}"


class _Starts:
    """The record offsets an ``.idx`` lists, sorted (an array: 8 bytes an offset, where a set of
    millions of ints would take hundreds of MB)."""

    def __init__(self, offsets: list[int]) -> None:
        self._sorted = np.unique(np.asarray(offsets, dtype=np.int64))

    def after(self, offset: int) -> int | None:
        """The first listed offset beyond ``offset``, None when there is none."""
        i = int(np.searchsorted(self._sorted, offset, side="right"))
        return int(self._sorted[i]) if i < len(self._sorted) else None


class _Listing:
    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.skipped: list[dict[str, str]] = []
        self.notes: list[str] = []

    def skip(self, key: str, where: str, reason: str) -> None:
        self.skipped.append({"key": key, "path": where, "reason": reason})


def _records(file: Path, buf: Any, out: _Listing) -> Iterator[tuple[str, int | None, Record]]:
    """(key, number, record) of each readable record: through the ``.idx`` beside ``file`` when
    there is one (then the records it does not list, found by scanning what it leaves out), else by
    a scan. Damaged ones go to ``out.skipped``."""
    index = file.with_suffix(INDEX_SUFFIX)
    if not index.is_file():
        for number, rec in enumerate(scan(buf)):
            if isinstance(rec, Damage):
                out.skip(f"{file.name}/{number}", f"{file}:byte {rec.offset}", rec.reason)
            else:
                yield f"{file.name}/{number}", None, rec
        return
    entries = read_index(index)
    if not entries:
        raise SourceError(f"{index} lists no records; remove it to scan {file.name} in order, or write it again "
                          "(one '<key><TAB><byte offset>' line per record)", path=index)
    # where the listed records start (a listed offset that is no record header bounds none of them)
    ends = _Starts([offset for _, offset, _ in entries if 0 <= offset < len(buf) and not offset % 4
                    and is_head(buf, offset)])
    spans: list[tuple[int, int]] = []   # the byte ranges the listed records take (damaged ones too)
    listed: dict[int, tuple[str, int]] = {}   # offset -> (key, line) that listed it first
    for key, offset, line in entries:
        name, where = f"{file.name}/{key}", f"{file}:byte {offset}"
        if not 0 <= offset < len(buf) or offset % 4:
            out.skip(name, f"{index} line {line}", f"{index.name} line {line} gives byte offset {offset}, which is "
                     f"not a record start in {file.name} ({len(buf)} bytes, records start at multiples of 4)")
            continue
        if offset in listed:   # each record is read once, whatever the index says
            first, first_line = listed[offset]
            out.skip(name, f"{index} line {line}", f"{index.name} line {line} gives byte offset {offset}, which line "
                     f"{first_line} already gives key {first!r}: a record is read once")
            continue
        listed[offset] = (key, line)
        rec = frame(buf, offset, ends.after(offset))
        if isinstance(rec, Damage):
            out.skip(name, where, f"{rec.reason} ({index.name} line {line})")
            if is_head(buf, offset):   # a record starts here: the bytes up to the next are its own
                spans.append((offset, min(next_head(buf, offset + 4), ends.after(offset) or len(buf))))
            continue
        spans.append((offset, rec.end))
        yield name, _integer(key), rec
    yield from _unlisted(file, buf, index, spans, {f"{file.name}/{k}" for k, _, _ in entries}, set(listed), out)


def _unlisted(file: Path, buf: Any, index: Path, spans: list[tuple[int, int]], keys: set[str],
              listed: set[int], out: _Listing) -> Iterator[tuple[str, int | None, Record]]:
    """The records in the bytes no listed record takes (an ``.idx`` cut short, or written for an
    older ``.rec``), keyed ``<file>/@<byte offset>``, and a note saying how many."""
    found, pos = 0, 0
    for start, end in [*sorted(spans), (len(buf), len(buf))]:
        while pos < start:
            rec = frame(buf, pos, start if start < len(buf) else None)
            name = f"{file.name}/@{pos}"
            if isinstance(rec, Damage) or name in keys:
                resume = min(next_head(buf, pos + 4), start)
                if pos in listed:   # damage already reported under the key that lists it
                    pos = resume
                    continue
                reason = f"the key {name!r} is also an {index.name} key" if name in keys else \
                    f"{rec.reason}; bytes {pos}..{resume} could not be read"
                out.skip(name, f"{file}:byte {pos}", f"{reason} (a record {index.name} does not list)")
                pos = resume
                continue
            found += 1
            yield name, None, rec
            pos = rec.end
        pos = max(pos, end)
    if found:
        out.notes.append(f"{index.name} does not list {found} record{'s' if found > 1 else ''} {file.name} holds: "
                         f"packed too, keyed {file.name}/@<byte offset>")


def _list_file(file: Path, buf: Any, out: _Listing) -> None:
    split = _SplitRecords(file, [])
    indexed = file.with_suffix(INDEX_SUFFIX).is_file()
    for key, number, rec in _records(file, buf, out):
        whole = len(rec.parts) == 1
        data, base = (buf, rec.parts[0][0]) if whole else (rejoin(buf, rec), 0)
        length = rec.parts[0][1] if whole else len(data)
        try:
            header = parse_header(data, base, length)
        except ValueError as exc:
            out.skip(key, f"{file}:byte {rec.offset}", str(exc))
            continue
        if whole:
            item = SourceItem(key=key, path=None, label=None, container=file, offset=base + header.image,
                              size=header.size)
        else:
            split.records.append((rec.parts, header.image))
            item = SourceItem(key=key, path=None, label=None, offset=len(split.records) - 1, size=header.size,
                              store=split)
        out.entries.append(_Entry(file, rec.offset, number if indexed else header.id, header, item))


def _whole(value: float) -> bool:
    return math.isfinite(value) and value == int(value) and abs(value) < _WHOLE_LIMIT


def _insightface(file: Path, entries: list[_Entry], out: _Listing) -> tuple[list[_Entry], bool]:
    """The entries that are samples, and whether ``file`` is in the InsightFace layout (its header
    and identity records taken out, what they say noted)."""
    head = next((e for e in entries if e.number == 0), None)
    if (head is None or head.header.size or head.header.flag != 2
            or not all(_whole(v) for v in head.header.label) or not 0 < head.header.label[0] <= head.header.label[1]):
        return entries, False
    first, end = (int(v) for v in head.header.label)
    identities = [e for e in entries if e.number is not None and first <= e.number < end
                  and not e.header.size and e.header.flag == 2]
    dropped = {id(head), *(id(e) for e in identities)}
    out.notes.append(f"InsightFace layout in {file.name}: header record 0 lists images 1..{first - 1} and "
                     f"{end - first} identities (records {first}..{end - 1}; {len(identities)} present)")
    return [e for e in entries if id(e) not in dropped], True


def open_recordio(path: Path, options: SourceOptions) -> Source:
    if options.label_column not in ("label", None):
        raise SourceError.spelled(f"a RecordIO record has one label (in its IRHeader), not a column named "
                                  f"{options.label_column!r}; drop {{column}}, or pass {{none}} to pack no labels",
                                  {"column": ("label_column=", "--label-column"), "none": ("label_column=None",
                                                                                         "--no-labels")}, path=path)
    files = _files(path)
    out = _Listing()
    samples: list[tuple[_Entry, bool]] = []
    for file in files:
        out.entries = []
        buf = _map(file)
        try:
            _list_file(file, buf, out)
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()
        entries, face = _insightface(file, out.entries, out)
        for entry in entries:
            if not entry.header.size:
                out.skip(entry.key, entry.where, "the record holds no image bytes after its IRHeader")
            else:
                samples.append((entry, face))
        prop = file.parent / PROPERTY_FILE
        if prop.is_file():
            values = read_property(prop)
            size = f", images {values[1]}x{values[2]}" if len(values) == 3 else ""
            out.notes.append(f"{PROPERTY_FILE}: {values[0]} identities{size}")
    if not samples:
        raise SourceError(f"no readable RecordIO records with an image in {path} "
                          f"({len(out.skipped)} damaged or without image bytes)", path=path)
    items, label_type = _labelled(samples, options, out)
    notes = "".join(f"; {n}" for n in dict.fromkeys(out.notes))
    count = f"{len(files)} file{'s' if len(files) > 1 else ''}"
    return Source(items=items, classes=None, label_type=label_type, extra_columns={},
                  root=path if path.is_dir() else path.parent, kind="recordio", skipped=out.skipped,
                  description=f"RecordIO {path} ({count}, {describe_labels(None, label_type)}{notes})")


def _map(file: Path) -> Any:
    try:
        with open_regular(file) as fh:
            if not fh.seek(0, 2):
                return b""
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise SourceError(f"cannot read RecordIO file {file}: {exc}", path=file) from None


def _labelled(samples: list[tuple[_Entry, bool]], options: SourceOptions,
              out: _Listing) -> tuple[list[SourceItem], str]:
    """The items with their typed labels (see the module docstring); a label that is not a finite
    number is skipped."""
    if options.label_column is None:
        return [e.item for e, _ in samples], "none"
    kept: list[tuple[SourceItem, float | tuple[float, ...]]] = []
    for entry, face in samples:
        label = entry.header.label
        if face and isinstance(label, tuple):
            label = label[0]
        values = label if isinstance(label, tuple) else (label,)
        if not all(math.isfinite(v) for v in values):
            out.skip(entry.key, entry.where, f"its label {label} is not a finite number")
            continue
        kept.append((entry.item, label))
    if any(isinstance(lab, tuple) for _, lab in kept):
        rows = [[float(v) for v in lab] if isinstance(lab, tuple) else [float(lab)] for _, lab in kept]
        return [replace(item, label=row) for (item, _), row in zip(kept, rows)], "list<float64>"
    if all(_whole(lab) for _, lab in kept):
        return [replace(item, label=int(lab)) for item, lab in kept], "int64"
    return [replace(item, label=float(lab)) for item, lab in kept], "float64"
