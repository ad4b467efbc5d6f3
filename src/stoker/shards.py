"""The on-disk format: a manifest (``stoker.json``) and Arrow IPC shard files.

A packed dataset is a directory::

    stoker.json          format version, schema, classes, sample count, one entry per shard
    shard-00000.arrow    Arrow IPC *file* format (random access, memory-mappable), uncompressed

Columns: ``key`` (string), ``image`` (large_binary), ``encoding`` (dictionary string),
``height``/``width`` (int32, of what is stored), ``label`` (typed), then extra user columns.
Any Arrow reader (pyarrow, pandas, polars, DuckDB) can open a shard. Nothing is pickled.

Crash safety: a shard is written under a temporary dot-name, fsynced, then renamed; the
manifest is written the same way, last. A directory without a manifest is never a dataset.
Every file goes through :mod:`stoker.storage`; nothing here opens a path itself.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from . import __version__
from .errors import ConfigError, IncompletePackError, ManifestError
from .storage import ShardSink, StorageBackend, as_storage, file_sha256

__all__ = ["ARROW_TYPES", "BASE_COLUMNS", "LABEL_TYPES", "MANIFEST_NAME", "Manifest", "ShardInfo", "ShardWriter",
           "file_sha256", "looks_like_partial_pack", "read_manifest", "shard_name", "shard_schema",
           "write_manifest"]

MANIFEST_NAME = "stoker.json"
FORMAT_VERSION = 1
#: File names a manifest may list: plain names inside the dataset directory, never a path.
SHARD_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.arrow")

#: Label and extra-column types stoker writes, by the name used in the manifest.
ARROW_TYPES: dict[str, pa.DataType] = {
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "string": pa.string(),
    "list<int64>": pa.list_(pa.int64()),
    "list<float64>": pa.list_(pa.float64()),
    "list<string>": pa.list_(pa.string()),   # several texts per sample: an image's captions
    "binary": pa.large_binary(),   # encoded bytes beside the image: a label-map PNG (a CSV's --mask-column)
}
#: "none" means the dataset has no labels; the label column then holds -1 (int64).
LABEL_TYPES = (*ARROW_TYPES, "none")
BASE_COLUMNS = ("key", "image", "encoding", "height", "width", "label")


def arrow_type(name: str) -> pa.DataType:
    """The Arrow type for a manifest type name ("none" labels are stored as int64 -1)."""
    if name == "none":
        return pa.int64()
    try:
        return ARROW_TYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported column type {name!r}; expected one of {sorted(LABEL_TYPES)}") from None


def shard_name(index: int) -> str:
    """File name of shard ``index``: ``shard-00000.arrow``."""
    return f"shard-{index:05d}.arrow"


@dataclass
class ShardInfo:
    """One finished shard: its file name, row count, size in bytes, SHA-256, and the SHA-256 of its
    small columns (:func:`columns_digest`; None in manifests written before it existed)."""

    file: str
    rows: int
    bytes: int
    sha256: str
    columns_sha256: str | None = None


@dataclass
class Manifest:
    """Contents of ``stoker.json``."""

    num_samples: int
    shards: list[ShardInfo]
    classes: list[str] | None = None
    label_type: str = "int64"
    extra_columns: dict[str, str] = field(default_factory=dict)
    pack_options: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    created_by: str = f"stoker {__version__}"

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        obj["format"] = "stoker"
        for entry in obj["shards"]:
            if entry["columns_sha256"] is None:
                del entry["columns_sha256"]
        return obj

    @classmethod
    def from_json(cls, obj: Any, path: str | Path) -> "Manifest":
        """Validate a parsed manifest; every problem is a ManifestError naming the field."""
        def bad(what: str) -> ManifestError:
            return ManifestError(f"{path}: {what}; the manifest is damaged — re-pack, or restore it "
                                 "from a backup", path=path)

        if not isinstance(obj, dict) or obj.get("format") != "stoker":
            raise bad('expected a JSON object with "format": "stoker"')
        version = obj.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise bad(f"format_version must be a positive integer, found {version!r}")
        if version > FORMAT_VERSION:
            raise ManifestError(f"{path}: format version {version} is newer than this stoker understands "
                                f"({FORMAT_VERSION}); upgrade stoker", path=path)
        shards_raw = obj.get("shards")
        if not isinstance(shards_raw, list):
            raise bad("'shards' must be a list")
        shards = []
        for i, entry in enumerate(shards_raw):
            if not isinstance(entry, dict):
                raise bad(f"shards[{i}] must be an object")
            name, rows, size, sha, cols = (entry.get(k) for k in ("file", "rows", "bytes", "sha256",
                                                                   "columns_sha256"))
            if not isinstance(name, str) or not SHARD_NAME_RE.fullmatch(name):
                raise bad(f"shards[{i}].file {name!r} is not a plain shard file name (no paths allowed)")
            if not (isinstance(rows, int) and rows >= 0 and isinstance(size, int) and size >= 0):
                raise bad(f"shards[{i}] ({name}) needs non-negative integer rows and bytes")
            if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
                raise bad(f"shards[{i}] ({name}) has no valid sha256")
            if cols is not None and not (isinstance(cols, str) and re.fullmatch(r"[0-9a-f]{64}", cols)):
                raise bad(f"shards[{i}] ({name}) has an invalid columns_sha256")
            shards.append(ShardInfo(name, rows, size, sha, cols))
        if len({s.file for s in shards}) != len(shards):
            raise bad("a shard file is listed twice")
        num = obj.get("num_samples")
        if not isinstance(num, int) or num != sum(s.rows for s in shards):
            raise bad(f"num_samples is {num!r} but the shards hold {sum(s.rows for s in shards)} rows")
        label_type = obj.get("label_type", "int64")
        if label_type not in LABEL_TYPES:
            raise bad(f"label_type {label_type!r} is not one of {list(LABEL_TYPES)}")
        classes = obj.get("classes")
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise bad("classes must be a list of strings or null")
        extras = obj.get("extra_columns", {})
        if not isinstance(extras, dict) or any(t not in ARROW_TYPES for t in extras.values()):
            raise bad(f"extra_columns must map names to one of {sorted(ARROW_TYPES)}")
        if set(extras) & set(BASE_COLUMNS):
            raise bad(f"extra_columns may not reuse a base column name {BASE_COLUMNS}")
        pack_options = obj.get("pack_options") or {}
        if not isinstance(pack_options, dict):
            raise bad(f"pack_options must be an object, found {type(pack_options).__name__}")
        return cls(num_samples=num, shards=shards, classes=classes, label_type=label_type,
                   extra_columns=dict(extras), pack_options=dict(pack_options),
                   format_version=version, created_by=str(obj.get("created_by", "")))

    def schema(self) -> pa.Schema:
        return shard_schema(self.label_type, self.extra_columns)


def shard_schema(label_type: str, extra_columns: dict[str, str]) -> pa.Schema:
    """Arrow schema of a shard with this label type and these extra columns."""
    fields = [
        pa.field("key", pa.string(), nullable=False),
        pa.field("image", pa.large_binary(), nullable=False),
        pa.field("encoding", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("label", arrow_type(label_type)),
    ]
    for name, type_name in extra_columns.items():
        if name in BASE_COLUMNS:
            raise ConfigError(f"extra column {name!r} clashes with a base column {BASE_COLUMNS}; rename it")
        fields.append(pa.field(name, arrow_type(type_name)))
    return pa.schema(fields)


def _digest_array(digest: Any, arr: pa.Array, values: bool = True) -> None:
    """Feed one array's logical content to ``digest``: validity, offsets made relative to the
    first, values (``values=False``: offsets only, for the image column). Independent of how the
    buffers are laid out in the file (padding, slicing, dictionary deltas), so the writer's batch
    and the same batch read back digest alike."""
    def feed(data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else data
        digest.update(struct.pack("<q", len(view)))
        digest.update(view)

    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary.take(arr.indices)
    nulls = arr.null_count
    feed(np.packbits(arr.is_valid().to_numpy(zero_copy_only=False)) if nulls else b"")
    kind = arr.type
    if (pa.types.is_binary(kind) or pa.types.is_string(kind) or pa.types.is_large_binary(kind)
            or pa.types.is_large_string(kind) or pa.types.is_list(kind)):
        wide = pa.types.is_large_binary(kind) or pa.types.is_large_string(kind)
        offsets = np.frombuffer(arr.buffers()[1], np.int64 if wide else np.int32)[arr.offset: arr.offset + len(arr) + 1]
        start, end = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
        feed((offsets - start).astype(np.int64))
        if not values:
            return
        if pa.types.is_list(kind):
            _digest_array(digest, arr.values.slice(start, end - start))
        else:
            data = arr.buffers()[2]
            feed(memoryview(data)[start:end] if data is not None else b"")
    elif pa.types.is_boolean(kind):
        feed(arr.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint8))
    else:  # fixed-width numbers; what lies under a null slot is not data
        feed(arr.fill_null(0).to_numpy(zero_copy_only=False) if nulls else arr.to_numpy(zero_copy_only=False))


def add_to_columns_digest(digest: Any, batch: pa.RecordBatch) -> None:
    """Feed one record batch to a shard's :func:`columns_digest` (the writer streams batches)."""
    if batch.num_rows:
        for name, column in zip(batch.schema.names, batch.columns):
            digest.update(name.encode())
            # encoded bytes (the image, label-map PNGs) digest by offsets only, as the image column
            encoded = pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
            _digest_array(digest, column, values=name != "image" and not encoded)


