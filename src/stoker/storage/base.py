"""The storage interface: the one seam through which datasets are read and written.

A :class:`StorageBackend` is bound to one dataset directory (local folder today; an object-store prefix
next) and addresses its files by plain name (``stoker.json``, ``shard-00000.arrow``): a dataset is
flat, so no caller builds paths. Reads hand back bytes or, for shards, a local memory-mappable file:
a remote backend fetches the object into a local cache first (verifying it), then serves the same
calls. Writes are crash-safe: small files are replaced atomically, shards stream to a temporary
name and appear under their final name only on :meth:`ShardSink.commit`.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ShardSink", "StorageBackend"]


class ShardSink(abc.ABC):
    """A file being streamed into storage under a temporary name."""

    @abc.abstractmethod
    def write(self, data: Any) -> int:
        """Append bytes; returns how many were written."""

    @abc.abstractmethod
    def flush(self) -> None: ...

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the file durable and give it its final name atomically."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the partial file; safe to call twice or after a failed commit."""


class StorageBackend(abc.ABC):
    """One dataset directory. Names are plain file names inside it, never paths.

    Missing files raise FileNotFoundError; other failures OSError (or a DatasetError naming the file).
    """

    #: Where the dataset lives, as the user wrote it (a folder or a URL): for messages.
    location: str
    #: True when `local_path(name)` is the stored file itself (no download): checking it is free.
    in_place: bool = True

    @abc.abstractmethod
    def join(self, name: str) -> str:
        """The full path or URL of ``name``, for messages and for the user."""

    @abc.abstractmethod
    def is_dir(self) -> bool:
        """True when the dataset directory itself exists."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool: ...

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """Size of ``name`` in bytes."""

    @abc.abstractmethod
    def list(self) -> list[str]:
        """Names of the files in the dataset directory, sorted (hidden temporaries included)."""

    @abc.abstractmethod
    def read_bytes(self, name: str) -> bytes: ...

    @abc.abstractmethod
    def sha256(self, name: str) -> str:
        """SHA-256 (hex) of the file's bytes, streamed."""

    @abc.abstractmethod
    def local_path(self, name: str) -> Path:
        """A local file holding ``name``'s bytes that may be memory-mapped; a remote backend
        fetches it into its cache first. Raises DatasetError for a file the dataset may not read
        (e.g. a symlink out of the directory)."""

    def memory_map(self, name: str) -> "pa.MemoryMappedFile":
        """``name`` memory-mapped read-only (zero-copy reads)."""
        import pyarrow as pa  # here, so listing a source or refusing a URL does not load Arrow

        return pa.memory_map(str(self.local_path(name)), "r")

    @abc.abstractmethod
    def identity(self, name: str) -> tuple[int, ...]:
        """A value that changes when the file served for ``name`` is replaced or resized (the
        reader checks it before touching a mapping; a shrunk mapping is SIGBUS, not an error)."""

    def stat_path(self, name: str) -> str | None:
        """A local path whose ``os.stat`` gives ``identity(name)`` as ``(st_dev, st_ino, st_size)``, or
        None where the identity is something else. The reader checks a shard once per batch of the GPU's
        or the native engine's rows: with the path at hand that check is one ``stat``."""
        return None

    @abc.abstractmethod
    def makedirs(self) -> None:
        """Create the dataset directory (and parents) if missing."""

    @abc.abstractmethod
    def write_atomic(self, name: str, payload: bytes) -> None:
        """Replace ``name`` with ``payload`` all at once, durably (readers see old or new, never half)."""

    @abc.abstractmethod
    def append_line(self, name: str, line: str) -> None:
        """Append one text line (newline added) durably: a journal."""

    @abc.abstractmethod
    def open_shard_sink(self, name: str) -> ShardSink:
        """Stream a new file; it appears as ``name`` only on commit (temporary: ``.{name}.tmp``)."""

    @abc.abstractmethod
    def remove(self, name: str) -> None:
        """Delete ``name``; a missing file is not an error."""

    def lock(self, name: str) -> ContextManager[Any]:
        """An exclusive lock on the dataset, kept in the file ``name``, held by one process at a
        time: entering raises :class:`stoker.storage.lock.LockHeldError` at once when another
        process holds it. Backends that cannot lock say so."""
        raise NotImplementedError(f"{type(self).__name__} cannot lock a dataset for writing")
