"""The source interface: what every input format hands to the packer and the loose reader.

A format is one module with two functions, registered as a ``Format(open, detect)`` line in
``FORMATS`` (``stoker/sources/__init__.py``):

- ``open(path, options) -> Source``: list every sample of ``path`` (a resolved local path) in a
  deterministic order. Listing is cheap: no image is opened. Each sample is a :class:`SourceItem`:
  a ``key`` (unique, stable: the relative posix path or the member/record id), where its encoded
  bytes are (``path``; or ``size`` bytes at ``offset`` inside ``container``; or a record of a
  :class:`RecordStore` such as an LMDB environment, a Parquet file or a gzip stream), its
  ``label`` and its ``extras`` (one value per extra column).
- ``detect(path) -> bool``: True when ``path`` looks like this format (used by ``kind="auto"``).

Labels and columns are declared on the :class:`Source`: ``label_type`` is a manifest type name
("int64", "float64", "string", list types, or "none" for unlabelled data); ``classes`` names the
classes when labels are class indices (:func:`type_labels` turns raw label text into either);
``extra_columns`` maps each extra column to its Arrow type name (see ``stoker.shards.ARROW_TYPES``).

Bad records: anything that makes the listing itself wrong (a missing file, a malformed line, a
duplicate key, labels mixing numbers and names, a pickled LMDB value) raises
:class:`~stoker.errors.SourceError` naming the file and line. A record the listing has to leave out
(a TFRecord checksum failure, a tar damaged part-way, a row without image bytes) goes to
``Source.skipped`` with its reason; the packer writes those to ``skipped.jsonl`` beside the
images it could not read or decode.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol

from ..errors import SourceError
from ..storage.local import open_regular, read_regular

__all__ = ["IMAGE_EXTENSIONS", "SAMPLE_EXTENSIONS", "VIDEO_EXTENSIONS", "RecordStore", "Source", "SourceItem", "SourceOptions", "read_bytes",
           "unencodable_keys"]

#: File name endings (lower case) treated as images when a folder is listed.
IMAGE_EXTENSIONS: frozenset[str] = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
    ".ppm", ".pgm", ".pbm", ".pnm",
})
#: File name endings (lower case) treated as videos: containers FFmpeg (PyAV) reads.
VIDEO_EXTENSIONS: frozenset[str] = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi"})
#: Every ending a folder, tar or listing takes as a sample.
SAMPLE_EXTENSIONS: frozenset[str] = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS


@dataclass(frozen=True)
class SourceItem:
    """One sample as listed: where its bytes are, its label and its extra fields.

    ``key`` is the path relative to the source root (posix), or the member/record id.
    ``path`` is the absolute file path, or None when the bytes sit inside ``container``
    (a tar or TFRecord file) at ``offset`` for ``size`` bytes, or in a ``store`` (a database,
    a table, a compressed file) that reads them from ``(offset, size)`` as it defines them.
    """

    key: str
    path: Path | None
    label: Any
    extras: dict[str, Any] = field(default_factory=dict)
    container: Path | None = None
    offset: int = 0
    size: int = 0
    store: RecordStore | None = None
    #: inode of the file (or container) when it was listed, 0 when not recorded: reading checks
    #: the opened file is still that one (sources that guard a root: folders, tar folders)
    inode: int = 0
    #: label-map files of this sample (one PNG of class ids per pixel), by the extra column that
    #: stores their bytes ("binary"): the packer reads, checks and (with max_side) resizes them
    label_maps: dict[str, Path] = field(default_factory=dict)

    def read(self) -> bytes:
        """The encoded image bytes. Raises OSError when they cannot be read."""
        if self.store is not None:
            return self.store.read(self.offset, self.size)
        return read_bytes(self.path, self.container, self.offset, self.size, inode=self.inode)

    def where(self) -> str:
        """Where the bytes live, for messages: a file path, or container/store and key."""
        if self.path is not None:
            return str(self.path)
        return f"{self.container if self.store is None else self.store.name}:{self.key}"

    def portable(self) -> SourceItem:
        """This item as another process can read it (a Ray worker, `stoker pack --engine ray`).
        A file or a file range stays a path (read there: the workers mount the source); bytes in
        an open store (an LMDB environment, an HDF5 or Parquet file, a decompressed gzip file)
        cannot travel, so they are read here and carry themselves, or the OSError reading raised."""
        if self.store is None:
            return self
        try:
            return replace(self, store=_Carried(self.store.name, self.read(), None))
        except OSError as exc:
            return replace(self, store=_Carried(self.store.name, b"", exc))


@dataclass(frozen=True)
class _Carried:
    """One record's bytes (or the error reading them), read by :meth:`SourceItem.portable`."""

    name: str
    data: bytes
    error: OSError | None

    def read(self, offset: int, size: int) -> bytes:
        if self.error is not None:
            raise self.error
        return self.data


