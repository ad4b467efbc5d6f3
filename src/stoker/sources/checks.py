"""What every format's listing goes through before it is packed: labels and extras the shards can hold.

Each format types its labels and extra fields the way its files describe them; the shards need
more than that, and a pack that exits 0 must open. So, for every source:

- class names are text (numbers become their text; anything else is refused);
- an integer label must be one of the classes when there are classes: a negative one (Hugging
  Face's ``-1``, "no label") is skipped with a reason, one past the end of the class list (a names
  list shorter than the labels) fails the listing naming the sample; a label outside int64 (a
  uint64 above 2**63) is skipped with a reason;
- an extra field named like a built-in column (``key``, ``image``, ``encoding``, ``height``,
  ``width``, ``label``: img2dataset's ``.json`` has key, width and height) is stored as
  ``source_<name>``; ``columns=`` (``--columns``) keeps only the extras named;
- an integer extra column holding a value outside int64 is stored as text (no digit lost).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..errors import SourceError
from ..shards import BASE_COLUMNS
from .base import Source, SourceItem

__all__ = ["checked_source"]

_log = logging.getLogger("stoker.sources")
_INT64 = (-(2**63), 2**63 - 1)
_PREFIX = "source_"


def checked_source(source: Source, columns: Sequence[str] | None = None) -> Source:
    """`source` with the checks of the module docstring applied (a new Source; the items it skips
    go to its ``skipped`` list). Raises SourceError naming the sample or the column."""
    source = _class_names(source)
    source = _labels(source)
    source = _rename_extras(source)
    if columns is not None:
        source = _select_extras(source, columns)
    return _wide_ints(source)


def _class_names(source: Source) -> Source:
    if source.classes is None:
        return source
    names = []
    for k, name in enumerate(source.classes):
        if isinstance(name, str):
            names.append(name)
        elif isinstance(name, (int, float)) and not isinstance(name, bool):
            names.append(str(name))
        else:
            raise SourceError(f"{source.description}: class name {k} is {name!r} ({type(name).__name__}); class "
                              "names must be text or numbers: fix the class list, or pass label_column=None "
                              "(--no-labels)", path=str(source.root))
    return replace(source, classes=names)


def _labels(source: Source) -> Source:
    if source.label_type not in ("int64", "list<int64>"):
        return source
    n = None if source.classes is None else len(source.classes)
    keep: list[SourceItem] = []
    skipped = list(source.skipped)
    for item in source.items:
        values = item.label if isinstance(item.label, list) else [item.label]
        reason = None
        for v in values:
            if not _INT64[0] <= v <= _INT64[1]:
                reason = f"label {v} does not fit a 64-bit integer, so it is not a class index"
            elif n is not None and v < 0:
                reason = (f"label {v} is not one of the {n} classes (Hugging Face writes -1 for 'no label'); pass "
                          "label_column=None (--no-labels) to pack the images without labels")
            elif n is not None and v >= n:
                raise SourceError(f"sample {item.key} ({item.where()}) has label {v}, but the class list names only "
                                  f"{n} classes (0..{n - 1}); fix the class list (its names), or pass "
                                  "label_column=None (--no-labels) to pack without labels", path=item.where())
            if reason is not None:
                break
        if reason is None:
            keep.append(item)
        else:
            skipped.append({"key": item.key, "path": item.where(), "reason": reason})
    if not keep:
        raise SourceError(f"{source.description}: no sample has a usable label ({skipped[-1]['reason']})",
                          path=str(source.root))
    return replace(source, items=keep, skipped=skipped) if len(keep) != len(source.items) else source


def _rename_extras(source: Source) -> Source:
    clashing = [name for name in source.extra_columns if name in BASE_COLUMNS]
    if not clashing:
        return source
    names = dict.fromkeys(source.extra_columns)
    renames: dict[str, str] = {}
    for name in clashing:
        new = _PREFIX + name
        while new in names or new in BASE_COLUMNS:
            new = _PREFIX + new
        renames[name] = new
        names[new] = None
    _log.warning("%s: extra field(s) named like built-in columns stored as %s", source.description,
                 ", ".join(f"{old!r} -> {new!r}" for old, new in renames.items()))
    extra_columns = {renames.get(n, n): t for n, t in source.extra_columns.items()}
    items = [replace(item, extras={renames.get(n, n): v for n, v in item.extras.items()},
                     label_maps={renames.get(n, n): p for n, p in item.label_maps.items()})
             for item in source.items]
    return replace(source, items=items, extra_columns=extra_columns,
                   description=f"{source.description}; renamed {', '.join(f'{o}->{n}' for o, n in renames.items())}")


def _select_extras(source: Source, columns: Sequence[str]) -> Source:
    wanted = list(dict.fromkeys(columns))
    unknown = [c for c in wanted if c not in source.extra_columns]
    if unknown:
        raise SourceError(f"{source.description}: no extra column(s) {unknown}; its extra columns are "
                          f"{list(source.extra_columns)} (built-in names are stored as {_PREFIX}<name>); fix "
                          "columns= (--columns)", path=str(source.root))
    maps = sorted({c for item in source.items for c in item.label_maps} - set(wanted))
    if maps:
        raise SourceError(f"{source.description}: columns= (--columns) leaves out the label-map column {maps[0]!r}; "
                          "name it too, or pack without mask_column= (--mask-column)", path=str(source.root))
    extra_columns = {c: source.extra_columns[c] for c in wanted}
    items = [replace(item, extras={c: item.extras[c] for c in wanted if c in item.extras}) for item in source.items]
    return replace(source, items=items, extra_columns=extra_columns)


def _wide_ints(source: Source) -> Source:
    wide = [c for c, t in source.extra_columns.items() if t in ("int64", "list<int64>")
            and any(not _fits(item.extras.get(c)) for item in source.items)]
    if not wide:
        return source
    _log.warning("%s: extra column(s) %s hold integers outside int64; stored as text", source.description, wide)
    extra_columns = {c: ("string" if c in wide else t) for c, t in source.extra_columns.items()}
    items = [replace(item, extras={c: (_text(v) if c in wide else v) for c, v in item.extras.items()})
             for item in source.items]
    return replace(source, items=items, extra_columns=extra_columns)


def _fits(value: Any) -> bool:
    if isinstance(value, list):
        return all(map(_fits, value))
    return not isinstance(value, int) or _INT64[0] <= value <= _INT64[1]


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return str(value) if not isinstance(value, list) else "[" + ", ".join(map(str, value)) + "]"
