"""An exclusive, non-blocking lock on a local directory, held by one process at a time.

``pack`` holds it on OUT for the whole run, so a second pack into the same OUT fails at once,
naming the holder, instead of racing the first (both exiting 0, the second silently replacing the
first's manifest and leaving its shards orphaned). The lock is the operating system's on an open
file (``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows, imported only when used): it ends
with the process, so a killed pack never leaves a stale lock behind. The file itself stays; it
holds the last holder's pid, host and start time, for the message.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["DirectoryLock", "LockHeldError", "holder_text"]


class LockHeldError(OSError):
    """The lock is held by another process; ``holder`` is what it wrote (pid, host, started)."""

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        super().__init__(f"{path} is locked by {holder_text(holder)}")
        self.path = path
        self.holder = holder


def holder_text(holder: dict[str, Any]) -> str:
    """'pid 123 on host h (since 2026-01-01 12:00:00)', from what the holder wrote (any of it may be missing)."""
    if not holder:
        return "another process"
    try:
        since = f" (since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(holder['started'])))})"
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        since = ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


class DirectoryLock:
    """``with DirectoryLock(path): ...`` holds the lock on the file ``path`` or raises LockHeldError."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def __enter__(self) -> DirectoryLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if not _try_lock(fd):
                raise LockHeldError(self.path, _holder(fd))
            info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode(), 0) if hasattr(os, "pwrite") else os.write(fd, info.encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the lock up (idempotent); closing the file releases it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _try_lock(fd: int) -> bool:
    if os.name == "nt":
        import msvcrt
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode("utf-8"))
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}
