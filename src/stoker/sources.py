"""Sources: turn what users have into one ordered list of samples.

Supported layouts (``kind``):

- ``"folder"``: an ImageFolder tree ``root/<class>/<image>``; class indices follow the sorted
  class-folder names and files come in torchvision's order, so labels match ``ImageFolder``.
- ``"files"``: a folder of images with no class folders (searched recursively); no labels.
- ``"list"``: a text file of ``<path> <label>`` lines (the common ``train.txt``).
- ``"csv"``: a CSV with a header: a path column, a label column, any extra columns (typed).
- ``"tar"``: WebDataset-style tar files (one ``.tar`` or a folder of them).

Listing is cheap: no image is opened here. Paths never leave the source root: ``..``,
absolute paths elsewhere and symlinks that point out are refused with a ``SourceError``.
"""

from __future__ import annotations

import csv
import io
import os
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import SourceError

__all__ = ["IMAGE_EXTENSIONS", "KINDS", "Source", "SourceItem", "open_source"]

#: File name endings (lower case) treated as images when a folder is listed.
IMAGE_EXTENSIONS: frozenset[str] = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
    ".ppm", ".pgm", ".pbm", ".pnm",
})
KINDS = ("auto", "folder", "files", "list", "csv", "tar")
_LABEL_EXTENSIONS = (".cls", ".txt")


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
    """Read a sample's bytes from a file, or ``size`` bytes at ``offset`` inside a container."""
    if path is not None:
        with open(path, "rb") as f:
            return f.read()
    if container is None:
        raise ValueError("a source item needs a path or a container")
    with open(container, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"{container} is shorter than its index says: wanted {size} bytes "
                      f"at offset {offset}, got {len(data)}")
    return data


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


def open_source(src: str | Path, *, kind: str = "auto", label_column: str | None = "label",
                path_column: str = "path", root: str | Path | None = None) -> Source:
    """List the samples of ``src``.

    ``kind`` is one of ``KINDS``; ``"auto"`` picks: a ``.txt`` file -> list, ``.csv`` -> csv,
    ``.tar`` or a folder of ``.tar`` files -> tar, a folder with images directly inside ->
    files, a folder of class folders -> folder. For lists and CSVs, ``root`` is the folder
    relative paths resolve against and that no path may leave (default: the list's folder).
    ``label_column=None`` reads a CSV without labels. Raises SourceError.
    """
    if kind not in KINDS:
        raise SourceError(f"unknown source kind {kind!r}; expected one of {', '.join(KINDS)}", path=src)
    path = Path(src).expanduser()
    if not path.exists():
        raise SourceError(f"source {path} does not exist; expected an image folder, a .txt list, "
                          "a .csv or a .tar", path=path)
    path = path.resolve()
    if kind == "auto":
        kind = _detect_kind(path)
    if kind in ("folder", "files", "tar") and root is not None:
        raise SourceError(f"root= only applies to list and csv sources, not {kind}", path=path)
    if kind in ("list", "csv"):
        if not path.is_file():
            raise SourceError(f"{kind} source {path} is not a file", path=path)
        base = path.parent if root is None else Path(root).expanduser().resolve()
        if not base.is_dir():
            raise SourceError(f"root {base} is not a folder", path=base)
        if kind == "list":
            return _open_list(path, base)
        return _open_csv(path, base, label_column, path_column)
    if kind == "tar":
        return _open_tar(path)
    if not path.is_dir():
        raise SourceError(f"{kind} source {path} is not a folder", path=path)
    return _open_folder(path) if kind == "folder" else _open_files(path)


def _detect_kind(path: Path) -> str:
    if path.is_file():
        suffix = path.suffix.lower()
        kinds = {".txt": "list", ".lst": "list", ".csv": "csv", ".tar": "tar"}
        if suffix in kinds:
            return kinds[suffix]
        raise SourceError(f"cannot tell what kind of source {path} is from its name; expected a "
                          "folder, .txt, .csv or .tar (or pass kind=...)", path=path)
    entries = _scandir(path)
    loose = sum(1 for e in entries if e.is_file() and _is_image_name(e.name))
    folders = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    if loose and folders:
        raise SourceError(f"{path} holds both {loose} images and {len(folders)} sub-folders; pass "
                          "kind='folder' (sub-folders are classes, loose images are ignored) or "
                          "kind='files' (every image, recursively, unlabelled)", path=path)
    if loose:
        return "files"
    if not folders and any(e.is_file() and e.name.lower().endswith(".tar") for e in entries):
        return "tar"
    return "folder"


# ---------------------------------------------------------------- folders

