"""Hugging Face datasets (kind "hf"): Parquet files, Arrow files and ``save_to_disk`` folders.

Read with pyarrow alone (the ``datasets`` package is not needed). Accepted: a ``.parquet`` file or
a folder of them (the Hub's ``data/train-00000-of-00004.parquet`` layout: pass the folder holding
the files of one split), an ``.arrow`` file (IPC stream or file format), or a folder written by
``Dataset.save_to_disk`` (``state.json``, ``dataset_info.json``, ``data-*.arrow``). A
``DatasetDict`` folder is refused with the names of its splits: pass one split's folder.

Columns: the image column (``image_column``; default ``image``, else the first column typed
``Image`` in the features, else the first binary column) holds ``{bytes, path}`` structs or plain
binary; its bytes are packed as they are (plain JPEGs stay byte for byte). A row with no embedded
bytes (only a ``path``, which would point into someone else's disk) or a null image is skipped and
logged. The label column (``label_column``; default ``label``, else ``labels``, else the first
``ClassLabel``) may be a ``ClassLabel`` (its names become the class list), a ``Sequence(ClassLabel)``
(multi-label), integers, floats or strings (names mapped to indices, the mapping kept as classes).
Other scalar columns (text included: captions) and lists of numbers or of strings (several captions per
image) become typed extra columns. Keys are
``<file name>/<row>``. Class names come from the ``huggingface`` key of the schema metadata, or
``dataset_info.json`` beside ``save_to_disk`` files.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SourceError
from .base import Source, SourceItem, SourceOptions, describe_labels, scandir, type_any_labels

if TYPE_CHECKING:
    import pyarrow as pa

SUFFIXES = (".parquet", ".arrow")
IMAGE_NAMES = ("image", "img", "jpg", "png", "webp", "video", "mp4")
LABEL_NAMES = ("label", "labels")
#: Row groups kept decoded per Parquet file while packing reads it (items come in near order).
KEEP_ROW_GROUPS = 4


# ---------------------------------------------------------------- finding the files

def detect(path: Path) -> bool:
    """A ``.parquet``/``.arrow`` file, a ``save_to_disk`` folder, or a folder of Parquet files
    (a packed stoker dataset, with its ``stoker.json``, is not a source)."""
    if path.is_file():
        return path.suffix.lower() in SUFFIXES
    if not path.is_dir() or (path / "stoker.json").exists():
        return False
    if (path / "dataset_dict.json").is_file():
        return True   # opened only to say which split to pass
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return True
    return any(e.is_file() and e.name.lower().endswith(".parquet") for e in scandir(path))


def _files(path: Path) -> tuple[list[Path], dict | None]:
    """(data files in order, features from dataset_info.json when present)."""
    if path.is_file():
        return [path], None
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            splits = sorted(e.name for e in scandir(path) if e.is_dir())
        raise SourceError(f"{path} is a DatasetDict with splits {', '.join(splits)}; pack one split: "
                          f"pass {path / splits[0]} (and the others separately)", path=path)
    if (path / "state.json").is_file():
        try:
            state = json.loads((path / "state.json").read_text())
            names = [f["filename"] for f in state["_data_files"]]
            info = json.loads((path / "dataset_info.json").read_text())
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise SourceError(f"{path} looks like a save_to_disk folder but its state.json or "
                              f"dataset_info.json cannot be read ({exc})", path=path) from None
        for n in names:
            if not isinstance(n, str) or Path(n).name != n or not (path / n).is_file():   # a name, not a path
                raise SourceError(f"{path}/state.json lists {n!r}, which is not a file in the folder",
                                  path=path)
        files = [path / n for n in names]
        features = info.get("features") if isinstance(info, dict) else None
        if not isinstance(features, (dict, type(None))):
            raise SourceError(f"{path}/dataset_info.json: 'features' is a {type(features).__name__}, expected an "
                              "object mapping column names to features (as datasets writes it); write the dataset "
                              "again with save_to_disk", path=path)
        return files, features
    files = sorted(Path(e.path) for e in scandir(path) if e.is_file() and e.name.lower().endswith(".parquet"))
    if not files:
        raise SourceError(f"{path} holds no .parquet files", path=path)
    return files, None


# ---------------------------------------------------------------- reading rows

class _Table:
    """One Parquet or Arrow file: its schema, its columns for listing, its images for packing."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        self.path = path
        self.name = str(path)
        self.parquet = path.suffix.lower() == ".parquet"
        self._lock = threading.Lock()
        self._groups: OrderedDict[int, pa.Array] = OrderedDict()
        self._arrow: pa.Table | None = None
        try:
            if self.parquet:
                import pyarrow.parquet as pq
                self._pf = pq.ParquetFile(path)
                self.schema = self._pf.schema_arrow
                meta = self._pf.metadata
                counts = _row_group_rows(meta, path)
                self._starts = [0]
                for c in counts:
                    self._starts.append(self._starts[-1] + c)
                self.num_rows = self._starts[-1]
            else:
                self._arrow = _read_arrow(path)
                self.schema = self._arrow.schema
                self.num_rows = self._arrow.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise SourceError(f"cannot read {path} as {'Parquet' if self.parquet else 'Arrow'} ({exc})",
                              path=path) from None
        self.image_column: str | None = None

    def columns(self, names: list[str]) -> pa.Table:
        if self._arrow is not None:
            return self._arrow.select(names)
        table = self._pf.read(columns=names)
        if table.num_rows != self.num_rows:
            raise SourceError(f"{self.path}: columns {names} hold {table.num_rows} rows, the row groups declare "
                              f"{self.num_rows}; the file is damaged or forged: write it again", path=self.path)
        return table

    def missing_images(self, column: str) -> dict[int, str | None]:
        """Rows whose image has no bytes -> their ``path`` (or None). Reads no image bytes where
        Parquet's statistics say a row group has no nulls (the usual case)."""
        if self._arrow is not None:   # chunk by chunk: combining them would copy every image
            found: dict[int, str | None] = {}
            first = 0
            for chunk in self._arrow.column(column).chunks:
                found.update(_nulls(chunk, first))
                first += len(chunk)
            return found
        leaf = f"{column}.bytes" if _struct_field(self.schema.field(column).type) else column
        found = {}
        meta = self._pf.metadata
        for group in range(meta.num_row_groups):
            rg = meta.row_group(group)
            chunk = next((rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema == leaf), None)
            stats = None if chunk is None else chunk.statistics
            if stats is not None and stats.has_null_count and stats.null_count == 0:
                continue
            values = self._pf.read_row_group(group, columns=[column]).column(0).combine_chunks()
            found.update(_nulls(values, self._starts[group]))
        return found

    def read(self, offset: int, size: int) -> bytes:
        """The image bytes of row ``offset`` (``size`` unused)."""
        import pyarrow as pa

        if self._arrow is not None:
            values = self._arrow.column(self.image_column)
            return _bytes_of(values[offset], self.path, offset)
        group = bisect.bisect_right(self._starts, offset) - 1
        with self._lock:   # one decode of a row group, however many threads want its rows
            array = self._groups.get(group)
            if array is None:
                try:
                    table = self._pf.read_row_group(group, columns=[self.image_column])
                except (OSError, pa.ArrowException) as exc:
                    raise OSError(f"cannot read row group {group} of {self.path}: {exc}") from None
                array = table.column(0).combine_chunks()
                declared = self._starts[group + 1] - self._starts[group]
                if len(array) != declared:   # labels were listed by the declared counts: never pair them wrongly
                    raise OSError(f"row group {group} of {self.path} declares {declared} rows but its image "
                                  f"column holds {len(array)}; the file is damaged, write it again")
                if pa.types.is_struct(array.type):   # keep the bytes child: no struct scalar per row
                    array = array.field("bytes")
                self._groups[group] = array
            self._groups.move_to_end(group)
            while len(self._groups) > KEEP_ROW_GROUPS:
                self._groups.popitem(last=False)
        return _bytes_of(array[offset - self._starts[group]], self.path, offset)