class RecordStore(Protocol):
    """Bytes that are not a plain file range: a record in LMDB, a row of a table, a member of a
    compressed file. Shared by many items and called from pack/loader threads at once."""

    name: str   # for messages: the file or environment the records come from

    def read(self, offset: int, size: int) -> bytes:
        """The bytes of one record (``offset``/``size`` as the store's items define them).
        Raises OSError when they cannot be read."""
        ...


#: Decompressed gzip files kept (in unlinked temporary files on disk, never in memory): the most
#: recent ones, up to this many decompressed bytes, always at least one.
GZIP_CACHE_BYTES = 8 << 30
#: A gzip file may decompress to at most this many times its own size, or GZIP_FLOOR_BYTES,
#: whichever is more. Images (JPEG, PNG) barely compress; a 6 MB file that claims 6 GB is a bomb.
GZIP_MAX_RATIO = 100
GZIP_FLOOR_BYTES = 64 << 20
_GZIP_CHUNK = 1 << 20


class Inflated:
    """One gzip file decompressed, streamed in 1 MiB pieces into an unlinked temporary file
    (``tempfile``'s folder: ``TMPDIR``). ``size`` bytes came out; ``damage`` says why the stream
    stopped early (truncated, corrupt, too large), None when it decompressed whole."""

    def __init__(self, path: Path) -> None:
        import tempfile

        self.path = path
        self.damage: str | None = None
        self.file = tempfile.TemporaryFile(prefix="stoker-gunzip-")
        try:
            self.size = self._inflate()
        except BaseException:
            self.file.close()
            raise

    def _inflate(self) -> int:
        size = 0
        with open_regular(self.path) as raw:
            limit = max(GZIP_FLOOR_BYTES, GZIP_MAX_RATIO * os.fstat(raw.fileno()).st_size)
            try:
                with gzip.GzipFile(fileobj=raw, mode="rb") as fh:
                    while block := fh.read1(_GZIP_CHUNK):   # read1: a damaged end keeps what came before
                        if size + len(block) > limit:
                            self.damage = (f"decompresses to more than {limit:,} bytes ({GZIP_MAX_RATIO}x its size: a "
                                           "decompression bomb, or data that is not images); decompress it "
                                           "yourself (gunzip) and pack the result if it is genuine")
                            break
                        self.file.write(block)
                        size += len(block)
            except (EOFError, gzip.BadGzipFile, zlib.error, ValueError) as exc:
                self.damage = f"the gzip stream is damaged after {size:,} decompressed bytes ({exc})"
            except OSError as exc:   # the temporary folder is full or unwritable
                import tempfile

                raise OSError(exc.errno, f"cannot decompress {self.path} into a temporary file in "
                              f"{tempfile.gettempdir()} ({exc.strerror or exc}); free space there, or set "
                              "TMPDIR to a folder with room") from None
        self.file.flush()
        return size

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self.size:
            why = f" ({self.damage})" if self.damage else ""
            raise OSError(f"cannot decompress {self.path} that far: it gives {self.size:,} bytes{why}, the "
                          f"index wants {size:,} bytes at offset {offset:,}")
        data = os.pread(self.file.fileno(), size, offset)
        if len(data) != size:
            raise OSError(f"{self.path}: short read of its decompressed copy ({len(data)} of {size} bytes)")
        return data

    def open(self) -> BinaryIO:
        """A new file object over the decompressed bytes, at offset 0, with a position of its own
        (positional reads: several may be open at once)."""
        return io.BufferedReader(_Positional(self), _GZIP_CHUNK)

    def fileno(self) -> int:
        return self.file.fileno()

    def skip_record(self, key: str) -> dict[str, str] | None:
        """The ``skipped.jsonl`` line for what could not be decompressed (None: nothing was lost)."""
        if self.damage is None:
            return None
        return {"key": key, "path": str(self.path), "reason": f"{self.damage}; the records after it could not "
                                                              "be read (the ones before it are packed)"}


