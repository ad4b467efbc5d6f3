"""LMDB environments (kind "lmdb"): one key per image, as PyTorch and Caffe pipelines wrote them.

Named ``lmdb_env`` so it does not shadow the ``lmdb`` package. Opened read-only, without the
lock file (``lock=False``: works on read-only media; do not write to the environment while
packing). Keys are listed in LMDB's order (sorted bytes); a key is the UTF-8 text of the LMDB key
(``hex:<digits>`` when it is not UTF-8). Keys like ``__keys__`` or ``__len__`` (metadata that
converters add) are not samples and are ignored, never read.

Values, one of (documented layouts):

- **encoded image bytes** (JPEG, PNG, WebP, GIF, BMP, TIFF), stored as they are;
- **Caffe ``Datum``** protobuf: ``encoded=true`` gives the image bytes, else raw ``C x H x W``
  uint8 BGR pixels (handed on as a lossless PPM); its ``label`` is the label.

Labels, first match: a ``labels.txt`` in the environment's folder (``<key> <label>`` lines, or
``<key> <l1> <l2> ...`` for multi-label; keys it does not list are skipped and logged); the
Datum labels; keys shaped ``<class>/<name>`` (every key), whose first part names the class, as
in an ImageFolder; else none.

**No pickle, ever**: a value that is a Python pickle (the ``(bytes, label)`` tuples some converters
write) is refused with a SourceError, because unpickling runs whatever code the file holds. Other
values that are not an image (damaged, or another format) are listed and then skipped by the
packer with the decoder's reason. Needs ``pip install 'stoker[lmdb]'``.

**Truncated files**: LMDB memory-maps ``data.mdb`` and trusts it, so touching a page past the end
of a truncated copy kills the process with SIGBUS. Before mapping, the file's size is checked
against what its own header (the newer of the two meta pages) says it holds; a shorter file is a
SourceError naming it.
"""

from __future__ import annotations

import struct
import threading
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SourceError
from ..storage.local import open_regular, require_regular
from .base import Source, SourceItem, SourceOptions, describe_labels, optional_module, read_text, type_any_labels
from .listing import split_line
from .protobuf import fields

LABELS_FILE = "labels.txt"
_META_MAGIC = 0xBEEFC0DE
#: offsets in a meta page (64-bit LMDB): 16-byte page header, then magic, version, address,
#: map size, the free DB (whose md_pad holds the page size), the main DB, last page, txn id
_META = struct.Struct("<16xII8x8xI44x48xQQ")
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")


def _lmdb() -> Any:
    return optional_module("lmdb", "lmdb", "reading LMDB")


def detect(path: Path) -> bool:
    """A folder holding ``data.mdb``, a ``data.mdb`` file, or a ``.lmdb``/``.mdb`` file."""
    if path.is_dir():
        return (path / "data.mdb").is_file()
    return path.is_file() and path.suffix.lower() in (".lmdb", ".mdb")


