"""WebDataset-style tars (kind "tar"): one uncompressed ``.tar``, or a folder of them.

Members are grouped by WebDataset key (folder + name up to the first dot): the first image member
of a group is the sample, a ``.cls`` or ``.txt`` member its label. Nothing is extracted: an item
records the member's offset and size inside the tar, and member names are only used as keys, never
as paths, so a downloaded archive cannot write or read outside itself.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

from ..errors import SourceError
from .base import IMAGE_EXTENSIONS, Source, SourceItem, SourceOptions, is_image_name, require_items, scandir, type_labels

LABEL_EXTENSIONS = (".cls", ".txt")


def detect(path: Path) -> bool:
    """A ``.tar`` file, or a folder holding ``.tar`` files and neither images nor sub-folders."""
    if path.is_file():
        return path.suffix.lower() == ".tar"
    if not path.is_dir():
        return False
    entries = scandir(path)
    if any(e.is_file() and is_image_name(e.name) for e in entries):
        return False
    if any(e.is_dir() and not e.name.startswith(".") for e in entries):
        return False
    return any(e.is_file() and e.name.lower().endswith(".tar") for e in entries)


def _members(tar_path: Path, prefix: str) -> tuple[list[SourceItem], list[str | None]]:
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
            elif ("." + ext.lower()) in LABEL_EXTENSIONS and group not in labels:
                labels[group] = tf.extractfile(m).read().decode("utf-8", "replace").strip()
    items, raw = [], []
    for group in sorted(images):
        m = images[group]
        items.append(SourceItem(key=prefix + m.name, path=None, label=None, container=tar_path,
                                offset=m.offset_data, size=m.size))
        raw.append(labels.get(group))
    return items, raw


def open_tar(path: Path, options: SourceOptions) -> Source:
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
        got, got_raw = _members(tar_path, f"{tar_path.name}/" if path.is_dir() else "")
        items += got
        raw += got_raw
    require_items(items, "tar source", path)
    labelled = [r for r in raw if r is not None]
    classes = None
    if not labelled:
        label_type = "none"
    elif len(labelled) != len(raw):
        missing = items[raw.index(None)].key
        raise SourceError(f"{path}: {missing} has no .cls or .txt label while others do; label "
                          "every sample or none", path=path)
    else:
        labels, label_type, classes = type_labels(labelled)
        items = [SourceItem(key=i.key, path=None, label=lab, container=i.container, offset=i.offset,
                            size=i.size) for i, lab in zip(items, labels)]
    return Source(items=items, classes=classes, label_type=label_type, extra_columns={}, root=root,
                  description=f"tar {path} ({len(tars)} files, {len(items)} samples)", kind="tar")