class _Positional(io.RawIOBase):
    """A read-only, seekable view of an :class:`Inflated` file, reading with ``os.pread``."""

    def __init__(self, content: Inflated) -> None:
        self._content = content   # keeps the temporary file open while this view is in use
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._content.fileno()

    def readinto(self, buffer: Any) -> int:
        data = os.pread(self._content.fileno(), min(len(buffer), max(0, self._content.size - self._pos)), self._pos)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._content.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class GzipMembers:
    """Byte ranges inside the *decompressed* content of gzip files (``.tar.gz``, gzip TFRecord).

    A gzip stream cannot seek, so a whole file is decompressed on first use, streamed into a
    temporary file on disk (memory stays bounded whatever the file claims), and kept while it is
    read: the most recently used files, up to GZIP_CACHE_BYTES (at least one). Listing fills the
    same cache, and items are read in near source order, so each file is decompressed once or
    twice per pack.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.name = str(path)

    def read(self, offset: int, size: int) -> bytes:
        return inflated(self.path).read(offset, size)


class _DecompressedCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[str, int, int], Inflated] = OrderedDict()

    def get(self, path: Path) -> Inflated:
        st = os.stat(path)   # a file rewritten in place is decompressed afresh
        key = (str(path), st.st_mtime_ns, st.st_size)
        with self._lock:  # one decompression per file, even when many threads ask at once
            done = self._files.get(key)
            if done is None:
                done = self._files[key] = Inflated(Path(path))
            self._files.move_to_end(key)
            total = sum(v.size for v in self._files.values())
            while len(self._files) > 1 and total > GZIP_CACHE_BYTES:
                # dropped, not closed: a reader holding it keeps its descriptor until done
                total -= self._files.popitem(last=False)[1].size
            return done

    def clear(self) -> None:
        with self._lock:
            self._files.clear()


_GZIP_CACHE = _DecompressedCache()


def forget_decompressed() -> None:
    """Drop every decompressed gzip file kept (benchmarks: each run pays its own)."""
    _GZIP_CACHE.clear()


def inflated(path: Path) -> Inflated:
    """The decompressed content of a gzip file, shared with :class:`GzipMembers` (listing a file
    and then packing it decompresses it once while it fits in GZIP_CACHE_BYTES)."""
    return _GZIP_CACHE.get(Path(path))


def read_bytes(path: Path | str | None, container: Path | str | None = None,
               offset: int = 0, size: int = 0, *, inode: int = 0) -> bytes:
    """Read a sample's bytes from a file, or ``size`` bytes at ``offset`` inside a container.

    Only regular files are read, checked on the opened descriptor (a FIFO or a device listed as
    an image is an OSError at once, never a hang), and never more than the file's size when it
    was opened (see :func:`stoker.storage.local.read_regular`); ``inode`` (not 0) must be the
    opened file's."""
    if path is not None:
        return read_regular(path, inode=inode)
    if container is None:
        raise ValueError("a source item needs a path or a container")
    return read_regular(container, offset, size, inode=inode)