def columns_digest(batches: list[pa.RecordBatch]) -> str:
    """SHA-256 of a shard's small columns: every column but the image bytes, plus the image
    column's offsets (where each image starts and ends). Reading it costs a few bytes a row, so
    the reader checks it at every open: a damaged key, label, size, encoding or extra value, or a
    shifted image boundary, is an error instead of silently different data. Batches must have
    passed ``validate(full=True)`` first."""
    digest = hashlib.sha256()
    for batch in batches:
        add_to_columns_digest(digest, batch)
    return digest.hexdigest()


def write_manifest(out: str | Path | StorageBackend, manifest: Manifest) -> None:
    """Write ``stoker.json`` atomically; call it last, after every shard is in place."""
    payload = json.dumps(manifest.to_json(), indent=1, sort_keys=False).encode() + b"\n"
    as_storage(out).write_atomic(MANIFEST_NAME, payload)


def looks_like_partial_pack(directory: str | Path | StorageBackend) -> bool:
    """True when a directory holds shard or journal files but no manifest."""
    try:
        names = as_storage(directory).list()
    except OSError:
        return False
    # stoker's own names only: another tool's .arrow files (a Hugging Face save_to_disk) are no pack of ours
    return any(fnmatch.fnmatch(n, "shard-*.arrow") or fnmatch.fnmatch(n, ".shard-*.arrow.tmp")
               or n.startswith(".stoker-pack") for n in names)


