"""Small answers every module may share: the CPUs this process may use, and how a measured number
is written out (JSON null or "-" where it is not a finite number)."""

from __future__ import annotations

import math
import os
from typing import Any


def cpu_ids() -> list[int]:
    """CPU ids this process may run on (its affinity mask where the OS has one)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on; at least 1."""
    return max(1, len(cpu_ids()))


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