def is_image(head: bytes) -> bool:
    return head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def is_pickle(head: bytes) -> bool:
    """Pickle protocol 2 and later open with PROTO (0x80) and the protocol number."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


class Datum:
    """The fields of a Caffe ``Datum`` that matter: shape, where the data bytes are, label, encoded."""

    __slots__ = ("channels", "height", "width", "data", "label", "encoded")

    def __init__(self, value: Any) -> None:
        self.channels = self.height = self.width = 0
        self.data: tuple[int, int] | None = None
        self.label: int | None = None
        self.encoded = False
        try:
            for number, wire, v in fields(value, 0, len(value)):
                if wire == 0 and number in (1, 2, 3, 5, 7):
                    name = {1: "channels", 2: "height", 3: "width", 5: "label", 7: "encoded"}[number]
                    setattr(self, name, bool(v) if number == 7 else (v - (1 << 64) if v >= 1 << 63 else v))
                elif number == 4 and wire == 2:
                    self.data = v
        except (IndexError, ValueError) as exc:
            raise ValueError(f"not a Caffe Datum ({exc})") from None
        if self.data is None:
            raise ValueError("not a Caffe Datum (no data field)")

    def image(self, value: Any) -> bytes:
        lo, hi = self.data
        if self.encoded:
            return bytes(value[lo:hi])
        c, h, w = self.channels, self.height, self.width
        if c not in (1, 3) or h <= 0 or w <= 0 or c * h * w != hi - lo:
            raise OSError(f"raw Datum of {c}x{h}x{w} does not match its {hi - lo} data bytes")
        planes = np.frombuffer(value, np.uint8, count=hi - lo, offset=lo).reshape(c, h, w)
        pixels = planes[0] if c == 1 else planes[::-1].transpose(1, 2, 0)   # BGR planes -> RGB
        header = f"P{5 if c == 1 else 6}\n{w} {h}\n255\n".encode()
        return header + np.ascontiguousarray(pixels).tobytes()


#: Environments open in this process, by path: lmdb allows one handle per environment and process.
_OPEN: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.Lock()


def check_data_file(data: Path) -> None:
    """Refuse a ``data.mdb`` shorter than its header says (a truncated copy): mapping it would
    end in SIGBUS on the first page past its end. Files whose header is not LMDB's are left to
    lmdb, which reads it without mapping and says so."""
    with open_regular(data) as fh:
        size = fh.seek(0, 2)
        fh.seek(0)
        head = fh.read(_META.size)
        if len(head) < _META.size:
            return
        magic, _, psize, last, txn = _META.unpack(head)
        if magic != _META_MAGIC:
            return
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            raise SourceError(f"{data}: the LMDB header is damaged (page size {psize}); restore the file or "
                              "convert the images again", path=data)
        metas = [(txn, last)]
        fh.seek(psize)
        second = fh.read(_META.size)
        if len(second) == _META.size and _META.unpack(second)[0] == _META_MAGIC:
            metas.append(_META.unpack(second)[3:][::-1])
    txn, last = max(metas)   # lmdb uses the meta page of the newest transaction
    need = (last + 1) * psize
    if size < need:
        raise SourceError(f"{data}: the LMDB file is truncated ({size:,} bytes; its header says it holds "
                          f"{last + 1:,} pages of {psize} bytes = {need:,} bytes); restore the whole file "
                          "(an interrupted copy or download?)", path=data)


def _environment(path: Path) -> Any:
    lmdb = _lmdb()
    with _OPEN_LOCK:
        env = _OPEN.get(str(path))
        if env is None:
            data = path / "data.mdb" if path.is_dir() else path
            try:  # lmdb opens the file itself: a FIFO as data.mdb would block it
                require_regular(data)
                check_data_file(data)
            except OSError as exc:
                raise SourceError(f"cannot open {path} as an LMDB environment ({exc.filename}: {exc.strerror})",
                                  path=path) from None
            try:
                env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, meminit=False,
                                subdir=path.is_dir(), max_readers=1024)
            except lmdb.Error as exc:
                raise SourceError(f"cannot open {path} as an LMDB environment ({exc})", path=path) from None
            _OPEN[str(path)] = env
        return env


class _Env:
    """The records of one listing; reads one value per call (a read transaction each: thread-safe)."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self.env = _environment(path)
        self.keys: list[bytes] = []
        self.datum: bytearray = bytearray()   # 1 where the value is a Caffe Datum

    def read(self, offset: int, size: int) -> bytes:
        try:
            with self.env.begin(buffers=True) as txn:
                value = txn.get(self.keys[offset])
                if value is None:
                    raise OSError(f"key {self.keys[offset]!r} is no longer in {self.name}")
                if self.datum[offset]:
                    return Datum(value).image(value)
                return bytes(value)
        except _lmdb().Error as exc:   # a damaged page: this record is lost, not the pack
            raise OSError(f"{self.name}: LMDB cannot read key {self.keys[offset]!r} ({exc})") from None


def _key_text(key: bytes) -> str:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + key.hex()