def _partial_contents(storage: StorageBackend) -> str:
    """What an unfinished pack left: its shards and/or its journal (killed before the first shard)."""
    names = storage.list()
    shards = sum(n.endswith(".arrow") for n in names)
    parts = [f"{shards} shard(s)"] if shards else []
    if any(n.startswith(".stoker-pack") for n in names):
        parts.append("its journal")
    return " and ".join(parts) or "a half-written shard"


def read_manifest(dataset: str | Path | StorageBackend) -> Manifest:
    """Read and validate ``stoker.json``. Raises ManifestError or IncompletePackError (and
    UnsupportedStorageError for a URL no backend serves)."""
    storage = as_storage(dataset)
    dataset_dir = storage.location
    path = storage.join(MANIFEST_NAME)
    try:  # read first: over plain HTTP(S) a dataset is its files, with no folder to look at
        raw = storage.read_bytes(MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError):
        if not storage.is_dir():
            raise ManifestError(f"{dataset_dir}: no such dataset directory", path=dataset_dir) from None
        if looks_like_partial_pack(storage):
            raise IncompletePackError(
                f"{dataset_dir}: the pack did not finish ({_partial_contents(storage)} but no {MANIFEST_NAME}); "
                "run `stoker pack SRC OUT --resume` to complete it", path=dataset_dir) from None
        if storage.exists("dataset_info.json") or storage.exists("dataset_dict.json"):
            raise ManifestError(f"{dataset_dir}: a Hugging Face dataset (save_to_disk), not a stoker pack; pack it "
                                f"once with `stoker pack {dataset_dir} OUT` (add --image-column / --label-column "
                                "if its columns are not image / label), then load OUT", path=dataset_dir) from None
        raise ManifestError(f"{dataset_dir}: not a stoker dataset (no {MANIFEST_NAME}); "
                            "create one with `stoker pack SRC OUT`", path=dataset_dir) from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest: {exc.strerror or exc}", path=path) from None
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc}); the manifest is damaged — re-pack, "
                            "or restore it from a backup", path=path) from None
    except RecursionError:  # thousands of nested brackets: no manifest stoker writes
        raise ManifestError(f"{path}: JSON nested too deeply to be a stoker manifest; the manifest is damaged "
                            "— re-pack, or restore it from a backup", path=path) from None
    return Manifest.from_json(obj, path)


class _HashingSink(io.RawIOBase):
    """A write-only file that hashes (SHA-256) and counts what passes through to ``fh``."""

    def __init__(self, fh: ShardSink) -> None:
        super().__init__()
        self.fh = fh
        self.digest = hashlib.sha256()
        self.size = 0
        self._closing = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        if not self._closing:
            self.fh.flush()

    def close(self) -> None:
        # Closing the wrapper never flushes the shard file: IOBase's finalizer closes it at garbage
        # collection, when the ShardWriter may have committed or aborted the file long ago (Python 3.13
        # printed "Exception ignored ... flush of closed file" once per shard).
        self._closing = True
        super().close()


