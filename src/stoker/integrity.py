"""Shard integrity: the one place that checks a shard file against its manifest entry.

Checks, in order: present, a file the dataset may read (no symlink out of it), the manifest's
size in bytes, optionally its SHA-256, readable as Arrow IPC, the base columns and the manifest's
label/extra column types, the manifest's row count. The reader (:func:`open_shard`, at open time),
``stoker verify`` (:func:`check_shard`, every problem reported) and a resumed pack
(:func:`shard_matches`, before trusting a finished shard) all use these.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from .errors import DatasetError, ShardError
from .shards import BASE_COLUMNS, Manifest, ShardInfo, columns_digest
from .storage import StorageBackend

__all__ = ["OpenShard", "ShardProblem", "check_shard", "open_shard", "shard_matches"]

_RESTORE = "restore the shard or re-pack"


@dataclass(frozen=True)
class ShardProblem:
    """What is wrong with one shard: ``what``, expected vs found where that applies, and the fix."""

    shard: str
    what: str
    expected: str = ""
    found: str = ""
    fix: str = _RESTORE

    def error(self, storage: StorageBackend) -> ShardError:
        """The ShardError the reader raises for this problem, naming the shard's full path."""
        where = storage.join(self.shard)
        detail = f" (expected {self.expected}, found {self.found})" if self.expected or self.found else ""
        return ShardError(f"{where}: {self.what}{detail}; {self.fix}", path=where)


@dataclass
class OpenShard:
    """A checked shard, memory-mapped: its record batches are zero-copy views of ``mapping``."""

    info: ShardInfo
    mapping: pa.MemoryMappedFile
    batches: list[pa.RecordBatch]
    identity: tuple[int, ...]

    def close(self) -> None:
        self.batches = []
        self.mapping.close()


def _check_file(storage: StorageBackend, info: ShardInfo, checksum: bool) -> ShardProblem | None:
    """Presence, readability, size and (with ``checksum``) SHA-256, before mapping anything."""
    try:
        size = storage.size(info.file)
    except FileNotFoundError:
        return ShardProblem(info.file, "missing", fix="the manifest lists it; restore it or re-pack")
    except OSError as exc:
        return ShardProblem(info.file, f"cannot read the shard: {exc.strerror or exc}")
    try:
        if storage.in_place:  # a remote shard is checked by its checksum, on its way into the cache
            storage.local_path(info.file)
    except DatasetError as exc:  # e.g. a symlink out of the dataset: "PATH: what; fix"
        what, _, fix = str(exc).split(": ", 1)[-1].partition("; ")
        return ShardProblem(info.file, what, fix=fix or _RESTORE)
    if size != info.bytes:
        return ShardProblem(info.file, f"size is wrong ({'truncated' if size < info.bytes else 'grown'})",
                            f"{info.bytes} bytes", f"{size} bytes")
    if checksum:
        found = storage.sha256(info.file)
        if found != info.sha256:
            return ShardProblem(info.file, "checksum mismatch", f"sha256 {info.sha256}", f"sha256 {found}",
                                fix="the file is damaged — restore it or re-pack")
    return None


#: Field metadata key that marks an Arrow extension type; pyarrow < 14.0.1 unpickled the metadata
#: of "arrow.py_extension_type" fields when reading a file (CVE-2023-47248).
_EXTENSION_KEY = b"ARROW:extension:name"


def _extension_in(field: pa.Field) -> str | None:
    """The extension type name used by ``field`` or any field nested in it, else None."""
    if isinstance(field.type, pa.BaseExtensionType):
        return field.type.extension_name
    if field.metadata and _EXTENSION_KEY in field.metadata:
        return field.metadata[_EXTENSION_KEY].decode("utf-8", "replace")
    kind = field.type
    children = [kind.value_field] if isinstance(kind, (pa.ListType, pa.LargeListType, pa.FixedSizeListType)) \
        else [kind.field(i) for i in range(kind.num_fields)] if isinstance(kind, pa.StructType) else []
    return next((name for name in map(_extension_in, children) if name is not None), None)


def _check_schema(info: ShardInfo, schema: pa.Schema, manifest: Manifest) -> ShardProblem | None:
    """Every column stoker reads has exactly the type stoker writes, and no column anywhere uses an
    Arrow extension type (stoker writes none: one in a shard is an edited or forged file)."""
    for field in schema:
        name = _extension_in(field)
        if name is not None:
            return ShardProblem(info.file, f"column {field.name!r} uses the Arrow extension type {name!r}, "
                                "which stoker never writes; refusing to read it",
                                fix="the shard was not written by stoker — re-pack from the source")
    missing = [c for c in (*BASE_COLUMNS, *manifest.extra_columns) if c not in schema.names]
    if missing:
        return ShardProblem(info.file, f"missing column(s) {missing}; expected a stoker shard")
    expected = manifest.schema()
    for col in (*BASE_COLUMNS, *manifest.extra_columns):
        if schema.field(col).type != expected.field(col).type:
            return ShardProblem(info.file, f"column {col!r} is {schema.field(col).type}, the manifest says "
                                f"{expected.field(col).type}",
                                fix="the manifest or the shard was edited — restore it or re-pack")
    return None


