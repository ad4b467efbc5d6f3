"""Sources: turn what users have into one ordered list of samples.

One module per input format, all behind the interface in :mod:`.base` (a :class:`Source` of
:class:`SourceItem`). Supported layouts (``kind``):

- ``"folder"``: an ImageFolder tree ``root/<class>/<image>`` (:mod:`.folder`).
- ``"files"``: a folder of images with no class folders, searched recursively; no labels.
- ``"list"``: a text file of ``<path> <label>`` lines, the common ``train.txt`` (:mod:`.listing`).
- ``"csv"``: a CSV with a header: a path column, a label column, typed extra columns (:mod:`.table`).
- ``"tar"``: WebDataset-style tar files, one ``.tar`` or a folder of them (:mod:`.tar`).
- ``"segmentation"``: ``images/`` and ``masks/`` folders, each image with its label-map PNG (:mod:`.folder`).
- ``"coco"``: a COCO instances JSON: images with their boxes and box labels as list columns (:mod:`.coco`).
- ``"recordio"``: MXNet RecordIO, a ``.rec`` file (with its ``.idx`` when present) or a folder of them (:mod:`.recordio`).

A new format is one module (``open`` and ``detect``, see :mod:`.base`) plus one line in
``FORMATS``. Listing is cheap: no image is opened here.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SourceError, UnsupportedStorageError
from ..storage import open_storage, url_scheme
from ..storage.local import not_regular
from . import coco, folder, hdf5, hf, listing, lmdb_env, recordio, table, tar, tfrecord
from .base import IMAGE_EXTENSIONS, Source, SourceItem, SourceOptions, read_bytes, unencodable_keys
from .checks import checked_source

__all__ = ["FORMATS", "IMAGE_EXTENSIONS", "KINDS", "Source", "SourceItem", "SourceOptions", "open_source",
           "read_bytes", "unencodable_keys"]


@dataclass(frozen=True)
class Format:
    """A registered format: how to open it, how ``kind="auto"`` recognizes it, and whether it
    reads paths from a listing (so ``root=`` applies)."""

    open: Callable[[Path, SourceOptions], Source]
    detect: Callable[[Path], bool]
    uses_root: bool = False
    uses_columns: bool = False   # its records have named fields: label_column / image_column apply


#: kind -> format. ``kind="auto"`` tries the detectors in this order; "folder" comes last
#: because any folder is one.
FORMATS: dict[str, Format] = {
    "list": Format(listing.open_list, listing.detect, uses_root=True),
    "csv": Format(table.open_csv, table.detect, uses_root=True, uses_columns=True),
    "coco": Format(coco.open_coco, coco.detect, uses_root=True),
    "segmentation": Format(folder.open_segmentation, folder.detect_segmentation),
    "files": Format(folder.open_files, folder.detect_files),
    "webdataset": Format(tar.open_tar, tar.detect, uses_columns=True),
    "tfrecord": Format(tfrecord.open_tfrecord, tfrecord.detect, uses_columns=True),
    "hf": Format(hf.open_hf, hf.detect, uses_columns=True),
    "lmdb": Format(lmdb_env.open_lmdb, lmdb_env.detect),
    "hdf5": Format(hdf5.open_hdf5, hdf5.detect, uses_columns=True),
    "recordio": Format(recordio.open_recordio, recordio.detect),
    "folder": Format(folder.open_folder, folder.detect_folder),
}
#: Other names accepted for a kind.
ALIASES = {"tar": "webdataset"}
KINDS = ("auto", *FORMATS, *ALIASES)


def open_source(src: str | Path | Sequence[str | Path], *, kind: str = "auto", label_column: str | None = "label",
                path_column: str = "path", root: str | Path | None = None,
                image_column: str | None = None, mask_column: str | None = None,
                columns: Sequence[str] | None = None) -> Source:
    """List the samples of ``src``.

    ``src`` is a path, a WebDataset brace pattern (``train-{000000..000146}.tar``) or a list of
    shard files. ``kind`` is one of ``KINDS``; ``"auto"`` asks each format's detector in
    ``FORMATS`` order (by file ending, or by content where names say nothing: TFRecord framing,
    LMDB's ``data.mdb``, RecordIO's magic word, a saved Hugging Face dataset's ``state.json``); a folder of class folders
    is the fallback. For lists and CSVs, relative paths resolve against the list's folder and
    ``root`` makes keys relative to a folder; for a COCO instances JSON (``.json``), ``root`` is
    the image folder (e.g. ``root="coco/train2017"``; default: the JSON's folder). ``label_column`` / ``image_column`` name the
    fields of records (table columns, TFRecord features, HDF5 datasets, JSON fields);
    ``label_column=None`` reads without labels; ``mask_column`` (CSV only) names a column of
    label-map PNG paths, packed as a binary column of that name. ``columns`` keeps only the extra
    columns named (None: all). Every listing then goes through :func:`.checks.checked_source` (labels
    within the classes, extras named like built-in columns stored as ``source_<name>``). Raises
    SourceError (and UnsupportedStorageError for a URL: sources are local today).
    """
    if kind not in KINDS:
        raise SourceError(f"unknown source kind {kind!r}; expected one of {', '.join(KINDS)}", path=str(src))
    kind = ALIASES.get(kind, kind)
    options = SourceOptions(root=None if root is None else Path(root), label_column=label_column,
                            path_column=path_column, image_column=image_column, mask_column=mask_column)
    locations = [_local(location) for location in (src if isinstance(src, (list, tuple)) else [src])]
    src = locations if isinstance(src, (list, tuple)) else locations[0]
    if isinstance(src, list) or (isinstance(src, str) and tar.is_pattern(src) and not Path(src).exists()):
        if kind not in ("auto", "webdataset"):
            raise SourceError(f"a list of files or a brace pattern is a WebDataset shard set, not kind {kind!r}",
                              path=str(src))
        _check_root(root, "webdataset", str(src))
        _check_mask_column(mask_column, "webdataset", str(src))
        return checked_source(tar.open_tar(src, options), columns)
    path = Path(src).expanduser()
    if not path.exists():
        raise SourceError(f"source {path} does not exist; expected an image folder, a .txt list, a .csv, "
                          "WebDataset .tar shards (a file, folder or brace pattern), Parquet/Arrow files, "
                          "an LMDB environment, TFRecord, MXNet RecordIO or HDF5 files", path=path)
    path = path.resolve()
    mode = path.stat().st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):  # a FIFO would block the format's reader
        raise SourceError(f"source {path} {not_regular(path, mode).strerror}", path=path)
    if kind == "auto":
        kind = _detect_kind(path)
    _check_root(root, kind, path)
    _check_mask_column(mask_column, kind, path)
    _check_columns(label_column, image_column, kind, path)
    return checked_source(FORMATS[kind].open(path, options), columns)


def _local(location: str | Path) -> str | Path:
    """``location`` as a local path; a URL (s3://...) is refused, never read as a local path of that name."""
    scheme = url_scheme(location)
    if scheme is None:
        return location
    if scheme == "file":
        return open_storage(location).location
    raise UnsupportedStorageError(
        f"{location}: images to pack are read from local paths; {scheme}:// sources are not supported — copy or "
        "mount them locally (a packed dataset, by contrast, can live in object storage)", location=str(location))


def _check_root(root: str | Path | None, kind: str, src: str | Path) -> None:
    if root is not None and not FORMATS[kind].uses_root:
        raise SourceError(f"root= (--root) only applies to list, csv and coco sources, not {kind}: its keys "
                          "come from the records themselves", path=src)


def _check_columns(label_column: str | None, image_column: str | None, kind: str, src: str | Path) -> None:
    """Column names for a source without named fields would be ignored in silence: refuse them."""
    named = [n for n, given in (("label_column", label_column not in ("label", None)),
                                ("image_column", image_column is not None)) if given]
    if named and not FORMATS[kind].uses_columns:
        flags = " and ".join(f"{n}= (--{n.replace('_', '-')})" for n in named)
        where = {"folder": "its class folders", "list": "the list's lines", "coco": "the annotations",
                 "lmdb": "labels.txt or the Caffe Datums", "segmentation": "its masks/ folder",
                 "files": "nowhere (loose files carry none)",
                 "recordio": "each record's header (label_column=None, --no-labels, packs none)"}.get(kind, "its files")
        raise SourceError(f"{flags} names fields of a table or record source (CSV, Parquet/Arrow, TFRecord, "
                          f"HDF5, WebDataset); {src} is a {kind} source whose labels come from {where}: drop "
                          f"{'it' if len(named) == 1 else 'them'}, or pass kind= (--kind) if {src} is another "
                          "format", path=src)


def _check_mask_column(mask_column: str | None, kind: str, src: str | Path) -> None:
    if mask_column is not None and kind != "csv":
        raise SourceError(f"mask_column= (--mask-column) names a column of a CSV source; {src} is a {kind} source: "
                          "list the images and their label maps in a CSV (columns path, mask)", path=src)


def _detect_kind(path: Path) -> str:
    for kind, fmt in FORMATS.items():
        if fmt.detect(path):
            return kind
    raise SourceError.spelled("cannot tell what kind of source " + str(path) + " is; expected an image folder, "
                              "a .txt list, a .csv, .tar/.tar.gz shards, .parquet/.arrow files or a saved Hugging "
                              "Face dataset, an LMDB environment, TFRecord files, an MXNet .rec file or an .h5 file (or pass {kind}: "
                              f"one of {', '.join(KINDS[1:])})", {"kind": ("kind=...", "--kind")}, path=path)
