"""Read packed datasets (memory-mapped Arrow shards) through the `Dataset` interface (`dataset`).

``open_dataset(path)`` maps every shard and hands out each sample's bytes as a zero-copy
view of the mapping, with its encoding, height, width and label, in O(1) (a bisect over the
shards' first rows). Loose image files are served the same way by `loose.open_loose`.
Shards are found, checked (:mod:`stoker.integrity`) and mapped through :mod:`stoker.storage`.
A dataset in object storage (``open_dataset("s3://bucket/ds")``) is a :class:`CachedDataset`: its
shards are fetched whole into the local shard cache when (or, with a plan, before) they are needed.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from .dataset import JPEG_ROW, OTHER_ROW, RAW_ROW, Dataset, Sample
from .errors import ConfigError, DatasetClosedError, ShardError
from .integrity import OpenShard, open_shard
from .shards import Manifest, ShardInfo, read_manifest
from .storage import LocalStorage, RemoteStorage, StorageBackend, as_storage
from ._system import format_bytes
from .storage.cache import working_set_bytes

def _numeric_view(arr: pa.Array, dtype: type) -> np.ndarray:
    """A zero-copy numpy view of a primitive Arrow array without nulls."""
    return arr.to_numpy(zero_copy_only=True).astype(dtype, copy=False)


def _binary_views(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, data) numpy views over a (large_)binary or string array's buffers."""
    bufs = arr.buffers()
    off_type = np.int64 if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=off_type)[arr.offset: arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    return offsets, data


@dataclass
class _Block:
    """One Arrow record batch of one shard, with zero-copy views of its hot columns."""

    shard: str
    first_row: int  # row of this batch inside its shard
    batch: pa.RecordBatch
    key_offsets: np.ndarray
    key_data: np.ndarray
    img_offsets: np.ndarray
    img_data: np.ndarray
    enc_codes: np.ndarray
    enc_names: list[str]
    heights: np.ndarray
    widths: np.ndarray


class PackedDataset(Dataset):
    """A packed dataset: memory-mapped shards described by ``stoker.json``."""

    def __init__(self, storage: StorageBackend, manifest: Manifest, shards: list[OpenShard]) -> None:
        self.storage = storage
        self.path = Path(storage.location)
        self.manifest = manifest
        self.classes = manifest.classes
        self.extra_columns = list(manifest.extra_columns)
        self._blocks = [block for shard in shards for block in _blocks(shard)]
        self._starts = [0]
        for b in self._blocks:
            self._starts.append(self._starts[-1] + b.batch.num_rows)
        self._n = self._starts.pop()
        self._shards = shards
        self._paths = {s.info.file: storage.stat_path(s.info.file) for s in shards}
        # each shard's storage identity (file, size) when it was mapped: see _guard
        self._identities = {s.info.file: s.identity for s in shards}
        self._one_shard = len(shards) == 1
        self._cache: dict[str, np.ndarray] = {}
        self._spans: tuple | None = None  # `_spans_table`, made on first use
        self._lock = threading.Lock()
        self._closed = False

    @property
    def _identities(self) -> dict[str, tuple[int, ...]]:
        """Each shard's storage identity when it was mapped, which `_guard` expects to find (a worker
        process is handed its parent's: `loading.proc_child`)."""
        return self._expected

    @_identities.setter
    def _identities(self, identities: dict[str, tuple[int, ...]]) -> None:
        # each shard's check as `_check` makes it (name, stat path, identity expected), by shard number
        self._expected = identities
        self._checks = [(name, path, identities.get(name)) for name, path in self._paths.items()]
        self._numbers = {name: (k,) for k, name in enumerate(self._paths)}

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"<stoker dataset {self.path}: {self._n} samples in {len(self.manifest.shards)} shards>"

    def _locate(self, i: int) -> tuple[_Block, int]:
        if self._closed:
            raise DatasetClosedError(f"{self.path}: the dataset was closed; open it again with open_dataset()")
        k = bisect.bisect_right(self._starts, i) - 1 if len(self._blocks) > 1 else 0
        return self._blocks[k], i - self._starts[k]

    def _guard(self, shard: str) -> None:
        """Refuse to touch a shard's mapping once its file was deleted, replaced or resized.

        A memory-mapped file that shrinks kills the process with SIGBUS on the next access to a
        page past its new end; Python cannot catch that. One stat (about 2 us) before each read
        turns it into a ShardError naming the shard. A file that shrinks while a sample from it is
        being decoded can still crash the process: see docs/reliability.md."""
        self._check(self._numbers.get(shard, ()))

    def _check(self, shards: Sequence[int]) -> None:
        """`_guard` for each of the shards numbered `shards`, in that order: one stat each where the
        storage's identity is a stat's (`StorageBackend.stat_path`), its own `identity` call elsewhere."""
        checks = self._checks
        for k in shards:
            name, path, expected = checks[k]
            if expected is None:
                continue
            if path is not None:
                try:
                    st = os.stat(path)
                except OSError:
                    st = None   # named by `_refuse`
                if st is not None and (st.st_dev, st.st_ino, st.st_size) == expected:
                    continue
            self._refuse(name, expected)

    def _refuse(self, shard: str, expected: tuple[int, ...]) -> None:
        """The ShardError for a shard whose storage identity is no longer `expected` (deleted, replaced,
        resized), or nothing when it is after all."""
        try:
            found = self.storage.identity(shard)
        except FileNotFoundError:
            path = self.storage.join(shard)
            raise ShardError(f"{path}: shard was deleted while the dataset was open; restore it and "
                             "reopen the dataset, or re-pack", path=path) from None
        except OSError as exc:
            path = self.storage.join(shard)
            raise ShardError(f"{path}: cannot stat the shard: {exc.strerror or exc}", path=path) from None
        if found == expected:
            return
        path = self.storage.join(shard)
        size, found_size = expected[-1], found[-1]
        if found[:-1] != expected[:-1]:
            raise ShardError(f"{path}: shard file was replaced while the dataset was open; reopen the "
                             "dataset (and run `stoker verify`) to read the new file", path=path)
        raise ShardError(f"{path}: shard changed size while the dataset was open ({size} -> "
                         f"{found_size} bytes{', truncated' if found_size < size else ''}); "
                         "restore the shard or re-pack", path=path)

    def jpeg_spans(self, indices: np.ndarray) -> tuple[Sequence[Any], np.ndarray]:
        """:meth:`Dataset.jpeg_spans` from the mapped shards: the blocks are the shards' mapped image
        bytes (zero-copy), the spans one gather from a table of every sample's (block, first byte,
        end byte), so a chunk costs a few NumPy calls whatever its size; each shard the rows read is
        checked once (`_guard`), and one that fails the check raises ShardError."""
        datas, spans, kinds = self.pixel_spans(indices)
        if self._spans[4]:   # a pack with raw rows: only the JPEGs here
            spans[kinds != JPEG_ROW, 0] = -1
        return datas, spans

    def pixel_spans(self, indices: np.ndarray) -> tuple[Sequence[Any], np.ndarray, np.ndarray]:
        """:meth:`Dataset.pixel_spans`: `jpeg_spans` with the rows of stored raw pixels too (`kinds`)."""
        table, datas, block_shard, names, _, kind = self._spans or self._spans_table()
        # the callers' int64 rows as they are (one call fewer per chunk)
        idx = indices if type(indices) is np.ndarray and indices.dtype == np.int64 else np.asarray(indices, np.int64)
        spans = table[idx]
        if self._one_shard:
            self._check((0,))
        else:
            blk = spans[:, 0]
            self._check(sorted(set(block_shard[blk[blk >= 0]].tolist())))   # each shard once, in order
        return datas, spans, kind[idx]

    def _spans_table(self) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[str], bool, np.ndarray]:
        """(table, image data per block, shard number per block, shard names, whether any row is raw,
        kinds): `table` int64 [n, 3] is each sample's (block, first byte, end byte), block -1 where it
        is neither a JPEG nor raw pixels; `kinds` uint8 [n] says which (`JPEG_ROW`, `RAW_ROW`, else
        `OTHER_ROW`). Made on first use (25 bytes per sample), for the native engine and the GPU's rows."""
        spans = self._spans
        if spans is not None:
            return spans
        with self._lock:
            if self._closed:
                raise DatasetClosedError(f"{self.path}: the dataset was closed; open it again with open_dataset()")
            if self._spans is None:
                table = np.empty((self._n, 3), np.int64)
                kinds = np.full(self._n, OTHER_ROW, np.uint8)
                names = [s.info.file for s in self._shards]
                number = {name: k for k, name in enumerate(names)}
                codes = {"jpeg": JPEG_ROW, "raw": RAW_ROW}
                for k, (b, start) in enumerate(zip(self._blocks, self._starts)):
                    end = start + b.img_offsets.shape[0] - 1
                    for j, enc in enumerate(b.enc_names):
                        if enc in codes:
                            kinds[start:end][b.enc_codes == j] = codes[enc]
                    table[start:end, 0] = k
                    table[start:end, 0][kinds[start:end] == OTHER_ROW] = -1
                    table[start:end, 1] = b.img_offsets[:-1]
                    table[start:end, 2] = b.img_offsets[1:]
                table.flags.writeable = kinds.flags.writeable = False
                self._spans = (table, [b.img_data for b in self._blocks],
                               np.array([number[b.shard] for b in self._blocks], np.int64), names,
                               bool((kinds == RAW_ROW).any()), kinds)
            return self._spans

    def sample(self, i: int) -> Sample:
        """Sample ``i``: bytes as a zero-copy view of the mapped shard, plus its metadata.

        Raises ShardError when the shard's file was deleted, replaced or resized since opening."""
        i = self._check_index(i)
        b, r = self._locate(i)
        self._guard(b.shard)
        img = b.img_data[b.img_offsets[r]: b.img_offsets[r + 1]]
        key = b.key_data[b.key_offsets[r]: b.key_offsets[r + 1]].tobytes().decode("utf-8")
        return Sample(i, key, img, b.enc_names[b.enc_codes[r]], int(b.heights[r]), int(b.widths[r]),
                      self._label(i), b.shard, b.first_row + r)

    def _column(self, name: str) -> np.ndarray:
        """A column over all samples as numpy: a zero-copy view for a single batch of a
        primitive type, else concatenated once and cached."""
        with self._lock:
            if self._closed:
                raise DatasetClosedError(f"{self.path}: the dataset was closed; open it again with open_dataset()")
            if name not in self._cache:
                parts = [b.batch.column(name) for b in self._blocks]
                arr = pa.chunked_array(parts, type=self._blocks[0].batch.schema.field(name).type) if parts else None
                if arr is None:
                    out = np.empty(0, np.int64)
                elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
                    out = arr.to_numpy() if arr.null_count or len(parts) != 1 or pa.types.is_boolean(arr.type) \
                        else parts[0].to_numpy(zero_copy_only=True)
                else:
                    out = np.array(arr.to_pylist() + [None], dtype=object)[:-1]
                out.flags.writeable = False
                self._cache[name] = out
            return self._cache[name]

    @property
    def labels(self) -> np.ndarray:
        """Labels of all samples: int64 (-1 when unlabelled) or float64 as numpy (zero-copy for a
        single-shard dataset), or an object array for string/list labels."""
        return self._column("label")

    def _label(self, i: int) -> Any:
        value = self.labels[i]
        return value.item() if isinstance(value, np.generic) else value

    @property
    def heights(self) -> np.ndarray:
        """Stored height of every sample in pixels (int32)."""
        return self._column("height")

    @property
    def widths(self) -> np.ndarray:
        """Stored width of every sample in pixels (int32)."""
        return self._column("width")

    @property
    def encodings(self) -> np.ndarray:
        """Encoding name of every sample (object array of str)."""
        return self._column("encoding")

    @property
    def sizes(self) -> np.ndarray:
        """Stored size of every sample in bytes (int64)."""
        return np.concatenate([np.diff(b.img_offsets) for b in self._blocks]) if self._blocks else np.empty(0, np.int64)

    def extra(self, i: int, name: str) -> Any:
        """Value of extra column ``name`` for sample ``i`` (Python object)."""
        if name not in self.extra_columns:
            raise KeyError(f"{self.path}: no extra column {name!r}; this dataset has {self.extra_columns}")
        b, r = self._locate(self._check_index(i))
        self._guard(b.shard)
        return b.batch.column(name)[r].as_py()

    def location(self, i: int) -> tuple[str, int]:
        b, r = self._locate(self._check_index(i))
        return b.shard, b.first_row + r

    def close(self) -> None:
        self._closed = True
        self._blocks = []
        self._spans = None
        self._cache.clear()
        for shard in self._shards:
            shard.close()
        self._shards = []


