"""Staging: a verified copy of a packed dataset in memory-backed storage (``/dev/shm``), made once,
shared by every process of a node, and cleaned up.

    with stage("data/train-packed", "/dev/shm/train") as copy:     # or Loader(..., stage="/dev/shm")
        loader = Loader(copy.path, 256, ...)

How copies stay under control, including after a crash:
- A lock file inside the copy (``.stoker-stage.lock``, a POSIX ``flock``) is held exclusively while
  copying and shared while in use. The kernel drops it when a process dies, so "held" always means
  "someone alive uses it": no pid guessing.
- A marker (``.stoker-stage.json``) records the source manifest's SHA-256 and whether the copy
  finished; every shard was hashed while copied and matched the manifest before the marker says so.
- A copy whose marker matches the source is reused (a crashed run's copy included); an unfinished
  or outdated one is redone in place.
- A copy made for a Loader (``persistent=False``) is removed by the last process that lets it go
  (``close()``, garbage collection, or interpreter exit); :func:`sweep` (run by ``Loader(stage=...)``
  before staging) removes such copies that nobody holds, i.e. those crashed runs left behind.
  ``stoker stage`` makes persistent copies: they stay until ``stoker stage --remove``.

What is never touched: a destination that exists, is not empty and holds no marker is not a stage
stoker made (``stoker stage packed ~/work``, ``/dev/shm`` itself, the folder above the dataset): it
is refused before anything is written. Removing a copy deletes only the names staging writes (the
manifest, ``*.arrow`` shards, the marker, the lock, their temporary files), then the folder if it is
left empty; anything else a user put there stays.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from ._system import format_bytes
from .errors import ConfigError, DatasetError, LoaderTimeoutError, OutputError, ShardError
from .shards import MANIFEST_NAME, SHARD_NAME_RE, read_manifest

try:
    import fcntl
except ImportError:  # Windows: no flock; staging is refused there with a clear error
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".stoker-stage.lock"
MARK_NAME = ".stoker-stage.json"
_CHUNK = 8 << 20
_POLL_S = 0.1
#: how long a wait may see another dataset's marker before staging refuses (a copier rewrites the
#: marker right after taking the lock, so a marker that stays is another dataset's copy in use)
_OTHER_GRACE_S = 1.0


def _ours(name: str) -> bool:
    """True for a name staging writes into a copy (and so may delete)."""
    if name in (LOCK_NAME, MARK_NAME, f".{MARK_NAME}.tmp", MANIFEST_NAME):
        return True
    if name.startswith(".") and name.endswith(".tmp"):
        name = name[1:-4]
    return bool(SHARD_NAME_RE.fullmatch(name))


def _remove_copy(dest: Path) -> None:
    """Delete what staging wrote in `dest`, then `dest` itself if nothing else is left in it."""
    try:
        entries = list(os.scandir(dest))
    except OSError:
        return
    for entry in entries:
        if _ours(entry.name) and not entry.is_dir(follow_symlinks=False):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
    try:
        dest.rmdir()
    except OSError:  # not empty: files staging did not write stay where they are
        pass


def _check_dest(src: Path, dest: Path) -> None:
    """Refuse a destination that is not (and cannot become) a stage of its own: a file, a folder
    holding the dataset, or a non-empty folder without a staging marker (someone's files)."""
    src_real, dest_real = src.resolve(), dest.resolve()
    if dest_real == src_real:
        raise ConfigError(f"{dest}: the staging destination is the dataset itself; pick another folder")
    if dest_real in src_real.parents:
        raise ConfigError(f"{dest}: the staging destination holds the dataset {src}; stage into a new "
                          f"folder of its own, e.g. {dest / 'stoker-stage'}")
    if src_real in dest_real.parents:
        raise ConfigError(f"{dest}: the staging destination is inside the dataset {src}; pick a folder outside it")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ConfigError(f"{dest}: the staging destination exists and is not a folder; pick a new folder")
    try:
        names = set(os.listdir(dest))
    except FileNotFoundError:
        return
    if names and MARK_NAME not in names and not names <= {LOCK_NAME, f".{MARK_NAME}.tmp"}:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"{dest}: the staging destination is a folder that holds files ({shown}) and is not a "
                          f"stage stoker made (no {MARK_NAME}); staging never replaces them. Stage into a new "
                          f"folder, e.g. {dest / src_real.name}")


def _other_dataset(dest: Path, src_sha: str) -> str | None:
    """The source of the copy at `dest` when its marker names another dataset than `src_sha`."""
    mark = _read_mark(dest)
    sha = mark.get("manifest_sha256")
    if sha and sha != src_sha:   # the same path re-packed since is another dataset too: say which version
        return f"{mark.get('source') or 'another dataset'} (manifest sha256 {str(sha)[:12]}...)"
    return None