def _row_group_rows(meta: Any, path: Path) -> list[int]:
    """Rows per row group, checked against what each flat column chunk says it holds: labels and
    images are read separately, so a forged count would pair images with other rows' labels."""
    counts = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for j in range(rg.num_columns):
            chunk = rg.column(j)
            if meta.schema.column(j).max_repetition_level == 0 and chunk.num_values != rg.num_rows:
                raise SourceError(f"{path}: row group {g} declares {rg.num_rows} rows but its column "
                                  f"{chunk.path_in_schema!r} holds {chunk.num_values} values; the file is damaged "
                                  "or forged: write it again (e.g. with pyarrow.parquet.write_table)", path=path)
        counts.append(rg.num_rows)
    if sum(counts) != meta.num_rows:
        raise SourceError(f"{path}: its row groups hold {sum(counts)} rows, its footer says {meta.num_rows}; the "
                          "file is damaged or forged: write it again", path=path)
    return counts


def _struct_field(t: pa.DataType) -> bool:
    import pyarrow as pa
    return pa.types.is_struct(t)


def _nulls(values: pa.Array, first_row: int) -> dict[int, str | None]:
    """Rows (numbered from ``first_row``) of an image array that hold no bytes -> their path."""
    import pyarrow as pa
    import pyarrow.compute as pc
    struct = pa.types.is_struct(values.type)
    data = values.field("bytes") if struct else values
    nulls = pc.is_null(data)   # a null struct has null children too
    if not pc.any(nulls).as_py():
        return {}
    rows = pc.indices_nonzero(nulls).to_pylist()
    has_path = struct and values.type.get_field_index("path") >= 0
    paths = values.field("path").take(rows).to_pylist() if has_path else [None] * len(rows)
    if struct and values.null_count:   # a null struct's path child is null whatever its buffer holds
        valid = pc.is_valid(values).take(rows).to_pylist()
        paths = [p if ok else None for p, ok in zip(paths, valid)]
    return {first_row + r: p for r, p in zip(rows, paths)}