def _blocks(shard: OpenShard) -> list[_Block]:
    """Zero-copy views of the hot columns of each non-empty record batch of a checked shard."""
    blocks, row = [], 0
    for batch in shard.batches:
        if batch.num_rows:
            key_off, key_data = _binary_views(batch.column("key"))
            img_off, img_data = _binary_views(batch.column("image"))
            enc = batch.column("encoding")
            if not pa.types.is_dictionary(enc.type):
                enc = enc.dictionary_encode()
            blocks.append(_Block(
                shard.info.file, row, batch, key_off, key_data, img_off, img_data,
                _numeric_view(enc.indices, np.int64) if enc.null_count == 0 else enc.indices.to_numpy(),
                [str(v) for v in enc.dictionary.to_pylist()],
                _numeric_view(batch.column("height"), np.int32), _numeric_view(batch.column("width"), np.int32)))
        row += batch.num_rows
    return blocks


def open_dataset(path: str | Path | StorageBackend, *, verify: bool = False, storage: Any = None
                 ) -> PackedDataset | CachedDataset:
    """Open a packed dataset directory or URL. Cheap: reads the manifest and each shard's footer.

    Checks at open time that every shard exists, has the manifest's size and row count and is
    Arrow; ``verify=True`` also checks every shard's SHA-256 (reads all bytes). A URL no storage
    backend serves raises UnsupportedStorageError. A URL gives a :class:`CachedDataset` (its
    shards are downloaded when needed; ``verify=True`` downloads and checks them all now), cached
    per ``storage`` (a ``stoker.Storage``: cache_dir, cache_limit, storage_options).
    """
    if storage is not None and isinstance(path, (str, Path)):
        from .storage import open_storage, url_scheme

        if url_scheme(path) not in (None, "file"):
            path = open_storage(path, **storage.remote())
    storage = as_storage(path)
    if isinstance(storage, RemoteStorage):
        return open_cached(storage, verify=verify)
    manifest = read_manifest(storage)
    shards: list[OpenShard] = []
    try:
        for info in manifest.shards:
            shards.append(open_shard(storage, info, manifest, checksum=verify))
    except BaseException:
        for shard in shards:
            shard.close()
        raise
    return PackedDataset(storage, manifest, shards)