def _check_batches(info: ShardInfo, batches: list[pa.RecordBatch]) -> ShardProblem | None:
    """Structure, then content, of every record batch, before anything reads a value.

    ``validate(full=True)`` checks every offset, length, null count, dictionary index and UTF-8
    string against the buffers: a flipped bit there would otherwise make a read run past the
    mapping (a segfault) or return garbage. It never reads the image bytes, only their offsets, so
    it costs a few microseconds a row (figures: docs/reliability.md). The columns checksum then
    catches a damaged value that is still well formed (a label, a size, a key, an image boundary)."""
    for k, batch in enumerate(batches):
        try:
            batch.validate(full=True)
        except (pa.ArrowException, ValueError) as exc:
            return ShardProblem(info.file, f"record batch {k} is damaged ({exc})",
                                fix="the file is damaged — restore it or re-pack")
    if info.columns_sha256 is not None:
        found = columns_digest(batches)
        if found != info.columns_sha256:
            return ShardProblem(info.file, "the small columns (keys, labels, sizes, encodings, extras, image "
                                "offsets) do not match their checksum", f"sha256 {info.columns_sha256}",
                                f"sha256 {found}", fix="the file is damaged — restore it or re-pack")
    return None


def _check_labels(info: ShardInfo, batches: list[pa.RecordBatch], manifest: Manifest) -> ShardProblem | None:
    """Class indices within the manifest's class list (a min/max over the label column: cheap),
    so an index past it is an error here, not an IndexError (or a wrong class) later."""
    if not manifest.classes or manifest.label_type not in ("int64", "list<int64>"):
        return None
    import pyarrow.compute as pc  # only for datasets with classes; keeps `import stoker` light
    for k, batch in enumerate(batches):
        labels = batch.column("label")
        if pa.types.is_list(labels.type):
            labels = labels.flatten()
        bounds = pc.min_max(labels).as_py()
        if bounds["min"] is not None and not (0 <= bounds["min"] and bounds["max"] < len(manifest.classes)):
            bad = bounds["min"] if bounds["min"] < 0 else bounds["max"]
            return ShardProblem(info.file, f"record batch {k} holds the label {bad}, outside the "
                                f"{len(manifest.classes)} classes the manifest lists", f"0..{len(manifest.classes) - 1}",
                                str(bad), fix="the manifest or the shard was edited — restore it or re-pack")
    return None


def _inspect(storage: StorageBackend, info: ShardInfo, manifest: Manifest,
             checksum: bool) -> tuple[ShardProblem | None, OpenShard | None]:
    problem = _check_file(storage, info, checksum)
    if problem is not None:
        return problem, None
    try:
        mm = storage.memory_map(info.file)
        identity = storage.identity(info.file)
    except OSError as exc:
        return ShardProblem(info.file, f"cannot map the shard: {exc.strerror or exc}"), None
    try:
        reader = pa.ipc.open_file(mm)
        problem = _check_schema(info, reader.schema, manifest)
        batches = [] if problem else [reader.get_batch(k) for k in range(reader.num_record_batches)]
    except (pa.ArrowInvalid, pa.ArrowException, ValueError, OSError) as exc:
        problem, batches = ShardProblem(info.file, f"not a readable Arrow IPC file ({exc})"), []
    rows = sum(b.num_rows for b in batches)
    if problem is None and rows != info.rows:
        problem = ShardProblem(info.file, f"holds {rows} rows, the manifest expects {info.rows}")
    if problem is None:
        problem = _check_batches(info, batches) or _check_labels(info, batches, manifest)
    if problem is not None:
        mm.close()
        return problem, None
    return None, OpenShard(info, mm, batches, identity)


def open_shard(storage: StorageBackend, info: ShardInfo, manifest: Manifest, *, checksum: bool = False) -> OpenShard:
    """Check a shard and map it. Raises ShardError naming the shard and the fix."""
    problem, shard = _inspect(storage, info, manifest, checksum)
    if problem is not None:
        raise problem.error(storage)
    assert shard is not None
    return shard


def check_shard(storage: StorageBackend, info: ShardInfo, manifest: Manifest, *,
                checksum: bool = True) -> ShardProblem | None:
    """Every check (SHA-256 included by default); the first problem found, or None when sound."""
    problem, shard = _inspect(storage, info, manifest, checksum)
    if shard is not None:
        shard.close()
    return problem


def shard_matches(storage: StorageBackend, info: ShardInfo) -> bool:
    """True when the shard file is present with the entry's size and SHA-256 (a resumed pack's
    test for trusting a shard it wrote before the interruption; no manifest exists yet)."""
    return _check_file(storage, info, checksum=True) is None