def _read_arrow(path: Path) -> pa.Table:
    """An Arrow IPC file or stream (``save_to_disk`` writes streams), memory-mapped: zero-copy."""
    import pyarrow as pa
    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _bytes_of(value: pa.Scalar, path: Path, row: int) -> bytes:
    import pyarrow as pa
    if isinstance(value, pa.StructScalar):
        value = value["bytes"]
    data = value.as_py()
    if data is None:
        raise OSError(f"{path} row {row} has no image bytes")
    return data


# ---------------------------------------------------------------- features and columns

def _features(table: _Table, fallback: dict | None) -> dict[str, Any]:
    meta = (table.schema.metadata or {}).get(b"huggingface")
    if meta:
        try:
            obj = json.loads(meta)
            features = (obj.get("info") or {}).get("features") or obj.get("features") or {}
            if isinstance(features, dict):
                return features
        except (ValueError, AttributeError, RecursionError):
            pass
    return fallback or {}


def _type(feature: Any) -> str:
    return feature.get("_type", "") if isinstance(feature, dict) else ""


def _class_names(feature: Any) -> tuple[list[str] | None, bool]:
    """(ClassLabel names, is a list of them) for a feature, or (None, False)."""
    if _type(feature) == "ClassLabel":
        return list(feature.get("names") or []), False
    if _type(feature) in ("Sequence", "List", "LargeList"):
        inner = feature.get("feature")
        if _type(inner) == "ClassLabel":
            return list(inner.get("names") or []), True
    return None, False


def _is_image_type(t: pa.DataType) -> bool:
    import pyarrow as pa
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    # an Image struct: its bytes child must be bytes itself (a struct there would fail on every row)
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 and \
        (pa.types.is_binary(t.field("bytes").type) or pa.types.is_large_binary(t.field("bytes").type))


def _pick_image(schema: pa.Schema, features: dict, wanted: str | None, path: Path) -> str:
    names = schema.names
    if wanted is not None:
        if wanted not in names:
            raise SourceError(f"{path}: no image column {wanted!r}; its columns are {names}; pass "
                              "image_column= (--image-column)", path=path)
        chosen = wanted
    else:
        chosen = next((n for n in IMAGE_NAMES if n in names and _is_image_type(schema.field(n).type)), None)
        chosen = chosen or next((n for n in names if _type(features.get(n)) == "Image"), None)
        chosen = chosen or next((n for n in names if _is_image_type(schema.field(n).type)), None)
        if chosen is None:
            raise SourceError(f"{path}: no image column (binary, or struct of bytes and path) among {names}; "
                              "pass image_column= (--image-column)", path=path)
    if not _is_image_type(schema.field(chosen).type):
        raise SourceError(f"{path}: column {chosen!r} is {schema.field(chosen).type}, not image bytes "
                          "(binary, or struct of bytes and path); pass image_column= (--image-column)", path=path)
    return chosen


def _pick_label(schema: pa.Schema, features: dict, wanted: str | None, path: Path) -> str | None:
    names = schema.names
    if wanted is None:
        return None
    if wanted != "label":   # named by the caller: it must exist
        if wanted not in names:
            raise SourceError(f"{path}: no label column {wanted!r}; its columns are {names}; pass "
                              "label_column= (--label-column), or None for unlabelled data", path=path)
        return wanted
    found = next((n for n in LABEL_NAMES if n in names), None)
    return found or next((n for n in names if _class_names(features.get(n))[0] is not None), None)


def _column_type(t: pa.DataType) -> str | None:
    """The manifest type of an extra column, or None to leave it out."""
    import pyarrow as pa
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int64"
    if pa.types.is_floating(t):
        return "float64"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _column_type(t.value_type)
        if inner in ("int64", "float64", "string"):   # list<string>: several captions per image, say
            return f"list<{inner}>"
    return None


# ---------------------------------------------------------------- the source

