"""The source interface: what every input format hands to the packer and the loose reader.

A format is one module with two functions, registered as a ``Format(open, detect)`` line in
``FORMATS`` (``stoker/sources/__init__.py``):

- ``open(path, options) -> Source``: list every sample of ``path`` (a resolved local path) in a
  deterministic order. Listing is cheap: no image is opened. Each sample is a :class:`SourceItem`:
  a ``key`` (unique, stable: the relative posix path or the member/record id), where its encoded
  bytes are (``path``, or ``size`` bytes at ``offset`` inside ``container``), its ``label`` and its
  ``extras`` (one value per extra column).
- ``detect(path) -> bool``: True when ``path`` looks like this format (used by ``kind="auto"``).

Labels and columns are declared on the :class:`Source`: ``label_type`` is a manifest type name
("int64", "float64", "string", list types, or "none" for unlabelled data); ``classes`` names the
classes when labels are class indices (:func:`type_labels` turns raw label text into either);
``extra_columns`` maps each extra column to its Arrow type name (see ``stoker.shards.ARROW_TYPES``).

Bad records: anything that makes the listing itself wrong (a missing file, a malformed line, a
duplicate key, a path leaving the source root) raises :class:`~stoker.errors.SourceError` naming the
file and line. A listed image that later cannot be read or decoded is not the source's business:
the packer skips it and logs why.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import SourceError
from ..storage.local import read_regular

__all__ = ["IMAGE_EXTENSIONS", "Source", "SourceItem", "SourceOptions", "read_bytes"]

#: File name endings (lower case) treated as images when a folder is listed.
IMAGE_EXTENSIONS: frozenset[str] = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
    ".ppm", ".pgm", ".pbm", ".pnm",
})


@dataclass(frozen=True)
class SourceItem:
    """One sample as listed: where its bytes are, its label and its extra fields.

    ``key`` is the path relative to the source root (posix), or the member name in a tar.
    ``path`` is the absolute file path, or None when the bytes sit inside ``container``
    (a tar file) at ``offset`` for ``size`` bytes.
    """

    key: str
    path: Path | None
    label: Any
    extras: dict[str, Any] = field(default_factory=dict)
    container: Path | None = None
    offset: int = 0
    size: int = 0

    def read(self) -> bytes:
        """The encoded image bytes. Raises OSError when the file cannot be read."""
        return read_bytes(self.path, self.container, self.offset, self.size)


def read_bytes(path: Path | str | None, container: Path | str | None = None,
               offset: int = 0, size: int = 0) -> bytes:
    """Read a sample's bytes from a file, or ``size`` bytes at ``offset`` inside a container.

    Only regular files are read, checked on the opened descriptor (a FIFO or a device listed as
    an image is an OSError at once, never a hang), and never more than the file's size when it
    was opened (see :func:`stoker.storage.local.read_regular`)."""
    if path is not None:
        return read_regular(path)
    if container is None:
        raise ValueError("a source item needs a path or a container")
    return read_regular(container, offset, size)


@dataclass
class Source:
    """Samples in a deterministic order, with what the shards need to know about labels."""

    items: list[SourceItem]
    classes: list[str] | None   # class names when labels are class indices
    label_type: str             # "int64", "float64", "string", "none" (as Manifest.label_type)
    extra_columns: dict[str, str]   # name -> Arrow type string
    root: Path
    description: str            # e.g. "ImageFolder /data/train (1000 classes)"
    kind: str = "folder"

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class SourceOptions:
    """Options a format may use. ``root``: the folder that relative paths in a list or table
    resolve against and that no listed path may leave (None: the list's own folder).
    ``label_column``/``path_column``: column names in a table (``label_column=None``: unlabelled)."""

    root: Path | None = None
    label_column: str | None = "label"
    path_column: str = "path"


# ---------------------------------------------------------------- helpers shared by formats

def is_image_name(name: str) -> bool:
    """A visible file whose ending is in IMAGE_EXTENSIONS."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def scandir(folder: Path) -> list[os.DirEntry]:
    """The entries of ``folder``; unreadable folders are a SourceError naming it."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except PermissionError:
        raise SourceError(f"cannot read folder {folder}: permission denied; fix its permissions "
                          "or pack a folder you can read", path=folder) from None
    except OSError as exc:
        raise SourceError(f"cannot read folder {folder}: {exc.strerror or exc}", path=folder) from None


def inside(root: Path, real: str) -> bool:
    """True when the real path ``real`` is ``root`` or below it."""
    return real == str(root) or real.startswith(str(root).rstrip(os.sep) + os.sep)


def make_key(root: Path, path: Path) -> str:
    """A sample key: ``path`` relative to ``root``, in posix form."""
    return PurePosixPath(*path.relative_to(root).parts).as_posix()


def require_items(items: list[SourceItem], what: str, path: Path) -> None:
    """Refuse a source that lists no image at all."""
    if not items:
        raise SourceError(f"no images found in {what} {path} (looked for "
                          f"{', '.join(sorted(IMAGE_EXTENSIONS))}); check the path", path=path)


def read_text(path: Path) -> str:
    """A UTF-8 text file (BOM allowed); unreadable or non-UTF-8 files are a SourceError."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except PermissionError:
        raise SourceError(f"cannot read {path}: permission denied", path=path) from None
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}", path=path) from None


