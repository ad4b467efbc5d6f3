"""WebDataset shard sets (kind "webdataset", alias "tar"): ``.tar``, ``.tar.gz`` or ``.tgz`` files.

Given as one file, a folder of them, a brace pattern (``train-{000000..000146}.tar``, expanded as
WebDataset does, with the ``braceexpand`` package) or a list of files. Members are grouped by
WebDataset key (folder + name up to the first dot): the group's image (``jpg jpeg png webp`` and
the other image endings) is the sample; its target comes from ``.cls`` (a class index or name,
or several numbers: multi-label), else from the ``label_column`` field of ``.json``, else from
``.txt`` (none of them with ``label_column=None``, ``stoker pack --no-labels``: image + caption data).
A ``.txt`` is also kept as the string column ``txt`` (a caption: `Targets(captions="txt")` hands it
out). The other fields of a ``.json`` dict become typed extra columns (a list of strings, such as
several captions, a ``list<string>`` column); a ``.json`` that is a list is a multi-label target.

Nothing is extracted: an item records the member's offset and size inside the tar (inside the
decompressed stream for gzip files), and member names are used only as keys, never as paths, so
a downloaded archive cannot write or read outside itself. A tar that is damaged part-way keeps
the samples before the damage; the rest of that file is logged in ``skipped.jsonl``, compressed
(a truncated ``.tar.gz``) or not alike.

What a member declares is bounded before it is read: a ``.cls``/``.json``/``.txt`` target over
MAX_TARGET_BYTES, a sparse member (its declared size is not what the tar stores) and a member
reaching past the end of the tar cost their sample (a ``skipped.jsonl`` line), never memory. A
gzip file is streamed to disk, bounded (see :class:`~stoker.sources.base.Inflated`).
"""

from __future__ import annotations

import os
import json
import logging
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import SourceError
from ..storage.local import open_regular
from .base import (SAMPLE_EXTENSIONS, GzipMembers, Source, SourceItem, SourceOptions, describe_labels,
                   inflated, inside, is_sample_name, optional_module, require_items, scandir, split_label_cell,
                   type_any_labels)

_log = logging.getLogger("stoker.sources")

SUFFIXES = (".tar", ".tar.gz", ".tgz")
TARGET_EXTENSIONS = (".cls", ".json", ".txt")
#: the extra column a sample's `.txt` is packed into (its caption, or the class name it also labels)
TEXT_COLUMN = "txt"
#: bytes a target member (.cls, .json, .txt) may hold: labels and metadata, never megabytes
MAX_TARGET_BYTES = 1 << 20


def is_shard_name(name: str) -> bool:
    return name.lower().endswith(SUFFIXES)


def is_pattern(text: str) -> bool:
    """A WebDataset brace pattern such as ``train-{000000..000146}.tar`` or ``{a,b}.tar``."""
    return "{" in text and "}" in text and (".." in text or "," in text)