def open_hf(path: Path, options: SourceOptions) -> Source:
    import pyarrow

    files, info_features = _files(path)
    tables = [_Table(f) for f in files]
    first = tables[0]
    features = _features(first, info_features)
    image = _pick_image(first.schema, features, options.image_column, first.path)
    label = _pick_label(first.schema, features, options.label_column, first.path)
    extra_columns = {n: t for n in first.schema.names if n not in (image, label)
                     and (t := _column_type(first.schema.field(n).type)) is not None}
    items: list[SourceItem] = []
    raw: list[Any] = []
    skipped: list[dict[str, str]] = []
    for table in tables:
        if table.schema.names != first.schema.names:
            raise SourceError(f"{table.path} has columns {table.schema.names}, unlike {first.path} "
                              f"({first.schema.names}); pack files of one dataset split together", path=table.path)
        table.image_column = image
        try:
            _list_table(table, image, label, list(extra_columns), items, raw, skipped)
        except (OSError, pyarrow.ArrowException) as exc:   # a damaged page: a corrupt snappy block, bad thrift
            raise SourceError(f"cannot list {table.path}: the file is damaged ({exc}); restore it, or download "
                              "it again", path=table.path) from None
    if not items:
        raise _no_image_bytes(path, skipped)
    classes, is_list = _class_names(features.get(label)) if label else (None, False)
    items, label_type, classes = _labels(items, raw, label, classes, is_list, first.schema, skipped)
    what = describe_labels(classes, label_type)
    return Source(items=items, classes=classes, label_type=label_type, extra_columns=extra_columns,
                  root=path if path.is_dir() else path.parent, kind="hf", skipped=skipped,
                  description=f"Hugging Face {path} ({len(files)} files, {what}, image column {image!r}, "
                              f"{len(extra_columns)} extra columns)")


def _no_image_bytes(path: Path, skipped: list[dict[str, str]]) -> SourceError:
    """No row has image bytes: nothing gets packed, so no skipped.jsonl is written; the message carries
    the rows' reason instead, and the way out for images saved as paths (Dataset.to_parquet of images
    loaded from files keeps their paths, not their bytes)."""
    if not skipped:
        return SourceError(f"{path} has no rows", path=path)
    paths = [s for s in skipped if s["reason"].startswith("only a path")]
    first = (paths or skipped)[0]
    message = (f"no rows with image bytes in {path}: {len(paths):,} of {len(skipped):,} rows hold only an image "
               f"path, the others a null image ({first['path']}: {first['reason']})")
    if paths:
        message += "; or pack the image files themselves from a CSV of path,label (`stoker pack train.csv OUT`)"
    return SourceError(message, path=path)


def _list_table(table: _Table, image: str, label: str | None, extras: list[str], items: list[SourceItem],
                raw: list[Any], skipped: list[dict[str, str]]) -> None:
    missing = table.missing_images(image)
    columns = table.columns(([label] if label else []) + extras).to_pydict() if (label or extras) else {}
    labels = columns.get(label, [None] * table.num_rows) if label else [None] * table.num_rows
    for row in range(table.num_rows):
        key = f"{table.path.name}/{row}"
        if row in missing:
            hint = (f"only a path ({missing[row]!r}), no embedded bytes; re-save the dataset with the images "
                    "embedded" if missing[row] else "the image is null")
            skipped.append({"key": key, "path": f"{table.path}:row {row}", "reason": hint})
            continue
        items.append(SourceItem(key=key, path=None, label=None, extras={n: columns[n][row] for n in extras},
                                offset=row, store=table))
        raw.append(labels[row])


def _labels(items: list[SourceItem], raw: list[Any], label: str | None, classes: list[str] | None,
            is_list: bool, schema: pa.Schema, skipped: list[dict[str, str]]) -> tuple:
    """Type the label column: ClassLabel keeps its names; other values go through type_any_labels."""
    import pyarrow as pa
    from dataclasses import replace
    if label is None:
        return items, "none", None
    keep = []
    for item, value in zip(items, raw):
        if value is None:
            skipped.append({"key": item.key, "path": item.where(), "reason": f"the {label!r} value is null"})
        else:
            keep.append((item, value))
    items, raw = [k[0] for k in keep], [k[1] for k in keep]
    t = schema.field(label).type
    listed = pa.types.is_list(t) or pa.types.is_large_list(t)
    if classes is not None:
        label_type = "list<int64>" if is_list else "int64"
        return [replace(i, label=v) for i, v in zip(items, raw)], label_type, classes
    where = [i.key for i in items]
    if listed:
        labels, label_type, classes = type_any_labels([[str(x) for x in v] for v in raw] or [[]], where)
    elif pa.types.is_integer(t) or pa.types.is_boolean(t):
        labels, label_type = [int(v) for v in raw], "int64"
    elif pa.types.is_floating(t):
        labels, label_type = [float(v) for v in raw], "float64"
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        labels, label_type, classes = type_any_labels([str(v) for v in raw], where)
    else:
        raise SourceError(f"label column {label!r} is {t}; expected a ClassLabel, integers, floats, strings "
                          "or lists of them; pass label_column= (--label-column) or None for no labels")
    return [replace(i, label=v) for i, v in zip(items, labels)], label_type, classes