def _is_image_name(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _scandir(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except PermissionError:
        raise SourceError(f"cannot read folder {folder}: permission denied; fix its permissions "
                          "or pack a folder you can read", path=folder) from None
    except OSError as exc:
        raise SourceError(f"cannot read folder {folder}: {exc.strerror or exc}", path=folder) from None


def _inside(root: Path, real: str) -> bool:
    return real == str(root) or real.startswith(str(root).rstrip(os.sep) + os.sep)


def _walk_images(root: Path, top: Path) -> list[Path]:
    """Image files under ``top`` in torchvision's order (sorted folders, then sorted names).

    Follows symlinks that stay inside ``root``; refuses ones that point out of it.
    """
    found: list[tuple[str, str, Path]] = []
    seen: set[str] = set()
    stack = [top]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:  # a symlink loop or two links to one folder
            continue
        seen.add(real)
        rel_dir = os.path.relpath(folder, top)
        for entry in _scandir(folder):
            if entry.name.startswith("."):
                continue
            full = Path(entry.path)
            if entry.is_symlink() and not _inside(root, os.path.realpath(full)):
                raise SourceError(f"{full} is a symlink that points outside the source root {root}; "
                                  "pack the folder it points to, or copy the file in", path=full)
            if entry.is_dir():
                stack.append(full)
            elif entry.is_file() and _is_image_name(entry.name):
                found.append(("" if rel_dir == "." else rel_dir, entry.name, full))
    found.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in found]


def _key(root: Path, path: Path) -> str:
    return PurePosixPath(*path.relative_to(root).parts).as_posix()


def _require_items(items: list[SourceItem], what: str, path: Path) -> None:
    if not items:
        raise SourceError(f"no images found in {what} {path} (looked for "
                          f"{', '.join(sorted(IMAGE_EXTENSIONS))}); check the path", path=path)


def _open_folder(root: Path) -> Source:
    classes = sorted(e.name for e in _scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise SourceError(f"{root} has no class folders and no images; an ImageFolder source "
                          "looks like ROOT/<class>/<image>", path=root)
    items = []
    for index, name in enumerate(classes):
        for path in _walk_images(root, root / name):
            items.append(SourceItem(key=_key(root, path), path=path, label=index))
    _require_items(items, "ImageFolder", root)
    return Source(items=items, classes=classes, label_type="int64", extra_columns={}, root=root,
                  description=f"ImageFolder {root} ({len(classes)} classes)", kind="folder")


def _open_files(root: Path) -> Source:
    items = [SourceItem(key=_key(root, p), path=p, label=None) for p in _walk_images(root, root)]
    _require_items(items, "folder", root)
    return Source(items=items, classes=None, label_type="none", extra_columns={}, root=root,
                  description=f"image folder {root} (unlabelled)", kind="files")


# ---------------------------------------------------------------- lists and CSVs

class _PathChecker:
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
        if not _inside(self.root, real_parent) or not _inside(self.root, real):
            raise SourceError(f"{self.listing} line {line}: path {text!r} leads outside the source "
                              f"root {self.root}; keep paths inside it or pass root=<a folder that "
                              "holds them>", path=self.listing, line=line)
        return PurePosixPath(*full.relative_to(self.root).parts).as_posix(), full


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except PermissionError:
        raise SourceError(f"cannot read {path}: permission denied", path=path) from None
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}", path=path) from None


def _type_labels(raw: list[str]) -> tuple[list[Any], str, list[str] | None]:
    """Integers stay integers, numbers become floats, anything else is a class name."""
    for parse, label_type in ((int, "int64"), (float, "float64")):
        try:
            return [parse(v) for v in raw], label_type, None
        except ValueError:
            pass
    classes = sorted(set(raw))
    index = {name: i for i, name in enumerate(classes)}
    return [index[v] for v in raw], "int64", classes


def _check_unique(keys: Iterable[tuple[str, int]], listing: Path) -> None:
    first: dict[str, int] = {}
    for key, line in keys:
        if key in first:
            raise SourceError(f"{listing} line {line}: {key!r} is already listed on line {first[key]}; "
                              "each image may appear once", path=listing, line=line)
        first[key] = line


def _open_list(listing: Path, root: Path) -> Source:
    check = _PathChecker(root, listing)
    rows: list[tuple[str, Path, str, int]] = []
    for number, raw in enumerate(_read_text(listing).splitlines(), start=1):
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
    _check_unique(((k, n) for k, _, _, n in rows), listing)
    labels, label_type, classes = _type_labels([r[2] for r in rows])
    items = [SourceItem(key=k, path=p, label=lab) for (k, p, _, _), lab in zip(rows, labels)]
    what = f"{len(classes)} classes" if classes else f"{label_type} labels"
    return Source(items=items, classes=classes, label_type=label_type, extra_columns={}, root=root,
                  description=f"file list {listing} ({what})", kind="list")


def _column_type(values: list[str]) -> tuple[str, Callable[[str], Any]]:
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


def _open_csv(listing: Path, root: Path, label_column: str | None, path_column: str) -> Source:
    reader = csv.reader(io.StringIO(_read_text(listing)))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise SourceError(f"{listing} is empty; expected a header line naming the "
                          f"{path_column!r} column", path=listing) from None
    except csv.Error as exc:
        raise SourceError(f"{listing} line 1: {exc}", path=listing, line=1) from None
    for name in (path_column, label_column):
        if name is not None and name not in header:
            hint = " (pass label_column=None for unlabelled data)" if name == label_column else ""
            raise SourceError(f"{listing}: no {name!r} column in the header {header}{hint}", path=listing, line=1)
    check = _PathChecker(root, listing)
    rows: list[tuple[str, Path, dict[str, str], int]] = []
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
    except csv.Error as exc:
        raise SourceError(f"{listing} line {reader.line_num}: {exc}", path=listing, line=reader.line_num) from None
    if not rows:
        raise SourceError(f"{listing} has a header but no rows", path=listing)
    _check_unique(((k, n) for k, _, _, n in rows), listing)
    extra_names = [h for h in header if h not in (path_column, label_column)]
    extra_columns, parsers = {}, {}
    for name in extra_names:
        extra_columns[name], parsers[name] = _column_type([r[2][name] for r in rows])
    if label_column is None:
        labels, label_type, classes = [None] * len(rows), "none", None
    else:
        labels, label_type, classes = _type_labels([r[2][label_column].strip() for r in rows])
    items = [SourceItem(key=k, path=p, label=lab, extras={n: parsers[n](c[n]) for n in extra_names})
             for (k, p, c, _), lab in zip(rows, labels)]
    what = f"{len(classes)} classes" if classes else f"{label_type} labels"
    return Source(items=items, classes=classes, label_type=label_type, extra_columns=extra_columns,
                  root=root, description=f"CSV {listing} ({what}, {len(extra_names)} extra columns)", kind="csv")


# ---------------------------------------------------------------- tar shards

def _tar_members(tar_path: Path, prefix: str) -> tuple[list[SourceItem], list[str | None]]:
    """Images and their label text from one uncompressed tar, grouped by WebDataset key."""
    try:
        tf = tarfile.open(tar_path, mode="r:")
    except (tarfile.TarError, OSError) as exc:
        raise SourceError(f"cannot read {tar_path} as an uncompressed tar ({exc}); decompress "
                          ".tar.gz files first", path=tar_path) from None
    images: dict[str, tarfile.TarInfo] = {}
    labels: dict[str, str] = {}
    with tf:
        for m in tf:
            if not m.isfile():
                continue
            folder, _, base = m.name.rpartition("/")
            stem, dot, ext = base.partition(".")
            group = f"{folder}/{stem}" if folder else stem
            if ("." + ext.lower()) in IMAGE_EXTENSIONS and group not in images:
                images[group] = m
            elif ("." + ext.lower()) in _LABEL_EXTENSIONS and group not in labels:
                labels[group] = tf.extractfile(m).read().decode("utf-8", "replace").strip()
    items, raw = [], []
    for group in sorted(images):
        m = images[group]
        items.append(SourceItem(key=prefix + m.name, path=None, label=None, container=tar_path,
                                offset=m.offset_data, size=m.size))
        raw.append(labels.get(group))
    return items, raw


def _open_tar(path: Path) -> Source:
    if path.is_dir():
        tars = sorted(p for p in path.iterdir() if p.suffix.lower() == ".tar" and p.is_file())
        if not tars:
            raise SourceError(f"{path} holds no .tar files", path=path)
        root = path
    else:
        tars, root = [path], path.parent
    items: list[SourceItem] = []
    raw: list[str | None] = []
    for tar_path in tars:
        got, got_raw = _tar_members(tar_path, f"{tar_path.name}/" if path.is_dir() else "")
        items += got
        raw += got_raw
    _require_items(items, "tar source", path)
    labelled = [r for r in raw if r is not None]
    classes = None
    if not labelled:
        label_type = "none"
    elif len(labelled) != len(raw):
        missing = items[raw.index(None)].key
        raise SourceError(f"{path}: {missing} has no .cls or .txt label while others do; label "
                          "every sample or none", path=path)
    else:
        labels, label_type, classes = _type_labels(labelled)
        items = [SourceItem(key=i.key, path=None, label=lab, container=i.container, offset=i.offset,
                            size=i.size) for i, lab in zip(items, labels)]
    return Source(items=items, classes=classes, label_type=label_type, extra_columns={}, root=root,
                  description=f"tar {path} ({len(tars)} files, {len(items)} samples)", kind="tar")