def expand(pattern: str) -> list[Path]:
    """The files a brace pattern names, in its order; every one must exist."""
    braceexpand = optional_module("braceexpand", "webdataset", "expanding a brace pattern").braceexpand
    paths = [Path(p).expanduser() for p in braceexpand(pattern)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise SourceError(f"the pattern {pattern} names {len(paths)} files but {len(missing)} do not exist "
                          f"(first: {missing[0]}); check the pattern's range", path=pattern)
    return paths


def detect(path: Path) -> bool:
    """A ``.tar``/``.tar.gz``/``.tgz`` file, or a folder holding such files and neither images
    nor sub-folders."""
    if path.is_file():
        return is_shard_name(path.name)
    if not path.is_dir():
        return False
    entries = scandir(path)
    if any(e.is_file() and is_sample_name(e.name) for e in entries):
        return False
    if any(e.is_dir() and not e.name.startswith(".") for e in entries):
        return False
    return any(e.is_file() and is_shard_name(e.name) for e in entries)


@dataclass
class _Group:
    image: tarfile.TarInfo | None = None
    targets: dict[str, bytes] = field(default_factory=dict)   # extension -> member bytes
    problem: str | None = None   # why the sample cannot be used (a member that declares too much)


def _open(tar_path: Path, skipped: list[dict[str, str]]) -> tuple[BinaryIO, GzipMembers | None, int]:
    """(the tar's bytes as a file object, the store of a compressed tar, the bytes there are).
    Only a regular file is opened (a FIFO would block); a gzip file's damage is logged in `skipped`
    and what decompressed before it is kept."""
    try:
        if tar_path.name.lower().endswith((".gz", ".tgz")):
            content = inflated(tar_path)   # decompressed once, to disk; packing then reads from it
            lost = content.skip_record(f"{tar_path.name}/*")
            if lost is not None:
                skipped.append(lost)
            return content.open(), GzipMembers(tar_path), content.size
        raw = open_regular(tar_path)
        return raw, None, os.fstat(raw.fileno()).st_size
    except OSError as exc:
        raise SourceError(f"cannot read {tar_path} as a tar ({exc.strerror or exc})", path=tar_path) from None


def _groups(tar_path: Path, skipped: list[dict[str, str]]) -> tuple[dict[str, _Group], GzipMembers | None, int]:
    """(samples by name, the store of a compressed tar, the inode of the tar file read)."""
    raw, store, size = _open(tar_path, skipped)
    with raw:
        inode = 0 if store else os.fstat(raw.fileno()).st_ino
        try:
            tf = tarfile.open(fileobj=raw, mode="r:")
        except tarfile.TarError as exc:
            if store is not None and skipped and skipped[-1]["path"] == str(tar_path):
                return {}, store, inode   # a .tar.gz cut before its first member: logged, nothing to list
            raise SourceError(f"cannot read {tar_path} as a tar ({exc})", path=tar_path) from None
        return _members(tf, tar_path, size, skipped), store, inode


def _declares_too_much(m: tarfile.TarInfo, ext: str, size: int) -> str | None:
    """Why member `m` of a tar holding `size` bytes cannot be read as it claims, or None."""
    if m.issparse():
        return f"member {m.name} is a sparse file (it declares {m.size:,} bytes the tar does not hold)"
    if m.offset_data + m.size > size:
        return (f"member {m.name} declares {m.size:,} bytes, but the tar is shorter (it ends "
                f"{max(0, size - m.offset_data):,} bytes into them)")
    if ext in TARGET_EXTENSIONS and m.size > MAX_TARGET_BYTES:
        return f"its {ext} member holds {m.size:,} bytes, more than the {MAX_TARGET_BYTES:,} a target may"
    return None


def _members(tf: tarfile.TarFile, tar_path: Path, size: int, skipped: list[dict[str, str]]) -> dict[str, _Group]:
    groups: dict[str, _Group] = {}
    with tf:
        try:
            for m in tf:
                if not m.isfile():
                    continue
                folder, _, base = m.name.rpartition("/")
                stem, _, ext = base.partition(".")
                ext = "." + ext.lower()
                name = f"{folder}/{stem}" if folder else stem
                group = groups.setdefault(name, _Group())
                wanted = (ext in SAMPLE_EXTENSIONS and group.image is None) or \
                    (ext in TARGET_EXTENSIONS and ext not in group.targets)
                if not wanted:
                    if ext in SAMPLE_EXTENSIONS or ext in TARGET_EXTENSIONS:
                        skipped.append(_second_member(m, ext, name, group, tar_path))
                    continue
                problem = _declares_too_much(m, ext, size)
                if problem is not None:
                    group.problem = group.problem or problem
                if ext in SAMPLE_EXTENSIONS:
                    group.image = m   # its name keys the sample, skipped or not
                elif problem is None:
                    group.targets[ext] = tf.extractfile(m).read(MAX_TARGET_BYTES)
        except (tarfile.TarError, OSError, EOFError) as exc:
            if skipped and skipped[-1]["key"] == f"{tar_path.name}/*":
                return groups   # a .tar.gz whose gzip stream was damaged: already logged, with why
            skipped.append({"key": f"{tar_path.name}/*", "path": str(tar_path),
                            "reason": f"the tar is damaged after {len(groups)} samples ({exc}); the rest "
                                      "of this file could not be read"})
    return groups


def _second_member(m: tarfile.TarInfo, ext: str, name: str, group: _Group, tar_path: Path) -> dict[str, str]:
    """The skipped.jsonl line of a member WebDataset does not use: a sample keeps one image and
    one target of each kind (the first), so a second ``x.png`` beside ``x.jpg`` is logged, not lost."""
    kept = f"the image {group.image.name}" if ext in SAMPLE_EXTENSIONS and group.image else f"a {ext} member"
    return {"key": m.name, "path": f"{tar_path}:{m.name}",
            "reason": f"sample {name!r} already has {kept}; only the first is packed: give each sample its own name"}


def _target(group: _Group, label_column: str | None, where: str) -> tuple[str | list[str] | None, dict]:
    """(label text or list, extra fields) of one sample from its .cls, .json and .txt members."""
    extras: dict[str, Any] = {}
    label: str | list[str] | None = None
    if ".json" in group.targets:
        try:
            meta = json.loads(group.targets[".json"].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"its .json is not JSON ({type(exc).__name__}: {exc})") from None
        if isinstance(meta, list):
            label = [str(v) for v in meta]
        elif isinstance(meta, dict):
            extras = dict(meta)
            if label_column is not None and label_column in extras:
                value = extras.pop(label_column)
                label = [str(v) for v in value] if isinstance(value, list) else str(value)
    for ext in (".txt", ".cls"):   # .cls wins over .json, .json over .txt
        if ext not in group.targets:
            continue
        try:
            text = group.targets[ext].decode("utf-8").strip()
        except UnicodeDecodeError:
            if ext == ".txt" and (label_column is None or label is not None or ".cls" in group.targets):
                # not its label: the sample is packed, its `txt` null (a Loader reading it as text names it)
                _log.warning("%s: its .txt is not UTF-8 text; packed with no 'txt' value", where)
                continue
            raise ValueError(f"its {ext} is not UTF-8 text") from None
        if ext == ".txt":   # a caption or a class name: kept as the text column `txt` either way
            extras.setdefault(TEXT_COLUMN, text)
        if label_column is not None and (ext == ".cls" or label is None):
            parts = split_label_cell(text, where)
            label = text if parts is None else parts
    return label, extras


def _json_type(values: list[Any]) -> str | None:
    """The Arrow type name of a JSON field across samples (None values allowed), None to leave
    it out: bool, int64, float64, string, list<int64>, list<float64>, list<string>; anything else -> string
    (JSON)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, bool) for v in present):
        return "bool"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "int64"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return "float64"
    if all(isinstance(v, list) for v in present):
        flat = [x for v in present for x in v]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
            return "list<int64>"
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat):
            return "list<float64>"
        if all(isinstance(x, str) for x in flat):
            return "list<string>"   # several captions, tags
    return "string"


def _json_value(value: Any, type_name: str) -> Any:
    if value is None:
        return [] if type_name.startswith("list") else None
    if type_name == "string":
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if type_name == "float64":
        return float(value)
    if type_name == "list<float64>":
        return [float(x) for x in value]
    return value


def shard_files(src: str | Path | Sequence[str | Path]) -> tuple[list[Path], Path, bool]:
    """(tar files, root, keys prefixed by file name) for a file, folder, pattern or list."""
    if isinstance(src, (list, tuple)):
        files = [Path(p).expanduser().resolve() for p in src]
        for f in files:
            if not f.is_file():
                raise SourceError(f"shard {f} does not exist", path=f)
        if not files:
            raise SourceError("an empty list of shards; pass at least one .tar file")
        twice = next((f for k, f in enumerate(files) if f in files[:k]), None)
        if twice is not None:
            raise SourceError(f"shard {twice} is listed twice; pass each file once", path=twice)
        return files, files[0].parent, True
    if isinstance(src, str) and is_pattern(src) and not Path(src).exists():
        files = [p.resolve() for p in expand(src)]
        return files, files[0].parent, True
    path = Path(src)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if is_shard_name(p.name) and p.is_file())
        real = Path(os.path.realpath(path))
        for f in files:  # a folder of downloaded shards must not pull in files from elsewhere
            if f.is_symlink() and not inside(real, os.path.realpath(f)):
                raise SourceError(f"{f} is a symlink that points outside the shard folder {path}; "
                                  "pass the file it points to, or copy it in", path=f)
        if not files:
            raise SourceError(f"{path} holds no .tar, .tar.gz or .tgz files", path=path)
        return files, path, True
    return [path], path.parent, False


def _key_prefixes(files: list[Path]) -> list[str]:
    """Each file's part of its samples' keys: its name, or, when two files share a name (shards
    from different folders), its path under the folders' common parent, so keys stay unique."""
    names = [f.name for f in files]
    if len(set(names)) == len(names):
        return [f"{n}/" for n in names]
    common = Path(os.path.commonpath([str(f.parent) for f in files]))
    return [f"{f.relative_to(common).as_posix()}/" for f in files]


def open_tar(path: Path | str | Sequence[str | Path], options: SourceOptions) -> Source:
    files, root, prefixed = shard_files(path)
    items: list[SourceItem] = []
    raw: list[str | list[str] | None] = []
    json_rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    prefixes = _key_prefixes(files) if prefixed else [""] * len(files)
    for tar_path, prefix in zip(files, prefixes):
        groups, store, inode = _groups(tar_path, skipped)
        for name in sorted(groups):
            group = groups[name]
            if group.problem is not None:
                key = prefix + (group.image.name if group.image is not None else name)
                skipped.append({"key": key, "path": str(tar_path), "reason": f"sample {name}: "
                                f"{group.problem}; the sample is left out"})
                continue
            if group.image is None:
                continue
            m = group.image
            item = SourceItem(key=prefix + m.name, path=None, label=None, container=None if store else tar_path,
                              offset=m.offset_data, size=m.size, store=store, inode=inode)
            try:
                label, extras = _target(group, options.label_column, f"{tar_path}: {m.name}")
            except ValueError as exc:
                skipped.append({"key": item.key, "path": item.where(), "reason": f"sample {name}: {exc}"})
                continue
            items.append(item)
            raw.append(label)
            json_rows.append(extras)
    require_items(items, "WebDataset shards", Path(str(path)) if not isinstance(path, (list, tuple)) else root)
    items, raw, json_rows, classes, label_type = _labels(items, raw, json_rows, skipped)
    names = sorted({k for row in json_rows for k in row})
    types = {n: _json_type([row.get(n) for row in json_rows]) for n in names}
    extra_columns = {n: t for n, t in types.items() if t is not None}
    items = [replace(i, extras={n: _json_value(row.get(n), t) for n, t in extra_columns.items()})
             for i, row in zip(items, json_rows)]
    what = describe_labels(classes, label_type)
    return Source(items=items, classes=classes, label_type=label_type, extra_columns=extra_columns, root=root,
                  description=f"WebDataset {path if not isinstance(path, (list, tuple)) else root} "
                              f"({len(files)} files, {len(items)} samples, {what})",
                  kind="webdataset", skipped=skipped)


def _labels(items: list[SourceItem], raw: list, json_rows: list, skipped: list[dict[str, str]]) -> tuple:
    """Type the targets; samples without one, while others have one, are skipped and logged."""
    if all(r is None for r in raw):
        return items, raw, json_rows, None, "none"
    keep = [i for i, r in enumerate(raw) if r is not None]
    for i, r in enumerate(raw):
        if r is None:
            skipped.append({"key": items[i].key, "path": items[i].where(),
                            "reason": "no .cls, .json label or .txt target while other samples have one"})
    items, raw, json_rows = [items[i] for i in keep], [raw[i] for i in keep], [json_rows[i] for i in keep]
    labels, label_type, classes = type_any_labels(raw, [i.where() for i in items])
    return [replace(i, label=lab) for i, lab in zip(items, labels)], raw, json_rows, classes, label_type