#: Columns a CachedDataset reads at open time without downloading shards (a few ranged GETs each).
META_COLUMNS = ("encoding", "height", "width", "label")


def _meta_column(tables: list[pa.Table], name: str) -> np.ndarray:
    if not tables:
        return np.empty(0, np.int64)
    arr = pa.chunked_array([t.column(name).combine_chunks() for t in tables])
    if (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)) and not arr.null_count:
        out = arr.to_numpy()
    else:
        out = np.array(arr.to_pylist() + [None], dtype=object)[:-1]
    out.flags.writeable = False
    return out


class _Mapped:
    """One shard as mapped now: the cache generation of the file and its zero-copy blocks."""

    def __init__(self, generation: int, blocks: list[_Block]) -> None:
        self.generation = generation
        self.blocks = blocks
        self.starts = [b.first_row for b in blocks]


class CachedDataset(Dataset):
    """A packed dataset in object storage. Labels, heights, widths and encodings are read at open
    time; a shard is downloaded whole (verified) into `storage`'s ShardCache when a sample of it is
    first needed, or ahead of need once :meth:`plan` gave the cache the epoch's order."""

    def __init__(self, storage: RemoteStorage, manifest: Manifest, meta: list[pa.Table]) -> None:
        self.storage = storage
        self.path = Path(storage.location)
        self.url = storage.location
        self.manifest = manifest
        self.classes = manifest.classes
        self.extra_columns = list(manifest.extra_columns)
        assert storage.cache is not None
        self.cache = storage.cache
        self._starts = np.cumsum([0, *[s.rows for s in manifest.shards]]).tolist()
        self._n = int(self._starts[-1])
        self._labels = _meta_column(meta, "label")
        self._heights = _meta_column(meta, "height").astype(np.int32, copy=False)
        self._widths = _meta_column(meta, "width").astype(np.int32, copy=False)
        self._encodings = _meta_column(meta, "encoding")
        self._mapped: dict[str, _Mapped] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.cache.on_evict(_forget_weakly(weakref.ref(self)))
        # a dataset dropped unclosed (say, with its Loader) still stops the download threads
        self._finalizer = weakref.finalize(self, storage.close)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return (f"<stoker dataset {self.url}: {self._n} samples in {len(self.manifest.shards)} shards, "
                f"cached in {self.cache.dir}>")

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    @property
    def heights(self) -> np.ndarray:
        return self._heights

    @property
    def widths(self) -> np.ndarray:
        return self._widths

    @property
    def encodings(self) -> np.ndarray:
        return self._encodings

    @property
    def sizes(self) -> None:
        """Per-sample sizes need the image column's offsets, i.e. the whole shard: not known."""
        return None

    def _forget(self, name: str) -> None:
        # the cache deleted the file: drop our mapping (views still in use keep it alive until done)
        with self._lock:
            self._mapped.pop(name, None)

    def _shard_of(self, i: int) -> tuple[ShardInfo, int]:
        if self._closed:
            raise DatasetClosedError(f"{self.url}: the dataset was closed; open it again with open_dataset()")
        k = bisect.bisect_right(self._starts, i) - 1
        return self.manifest.shards[k], i - int(self._starts[k])

    def _mapping(self, info: ShardInfo, path: Path, generation: int) -> _Mapped:
        """The blocks of the cached copy `generation` of a shard (the caller holds it in the cache)."""
        with self._lock:
            mapped = self._mapped.get(info.file)
            if mapped is not None and mapped.generation == generation:
                return mapped
        try:  # the copy was verified on download; this checks it is a shard of this manifest
            local = open_shard(LocalStorage(path.parent), replace(info, file=path.name), self.manifest)
        except ShardError as exc:
            where = self.storage.join(info.file)
            raise ShardError(f"{where} (cached as {path}): {exc}", path=where) from None
        mapped = _Mapped(generation, _blocks(OpenShard(info, local.mapping, local.batches, local.identity)))
        with self._lock:
            self._mapped[info.file] = mapped
        return mapped

    def _read(self, i: int, fn: Any) -> Any:
        info, row = self._shard_of(self._check_index(i))
        path, generation = self.cache.get(info.file)
        try:
            mapped = self._mapping(info, path, generation)
            block = mapped.blocks[bisect.bisect_right(mapped.starts, row) - 1]
            return fn(block, row - block.first_row, info)
        finally:
            self.cache.release(info.file)

    def sample(self, i: int) -> Sample:
        """Sample `i`: bytes as a zero-copy view of the cached shard (downloaded first if needed)."""
        def view(b: _Block, r: int, info: ShardInfo) -> Sample:
            img = b.img_data[b.img_offsets[r]: b.img_offsets[r + 1]]
            key = b.key_data[b.key_offsets[r]: b.key_offsets[r + 1]].tobytes().decode("utf-8")
            label = self._labels[i]
            return Sample(i, key, img, b.enc_names[b.enc_codes[r]], int(b.heights[r]), int(b.widths[r]),
                          label.item() if isinstance(label, np.generic) else label, info.file, b.first_row + r)
        return self._read(i, view)

    def extra(self, i: int, name: str) -> Any:
        if name not in self.extra_columns:
            raise KeyError(f"{self.url}: no extra column {name!r}; this dataset has {self.extra_columns}")
        return self._read(i, lambda b, r, info: b.batch.column(name)[r].as_py())

    def location(self, i: int) -> tuple[str, int]:
        info, row = self._shard_of(self._check_index(i))
        return info.file, row

    @property
    def plans_downloads(self) -> bool:
        return True

    def plan(self, indices: np.ndarray, lookahead: int, order: str | None = None) -> None:
        """Give the cache the order samples will be read in (`lookahead`: how far ahead the readers
        may run; `order`: the Loader's name for it, for the message), so it downloads ahead of need
        and evicts what this epoch is done with. Raises ConfigError when that order needs more
        shards at once than the cache may hold."""
        shard_idx = np.searchsorted(self._starts, np.asarray(indices, dtype=np.int64), side="right") - 1
        if not len(shard_idx):
            self.cache.plan([])
            return
        uniq, first, counts = np.unique(shard_idx, return_index=True, return_counts=True)
        last = len(shard_idx) - 1 - np.unique(shard_idx[::-1], return_index=True)[1]
        infos = [self.manifest.shards[k] for k in uniq]
        names = [s.file for s in infos]
        need = working_set_bytes(dict(zip(names, first.tolist())), dict(zip(names, last.tolist())),
                                 {s.file: s.bytes for s in infos}, lookahead)
        if need > self.cache.limit:
            fix = (f"raise Storage(cache_limit=) to at least {format_bytes(need)}, or read fewer samples ahead (lower Workers(prefetch=), "
                   f"batch_size or num_threads: they read up to {lookahead:,} samples ahead)"
                   if order == "shard_window" else
                   "use order='shard_window' (a few shards at a time) or raise cache_limit")
            raise ConfigError(
                f"{self.url}: this epoch's order needs up to {format_bytes(need)} of shards cached at once, more than "
                f"cache_limit ({format_bytes(self.cache.limit)}); {fix}")
        self.cache.plan([names[j] for j in np.argsort(first, kind="stable")], dict(zip(names, counts.tolist())))

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._mapped.clear()
        self._finalizer()


def _forget_weakly(ref: weakref.ref) -> Any:
    """The cache's eviction callback, holding the dataset weakly: the cache's threads must not keep
    a dataset alive that nobody else holds (its finalizer is what stops them)."""
    def forget(name: str) -> None:
        ds = ref()
        if ds is not None:
            ds._forget(name)
    return forget


def open_cached(storage: RemoteStorage, *, verify: bool = False, fetch_threads: int = 2,
                timeout: float = 300.0) -> CachedDataset:
    """Open a dataset in object storage: the manifest, each shard's small columns (META_COLUMNS) and
    the shard cache. `verify=True` also downloads and checks every shard now."""
    manifest = read_manifest(storage)
    cache = storage.open_cache(manifest.shards, threads=fetch_threads, timeout=timeout)
    try:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="stoker-meta") as pool:
            meta = list(pool.map(lambda s: storage.shard_meta(s, s.rows, META_COLUMNS), manifest.shards))
        ds = CachedDataset(storage, manifest, meta)
        if verify:
            for info in manifest.shards:
                path, generation = cache.get(info.file)
                try:
                    ds._mapping(info, path, generation)
                finally:
                    cache.release(info.file)
    except BaseException:
        storage.close()
        raise
    return ds
