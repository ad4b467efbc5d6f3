"""CSV tables (kind "csv"): a header, a path column, a label column, any extra columns.

Named ``table`` so it does not shadow the standard library's ``csv`` inside this package.
Extra columns are typed from their values (int64, float64 with blanks as NaN, else string);
labels by :func:`~.base.type_labels`. Paths resolve and are checked as for lists. ``mask_column``
names a column of label-map paths (one PNG of class ids per image, resolved like the image paths):
the packer stores each file's bytes in a binary column of that name (``SourceItem.label_maps``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import SourceError
from .base import (ListedPaths, Source, SourceItem, SourceOptions, check_unique, describe_labels,
                   listing_root, read_text, split_label_cell, type_any_labels)


def detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".csv"


def column_type(values: list[str]) -> tuple[str, Callable[[str], Any]]:
    """(Arrow type name, parser) for one extra column's text values."""
    def as_float(v: str) -> float:
        return float(v) if v.strip() else float("nan")
    if values and all(v.strip() for v in values):
        try:
            [int(v) for v in values]
            return "int64", int
        except ValueError:
            pass
    try:
        [as_float(v) for v in values]
        if any(v.strip() for v in values):
            return "float64", as_float
    except ValueError:
        pass
    return "string", str


def _mask_path(check: ListedPaths, cell: str, listing: Path, number: int) -> Path:
    """A row's label-map path, resolved like its image path; an empty cell is refused (a sample
    without its mask would train on nothing)."""
    if not cell.strip():
        raise SourceError(f"{listing} line {number}: the mask column is empty; every row needs its label map "
                          "(drop the row, or pack without --mask-column / mask_column=)", path=listing, line=number)
    return check(cell.strip(), number)[1]


def open_csv(listing: Path, options: SourceOptions) -> Source:
    base, root = listing_root(listing, options, "csv")
    label_column, path_column, mask_column = options.label_column, options.path_column, options.mask_column
    reader = csv.reader(io.StringIO(read_text(listing)))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise SourceError(f"{listing} is empty; expected a header line naming the "
                          f"{path_column!r} column", path=listing) from None
    except csv.Error as exc:
        raise SourceError(f"{listing} line 1: {exc}", path=listing, line=1) from None
    for name in (path_column, label_column, mask_column):
        if name is not None and name not in header:
            flag = {path_column: ("path_column=", "--path-column"), label_column: ("label_column=", "--label-column"),
                    mask_column: ("mask_column=", "--mask-column")}[name]
            what = {path_column: "the image paths", label_column: "the labels", mask_column: "the label maps"}[name]
            unlabelled = " ({none} for unlabelled data)" if name == label_column else ""
            raise SourceError.spelled(f"{listing}: no {name!r} column in the header {header}; pass {{column}} "
                                      f"with the column holding {what}{unlabelled}",
                                      {"column": (f"{flag[0]}NAME", f"{flag[1]} NAME"),
                                       "none": ("label_column=None", "--no-labels")}, path=listing, line=1)
    check = ListedPaths(base, listing, root)
    rows: list[tuple[str, Path, dict[str, str], int]] = []
    maps: list[dict[str, Path]] = []
    try:
        for row in reader:
            number = reader.line_num
            if not row or not any(c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise SourceError(f"{listing} line {number}: expected {len(header)} fields like the "
                                  f"header, found {len(row)}", path=listing, line=number)
            cells = dict(zip(header, row))
            key, full = check(cells[path_column].strip(), number)
            rows.append((key, full, cells, number))
            maps.append({} if mask_column is None else {mask_column: _mask_path(check, cells[mask_column], listing,
                                                                                number)})
    except csv.Error as exc:
        raise SourceError(f"{listing} line {reader.line_num}: {exc}", path=listing, line=reader.line_num) from None
    if not rows:
        raise SourceError(f"{listing} has a header but no rows", path=listing)
    check_unique(((k, n) for k, _, _, n in rows), listing)
    extra_names = [h for h in header if h not in (path_column, label_column, mask_column)]
    extra_columns, parsers = {}, {}
    for name in extra_names:
        extra_columns[name], parsers[name] = column_type([r[2][name] for r in rows])
    if mask_column is not None:
        extra_columns[mask_column] = "binary"
    if label_column is None:
        labels, label_type, classes = [None] * len(rows), "none", None
    else:
        where = [f"{listing} line {n}" for _, _, _, n in rows]
        cells = [r[2][label_column].strip() for r in rows]
        split = [split_label_cell(c, w) for c, w in zip(cells, where)]
        cells = [c if parts is None else parts for c, parts in zip(cells, split)]
        labels, label_type, classes = type_any_labels(cells, where)
    items = [SourceItem(key=k, path=p, label=lab, extras={n: parsers[n](c[n]) for n in extra_names}, label_maps=m)
             for (k, p, c, _), lab, m in zip(rows, labels, maps)]
    what = describe_labels(classes, label_type)
    return Source(items=items, classes=classes, label_type=label_type, extra_columns=extra_columns,
                  root=base, kind="csv", description=f"CSV {listing} ({what}, {len(extra_names)} extra columns"
                                                     f"{'' if mask_column is None else f', label maps in {mask_column!r}'})")
