"""``path label`` text lists (kind "list"): the common ``train.txt``.

One sample per line, the label after the last run of whitespace (so paths may hold spaces), or
several numeric labels after the path (``a.jpg 1 3 7``: multi-label, every line then gets a list);
blank lines and ``#`` comments are skipped. Labels are typed by :func:`~.base.type_labels`.
The list is the user's own, trusted input: absolute paths are used as written, relative paths
resolve against the list's folder, and ``root`` (``--root``) makes keys relative to a folder.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceError
from .base import (ListedPaths, Source, SourceItem, SourceOptions, check_unique, describe_labels,
                   is_number, listing_root, read_text, type_any_labels)

SUFFIXES = (".txt", ".lst")


def detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in SUFFIXES


def split_line(text: str) -> tuple[str, list[str]]:
    """``<path> <label>`` (the path may hold spaces) or ``<path> <l1> <l2> ...`` (multi-label:
    every token after the first is a number)."""
    tokens = text.split()
    if len(tokens) > 2 and all(is_number(t) for t in tokens[1:]):
        return tokens[0], tokens[1:]
    path, label = text.rsplit(None, 1)
    return path.strip(), [label]


def open_list(listing: Path, options: SourceOptions) -> Source:
    base, root = listing_root(listing, options, "list")
    check = ListedPaths(base, listing, root)
    rows: list[tuple[str, Path, list[str], int]] = []
    for number, raw in enumerate(read_text(listing).splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        if len(text.split(None, 1)) != 2:
            raise SourceError(f"{listing} line {number}: expected '<path> <label>' (or '<path> <label> "
                              f"<label> ...' for multi-label), found {text!r}", path=listing, line=number)
        path, labels = split_line(text)
        key, full = check(path, number)
        rows.append((key, full, labels, number))
    if not rows:
        raise SourceError(f"{listing} lists no images (only blank or # lines); expected "
                          "'<path> <label>' lines", path=listing)
    check_unique(((k, n) for k, _, _, n in rows), listing)
    where = [f"{listing} line {n}" for _, _, _, n in rows]
    multi = any(len(r[2]) > 1 for r in rows)
    cells = [r[2] if multi else r[2][0] for r in rows]
    labels, label_type, classes = type_any_labels(cells, where)
    items = [SourceItem(key=k, path=p, label=lab) for (k, p, _, _), lab in zip(rows, labels)]
    return Source(items=items, classes=classes, label_type=label_type, extra_columns={}, root=base,
                  description=f"file list {listing} ({describe_labels(classes, label_type)})", kind="list")
