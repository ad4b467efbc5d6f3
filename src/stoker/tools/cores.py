"""`--cores N` of `stoker bench` and `stoker doctor`: measure as a machine with N CPU cores would.

A cloud instance gives each GPU a number of vCPUs; whether the loader keeps the GPU fed there is
the question, not what it does on every core of this machine. `pinned(n)` restricts this process
to `n` of the CPUs it may run on (`os.sched_setaffinity`, each of its threads), so every thread and
every child process it starts afterwards (the bench's pipeline processes, a Loader's worker
processes) runs on those `n`, and every count that defaults from the usable CPUs (`Workers`'
threads, the bench's `--workers`, the doctor's split between model and loader) follows `n`. The
previous masks come back when the block ends. Only the command-line tools do this: the library never changes process-wide state.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from .._system import cpu_ids
from ..errors import ConfigError

__all__ = ["check_cores", "cpu_list", "parse_cores", "pinned"]


def parse_cores(text: str) -> tuple[int, ...]:
    """'16,8' -> (16, 8): the core counts to run at, in the order given (each a positive integer)."""
    counts: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(f"--cores {text}: expected positive integers separated by commas (e.g. --cores 16,8), "
                              f"got {part!r}")
        counts.append(int(part))
    return tuple(counts)


def check_cores(counts: Sequence[int]) -> list[int]:
    """The CPUs this process may run on, after checking that each of `counts` fits in them and that
    this platform can pin a process (Linux can; macOS and Windows have no sched_setaffinity)."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--cores needs os.sched_setaffinity to pin the process to N cores, which this "
                          "platform does not have (Linux has it); leave --cores out, or run on Linux")
    if any(n < 1 for n in counts):
        raise ConfigError(f"--cores: expected positive core counts, got {', '.join(map(str, counts))}")
    cpus = cpu_ids()
    over = [n for n in counts if n > len(cpus)]
    if over:
        raise ConfigError(f"--cores {max(over)}: this process may run on {len(cpus)} core(s) "
                          f"(CPUs {cpu_list(cpus)}); use at most --cores {len(cpus)}")
    return cpus


@contextlib.contextmanager
def pinned(n: int) -> Iterator[list[int]]:
    """Run the block on the first `n` CPUs of this process's affinity mask (yielded); restores the masks.

    Every thread of the process is pinned, not only the calling one: Linux keeps a mask per thread, and
    a pool started before the block (torch's intra-op threads) would otherwise keep running on every
    core. Threads and processes started inside the block inherit the mask."""
    cpus = check_cores([n])
    before = {tid: _mask(tid) for tid in _threads()}
    for tid in before:
        _set(tid, cpus[:n])
    try:
        yield cpus[:n]
    finally:
        for tid in _threads():   # threads started in the block get the caller's mask from before it
            _set(tid, before.get(tid) or cpus)


def _threads() -> list[int]:
    """The ids of this process's threads (Linux: /proc/self/task), or [0]: the calling thread."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _mask(tid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(tid))
    except OSError:   # the thread ended since it was listed
        return []


def _set(tid: int, cpus: Sequence[int]) -> None:
    with contextlib.suppress(ProcessLookupError):   # the thread ended since it was listed
        os.sched_setaffinity(tid, cpus)


def cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (how Linux writes a CPU list)."""
    parts: list[str] = []
    start = prev = None
    for c in sorted(cpus):
        if start is None:
            start = prev = c
        elif c == prev + 1:   # type: ignore[operator]
            prev = c
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = c
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)
