"""Object storage through fsspec: s3://, gs://, az://, https:// and any other URL fsspec knows.

Reading: small files (the manifest) are fetched whole; shards are fetched whole, in large ranges,
into a bounded local cache (:class:`~stoker.storage.cache.ShardCache`) and verified against the
manifest's SHA-256 before anything maps them. Writing (``stoker pack SRC s3://...``): every object
is uploaded complete (a shard from a local temporary file, on commit), so nothing half-written is
ever visible under a final name; the manifest goes last. Credentials come from each backend's
usual environment and config files (or ``storage_options``); stoker never stores any.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa

from ..errors import ConfigError, DatasetError, ShardError, UnsupportedStorageError
from .base import ShardSink, StorageBackend
from .._system import parse_size
from .cache import ShardCache, ShardEntry
from .local import TempFileSink, file_sha256
from .lock import DirectoryLock

INSTALL_HINT = "pip install 'stoker[remote]'"
#: Schemes served locally by other backends, or that fsspec knows but cannot hold a dataset.
_NOT_REMOTE = {"file", "local", "memory", "cached", "filecache", "simplecache", "blockcache", "reference",
               "zip", "tar", "libarchive", "jupyter", "dask", "dir"}
DEFAULT_CACHE_LIMIT = "50GB"


def fsspec_module() -> Any:
    try:
        import fsspec
    except ImportError:
        raise UnsupportedStorageError(f"reading or writing URLs needs fsspec: {INSTALL_HINT}") from None
    return fsspec


def serves(scheme: str) -> bool:
    """True when fsspec knows `scheme` as an object store or remote file system."""
    if scheme in _NOT_REMOTE:
        return False
    try:
        import fsspec
    except ImportError:
        return False
    return scheme in fsspec.available_protocols()


def default_cache_dir(url: str) -> Path:
    """Where shards of `url` are cached when no cache_dir is given: $STOKER_CACHE, else
    $XDG_CACHE_HOME/stoker or ~/.cache/stoker, one folder per dataset URL."""
    root = os.environ.get("STOKER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stoker")
    return Path(root) / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


class _UploadSink(TempFileSink):
    """A shard streamed into a local temporary file, uploaded whole on commit."""

    def __init__(self, storage: "RemoteStorage", name: str) -> None:
        self._storage, self._name = storage, name
        fd, tmp = tempfile.mkstemp(prefix=f"stoker-upload-{name}.", suffix=".tmp")
        super().__init__(Path(tmp), os.fdopen(fd, "wb"))

    def commit(self) -> None:
        self._close(fsync=False)  # the upload, not this file, is what must last
        try:
            self._storage.fs.put_file(str(self.tmp), self._storage.path(self._name))
        finally:
            self.tmp.unlink(missing_ok=True)


class RemoteStorage(StorageBackend):
    """A dataset under a URL prefix, through fsspec. Shards are read through a local cache (made
    by :meth:`open_cache` once the manifest is known), written by whole-object uploads.

    `storage_options` go to the fsspec file system (e.g. ``{"anon": True}``, ``{"endpoint_url": ...}``
    for an S3-compatible store). `cache_dir` (default: see :func:`default_cache_dir`) holds at most
    `cache_limit` bytes of shards ("50GB", "512MiB" or an int)."""

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | Path | None = None, cache_limit: int | str = DEFAULT_CACHE_LIMIT) -> None:
        fsspec = fsspec_module()
        self.location = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.location, **dict(storage_options or {}))
        except ImportError as exc:  # the backend package for this scheme (s3fs, gcsfs, adlfs, ...)
            raise UnsupportedStorageError(
                f"{url}: {exc} ({INSTALL_HINT} brings fsspec and s3fs for s3://; other stores need their "
                "fsspec package beside it: gcsfs for gs://, adlfs for az://)", location=url) from None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{url}: cannot open this URL with fsspec: {exc}") from None
        self.root = self.root.rstrip("/")
        self.in_place = False
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(self.location)
        self.cache_limit = parse_size(cache_limit)
        self._cache: ShardCache | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteStorage({self.location!r}, cache_dir={str(self.cache_dir)!r})"

    # ---- names -------------------------------------------------------------------------------
    def path(self, name: str) -> str:
        """The file system path (no scheme) of `name`."""
        return f"{self.root}/{name}"

    def join(self, name: str) -> str:
        return f"{self.location}/{name}"

    # ---- reading -----------------------------------------------------------------------------
    def is_dir(self) -> bool:
        self.fs.invalidate_cache(self.root)
        try:
            return bool(self.fs.isdir(self.root))
        except FileNotFoundError:
            return False

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache(self.root)
        return bool(self.fs.exists(self.path(name)))

    def size(self, name: str) -> int:
        self.fs.invalidate_cache(self.root)
        return int(self.fs.info(self.path(name))["size"])

    def list(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:  # object stores have no empty folders: a prefix without objects
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in paths)

    def read_bytes(self, name: str) -> bytes:
        self.fs.invalidate_cache(self.root)   # a listing cached earlier must not hide a newer object
        try:
            return bytes(self.fs.cat_file(self.path(name)))
        except OSError:
            raise
        except Exception as exc:  # a backend's own error type (aiohttp's for an HTTP 403): an OSError to callers
            raise OSError(f"{type(exc).__name__}: {exc}") from exc

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `name`: one ranged GET on object stores."""
        return bytes(self.fs.cat_file(self.path(name), start=start, end=end))

    def sha256(self, name: str) -> str:
        """SHA-256 of `name`: of its cached copy once a cache is open (downloaded, verified against
        the manifest, hashed again locally), else streamed from storage."""
        cache = self._cache
        if cache is not None:
            try:  # one download serves both this check and the mapping that follows
                path, _ = cache.get(name)
                cache.release(name)
                return file_sha256(path)
            except ShardError:
                pass  # damaged or unreachable: hash what storage holds, so the caller sees what is wrong
        digest = hashlib.sha256()
        with self.fs.open(self.path(name), "rb", block_size=16 << 20, cache_type="none") as fh:
            while block := fh.read(16 << 20):
                digest.update(block)
        return digest.hexdigest()

    def open_cache(self, shards: Sequence[ShardEntry], **options: Any) -> ShardCache:
        """The shard cache of this dataset (made on first call; `options` go to ShardCache)."""
        with self._lock:
            if self._cache is None:
                self._cache = ShardCache(self.read_range, shards, self.cache_dir, self.cache_limit,
                                         where=self.join, **options)
            return self._cache

    @property
    def cache(self) -> ShardCache | None:
        return self._cache

    def local_path(self, name: str) -> Path:
        """The verified cached copy of shard `name`, downloaded first when needed; it may be evicted
        once the cache needs the room. (The reader holds shards through the cache directly.)"""
        if self._cache is None:
            raise DatasetError(f"{self.join(name)}: a remote shard is read through the shard cache; open the "
                               "dataset with stoker.open_dataset(url) or stoker.Loader(url)", path=self.join(name))
        path, _ = self._cache.get(name)
        self._cache.release(name)
        return path

    def shard_meta(self, info: ShardEntry, rows: int, columns: Sequence[str]) -> pa.Table:
        """`columns` of a shard (small ones: height, width, label) without downloading it: ranged
        GETs of just their buffers (Arrow IPC's footer says where they are). Kept in the cache
        directory for the next run (`<sha256>.meta.arrow`, with its own SHA-256 beside it in
        `<sha256>.meta.sha256`: labels come from this file, so a damaged copy must not be used)."""
        local = self.cache_dir / f"{info.sha256}.meta.arrow"
        mark = local.with_suffix(".sha256")
        try:
            payload = local.read_bytes()
            if hashlib.sha256(payload).hexdigest() == mark.read_text().strip():
                table = pa.ipc.open_file(pa.BufferReader(payload)).read_all()
                if table.num_rows == rows and table.schema.names == list(columns):
                    return table
        except (OSError, ValueError, pa.ArrowException):
            pass  # absent or damaged: read it again
        where = self.join(info.file)
        try:
            with self.fs.open(self.path(info.file), "rb", block_size=1 << 16, cache_type="none") as fh:
                schema = pa.ipc.open_file(pa.PythonFile(fh, mode="r")).schema
                missing = [c for c in columns if c not in schema.names]
                if missing:
                    raise ShardError(f"{where}: missing column(s) {missing}; expected a stoker shard", path=where)
                fh.seek(0)
                options = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index(c) for c in columns])
                table = pa.ipc.open_file(pa.PythonFile(fh, mode="r"), options=options).read_all()
                table = table.select(list(columns))
        except FileNotFoundError:
            raise ShardError(f"{where}: listed in the manifest but missing from the storage; upload it or "
                             "re-pack the dataset", path=where) from None
        except (pa.ArrowException, ValueError) as exc:
            raise ShardError(f"{where}: not a readable Arrow IPC file ({exc}); upload it again or re-pack",
                             path=where) from None
        except ShardError:
            raise
        except Exception as exc:  # denied, unreachable: the backend's own error type
            raise ShardError(f"{where}: cannot read it ({type(exc).__name__}: {exc}); check the URL, the "
                             "credentials and storage_options", path=where) from None
        if table.num_rows != rows:
            raise ShardError(f"{where}: holds {table.num_rows} rows, the manifest expects {rows}; upload it "
                             "again or re-pack", path=where)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue().to_pybytes()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for path, data in ((local, payload), (mark, hashlib.sha256(payload).hexdigest().encode())):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, path)
            except OSError:  # a full or read-only cache disk: this copy only saves the next run some GETs
                tmp.unlink(missing_ok=True)
                break
        return table

    def identity(self, name: str) -> tuple[int, ...]:
        if self._cache is None:
            return (0, self.size(name))
        st = os.stat(self._cache.path(name))
        return (st.st_dev, st.st_ino, st.st_size)

    # ---- writing -----------------------------------------------------------------------------
    def makedirs(self) -> None:
        # object stores have no folders; a bucket that does not exist is an error worth seeing now
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except (PermissionError, OSError) as exc:
            raise DatasetError(f"{self.location}: cannot create or reach the destination: {exc}; check the "
                               "bucket name and the storage credentials", path=self.location) from None

    def write_atomic(self, name: str, payload: bytes) -> None:
        """One PUT: object stores make a whole object visible at once, never part of it."""
        self.fs.pipe_file(self.path(name), payload)
        self.fs.invalidate_cache(self.root)

    def append_line(self, name: str, line: str) -> None:
        """Object stores cannot append: read, add the line, write the whole object again."""
        try:
            old = self.read_bytes(name)
        except FileNotFoundError:
            old = b""
        self.write_atomic(name, old + line.encode() + b"\n")

    def open_shard_sink(self, name: str) -> ShardSink:
        return _UploadSink(self, name)

    def lock(self, name: str) -> DirectoryLock:
        """Object stores have no lock a writer can hold: this is a lock on a local file named after
        the URL (in the cache folder), so a second pack into this URL from this machine fails at
        once. Two machines packing into one URL are not detected: give each its own URL."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return DirectoryLock(self.cache_dir / name)

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.root)

    def close(self) -> None:
        """Stop the cache's download threads (a later read opens a new cache). Idempotent."""
        cache, self._cache = self._cache, None
        if cache is not None:
            cache.close()