def open_lmdb(path: Path, options: SourceOptions) -> Source:
    folder = path if path.is_dir() else path.parent
    if path.is_file() and path.name == "data.mdb":
        path = folder
    env = _Env(path)
    try:
        items, datum_labels = _list(path, env)
    except _lmdb().Error as exc:
        raise SourceError(f"{path}: the LMDB environment is damaged ({exc}); its records cannot be listed — "
                          "restore it, or convert the images again", path=path) from None
    if not items:
        raise SourceError(f"{path} holds no records (besides __metadata__ keys)", path=path)
    return _with_labels(path, folder, items, datum_labels)


def _list(path: Path, env: _Env) -> tuple[list[SourceItem], list[int | None]]:
    """Every record in key order, with its Caffe Datum label when it is one."""
    items: list[SourceItem] = []
    datum_labels: list[int | None] = []
    with env.env.begin(buffers=True) as txn:
        for key, value in txn.cursor():
            key = bytes(key)
            if key.startswith(b"__") and key.endswith(b"__"):
                continue   # converter metadata (often pickled): not a sample, never read
            text = _key_text(key)
            head = bytes(value[:16])
            if is_pickle(head):
                raise SourceError(f"{path}: the value of key {text!r} is a Python pickle; stoker never unpickles "
                                  "(loading a pickle runs whatever code it holds). Re-export the images as their "
                                  f"encoded bytes, one key per image, with labels in {LABELS_FILE} beside "
                                  "data.mdb", path=path)
            label = None
            is_datum = False
            if not is_image(head):
                try:
                    datum = Datum(value)
                    is_datum, label = True, datum.label
                except ValueError:
                    pass   # listed anyway: the packer decodes it, fails, and logs why
            env.keys.append(key)
            env.datum.append(1 if is_datum else 0)
            items.append(SourceItem(key=text, path=None, label=None, offset=len(env.keys) - 1,
                                    size=len(value), store=env))
            datum_labels.append(label)
    return items, datum_labels


def _with_labels(path: Path, folder: Path, items: list[SourceItem], datum_labels: list[int | None]) -> Source:
    skipped: list[dict[str, str]] = []
    classes, label_type, how = None, "none", "unlabelled"
    side = folder / LABELS_FILE
    if side.is_file():
        items, labels, label_type, classes = _side_labels(side, items, skipped)
        how = f"labels from {LABELS_FILE}"
    elif any(v is not None for v in datum_labels):
        labels, label_type, how = [v if v is not None else -1 for v in datum_labels], "int64", "Datum labels"
    elif all("/" in i.key for i in items):
        names = [i.key.split("/", 1)[0] for i in items]
        classes = sorted(set(names))
        index = {n: k for k, n in enumerate(classes)}
        labels, label_type, how = [index[n] for n in names], "int64", "classes from key folders"
    else:
        labels = [None] * len(items)
    items = [replace(i, label=lab) for i, lab in zip(items, labels)]
    return Source(items=items, classes=classes, label_type=label_type, extra_columns={}, root=folder, kind="lmdb",
                  skipped=skipped, description=f"LMDB {path} ({len(items)} records, {how}, "
                                               f"{describe_labels(classes, label_type)})")


def _side_labels(side: Path, items: list[SourceItem], skipped: list[dict[str, str]]) -> tuple:
    by_key: dict[str, tuple[list[str], int]] = {}
    for number, raw in enumerate(read_text(side).splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        if len(text.split(None, 1)) != 2:
            raise SourceError(f"{side} line {number}: expected '<key> <label>', found {text!r}", path=side, line=number)
        key, labels = split_line(text)
        by_key[key] = (labels, number)
    kept = []
    for item in items:
        if item.key in by_key:
            kept.append(item)
        else:
            skipped.append({"key": item.key, "path": item.where(), "reason": f"no label for this key in {side}"})
    if not kept:
        raise SourceError(f"{side} labels none of the environment's keys (first key: {items[0].key!r})", path=side)
    cells = [by_key[i.key][0] for i in kept]
    multi = any(len(c) > 1 for c in cells)
    where = [f"{side} line {by_key[i.key][1]}" for i in kept]
    labels, label_type, classes = type_any_labels([c if multi else c[0] for c in cells], where)
    return kept, labels, label_type, classes