class ShardWriter:
    """Writes one shard: rows are buffered and streamed to a temporary file as Arrow record
    batches of about ``batch_bytes`` of image data, hashed on the way; :meth:`finish` closes,
    fsyncs and renames it. Streaming keeps memory bounded and lets a packer's workers go on
    decoding while the shard is being written, instead of waiting for one big write at the end.
    ``out`` is the dataset folder or its :class:`~stoker.storage.StorageBackend`.
    """

    def __init__(self, out: str | Path | StorageBackend, index: int, *, label_type: str = "int64",
                 extra_columns: dict[str, str] | None = None, batch_bytes: int = 32 * 2**20) -> None:
        self.storage = as_storage(out)
        self.name = shard_name(index)
        self.label_type = label_type
        self.extra_columns = dict(extra_columns or {})
        self.schema = shard_schema(label_type, self.extra_columns)
        self.batch_bytes = batch_bytes
        self._reset()

    def _reset(self) -> None:
        self._columns: dict[str, list[Any]] = {name: [] for name in self.schema.names}
        self._buffered = 0  # image bytes not yet written
        self._nbytes = 0  # image bytes added to this shard
        self._rows = 0
        self._file: ShardSink | None = None
        self._sink: _HashingSink | None = None
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        # The encoding dictionary only grows within a shard: the IPC file format allows dictionary
        # deltas across record batches but not replacements (a later batch bringing "png" after an
        # all-"jpeg" batch would otherwise fail to write).
        self._encodings: dict[str, int] = {}
        self._columns_digest = hashlib.sha256()  # see columns_digest()

    @property
    def nbytes(self) -> int:
        """Image bytes added so far; the packer starts a new shard past its target size."""
        return self._nbytes

    @property
    def rows(self) -> int:
        return self._rows

    def add(self, key: str, image: bytes, encoding: str, height: int, width: int,
            label: Any, extras: dict[str, Any] | None = None) -> None:
        """Append one sample. ``label`` None is stored as -1 for label type "none"."""
        extras = extras or {}
        cols = self._columns
        cols["key"].append(key)
        cols["image"].append(image)
        cols["encoding"].append(encoding)
        cols["height"].append(height)
        cols["width"].append(width)
        cols["label"].append(-1 if self.label_type == "none" else label)
        for name in self.extra_columns:
            cols[name].append(extras.get(name))
        self._nbytes += len(image)
        self._buffered += len(image)
        self._rows += 1
        if self._buffered >= self.batch_bytes:
            self._write_batch()

    def _open(self) -> None:
        self._file = self.storage.open_shard_sink(self.name)
        self._sink = _HashingSink(self._file)
        self._writer = pa.ipc.new_file(pa.PythonFile(self._sink, mode="w"), self.schema,
                                       options=pa.ipc.IpcWriteOptions(emit_dictionary_deltas=True))

    def _write_batch(self) -> None:
        if not self._columns["key"]:
            return
        arrays = []
        for fld in self.schema:
            values = self._columns[fld.name]
            if fld.name == "encoding":
                arrays.append(self._encoding_array(values))
            else:
                arrays.append(pa.array(values, fld.type))
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        try:
            if self._writer is None:
                self._open()
            self._writer.write_batch(batch)
            add_to_columns_digest(self._columns_digest, batch)
        except BaseException:
            self.abort()
            raise
        self._columns = {name: [] for name in self.schema.names}
        self._buffered = 0

    def _encoding_array(self, values: list[str]) -> pa.DictionaryArray:
        codes = self._encodings
        indices = [codes.setdefault(v, len(codes)) for v in values]
        if len(codes) > 127:
            raise ConfigError(f"shard {self.name}: more than 127 distinct encodings; expected a few "
                              "(jpeg, png, webp, raw)")
        return pa.DictionaryArray.from_arrays(pa.array(indices, pa.int8()), pa.array(list(codes), pa.string()))

    def finish(self) -> ShardInfo:
        """Write what is buffered, close, fsync and rename; return the manifest entry."""
        try:
            self._write_batch()
            if self._writer is None:  # no rows at all: still a valid, empty shard
                self._open()
            self._writer.close()
            assert self._file is not None and self._sink is not None
            self._sink.close()
            info = ShardInfo(self.name, self._rows, self._sink.size, self._sink.digest.hexdigest(),
                             self._columns_digest.hexdigest())
            self._file.commit()
        except BaseException:
            self.abort()
            raise
        self._reset()
        return info

    def abort(self) -> None:
        """Drop buffered rows, close and remove the temporary file, if any."""
        try:
            if self._writer is not None:
                self._writer.close()
        except Exception:  # already broken; removing the file is what matters
            pass
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:  # a flush into a broken file; removing it is what matters
                pass
        if self._file is not None:
            self._file.abort()
        self._reset()
