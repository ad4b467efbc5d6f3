"""Local folders: plain files, memory-mapped for reading, fsynced and renamed for writing."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ShardError
from .base import ShardSink, StorageBackend
from .lock import DirectoryLock


#: Opening never blocks: a FIFO with no writer would block ``open()`` itself (and Ctrl-C with it).
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(path: str | Path, mode: int) -> OSError:
    """The error for a path that is not a regular file (IsADirectoryError for a folder)."""
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if stat.S_ISDIR(mode):
        return IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(path))
    return OSError(errno.EINVAL, f"is {kind}, not a regular file; only regular files are read", str(path))


def _open_checked(path: str | Path) -> tuple[int, os.stat_result]:
    """(descriptor, its fstat) of a regular file opened without blocking; OSError for anything else."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except ValueError:  # a NUL byte in the path: no such file can exist
        raise OSError(errno.EINVAL, "the path holds a NUL byte, so no file has this name", repr(str(path))) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path: str | Path, offset: int = 0, size: int | None = None, *, inode: int = 0) -> bytes:
    """The bytes of a regular file (``size`` bytes at ``offset``, or all of it), never anything else.

    The file is opened without blocking and checked on its descriptor (``fstat``), so a FIFO, a
    device or a socket (even one swapped in after a listing checked the name) is an OSError at
    once instead of a read that never ends or never stops growing. At most the size ``fstat``
    reported is read: a file that grows while it is read does not pull in more. ``inode`` (when not 0) is
    the inode the file had when it was listed: the file opened must be that one, so a file swapped
    for a symlink (or anything else) between listing and reading is refused, not read.
    """
    fd, st = _open_checked(path)
    try:
        if inode and st.st_ino != inode:
            raise OSError(errno.ESTALE, "is not the file that was listed (replaced, or swapped for a symlink, "
                          "after the source was listed); list the source again", str(path))
        end = st.st_size if size is None else offset + size
        if end > st.st_size:
            raise OSError(errno.EINVAL, f"is shorter than its index says: wanted {size} bytes at offset "
                          f"{offset}, the file holds {st.st_size}", str(path))
        chunks, pos = [], offset
        while pos < end:
            chunk = os.pread(fd, min(end - pos, 64 << 20), pos) if hasattr(os, "pread") else _read_at(fd, pos, end - pos)
            if not chunk:
                break  # shrank while read: what is there; the decoder reports a truncated image
            chunks.append(chunk)
            pos += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular(path: str | Path) -> BinaryIO:
    """A regular file opened for reading (a buffered binary file object), checked on its descriptor
    like :func:`read_regular`: a FIFO, device or socket is an OSError at once, never a blocked
    ``open()``. For readers that stream a container (tar, gzip, TFRecord) themselves."""
    fd, _ = _open_checked(path)
    try:
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def require_regular(path: str | Path) -> None:
    """Raise OSError unless ``path`` is a regular file now (for libraries that open a path
    themselves, such as h5py and lmdb: the check narrows, but cannot close, the window in which
    the file could be swapped)."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise not_regular(path, mode)


def _read_at(fd: int, pos: int, n: int) -> bytes:  # platforms without pread (Windows)
    os.lseek(fd, pos, os.SEEK_SET)
    return os.read(fd, min(n, 64 << 20))


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform/filesystem; the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` via a fsynced temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # disk full, Ctrl-C: leave the old file, not a half-written temporary
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    """SHA-256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class TempFileSink(ShardSink):
    """A file streamed to a local temporary path; subclasses say what `commit` does with it."""

    def __init__(self, tmp: Path, fh: BinaryIO) -> None:
        self.tmp = tmp
        self._fh: BinaryIO | None = fh

    def write(self, data: Any) -> int:
        assert self._fh is not None, "write after commit or abort"
        return self._fh.write(data)

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def _close(self, fsync: bool) -> None:
        assert self._fh is not None, "commit after commit or abort"
        self._fh.flush()
        if fsync:
            os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None

    def abort(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:  # already broken (disk full): removing the file is what matters
                pass
            self._fh = None
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


class _LocalSink(TempFileSink):
    def __init__(self, path: Path) -> None:
        self.path = path
        tmp = path.with_name(f".{path.name}.tmp")
        super().__init__(tmp, open(tmp, "wb"))

    def commit(self) -> None:
        self._close(fsync=True)
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)


class LocalStorage(StorageBackend):
    """A dataset directory on a local (or mounted) file system."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().absolute()
        self.location = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def _path(self, name: str) -> Path:
        return self.root / name

    def join(self, name: str) -> str:
        return str(self._path(name))

    def is_dir(self) -> bool:
        return self.root.is_dir()

    def exists(self, name: str) -> bool:
        return self._path(name).exists()

    def size(self, name: str) -> int:
        return self._path(name).stat().st_size

    def list(self) -> list[str]:
        return sorted(os.listdir(self.root))

    def read_bytes(self, name: str) -> bytes:
        return read_regular(self._path(name))

    def sha256(self, name: str) -> str:
        return file_sha256(self._path(name))

    def local_path(self, name: str) -> Path:
        """The file itself; a symlink leading out of the dataset directory is refused, so a
        dataset someone else made can only make stoker read its own files."""
        path = self._path(name)
        root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if not real.startswith(root.rstrip(os.sep) + os.sep):
            raise ShardError(f"{path}: is a symlink to {real}, outside the dataset directory {root}; "
                             "a dataset may only read its own files — copy the file in", path=path)
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # mapping a FIFO would block forever
            raise ShardError(f"{path}: {not_regular(path, mode).strerror.split(';')[0]}; a dataset holds only "
                             "regular files — restore the shard or re-pack", path=path)
        return path

    def identity(self, name: str) -> tuple[int, ...]:
        st = os.stat(self.stat_path(name))
        return st.st_dev, st.st_ino, st.st_size

    def stat_path(self, name: str) -> str:
        # the reader keeps it per shard (`reader.PackedDataset`), so each check is one stat
        return os.path.join(self.location, name)

    def makedirs(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def write_atomic(self, name: str, payload: bytes) -> None:
        atomic_write_bytes(self._path(name), payload)

    def append_line(self, name: str, line: str) -> None:
        with open(self._path(name), "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def open_shard_sink(self, name: str) -> ShardSink:
        return _LocalSink(self._path(name))

    def lock(self, name: str) -> DirectoryLock:
        return DirectoryLock(self._path(name))

    def remove(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            pass
