"""Small answers every module may share: the CPUs this process may use, the one bounded, stop-aware
poll for what no thread can notify (a CUDA fence), and how a measured number is
written out (JSON null or "-" where it is not a finite number)."""

from __future__ import annotations

import atexit
import math
import os
import re
import threading
import time
import weakref
from typing import Any, Callable

from .errors import ConfigError

POLL_PAUSE_S = (0.0002, 0.002)  # poll_until: first pause between checks, growing to the second (seconds)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


# ---- fork() --------------------------------------------------------------------------------------
# Threads do not survive fork(): a child has only the thread that forked, and any lock a parent thread held
# stays held. So every object that owns threads records the generation it was made in, and a child (a torch
# DataLoader fork worker, a plain os.fork()) never joins, signals or locks what belongs to its parent.
_FORKS = [0]


def _count_fork() -> None:
    _FORKS[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def fork_generation() -> int:
    """How many fork()s lie between the first process and this one: an object made at another generation
    belongs to a parent process, whose threads this process does not have."""
    return _FORKS[0]


# ---- interpreter exit ----------------------------------------------------------------------------
# A loader's threads are daemons (an unclosed Loader must not hold the interpreter open), but a daemon still
# inside native code (a decoder call, a torch op) when the interpreter finalizes kills the process (SIGABRT,
# "terminate called without an active exception"). So at exit every loader thread still alive is told to stop
# and joined, bounded, before finalization: close() need not outwait a long decoder call itself.
EXIT_JOIN_S = 15.0   # a decoder call that never returns must not hold the exit for long
_AT_EXIT: "weakref.WeakKeyDictionary[threading.Thread, tuple[threading.Event, int]]" = weakref.WeakKeyDictionary()


def join_at_exit(thread: threading.Thread, stop: threading.Event) -> None:
    """At interpreter exit, set `stop` and join `thread` (bounded by EXIT_JOIN_S over all threads)."""
    _AT_EXIT[thread] = (stop, fork_generation())


@atexit.register
def _join_loader_threads() -> None:
    mine = [(t, stop) for t, (stop, gen) in list(_AT_EXIT.items()) if gen == fork_generation() and t.is_alive()]
    for _, stop in mine:
        stop.set()
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread, _ in mine:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def cpu_ids() -> list[int]:
    """CPU ids this process may run on (its affinity mask where the OS has one)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on; at least 1."""
    return max(1, len(cpu_ids()))


#: cores a GPU training process keeps for itself beside the loader: the training thread (Python and
#: kernel dispatch), autograd's thread for the device (the backward pass's dispatch) and stoker's
#: device thread (copies, slot guards). Each is busy for much of a step and none can wait for a core:
#: a dispatch-bound step slows by the time its threads sit runnable behind a loader thread.
TRAINER_THREADS = 3


def threads_per_process(gpu: bool = False) -> int:
    """The default thread count of one process: its usable CPUs shared among the processes `torchrun`
    started on this machine (LOCAL_WORLD_SIZE), so 2 ranks on 4 CPUs take 2 threads each instead of
    4 (oversubscribed cores run slower than fewer threads); at least 1. `gpu`: batches go to a GPU, so
    `TRAINER_THREADS` of those cores stay the training process's own (one where there are only 2 to 4:
    the loader is the bottleneck there, and the device thread mostly waits)."""
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:   # not set by torchrun: a stray value is no reason to fail
        local_world = 1
    cpus = max(1, usable_cpus() // max(1, local_world))
    if gpu:
        cpus -= TRAINER_THREADS if cpus > TRAINER_THREADS + 1 else min(1, cpus - 1)
    return max(1, cpus)


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, inf) in nested dicts, lists and tuples turned into None,
    so `json.dumps` writes valid JSON (null) instead of NaN."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def fmt_number(value: float | None, spec: str, suffix: str = "") -> str:
    """`value` formatted with `spec` (e.g. ",.0f") plus `suffix`, or "-" when it is None or not finite."""
    return "-" if value is None or not math.isfinite(value) else f"{value:{spec}}{suffix}"


def poll_until(predicate: Callable[[], object], timeout: float | None, *, stop: threading.Event | None = None,
               on_timeout: Callable[[], BaseException] | None = None,
               pause: tuple[float, float] = POLL_PAUSE_S) -> bool:
    """Wait until `predicate()` is true: return True. Return False as soon as `stop` is set first.

    After `timeout` seconds (None: no limit, only `stop` ends the wait) raise `on_timeout()` (default
    TimeoutError). Polls with short sleeps, 0.2 ms growing to 2 ms, so a wait costs at most ~2 ms of
    latency and little CPU, and never holds a lock Ctrl-C could strand; used only where the thing waited on
    has no waitable handle and no thread to notify (a CUDA event); a hand-off between threads waits
    on a threading.Condition instead (slots.py)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    wait = pause[0]
    while not predicate():
        if stop is not None and stop.is_set():
            return False
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise on_timeout() if on_timeout is not None else TimeoutError(f"no result after {timeout:g} s")
        time.sleep(wait if left is None else min(wait, left))
        wait = min(wait * 2, pause[1])
    return True


def format_bytes(n: int) -> str:
    """'20.5 MiB (21,474,836 bytes)': readable, and exact, so two different sizes never print alike."""
    n = int(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string in binary multiples: '256MiB', '64M', '50GB' (= 50 GiB),
    '1048576'. Raises ConfigError naming the accepted forms."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(f"not a size: {value!r}; use bytes or a string like 256MiB, 64M, 50GB (binary multiples)")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def ratio_words(ratio: float | None, *, faster: str = "faster", slower: str = "slower") -> str:
    """A speed ratio (new / old) in words that follow its sign: 1.9 -> "1.90x faster", 0.25 -> "4.00x
    slower" (never "0.25x faster"), within half a percent of 1 -> "as fast"; "not measured" for
    None, NaN or a ratio that is not positive."""
    if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        return "not measured"
    if abs(ratio - 1.0) < 0.005:
        return "as fast"
    return f"{ratio:.2f}x {faster}" if ratio > 1 else f"{1.0 / ratio:.2f}x {slower}"