def type_labels(raw: list[str]) -> tuple[list[Any], str, list[str] | None]:
    """(labels, label_type, classes): integers stay integers, numbers become floats, anything
    else is a class name (classes sorted, labels their indices)."""
    for parse, label_type in ((int, "int64"), (float, "float64")):
        try:
            return [parse(v) for v in raw], label_type, None
        except ValueError:
            pass
    classes = sorted(set(raw))
    index = {name: i for i, name in enumerate(classes)}
    return [index[v] for v in raw], "int64", classes


def check_unique(keys: Iterable[tuple[str, int]], listing: Path) -> None:
    """Refuse a key listed twice; ``keys`` are (key, line number) pairs."""
    first: dict[str, int] = {}
    for key, line in keys:
        if key in first:
            raise SourceError(f"{listing} line {line}: {key!r} is already listed on line {first[key]}; "
                              "each image may appear once", path=listing, line=line)
        first[key] = line


class PathChecker:
    """Resolve listed paths against ``root`` and refuse any that leave it.

    Folder real paths are cached, so a million-line list costs about one lstat per file.
    """

    def __init__(self, root: Path, listing: Path) -> None:
        self.root = root
        self.listing = listing
        self._dirs: dict[str, str] = {}

    def __call__(self, text: str, line: int) -> tuple[str, Path]:
        candidate = Path(text)
        full = Path(os.path.normpath(candidate if candidate.is_absolute() else self.root / candidate))
        parent = str(full.parent)
        real_parent = self._dirs.get(parent)
        if real_parent is None:
            real_parent = self._dirs[parent] = os.path.realpath(parent)
        real = os.path.join(real_parent, full.name)
        if os.path.islink(real):
            real = os.path.realpath(real)
        if not inside(self.root, real_parent) or not inside(self.root, real):
            raise SourceError(f"{self.listing} line {line}: path {text!r} leads outside the source "
                              f"root {self.root}; keep paths inside it or pass root=<a folder that "
                              "holds them>", path=self.listing, line=line)
        return make_key(self.root, full), full


def listing_root(listing: Path, options: SourceOptions, kind: str) -> Path:
    """The folder a list or table's paths resolve against (checked to be a folder)."""
    if not listing.is_file():
        raise SourceError(f"{kind} source {listing} is not a file", path=listing)
    base = listing.parent if options.root is None else Path(options.root).expanduser().resolve()
    if not base.is_dir():
        raise SourceError(f"root {base} is not a folder", path=base)
    return base


def describe_labels(classes: list[str] | None, label_type: str) -> str:
    return f"{len(classes)} classes" if classes else f"{label_type} labels"
