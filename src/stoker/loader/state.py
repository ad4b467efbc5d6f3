"""A saved Loader state checked whole before any of it is used: every field of the type and range a
`state_dict()` writes, `remaining`'s ranges increasing and disjoint, the batch count agreeing with the
sample cursor. A hand-merged or forged state is refused naming the field, never half-applied: a range
listed twice would otherwise make the resumed ranks read those samples twice."""
from __future__ import annotations

import numbers
from typing import Any

from ..errors import ConfigError

#: field -> (what it must be, whether None is allowed)
_INTS = {"epoch": 0, "batch": 0, "sample": 0, "batch_size": 1, "world_size": 1, "num_samples": 0}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _refuse(field: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"saved loader state: {field!r} must be {expected}, got {value!r:.120}; pass "
                       f"load_state_dict() a state that Loader.state_dict() wrote, unmodified")


def check_state(state: dict[str, Any]) -> None:
    """Raise ConfigError naming the first field of `state` that no `state_dict()` could have written."""
    for name, low in _INTS.items():
        if name not in state or (name == "sample" and state[name] is None):
            continue
        value = state[name]
        if not _is_int(value) or value < low:
            raise _refuse(name, f"an int >= {low}", value)
    for name in ("drop_last", "requeued"):
        if name in state and not isinstance(state[name], bool):
            raise _refuse(name, "True or False", state[name])
    if "order" in state and not isinstance(state["order"], str):
        raise _refuse("order", "a str", state["order"])
    if "epoch" not in state:
        raise _refuse("epoch", "an int >= 0", None)
    sample, batch, size = state.get("sample"), state.get("batch"), state.get("batch_size")
    if sample is not None and batch is not None and size is not None and batch != -(-sample // size):
        raise ConfigError(f"saved loader state: 'batch' {batch} does not add up with 'sample' {sample} at "
                          f"'batch_size' {size} (expected {-(-sample // size)}); pass load_state_dict() a state "
                          f"that Loader.state_dict() wrote, unmodified")
    remaining = state.get("remaining")
    if remaining is not None:
        check_ranges(remaining)


def check_ranges(ranges: Any) -> None:
    """`remaining`: a list of [start, stop) int pairs, each non-empty, increasing and disjoint (as
    `order.to_ranges` writes them)."""
    if not isinstance(ranges, (list, tuple)):
        raise _refuse("remaining", "a list of [start, stop) pairs", ranges)
    prev = None
    for pair in ranges:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(_is_int(v) for v in pair):
            raise _refuse("remaining", "a list of [start, stop) int pairs", pair)
        start, stop = pair
        if not 0 <= start < stop:
            raise _refuse("remaining", "pairs with 0 <= start < stop", list(pair))
        if prev is not None and start < prev[1]:
            kind = "repeats" if list(pair) == list(prev) else "overlaps or comes before"
            raise ConfigError(f"saved loader state: 'remaining' range {list(pair)} {kind} the range {list(prev)} "
                              f"before it: the ranges must be increasing and disjoint (a sample listed twice would "
                              f"be read twice); pass load_state_dict() a state that Loader.state_dict() wrote, "
                              f"unmodified")
        prev = pair