@dataclass
class Source:
    """Samples in a deterministic order, with what the shards need to know about labels."""

    items: list[SourceItem]
    classes: list[str] | None   # class names when labels are class indices
    label_type: str             # "int64", "float64", "string", "none" (as Manifest.label_type)
    extra_columns: dict[str, str]   # name -> Arrow type string
    root: Path
    description: str            # e.g. "ImageFolder /data/train (1000 classes)"
    kind: str = "folder"
    #: records refused while listing (a checksum mismatch, an unreadable member), each
    #: {"key", "path", "reason"}; the packer adds them to ``skipped.jsonl``.
    skipped: list[dict[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class SourceOptions:
    """Options a format may use. ``root``: the folder that keys of a list or table are made
    relative to (None: the list's own folder, with absolute paths kept whole).
    ``label_column``/``path_column``: column names in a table (``label_column=None``: unlabelled);
    ``mask_column``: a table column of label-map paths (PNG of class ids), stored as a binary column;
    ``label_column`` and ``image_column`` also name the fields of records (Hugging Face
    columns, TFRecord features, HDF5 datasets, WebDataset JSON fields); None: the format's default."""

    root: Path | None = None
    label_column: str | None = "label"
    path_column: str = "path"
    image_column: str | None = None
    mask_column: str | None = None


# ---------------------------------------------------------------- helpers shared by formats

def optional_module(name: str, extra: str, needed_for: str) -> Any:
    """Import an optional reader library, or raise a SourceError saying which extra installs it."""
    import importlib
    try:
        return importlib.import_module(name)
    except ImportError:
        raise SourceError(f"{needed_for} needs the {name} package; run: pip install 'stoker[{extra}]'") from None


def is_sample_name(name: str) -> bool:
    """A visible file whose ending is in SAMPLE_EXTENSIONS (an image or a video)."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in SAMPLE_EXTENSIONS


def scandir(folder: Path) -> list[os.DirEntry]:
    """The entries of ``folder``; unreadable folders are a SourceError naming it."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except PermissionError:
        raise SourceError(f"cannot read folder {folder}: permission denied; fix its permissions "
                          "or pack a folder you can read", path=folder) from None
    except OSError as exc:
        raise SourceError(f"cannot read folder {folder}: {exc.strerror or exc}", path=folder) from None


def inside(root: Path, real: str) -> bool:
    """True when the real path ``real`` is ``root`` or below it."""
    return real == str(root) or real.startswith(str(root).rstrip(os.sep) + os.sep)


def make_key(root: Path, path: Path) -> str:
    """A sample key: ``path`` relative to ``root``, in posix form."""
    return PurePosixPath(*path.relative_to(root).parts).as_posix()


def require_items(items: list[SourceItem], what: str, path: Path) -> None:
    """Refuse a source that lists no image at all."""
    if not items:
        raise SourceError(f"no images found in {what} {path} (looked for "
                          f"{', '.join(sorted(SAMPLE_EXTENSIONS))}); check the path", path=path)


def read_text(path: Path) -> str:
    """A UTF-8 text file (BOM allowed); unreadable or non-UTF-8 files are a SourceError."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except PermissionError:
        raise SourceError(f"cannot read {path}: permission denied", path=path) from None
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}", path=path) from None


def is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _check_not_mixed(raw: Sequence[str], where: Sequence[str] | None) -> None:
    """Refuse labels that mix numbers and names: remapping them silently would hide a typo."""
    numeric = [is_number(v) for v in raw]
    if all(numeric) or not any(numeric):
        return
    i, j = numeric.index(True), numeric.index(False)
    name = (lambda k: where[k]) if where is not None else (lambda k: f"entry {k + 1}")
    raise SourceError(f"{name(j)}: label {raw[j]!r} is a name while {name(i)} has the number {raw[i]!r}; "
                      "use class names everywhere or numbers everywhere")


INT64_RANGE = (-(1 << 63), (1 << 63) - 1)


def _check_int64(labels: Sequence[int], raw: Sequence[str], where: Sequence[str] | None) -> None:
    """Refuse an integer label that a 64-bit label column cannot hold."""
    lo, hi = INT64_RANGE
    for k, v in enumerate(labels):
        if not lo <= v <= hi:
            name = where[k] if where is not None else f"entry {k + 1}"
            raise SourceError(f"{name}: label {raw[k]!r} does not fit in a 64-bit integer "
                              f"({lo} to {hi}); fix the label on that line")


def unencodable_keys(items: Sequence[SourceItem]) -> tuple[list[SourceItem], list[dict[str, str]]]:
    """(items kept, skip records) where an item whose key is not valid UTF-8 text (a file name
    with bytes that are not UTF-8, kept by Python as surrogates) is skipped: a shard's key column
    is UTF-8, and one such name must cost that file, not the pack."""
    kept: list[SourceItem] = []
    skipped: list[dict[str, str]] = []
    for item in items:
        try:
            item.key.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(item.key).decode("utf-8", "backslashreplace")
            skipped.append({"key": shown, "path": os.fsencode(item.where()).decode("utf-8", "backslashreplace"),
                            "reason": f"the name {shown} is not valid UTF-8; rename the file to pack it"})
        else:
            kept.append(item)
    return kept, skipped


def type_labels(raw: Sequence[str], where: Sequence[str] | None = None) -> tuple[list[Any], str, list[str] | None]:
    """(labels, label_type, classes): integers stay integers, numbers become floats, anything
    else is a class name (classes sorted, labels their indices). Numbers mixed with names are a
    SourceError naming both entries; ``where[i]`` describes entry i ("train.txt line 3")."""
    _check_not_mixed(raw, where)
    for parse, label_type in ((int, "int64"), (float, "float64")):
        try:
            labels = [parse(v) for v in raw]
        except ValueError:
            continue
        if label_type == "int64":
            _check_int64(labels, raw, where)
        return labels, label_type, None
    classes = sorted(set(raw))
    index = {name: i for i, name in enumerate(classes)}
    return [index[v] for v in raw], "int64", classes


def type_label_lists(raw: Sequence[Sequence[str]],
                     where: Sequence[str] | None = None) -> tuple[list[list[Any]], str, list[str] | None]:
    """Multi-label version of :func:`type_labels`: each sample has a list of labels (maybe empty).
    Gives "list<int64>" (indices, with ``classes`` when the labels were names) or "list<float64>"."""
    flat = [v for values in raw for v in values]
    owner = [where[i] for i, values in enumerate(raw) for _ in values] if where is not None else None
    labels, label_type, classes = type_labels(flat, owner)
    out, pos = [], 0
    for values in raw:
        out.append(labels[pos:pos + len(values)])
        pos += len(values)
    return out, f"list<{label_type}>", classes


def split_label_cell(text: str, where: str) -> list[str] | None:
    """The labels in one table cell when it holds several: a JSON list (``[1, 3, 7]``,
    ``["cat", "dog"]``) or numbers separated by spaces (``1 3 7``); None for one label
    (a class name may hold spaces: ``golden retriever``)."""
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{where}: label {text!r} starts like a JSON list but is not one ({exc.msg})") from None
        except RecursionError:
            raise SourceError(f"{where}: label starts like a JSON list but is nested too deeply to be one") from None
        if not isinstance(values, list) or any(isinstance(v, (list, dict)) for v in values):
            raise SourceError(f"{where}: label {text!r} must be a flat JSON list of numbers or names")
        return [str(v) for v in values]
    parts = text.split()
    if len(parts) > 1 and all(is_number(p) for p in parts):
        return parts
    return None


def type_any_labels(cells: Sequence[str | list[str]],
                    where: Sequence[str] | None = None) -> tuple[list[Any], str, list[str] | None]:
    """Type labels where each entry is one label (a string) or several (a list): when any entry
    is a list, every entry becomes one (multi-label, "list<...>"), else as :func:`type_labels`."""
    if any(isinstance(c, list) for c in cells):
        return type_label_lists([c if isinstance(c, list) else [c] for c in cells], where)
    return type_labels(cells, where)  # type: ignore[arg-type]


def check_unique(keys: Iterable[tuple[str, int]], listing: Path) -> None:
    """Refuse a key listed twice; ``keys`` are (key, line number) pairs."""
    first: dict[str, int] = {}
    for key, line in keys:
        if key in first:
            raise SourceError(f"{listing} line {line}: {key!r} is already listed on line {first[key]}; "
                              "each image may appear once", path=listing, line=line)
        first[key] = line


class ListedPaths:
    """Resolve the paths a user's own list or table names, and derive their keys.

    A list is trusted input (the user wrote it), so there is no traversal guard here: absolute
    paths are used as they are and relative ones resolve against ``base`` (the list's folder, or
    ``root``). Keys are relative to ``root`` when one is given (a path outside it then has no
    key: a SourceError naming the line); without one, relative to the list's folder for files
    under it, else the absolute path.
    Archives downloaded from elsewhere (tars) keep their guard in their own module.
    """

    def __init__(self, base: Path, listing: Path, root: Path | None) -> None:
        self.base = base
        self.listing = listing
        self.root = root

    def __call__(self, text: str, line: int) -> tuple[str, Path]:
        candidate = Path(text).expanduser()
        full = Path(os.path.normpath(candidate if candidate.is_absolute() else self.base / candidate))
        if self.root is None:
            key = make_key(self.base, full) if inside(self.base, str(full)) else full.as_posix()
            return key, full
        if not inside(self.root, str(full)):
            raise SourceError(f"{self.listing} line {line}: path {text!r} is not under the root {self.root} "
                              "that keys are made relative to; pass a root that holds every listed file "
                              "(--root / root=), or none to keep the paths as written",
                              path=self.listing, line=line)
        return make_key(self.root, full), full


def listing_root(listing: Path, options: SourceOptions, kind: str) -> tuple[Path, Path | None]:
    """(base, root) for a list or table: relative paths resolve against ``base`` (``root`` when
    given, else the list's folder); ``root`` (or None) is what keys are relative to."""
    if not listing.is_file():
        raise SourceError(f"{kind} source {listing} is not a file", path=listing)
    if options.root is None:
        return listing.parent, None
    root = Path(options.root).expanduser().resolve()
    if not root.is_dir():
        raise SourceError(f"root {root} is not a folder; pass an existing folder (--root / root=)", path=root)
    return root, root


def describe_labels(classes: list[str] | None, label_type: str) -> str:
    return f"{len(classes)} classes" if classes else f"{label_type} labels"
