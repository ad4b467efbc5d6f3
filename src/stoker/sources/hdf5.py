"""HDF5 files (kind "hdf5"), read with h5py: ``pip install 'stoker[hdf5]'``.

The images are one dataset (``image_column``; default the first of ``images``, ``image``, ``imgs``,
``data``, ``x`` present, else the first dataset that looks like images), holding either

- **encoded bytes**, one element per image: variable-length uint8 (``h5py.vlen_dtype(np.uint8)``),
  variable-length bytes, or fixed-size opaque/bytes elements (JPEGs stay byte for byte); or
- **pixels**: a uint8 array ``N x H x W x 3`` (or ``N x H x W`` grey), handed on as lossless PPM.

Labels are a dataset of the same length (``label_column``; default the first of ``labels``,
``label``, ``targets``, ``y``): integers, floats, strings (class names), or ``N x K`` (multi-label:
rows of label indices, -1 padding dropped). Class names come from a ``classes`` or ``class_names``
attribute of the label dataset or the file when present. Other 1-D datasets of length N with
numbers or strings become typed extra columns. Keys are ``<dataset name>/<index>``.

A downloaded ``.h5`` is untrusted input, so what it declares is checked before it is believed:
- data kept outside the file (**external storage**, a **virtual dataset**) is refused, naming the
  dataset: it would make pack and the Loader read any file of the machine as pixels;
- a dataset whose declared elements were never written (unallocated chunks: a 2 KB file can declare
  10^9 images) is refused, and the image dataset must store at least one byte per image it declares;
- pixel arrays larger than the pixel limit (``codecs.MAX_PIXELS`` per image) are refused from their
  shape, before one is read; label and extra rows are bounded to ``MAX_ROW_BYTES`` each.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import codecs
from ..errors import SourceError
from ..storage.local import open_regular, require_regular
from .base import Source, SourceItem, SourceOptions, describe_labels, optional_module, type_any_labels

SUFFIXES = (".h5", ".hdf5", ".he5", ".hdf")
IMAGE_NAMES = ("images", "image", "imgs", "data", "x")
LABEL_NAMES = ("labels", "label", "targets", "y")
_MAGIC = b"\x89HDF\r\n\x1a\n"
#: bytes one label or extra row may declare (a class name, N x K label indices): above it the
#: dataset is refused before it is read whole
MAX_ROW_BYTES = 64 << 10


def _h5py() -> Any:
    return optional_module("h5py", "hdf5", "reading HDF5")


def detect(path: Path) -> bool:
    """An ``.h5``/``.hdf5`` file, or any file starting with the HDF5 signature."""
    if not path.is_file():
        return False
    if path.suffix.lower() in SUFFIXES:
        return True
    with open_regular(path) as fh:
        return fh.read(8) == _MAGIC


def _datasets(h5: Any) -> dict[str, Any]:
    """Every dataset in the file by its path (``group/name``), in name order."""
    h5py = _h5py()
    found: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:   # returning anything but None would stop the walk
        if isinstance(obj, h5py.Dataset):
            found[name] = obj

    h5.visititems(visit)
    return dict(sorted(found.items()))


def _encoded(ds: Any) -> bool:
    h5py = _h5py()
    if ds.ndim != 1:
        return False
    base = h5py.check_vlen_dtype(ds.dtype)
    if base is not None:
        return base == np.uint8 or base is bytes
    return ds.dtype.kind == "V" or ds.dtype.kind == "S"


def _pixels(ds: Any) -> bool:
    return ds.dtype == np.uint8 and (ds.ndim == 3 or (ds.ndim == 4 and ds.shape[-1] in (1, 3)))


def _check_stored_here(ds: Any, path: Path) -> None:
    """Refuse a dataset whose data lives outside the file: external raw files or a virtual dataset
    (reading it would read whatever file it names, a credentials file as pixels)."""
    where = f"{path}: dataset {ds.name.lstrip('/')!r}"
    fix = "stoker reads only data stored in the file itself; copy the data into a regular dataset and pack that"
    if ds.is_virtual:
        files = sorted({v.file_name for v in ds.virtual_sources()})
        raise SourceError(f"{where} is a virtual dataset mapping other files ({', '.join(files)}); {fix}", path=path)
    if ds.external:
        files = sorted({_text(e[0]) for e in ds.external})
        raise SourceError(f"{where} keeps its data in external files ({', '.join(files)}); {fix}", path=path)


def _check_written(ds: Any, path: Path) -> None:
    """Refuse a dataset that declares elements it never stored (unallocated storage reads as fill
    values: a tiny forged file would list 10^9 samples)."""
    if ds.size == 0:
        return
    if ds.chunks is None:
        missing = ds.id.get_storage_size() == 0
    else:
        expected = int(np.prod([-(-n // c) for n, c in zip(ds.shape, ds.chunks)]))
        missing = ds.id.get_num_chunks() < expected
    if missing:
        raise SourceError(f"{path}: dataset {ds.name.lstrip('/')!r} declares {ds.shape} elements, but part of it "
                          "was never written (no storage allocated); the file is unfinished or forged — write "
                          "every element, or pack the part that was written", path=path)


def _check_images(ds: Any, path: Path) -> None:
    name = ds.name.lstrip("/")
    if _pixels(ds) and ds.shape[1] * ds.shape[2] > codecs.MAX_PIXELS:
        h, w = ds.shape[1:3]
        raise SourceError(f"{path}: image dataset {name!r} holds {w}x{h} pixel arrays = {w * h:,} pixels each, "
                          f"above the limit of {codecs.MAX_PIXELS:,} (a decompression bomb, refused before "
                          "reading one); store such images encoded (PNG) to pack them", path=path)
    _check_stored_here(ds, path)
    _check_written(ds, path)
    if ds.id.get_storage_size() < len(ds):
        raise SourceError(f"{path}: image dataset {name!r} declares {len(ds):,} images but stores only "
                          f"{ds.id.get_storage_size():,} bytes; the file is forged or unfinished", path=path)


def _check_rows(ds: Any, path: Path) -> None:
    """A label or extra dataset, read whole at listing: stored in the file, written, bounded rows."""
    _check_stored_here(ds, path)
    _check_written(ds, path)
    row = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
    if row > MAX_ROW_BYTES:
        raise SourceError(f"{path}: dataset {ds.name.lstrip('/')!r} declares {row:,} bytes per row, above "
                          f"{MAX_ROW_BYTES:,} for a label or extra column; pass label_column= (--label-column) "
                          "to name the right one", path=path)


class _Images:
    """One image dataset, open for reading; h5py serializes access itself (its global lock)."""

    def __init__(self, path: Path, name: str) -> None:
        self.name = f"{path}:{name}"
        self._file = _h5py().File(path, "r")
        self._ds = self._file[name]
        try:  # the file may have been replaced since listing: the same checks again
            _check_images(self._ds, path)
        except BaseException:
            self._file.close()
            raise
        self.encoded = _encoded(self._ds)
        self._lock = threading.Lock()

    def read(self, offset: int, size: int) -> bytes:
        with self._lock:
            try:
                value = self._ds[offset]
            except (OSError, RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                raise OSError(f"cannot read element {offset} of {self.name}: {exc}") from None
        if self.encoded:
            return value if isinstance(value, bytes) else np.asarray(value).tobytes()
        pixels = np.asarray(value)
        if pixels.ndim == 3 and pixels.shape[-1] == 1:
            pixels = pixels[..., 0]
        h, w = pixels.shape[:2]
        return f"P{5 if pixels.ndim == 2 else 6}\n{w} {h}\n255\n".encode() + np.ascontiguousarray(pixels).tobytes()


def _pick(sets: dict[str, Any], wanted: str | None, defaults: tuple[str, ...], what: str, flag: str,
          path: Path) -> str | None:
    if wanted is not None:
        if wanted not in sets:
            raise SourceError(f"{path}: no {what} dataset {wanted!r}; its datasets are {list(sets)}; pass "
                              f"{flag}", path=path)
        return wanted
    return next((n for n in defaults if n in sets), None)


def open_hdf5(path: Path, options: SourceOptions) -> Source:
    """The samples of an HDF5 file. A damaged file makes h5py raise KeyError, RuntimeError or
    others from deep inside its object walk: any of them is a SourceError naming the file."""
    try:
        return _open_hdf5(path, options)
    except SourceError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise SourceError(f"{path}: the HDF5 file is damaged ({type(exc).__name__}: {exc}); restore it, or "
                          "write it again", path=path) from None


def _open_hdf5(path: Path, options: SourceOptions) -> Source:
    h5py = _h5py()
    try:
        require_regular(path)   # h5py opens the path itself: a FIFO would block it
        h5 = h5py.File(path, "r")
    except OSError as exc:
        raise SourceError(f"cannot open {path} as HDF5 ({exc})", path=path) from None
    with h5:
        sets = _datasets(h5)
        image = _pick(sets, options.image_column, IMAGE_NAMES, "image", "image_column= (--image-column)", path)
        image = image or next((n for n, d in sets.items() if _encoded(d) or _pixels(d)), None)
        if image is None or not (_encoded(sets[image]) or _pixels(sets[image])):
            raise SourceError(f"{path}: no image dataset (encoded bytes per element, or uint8 N x H x W x 3) "
                              f"among {list(sets)}; pass image_column= (--image-column)", path=path)
        _check_images(sets[image], path)
        n = len(sets[image])
        wanted = None if options.label_column == "label" else options.label_column
        label = None if options.label_column is None else _pick(
            sets, wanted, LABEL_NAMES, "label", "label_column= (--label-column)", path)
        if label is not None and len(sets[label]) != n:
            raise SourceError(f"{path}: label dataset {label!r} has {len(sets[label])} elements for {n} images",
                              path=path)
        extras = {name: ds for name, ds in sets.items()
                  if name not in (image, label) and ds.ndim == 1 and len(ds) == n and ds.dtype.kind in "biufSO"}
        for ds in ([sets[label]] if label is not None else []) + list(extras.values()):
            _check_rows(ds, path)
        extra_columns, extra_values = _extras(extras)
        raw = None if label is None else sets[label][()]
        names = _class_names(h5, sets[label]) if label is not None else None
    store = _Images(path, image)
    items = [SourceItem(key=f"{image}/{i}", path=None, label=None, offset=i, store=store,
                        extras={c: extra_values[c][i] for c in extra_columns}) for i in range(n)]
    if raw is None:
        classes, label_type = None, "none"
    else:
        labels, label_type, classes = _labels(raw, names, label, path)
        items = [replace(i, label=lab) for i, lab in zip(items, labels)]
    return Source(items=items, classes=classes, label_type=label_type, extra_columns=extra_columns,
                  root=path.parent, kind="hdf5",
                  description=f"HDF5 {path} ({n} images in {image!r}, "
                              f"{'encoded' if store.encoded else 'pixels'}, {describe_labels(classes, label_type)})")


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _class_names(h5: Any, ds: Any) -> list[str] | None:
    for holder in (ds, h5):
        for attr in ("classes", "class_names"):
            if attr in holder.attrs:
                return [_text(v) for v in np.atleast_1d(holder.attrs[attr])]
    return None


def _labels(raw: np.ndarray, names: list[str] | None, label: str, path: Path) -> tuple:
    where = [f"{path}:{label}[{i}]" for i in range(len(raw))]
    if raw.ndim == 2 and raw.dtype.kind in "iu":   # rows of label indices, -1 as padding
        return [[int(v) for v in row if v >= 0] for row in raw], "list<int64>", names
    if raw.ndim != 1:
        raise SourceError(f"{path}: label dataset {label!r} has shape {raw.shape}; expected N values or "
                          "N x K label indices; pass label_column= (--label-column)", path=path)
    if raw.dtype.kind in "iub":
        return [int(v) for v in raw], "int64", names
    if raw.dtype.kind == "f":
        return [float(v) for v in raw], "float64", None
    return type_any_labels([_text(v) for v in raw], where)


def _extras(sets: dict[str, Any]) -> tuple[dict[str, str], dict[str, list]]:
    columns: dict[str, str] = {}
    values: dict[str, list] = {}
    for name, ds in sets.items():
        data = ds[()]
        if data.dtype.kind in "iu":
            columns[name], values[name] = "int64", [int(v) for v in data]
        elif data.dtype.kind == "b":
            columns[name], values[name] = "bool", [bool(v) for v in data]
        elif data.dtype.kind == "f":
            columns[name], values[name] = "float64", [float(v) for v in data]
        elif all(isinstance(v, (bytes, str)) for v in data):
            columns[name], values[name] = "string", [_text(v) for v in data]
    return columns, values
