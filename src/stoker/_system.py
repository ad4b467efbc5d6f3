"""The CPUs this process may use: the one answer every default thread or worker count starts from."""

from __future__ import annotations

import os


def cpu_ids() -> list[int]:
    """CPU ids this process may run on (its affinity mask where the OS has one)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on; at least 1."""
    return max(1, len(cpu_ids()))
