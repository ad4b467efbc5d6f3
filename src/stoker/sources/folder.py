"""Image folders: an ImageFolder tree ``root/<class>/<image>`` (kind "folder"), a folder of
unlabelled images searched recursively (kind "files"), and images paired with their segmentation
label maps, ``root/images/<path>.<ext>`` with ``root/masks/<path>.png`` (kind "segmentation").

Class indices follow the sorted class-folder names and files come in torchvision's order, so
labels match ``ImageFolder``. Symlinks are followed while they stay inside the source root; one
pointing out of it is refused (a shared folder must not pull in files from elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import SourceError
from .base import Source, SourceItem, SourceOptions, inside, is_sample_name, make_key, require_items, scandir


def _entries(path: Path) -> tuple[int, list[str]]:
    """(number of loose images, names of visible sub-folders) directly in ``path``."""
    entries = scandir(path)
    loose = sum(1 for e in entries if e.is_file() and is_sample_name(e.name))
    return loose, [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]


def detect_files(path: Path) -> bool:
    """A folder with images directly inside (and no class folders beside them)."""
    if not path.is_dir():
        return False
    loose, folders = _entries(path)
    if loose and folders:
        raise SourceError.spelled(f"{path} holds both {loose} images and {len(folders)} sub-folders; pass "
                                  "{folder} (sub-folders are classes, loose images are ignored) or "
                                  "{files} (every image, recursively, unlabelled)",
                                  {"folder": ("kind='folder'", "--kind folder"),
                                   "files": ("kind='files'", "--kind files")}, path=path)
    return bool(loose)


def detect_folder(path: Path) -> bool:
    """Any folder: the fallback once no other folder format matched."""
    return path.is_dir()


def _require_folder(path: Path, kind: str) -> None:
    if not path.is_dir():
        raise SourceError(f"{kind} source {path} is not a folder", path=path)


def walk_images(root: Path, top: Path) -> list[tuple[Path, int]]:
    """(path, inode) of the image files under ``top`` in torchvision's order (sorted folders, then
    sorted names).

    Follows symlinks that stay inside ``root``; refuses ones that point out of it. The inode (of
    the file a symlink points to) lets a read check it opened the file listed here: one swapped
    for a symlink to elsewhere after listing is refused then (time of check, time of use).
    """
    found: list[tuple[str, str, Path, int]] = []
    seen: set[str] = set()
    stack = [top]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:  # a symlink loop or two links to one folder
            continue
        seen.add(real)
        rel_dir = os.path.relpath(folder, top)
        for entry in scandir(folder):
            if entry.name.startswith("."):
                continue
            full = Path(entry.path)
            if entry.is_symlink() and not inside(root, os.path.realpath(full)):
                raise SourceError(f"{full} is a symlink that points outside the source root {root} (refused: a "
                                  "downloaded tree must not make a pack read elsewhere); pack the folder it points "
                                  "to, or copy the file in; for a tree you trust, write its images to a file list "
                                  "('path label' lines, e.g. train.txt) and pack that: a list is your own input, "
                                  "and its paths are read as written, links included", path=full)
            if entry.is_dir():
                stack.append(full)
            elif entry.is_file() and is_sample_name(entry.name):
                # DirEntry.inode() is free (from readdir); a symlink costs one stat for its target's
                inode = entry.stat().st_ino if entry.is_symlink() else entry.inode()
                found.append(("" if rel_dir == "." else rel_dir, entry.name, full, inode))
    found.sort(key=lambda t: (t[0], t[1]))
    return [(p, inode) for _, _, p, inode in found]


def open_folder(root: Path, options: SourceOptions) -> Source:
    """An ImageFolder tree: every sub-folder is a class, its images (recursively) its samples."""
    _require_folder(root, "folder")
    classes = sorted(e.name for e in scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise SourceError(f"{root} has no class folders and no images; an ImageFolder source "
                          "looks like ROOT/<class>/<image>", path=root)
    items = []
    for index, name in enumerate(classes):
        for path, inode in walk_images(root, root / name):
            items.append(SourceItem(key=make_key(root, path), path=path, label=index, inode=inode))
    require_items(items, "ImageFolder", root)
    return Source(items=items, classes=classes, label_type="int64", extra_columns={}, root=root,
                  description=f"ImageFolder {root} ({len(classes)} classes)", kind="folder")


def open_files(root: Path, options: SourceOptions) -> Source:
    """Every image under ``root``, recursively, unlabelled."""
    _require_folder(root, "files")
    items = [SourceItem(key=make_key(root, p), path=p, label=None, inode=inode)
             for p, inode in walk_images(root, root)]
    require_items(items, "folder", root)
    return Source(items=items, classes=None, label_type="none", extra_columns={}, root=root,
                  description=f"image folder {root} (unlabelled)", kind="files")


#: kind "segmentation": the two folders of ROOT, and the extra column the label maps are packed into
SEGMENTATION_FOLDERS = ("images", "masks")
MASK_COLUMN = "mask"


def detect_segmentation(path: Path) -> bool:
    """A folder holding exactly the folders ``images`` and ``masks`` (never an ImageFolder: a
    two-class tree of those names would be a segmentation dataset read wrong)."""
    if not path.is_dir():
        return False
    loose, folders = _entries(path)
    return not loose and sorted(folders) == sorted(SEGMENTATION_FOLDERS)


def open_segmentation(root: Path, options: SourceOptions) -> Source:
    """Every image under ``root/images`` (recursively, unlabelled), each with its label map: the PNG
    of the same relative path under ``root/masks`` (``images/a/x.jpg`` -> ``masks/a/x.png``), packed
    into the binary column "mask". An image without its map is left out with a reason naming the
    file it looked for; a map that is a symlink out of ``root`` is refused like an image."""
    _require_folder(root, "segmentation")
    images, masks = (root / name for name in SEGMENTATION_FOLDERS)
    for folder in (images, masks):
        if not folder.is_dir():
            raise SourceError(f"segmentation source {root} needs the folders images/ and masks/ (label-map "
                              f"PNGs of the same relative paths); {folder} is missing", path=root)
    items, skipped = [], []
    for path, inode in walk_images(root, images):
        key = make_key(root, path)
        mask = masks / path.relative_to(images).with_suffix(".png")
        if not mask.is_file():
            skipped.append({"key": key, "path": str(path), "reason": f"no label map {mask}: each image needs "
                            "masks/<its path under images/, ending .png>"})
            continue
        if not inside(root, os.path.realpath(mask)):
            raise SourceError(f"{mask} is a symlink that points outside the source root {root}; copy the "
                              "file in", path=mask)
        items.append(SourceItem(key=key, path=path, label=None, inode=inode, label_maps={MASK_COLUMN: mask}))
    if not items and not skipped:
        require_items(items, "segmentation images folder", images)
    return Source(items=items, classes=None, label_type="none", extra_columns={MASK_COLUMN: "binary"}, root=root,
                  description=f"segmentation folder {root} (images/ with label maps in masks/)",
                  kind="segmentation", skipped=skipped)
