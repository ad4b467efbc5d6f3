"""``path label`` text lists (kind "list"): the common ``train.txt``.

One sample per line, the label after the last run of whitespace (so paths may hold spaces);
blank lines and ``#`` comments are skipped. Labels are typed by :func:`~.base.type_labels`.
Relative paths resolve against the list's folder (or ``root``); no path may leave that root.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceError
from .base import (PathChecker, Source, SourceItem, SourceOptions, check_unique, describe_labels,
                   listing_root, read_text, type_labels)

SUFFIXES = (".txt", ".lst")


def detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in SUFFIXES


def open_list(listing: Path, options: SourceOptions) -> Source:
    root = listing_root(listing, options, "list")
    check = PathChecker(root, listing)
    rows: list[tuple[str, Path, str, int]] = []
    for number, raw in enumerate(read_text(listing).splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.rsplit(None, 1)
        if len(parts) != 2:
            raise SourceError(f"{listing} line {number}: expected '<path> <label>', found {text!r}",
                              path=listing, line=number)
        key, full = check(parts[0].strip(), number)
        rows.append((key, full, parts[1], number))
    if not rows:
        raise SourceError(f"{listing} lists no images (only blank or # lines); expected "
                          "'<path> <label>' lines", path=listing)
    check_unique(((k, n) for k, _, _, n in rows), listing)
    labels, label_type, classes = type_labels([r[2] for r in rows])
    items = [SourceItem(key=k, path=p, label=lab) for (k, p, _, _), lab in zip(rows, labels)]
    return Source(items=items, classes=classes, label_type=label_type, extra_columns={}, root=root,
                  description=f"file list {listing} ({describe_labels(classes, label_type)})", kind="list")