def _open_lock(dest: Path, exclusive: bool, timeout: float, src_sha: str | None = None) -> int:
    """An fd holding the copy's lock (exclusive or shared), waiting up to `timeout` seconds.
    Re-opens when the lock file was deleted meanwhile (the copy was removed under us). With
    `src_sha`, a wait on another dataset's copy in use fails at once (ConfigError naming it)."""
    if fcntl is None:
        raise ConfigError("staging needs POSIX file locks (flock), which this platform lacks; pass the dataset "
                          "path to the Loader directly")
    start = time.monotonic()
    deadline = start + timeout
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    while True:
        dest.mkdir(parents=True, exist_ok=True)
        fd = os.open(dest / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except BlockingIOError:
                    other = None if src_sha is None else _other_dataset(dest, src_sha)
                    if other is not None and time.monotonic() - start > _OTHER_GRACE_S:
                        raise ConfigError(
                            f"{dest}: holds a staged copy of {other}, in use by another process; staging never "
                            f"replaces a copy in use. Stage into another folder, or remove that copy once "
                            f"nothing uses it (`stoker stage --remove {dest}`)") from None
                    if time.monotonic() > deadline:
                        raise LoaderTimeoutError(
                            f"{dest}: another process has held the staging lock for {timeout:.0f} s (copying "
                            f"or removing the dataset); wait for it, or raise the timeout") from None
                    time.sleep(_POLL_S)
            try:
                same = os.fstat(fd).st_ino == os.stat(dest / LOCK_NAME).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the copy was removed while we waited: start over


def _try_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _read_mark(dest: Path) -> dict:
    try:
        mark = json.loads((dest / MARK_NAME).read_text())
        return mark if isinstance(mark, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_mark(dest: Path, mark: dict) -> None:
    tmp = dest / f".{MARK_NAME}.tmp"
    tmp.write_text(json.dumps(mark, indent=1))
    os.replace(tmp, dest / MARK_NAME)


def _copy_verified(src: Path, dst: Path, expected_sha: str, expected_bytes: int) -> None:
    """Copy `src` to `dst` (via a temporary name), hashing on the way; ShardError on a mismatch."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    digest = hashlib.sha256()
    size = 0
    try:
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                while block := fin.read(_CHUNK):
                    digest.update(block)
                    size += len(block)
                    fout.write(block)
        except OSError as exc:  # another stager (or anything else) filled the file system since the check
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise OutputError(f"{dst.parent}: the file system filled up while staging {src.name} "
                              f"({os.strerror(exc.errno)}; {format_bytes(shutil.disk_usage(dst.parent).free)} free "
                              f"now, the shard needs {format_bytes(expected_bytes)}); free memory there (another "
                              "process may be staging at the same time), or stage to a bigger file system",
                              path=dst.parent, errno=exc.errno) from None
        if size != expected_bytes or digest.hexdigest() != expected_sha:
            raise ShardError(f"{src}: does not match the manifest (expected {expected_bytes} bytes, sha256 "
                             f"{expected_sha}; found {size} bytes, sha256 {digest.hexdigest()}); the source is "
                             f"damaged — restore it or re-pack before staging", path=src)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class StagedCopy:
    """A staged dataset in use by this process. `close()` (or leaving the `with`) lets it go; a
    non-persistent copy is removed by the last process to let go."""

    path: Path
    reused: bool  # True when a finished copy (of an earlier or crashed run, or another rank) was reused
    persistent: bool
    _fd: int | None

    def __post_init__(self) -> None:
        # a copy dropped without close() (a Loader never closed) is let go when collected, or at
        # interpreter exit at the latest (weakref.finalize runs then): its memory is not held until
        # a later sweep
        self._finalizer = weakref.finalize(self, _let_go, self.path, self._fd, self.persistent)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._finalizer.detach()
        _let_go(self.path, fd, self.persistent)

    def __enter__(self) -> "StagedCopy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _let_go(path: Path, fd: int, persistent: bool) -> None:
    """Release this process's hold on a copy; the last holder of a non-persistent copy removes it."""
    try:
        if not persistent and _try_exclusive(fd):
            _remove_copy(path)
    finally:
        os.close(fd)


def _manifest_sha(src: Path) -> str:
    return hashlib.sha256((src / MANIFEST_NAME).read_bytes()).hexdigest()


def _complete(dest: Path, src_sha: str) -> bool:
    """True when `dest` holds a finished copy of the dataset whose manifest hashes to `src_sha`."""
    mark = _read_mark(dest)
    if mark.get("manifest_sha256") != src_sha or not mark.get("complete"):
        return False
    try:
        if _manifest_sha(dest) != src_sha:
            return False
        manifest = read_manifest(dest)
        return all((dest / s.file).stat().st_size == s.bytes for s in manifest.shards)
    except (OSError, DatasetError):
        return False


def stage(source: str | Path, dest: str | Path, *, persistent: bool = True, timeout: float = 3600.0) -> StagedCopy:
    """Copy the packed dataset `source` to `dest` (e.g. "/dev/shm/train") once, verified against
    its manifest's checksums, or reuse a finished copy there. Returns the copy, held (shared)
    until `close()`. Raises ConfigError when `dest` lacks the room, ShardError for a damaged source."""
    src, dest = Path(source), Path(dest)
    manifest = read_manifest(src)  # a damaged or unfinished source fails here, before anything is copied
    _check_dest(src, dest)  # someone's own folder is refused before anything is written into it
    src_sha = _manifest_sha(src)
    # a finished copy is joined under a shared lock (other ranks may be using it); copying needs
    # the exclusive one, and whoever gets it first checks again, so one process copies
    fd = _open_lock(dest, exclusive=False, timeout=timeout, src_sha=src_sha)
    if _complete(dest, src_sha):
        if persistent and not _read_mark(dest).get("persistent"):
            _write_mark(dest, {**_read_mark(dest), "persistent": True})
        return StagedCopy(dest, True, bool(_read_mark(dest).get("persistent")), fd)
    os.close(fd)
    fd = _open_lock(dest, exclusive=True, timeout=timeout, src_sha=src_sha)
    reused = False
    try:
        reused = _complete(dest, src_sha)
        if not reused:
            # the marker first (so a waiter sees which dataset this is), then an unfinished or outdated
            # copy's files go: only names staging writes
            _write_mark(dest, {"source": str(src.resolve()), "manifest_sha256": src_sha, "complete": False,
                               "persistent": persistent, "host": socket.gethostname(), "started": time.time()})
            for entry in os.scandir(dest):
                if _ours(entry.name) and entry.name not in (LOCK_NAME, MARK_NAME) \
                        and not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)
            need = sum(s.bytes for s in manifest.shards)
            free = shutil.disk_usage(dest).free
            if need > free:
                raise ConfigError(f"{dest}: the dataset needs {format_bytes(need)}, only {format_bytes(free)} are free "
                                  f"there; free memory, or stage to a bigger file system")
            for info in manifest.shards:
                _copy_verified(src / info.file, dest / info.file, info.sha256, info.bytes)
            shutil.copyfile(src / MANIFEST_NAME, dest / MANIFEST_NAME)
            _write_mark(dest, {**_read_mark(dest), "complete": True, "finished": time.time()})
        elif persistent and not _read_mark(dest).get("persistent"):
            _write_mark(dest, {**_read_mark(dest), "persistent": True})  # a persistent copy is never made transient
        fcntl.flock(fd, fcntl.LOCK_SH)  # copied: let other processes share it
    except BaseException:
        if not reused:
            # remove what we copied, unless someone else holds it
            if _try_exclusive(fd):
                _remove_copy(dest)
        os.close(fd)
        raise
    return StagedCopy(dest, reused, bool(_read_mark(dest).get("persistent")), fd)


def sweep(root: str | Path, keep: Path | None = None) -> list[Path]:
    """Remove the non-persistent staged copies under `root` that no process holds (left by runs
    that crashed or were killed), except `keep`. Returns what was removed."""
    removed: list[Path] = []
    root = Path(root)
    if fcntl is None:  # no locks, no way to tell a live copy from an abandoned one: touch nothing
        return removed
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        dest = Path(entry.path)
        if not entry.is_dir(follow_symlinks=False) or not (dest / LOCK_NAME).exists() or dest == keep:
            continue
        if _read_mark(dest).get("persistent"):
            continue
        try:
            fd = os.open(dest / LOCK_NAME, os.O_RDWR)
        except OSError:
            continue
        try:
            if _try_exclusive(fd):
                _remove_copy(dest)
                removed.append(dest)
        finally:
            os.close(fd)
    return removed


def remove(dest: str | Path, timeout: float = 60.0) -> None:
    """Delete a staged copy (persistent or not) once no process holds it."""
    dest = Path(dest)
    if not (dest / LOCK_NAME).exists():
        raise ConfigError(f"{dest}: not a staged copy (no {LOCK_NAME}); remove it yourself if it is yours")
    fd = _open_lock(dest, exclusive=True, timeout=timeout)
    try:
        _remove_copy(dest)
    finally:
        os.close(fd)


def stage_for_loader(source: str | Path, root: str | Path, timeout: float = 3600.0) -> StagedCopy:
    """What `Loader(source, stage=root)` does: sweep `root` of abandoned copies, then stage to
    `root/stoker-<manifest hash>` (non-persistent: removed when the last user closes it)."""
    src = Path(source)
    read_manifest(src)
    dest = Path(root) / f"stoker-{_manifest_sha(src)[:16]}"
    sweep(root, keep=dest)  # a copy of this very dataset left by a crash is reused instead
    return stage(src, dest, persistent=False, timeout=timeout)
