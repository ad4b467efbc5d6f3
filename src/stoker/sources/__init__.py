"""Sources: turn what users have into one ordered list of samples.

One module per input format, all behind the interface in :mod:`.base` (a :class:`Source` of
:class:`SourceItem`). Supported layouts (``kind``):

- ``"folder"``: an ImageFolder tree ``root/<class>/<image>`` (:mod:`.folder`).
- ``"files"``: a folder of images with no class folders, searched recursively; no labels.
- ``"list"``: a text file of ``<path> <label>`` lines, the common ``train.txt`` (:mod:`.listing`).
- ``"csv"``: a CSV with a header: a path column, a label column, typed extra columns (:mod:`.table`).
- ``"tar"``: WebDataset-style tar files, one ``.tar`` or a folder of them (:mod:`.tar`).

A new format is one module (``open`` and ``detect``, see :mod:`.base`) plus one line in
``FORMATS``. Listing is cheap: no image is opened here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import SourceError
from ..storage import open_storage
from . import folder, listing, table, tar
from .base import IMAGE_EXTENSIONS, Source, SourceItem, SourceOptions, read_bytes

__all__ = ["FORMATS", "IMAGE_EXTENSIONS", "KINDS", "Source", "SourceItem", "SourceOptions", "open_source",
           "read_bytes"]


@dataclass(frozen=True)
class Format:
    """A registered format: how to open it, how ``kind="auto"`` recognizes it, and whether it
    reads paths from a listing (so ``root=`` applies)."""

    open: Callable[[Path, SourceOptions], Source]
    detect: Callable[[Path], bool]
    uses_root: bool = False


#: kind -> format. ``kind="auto"`` tries the detectors in this order; "folder" comes last
#: because any folder is one.
FORMATS: dict[str, Format] = {
    "list": Format(listing.open_list, listing.detect, uses_root=True),
    "csv": Format(table.open_csv, table.detect, uses_root=True),
    "files": Format(folder.open_files, folder.detect_files),
    "tar": Format(tar.open_tar, tar.detect),
    "folder": Format(folder.open_folder, folder.detect_folder),
}
KINDS = ("auto", *FORMATS)


def open_source(src: str | Path, *, kind: str = "auto", label_column: str | None = "label",
                path_column: str = "path", root: str | Path | None = None) -> Source:
    """List the samples of ``src``.

    ``kind`` is one of ``KINDS``; ``"auto"`` picks: a ``.txt`` file -> list, ``.csv`` -> csv,
    ``.tar`` or a folder of ``.tar`` files -> tar, a folder with images directly inside ->
    files, a folder of class folders -> folder. For lists and CSVs, ``root`` is the folder
    relative paths resolve against and that no path may leave (default: the list's folder).
    ``label_column=None`` reads a CSV without labels. Raises SourceError (and
    UnsupportedStorageError for a URL: sources are local today).
    """
    if kind not in KINDS:
        raise SourceError(f"unknown source kind {kind!r}; expected one of {', '.join(KINDS)}", path=src)
    open_storage(src)  # a URL (s3://...) is refused, never read as a local path of that name
    path = Path(src).expanduser()
    if not path.exists():
        raise SourceError(f"source {path} does not exist; expected an image folder, a .txt list, "
                          "a .csv or a .tar", path=path)
    path = path.resolve()
    if kind == "auto":
        kind = _detect_kind(path)
    fmt = FORMATS[kind]
    if root is not None and not fmt.uses_root:
        raise SourceError(f"root= only applies to list and csv sources, not {kind}", path=path)
    options = SourceOptions(root=None if root is None else Path(root), label_column=label_column,
                            path_column=path_column)
    return fmt.open(path, options)


def _detect_kind(path: Path) -> str:
    for kind, fmt in FORMATS.items():
        if fmt.detect(path):
            return kind
    raise SourceError.spelled(f"cannot tell what kind of source {path} is from its name; expected a "
                              "folder, .txt, .csv or .tar (or pass {kind})", {"kind": ("kind=...", "--kind ...")},
                              path=path)
