"""A bounded, checksum-verified local cache of whole shards fetched from object storage.

    cache = ShardCache(fetcher, manifest.shards, "/scratch/stoker-cache", limit="50GB")
    cache.plan(["shard-00003.arrow", "shard-00000.arrow", ...], uses={...}, lookahead=...)
    path = cache.get("shard-00003.arrow")      # blocks (with a timeout) until it is local and verified
    ...                                        # read the file (memory-map it)
    cache.release("shard-00003.arrow")         # one planned read of it is done
    cache.close()

Background threads download the shards of the plan in the order they are needed, in ranges of
`chunk_bytes` (a dropped connection costs one range, retried with back-off), hash them on the way,
and rename a shard into the cache only when its size and SHA-256 match the manifest: a reader never
sees a partial or damaged file. The cache never holds more than `limit` bytes, downloads in flight
included: before a download starts, room is made by deleting shards no reader still needs this
epoch (least recently used first), then shards needed only later than the one coming in (the
furthest first); a shard a reader holds is never deleted, and a download waits until there is room.

Files are named by their SHA-256 (`<sha256>.arrow`), so a second run, another rank on the same
machine or another dataset holding the same shard reuses them. A file found in the folder is hashed
again before its first use in this process (a disk error or a stray write since it was renamed in
would otherwise be served for ever); one that does not match is downloaded again.

Several processes may share one folder (two jobs on one URL use the same default folder). Each
holds a lease, a shared ``flock`` on the file, on every shard it has local; a process deletes a
file only when it can take the exclusive lock, i.e. when no live process holds it (the kernel
drops a dead process's leases). A file another process holds is left in place and no longer
counts against this process's `limit`: each process keeps to its own limit. A shard whose file
changed or vanished under a process anyway (deleted by hand) is fetched again on its next use.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from .._system import format_bytes, parse_size
from ..errors import ConfigError, LoaderTimeoutError, OutputError, ShardError

try:
    import fcntl
except ImportError:  # Windows: no flock; a shared cache folder is then unguarded, as before
    fcntl = None  # type: ignore[assignment]


class ShardEntry(Protocol):
    """What the cache needs of a manifest entry (`stoker.shards.ShardInfo` has it)."""

    file: str
    bytes: int
    sha256: str


#: fetch(name, start, end) -> the bytes [start, end) of shard `name` in storage.
RangeFetcher = Callable[[str, int, int], bytes]

_CACHED_RE = re.compile(r"[0-9a-f]{64}\.arrow")
_POLL_S = 0.1  # every wait wakes at least this often to check for close() and errors


def working_set_bytes(first: Mapping[str, int], last: Mapping[str, int], sizes: Mapping[str, int],
                      lookahead: int) -> int:
    """The most bytes of shards that must be local at once when samples are read in order and the
    readers run up to `lookahead` positions ahead: the peak, over positions, of the sizes of the
    shards whose use interval [first - lookahead, last] covers that position."""
    events: list[tuple[int, int]] = []
    for name, start in first.items():
        events.append((max(0, start - lookahead), sizes[name]))
        events.append((last[name] + 1, -sizes[name]))
    peak = live = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # frees before loads at one position
        live += delta
        peak = max(peak, live)
    return peak


@dataclass
class CacheStats:
    """What the cache did since it was made (bytes; requests are range GETs to the storage)."""

    requests: int = 0
    bytes_fetched: int = 0
    shards_fetched: int = 0
    hits: int = 0  # get() calls answered by a file already local
    evictions: int = 0
    retries: int = 0
    adopted: int = 0  # verified files found in the cache directory at start
    peak_bytes: int = 0  # the most bytes held (files plus downloads in flight)
    fetched: list[str] = field(default_factory=list)  # shard names, in download order

    def as_dict(self) -> dict[str, object]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}


@dataclass
class _Entry:
    info: ShardEntry
    state: str = "remote"  # remote | unverified (a file found in the folder) | fetching | local | failed
    remaining: int = 0  # planned reads not yet released this epoch
    pins: int = 0  # get() calls not yet released
    position: int = 2**62  # place in the current plan's order (unplanned: last)
    generation: int = 0  # bumped on every (re)download, so readers notice a new file
    last_used: float = 0.0
    error: BaseException | None = None
    lease: int | None = None  # fd holding a shared flock on the local file (state "local" only)
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the leased file


class ShardCache:
    """Whole shards fetched ahead of need into `cache_dir`, verified, bounded by `limit` bytes.

    `fetch(name, start, end)` returns a byte range of a shard in storage; `where(name)` names it in
    messages (e.g. its URL). `threads` downloads run at once; each range is retried `retries` times
    with exponential back-off on transient errors; every wait gives up after `timeout` seconds.
    """

    def __init__(self, fetch: RangeFetcher, shards: Sequence[ShardEntry], cache_dir: str | Path,
                 limit: int | str, *, where: Callable[[str], str] = str, threads: int = 2,
                 chunk_bytes: int = 16 << 20, retries: int = 4, backoff_s: float = 0.2,
                 timeout: float = 300.0) -> None:
        self.limit = parse_size(limit)
        if threads < 1 or chunk_bytes < 1 or retries < 0 or not timeout > 0:
            raise ConfigError(f"ShardCache needs threads >= 1, chunk_bytes >= 1, retries >= 0 and timeout > 0, "
                              f"got {threads}, {chunk_bytes}, {retries}, {timeout}")
        biggest = max(shards, key=lambda s: s.bytes, default=None)
        if biggest is not None and biggest.bytes > self.limit:
            raise ConfigError(f"cache_limit={self.limit} bytes is smaller than shard {biggest.file} "
                              f"({biggest.bytes} bytes); raise cache_limit to at least a few shards")
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fetch, self._where = fetch, where
        self._chunk, self._retries, self._backoff, self.timeout = chunk_bytes, retries, backoff_s, float(timeout)
        self._entries = {s.file: _Entry(s) for s in shards}
        self._queue: list[str] = []  # shards to download, in order of need
        self._foreign: dict[Path, int] = {}  # other cached files in the directory, evictable
        self._used = 0  # bytes of local files plus downloads in flight
        self._cond = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self._fatal: BaseException | None = None
        self.stats = CacheStats()
        self._on_evict: list[Callable[[str], None]] = []
        self._adopt()
        self._threads = [threading.Thread(target=self._worker, name=f"stoker-cache-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    # ---- public ------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """Where shard `name` lives once local."""
        return self.dir / f"{self._entries[name].info.sha256}.arrow"

    def holds(self, name: str) -> bool:
        """True when shard `name` is in the cache now (verified)."""
        with self._cond:
            e = self._entries.get(name)
            return e is not None and e.state == "local"

    def on_evict(self, callback: Callable[[str], None]) -> None:
        """Call `callback(name)` (under the cache's lock: keep it short, never call back in) when a
        shard's file is deleted, so a reader drops its mapping and the disk space is freed."""
        self._on_evict.append(callback)

    def plan(self, order: Sequence[str], uses: Mapping[str, int] | None = None) -> None:
        """The shards of the coming epoch in the order they are first needed, and how many reads
        of each (`release` calls) will come; downloads follow this order. Replaces any old plan."""
        unknown = [n for n in order if n not in self._entries]
        if unknown:
            raise ConfigError(f"plan names shards not in the manifest: {unknown[:5]}")
        with self._cond:
            for e in self._entries.values():
                e.remaining, e.position = 0, 2**62
                if e.state == "failed":  # a new epoch tries again
                    e.state, e.error = "remote", None
            for position, name in enumerate(order):
                self._entries[name].remaining = (uses or {}).get(name, 1)
                self._entries[name].position = min(self._entries[name].position, position)
            self._queue = [n for n in dict.fromkeys(order) if self._entries[n].state in ("remote", "unverified")]
            self._cond.notify_all()

    def get(self, name: str, timeout: float | None = None) -> tuple[Path, int]:
        """(local path, generation) of shard `name`, downloading it first if needed (ahead of the
        plan when it is not in it). The shard stays until `release(name)`. Raises ShardError when
        it cannot be fetched or fails verification, LoaderTimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            e = self._entries.get(name)
            if e is None:
                raise ShardError(f"{self._where(name)}: not a shard of this dataset", path=self._where(name))
            e.pins += 1
            try:
                if e.state == "local" and self._still_there(e):
                    self.stats.hits += 1
                while e.state != "local":
                    self._raise_if_closed()
                    if e.state == "failed":
                        assert e.error is not None
                        raise e.error
                    if e.state in ("remote", "unverified") and name not in self._queue[:1]:
                        self._queue = [name] + [n for n in self._queue if n != name]  # needed now
                        e.position = min(e.position, -1)
                        self._cond.notify_all()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LoaderTimeoutError(
                            f"{self._where(name)}: not downloaded within {self.timeout:.0f} s ({e.state}); "
                            f"check the connection to the storage, or raise the Loader's timeout=")
                    self._cond.wait(min(_POLL_S, left))
            except BaseException:
                e.pins -= 1
                raise
            e.last_used = time.monotonic()
            return self.path(name), e.generation

    def release(self, name: str) -> None:
        """One read of `name` (a `get`, and a planned use when it was planned) is over."""
        with self._cond:
            e = self._entries[name]
            e.pins = max(0, e.pins - 1)
            e.remaining = max(0, e.remaining - 1)
            if e.pins == 0 and e.remaining == 0:
                self._cond.notify_all()  # a download may be waiting for room

    @property
    def used_bytes(self) -> int:
        """Bytes held now: local shard files plus downloads in flight."""
        with self._cond:
            return self._used

    def close(self, timeout: float = 5.0) -> None:
        """Stop the download threads (a range in flight finishes first) and remove partial files.
        Idempotent; the verified shards stay in the cache directory for the next run."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)
        self._threads = []
        with self._cond:
            for e in self._entries.values():
                _drop_lease(e)

    def __enter__(self) -> "ShardCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- bookkeeping -------------------------------------------------------------------------
    def _raise_if_closed(self) -> None:
        if self._fatal is not None:
            raise ShardError(f"{self.dir}: a shard cache download thread failed: {self._fatal!r}; this is a bug "
                             "in stoker, please report it with the traceback", path=self.dir) from self._fatal
        if self._stop.is_set():
            raise ShardError(f"{self.dir}: the shard cache was closed", path=self.dir)

    def _adopt(self) -> None:
        """Take over verified files left by earlier runs; delete partial downloads of dead ones."""
        by_sha = {e.info.sha256: e for e in self._entries.values()}
        for entry in os.scandir(self.dir):
            path = Path(entry.path)
            if entry.name.endswith(".tmp"):
                pid = entry.name.rsplit(".", 2)[-2]
                if not (pid.isdigit() and _alive(int(pid))):
                    path.unlink(missing_ok=True)
                continue
            if not (_CACHED_RE.fullmatch(entry.name) and entry.is_file()):
                continue
            size = entry.stat().st_size
            e = by_sha.get(entry.name[:64])
            if e is not None and size == e.info.bytes and e.state == "remote":
                e.state, e.last_used = "unverified", entry.stat().st_mtime  # hashed before its first use
                self.stats.adopted += 1
            else:
                self._foreign[path] = size
            self._used += size
        self.stats.peak_bytes = self._used

    def _evictable(self, before: int) -> Iterable[tuple[tuple[int, float], str | Path]]:
        """(priority, victim): first files this epoch is done with (least recently used first), then
        shards needed again only after plan position `before`, the furthest first (they will be
        fetched again when their turn comes; keeping them would stall what is needed sooner)."""
        for path, _ in self._foreign.items():
            yield (0, 0.0), path
        for name, e in self._entries.items():
            if e.state not in ("local", "unverified") or e.pins:
                continue
            if e.remaining == 0:
                yield (1, e.last_used), name
            elif e.position > before:
                yield (2, -float(e.position)), name

    def _make_room(self, need: int, position: int) -> bool:
        """Delete files until `need` more bytes fit, for a shard at plan position `position`."""
        while self._used + need > self.limit:
            victims = sorted(self._evictable(position), key=lambda v: v[0])
            if not victims:
                return False
            victim = victims[0][1]
            if isinstance(victim, Path):
                _unlink_unleased(victim)
                self._used -= self._foreign.pop(victim)
            else:
                e = self._entries[victim]
                for callback in self._on_evict:
                    callback(victim)
                _drop_lease(e)
                _unlink_unleased(self.path(victim))  # left in place while another process holds it
                e.state = "remote"
                self._used -= e.info.bytes
            self.stats.evictions += 1
        return True

    def _still_there(self, e: _Entry) -> bool:
        """Under the lock: True when the leased file of local entry `e` is still at its path; else
        `e` goes back to the queue (a file there now is hashed first), and False."""
        try:
            st = os.stat(self.path(e.info.file))
            if (st.st_dev, st.st_ino) == e.identity:
                return True
            state = "unverified" if st.st_size == e.info.bytes else "remote"
        except FileNotFoundError:
            state = "remote"
        _drop_lease(e)
        e.state = state
        if state == "remote":
            self._used -= e.info.bytes
        return False

    def _next_job(self) -> tuple[_Entry, bool] | None:
        """Under the lock: the next shard to download (or to hash, when its file is already here:
        the flag), with room reserved for it, or None."""
        while self._queue and self._entries[self._queue[0]].state not in ("remote", "unverified"):
            self._queue.pop(0)
        if not self._queue:
            return None
        e = self._entries[self._queue[0]]
        present = e.state == "unverified"  # its bytes are counted already
        if not present and not self._make_room(e.info.bytes, e.position):
            return None  # wait for readers to release shards
        self._queue.pop(0)
        e.state = "fetching"
        if not present:
            self._used += e.info.bytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self._used)
        return e, present

    def _worker(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # a bug, not a download problem: every waiting get() reports it
            with self._cond:
                self._fatal = exc
                self._cond.notify_all()

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                job = self._next_job()
                if job is None:
                    self._cond.wait(_POLL_S)
                    continue
            e, present = job
            try:
                lease = self._verified(e.info) if present else None
                downloaded = lease is None
                if downloaded:
                    lease = self._download(e.info)
            except BaseException as exc:  # reported to every get() of this shard
                with self._cond:
                    e.state, e.error = "failed", exc if isinstance(exc, (ShardError, OutputError)) else ShardError(
                        f"{self._where(e.info.file)}: download failed: {exc!r}", path=self._where(e.info.file))
                    self._used -= e.info.bytes
                    self._cond.notify_all()
                continue
            with self._cond:
                if self._stop.is_set() and not self._threads:  # close() gave up waiting for this thread
                    os.close(lease)
                    continue
                st = os.fstat(lease)
                e.lease, e.identity = lease, (st.st_dev, st.st_ino)
                e.state, e.generation, e.last_used = "local", e.generation + 1, time.monotonic()
                if downloaded:
                    self.stats.shards_fetched += 1
                    self.stats.fetched.append(e.info.file)
                self._cond.notify_all()

    def _verified(self, info: ShardEntry) -> int | None:
        """A lease on the file of `info` found in the folder when its SHA-256 matches the manifest;
        else None, the damaged file deleted (unless another process holds it)."""
        path = self.dir / f"{info.sha256}.arrow"
        try:
            fd = _lease(path)
        except FileNotFoundError:
            return None
        try:
            digest = hashlib.sha256()
            with open(fd, "rb", closefd=False) as fh:
                while block := fh.read(8 << 20):
                    if self._stop.is_set():
                        raise ShardError(f"{path}: check stopped (the cache was closed)", path=path)
                    digest.update(block)
            if digest.hexdigest() == info.sha256:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        _unlink_unleased(path)
        with self._cond:
            self.stats.retries += 1
        return None

    # ---- download ----------------------------------------------------------------------------
    def _download(self, info: ShardEntry) -> int:
        """Fetch `info` into a temporary file, verify size and SHA-256, rename it in; returns a
        lease on it (taken before the rename, so no other process can delete it in between). One
        more full attempt after a checksum mismatch, in case the damage happened on the way."""
        final = self.dir / f"{info.sha256}.arrow"
        tmp = self.dir / f".{info.sha256}.{os.getpid()}.tmp"
        where = self._where(info.file)
        try:
            for attempt in range(2):
                digest = hashlib.sha256()
                try:
                    with open(tmp, "wb") as fh:
                        for start in range(0, info.bytes, self._chunk):
                            if self._stop.is_set():
                                raise ShardError(f"{where}: download stopped (the cache was closed)", path=where)
                            data = self._fetch_range(info, start, min(start + self._chunk, info.bytes))
                            digest.update(data)
                            fh.write(data)
                        fh.flush()
                        os.fsync(fh.fileno())
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        raise self._disk_full(info, exc) from None
                    raise
                found = digest.hexdigest()
                if found == info.sha256:
                    if fcntl is None:  # Windows: an open file cannot be renamed (and there is no flock)
                        os.replace(tmp, final)
                        return _lease(final)
                    fd = _lease(tmp)
                    os.replace(tmp, final)
                    return fd
                if attempt:
                    raise ShardError(f"{where}: checksum mismatch: the manifest expects sha256 {info.sha256}, "
                                     f"the stored object has {found}; the object is damaged — upload it again "
                                     f"or re-pack the dataset", path=where)
                with self._cond:
                    self.stats.retries += 1
        finally:
            tmp.unlink(missing_ok=True)

    def _disk_full(self, info: ShardEntry, exc: OSError) -> OutputError:
        """A full disk is the cache folder's problem, not the shard's: the error names the folder and
        the room the shard needs (not the bucket URL, which is intact)."""
        try:
            free = f"{format_bytes(shutil.disk_usage(self.dir).free)} free"
        except OSError:
            free = "free space unknown"
        return OutputError(
            f"{self.dir}: the shard cache folder's disk is full ({os.strerror(exc.errno)}) while downloading "
            f"{self._where(info.file)}: it needs {format_bytes(info.bytes)} for this shard and up to "
            f"{format_bytes(self.limit)} in all (cache_limit), {free}; free space there, lower cache_limit, or "
            f"point cache_dir at a larger disk", path=self.dir, errno=exc.errno)

    def _fetch_range(self, info: ShardEntry, start: int, end: int) -> bytes:
        where = self._where(info.file)
        for attempt in range(self._retries + 1):
            with self._cond:
                self.stats.requests += 1
            try:
                data = self._fetch(info.file, start, end)
                if len(data) == end - start:
                    with self._cond:
                        self.stats.bytes_fetched += len(data)
                    return data
                problem: BaseException = ShardError(
                    f"{where}: range {start}-{end} returned {len(data)} bytes, expected {end - start} "
                    f"(the manifest says the shard has {info.bytes} bytes)", path=where)
                if len(data) < end - start and end <= info.bytes and attempt < self._retries:
                    pass  # a short read: a cut connection, retried below
                else:
                    raise problem
            except FileNotFoundError:
                raise ShardError(f"{where}: listed in the manifest but missing from the storage; upload it "
                                 "or re-pack the dataset", path=where) from None
            except PermissionError as exc:
                raise ShardError(f"{where}: access denied ({exc}); check the storage credentials "
                                 "(environment or the backend's config file)", path=where) from None
            except ShardError:
                raise
            except Exception as exc:  # connection reset, timeout, throttling: transient
                problem = exc
            if attempt == self._retries:
                raise ShardError(f"{where}: range {start}-{end} failed {self._retries + 1} times, last error: "
                                 f"{problem!r}; check the connection to the storage", path=where) from problem
            with self._cond:
                self.stats.retries += 1
            if self._stop.wait(self._backoff * 2 ** attempt):
                raise ShardError(f"{where}: download stopped (the cache was closed)", path=where)
        raise AssertionError("unreachable")


def _lease(path: Path) -> int:
    """An fd of `path` holding a shared flock on it: while it is open, no stoker process deletes the
    file (see the module docstring)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_SH)  # only an evicting process holds LOCK_EX, for an instant
    return fd


def _drop_lease(e: _Entry) -> None:
    fd, e.lease, e.identity = e.lease, None, None
    if fd is not None:
        os.close(fd)


def _unlink_unleased(path: Path) -> bool:
    """Delete `path` unless a live process holds a lease on it; True when it is gone."""
    if fcntl is None:  # Windows: no flock, but a file another process has open cannot be deleted
        try:
            path.unlink(missing_ok=True)
        except PermissionError:
            return False
        return True
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """True when process `pid` exists (a partial download of a live process is left alone)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
