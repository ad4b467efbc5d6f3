"""Packed datasets in object storage, read shard by shard through the local shard cache.

``open_dataset("s3://bucket/ds")`` lands here. Opening reads the manifest and, per shard, only the
small ``height``/``width``/``label`` columns (a few ranged GETs each, kept in the cache directory
for the next run), so a Loader can plan crops and batches at once. A sample's shard is downloaded
whole when it is first needed (or earlier: :meth:`CachedDataset.plan` tells the cache the epoch's
order and its threads fetch ahead of the readers), verified, memory-mapped, and served zero-copy
like a local shard.
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import ConfigError, DatasetClosedError, ShardError
from .integrity import check_mapped_shard
from .reader import Dataset, Sample, _Block, _blocks
from .shards import Manifest, ShardInfo, read_manifest
from .storage.cache import ShardCache, working_set_bytes
from .storage.remote import RemoteStorage

_META_COLUMNS = ("height", "width", "label")


def _read_meta(storage: RemoteStorage, info: ShardInfo, cache_dir: Path) -> pa.Table:
    """The shard's height, width and label columns: from the cache directory when an earlier run
    saved them, else read from storage with ranged GETs of just those columns' buffers."""
    local = cache_dir / f"{info.sha256}.meta.arrow"
    try:
        with pa.memory_map(str(local), "r") as mm:
            table = pa.ipc.open_file(mm).read_all()
        if table.num_rows == info.rows and table.schema.names == list(_META_COLUMNS):
            return table
    except (OSError, pa.ArrowException):
        pass  # absent or damaged: read it again
    where = storage.join(info.file)
    try:
        with storage.fs.open(storage.path(info.file), "rb", block_size=1 << 16, cache_type="none") as fh:
            reader = pa.ipc.open_file(pa.PythonFile(fh, mode="r"))
            fields = [reader.schema.get_field_index(c) for c in _META_COLUMNS]
            if min(fields) < 0:
                raise ShardError(f"{where}: missing column(s) {[c for c, f in zip(_META_COLUMNS, fields) if f < 0]}; "
                                 "expected a stoker shard", path=where)
            fh.seek(0)
            reader = pa.ipc.open_file(pa.PythonFile(fh, mode="r"),
                                      options=pa.ipc.IpcReadOptions(included_fields=fields))
            table = reader.read_all().select(list(_META_COLUMNS))
    except FileNotFoundError:
        raise ShardError(f"{where}: listed in the manifest but missing from the storage; upload it or "
                         "re-pack the dataset", path=where) from None
    except (pa.ArrowException, ValueError) as exc:
        raise ShardError(f"{where}: not a readable Arrow IPC file ({exc}); upload it again or re-pack",
                         path=where) from None
    if table.num_rows != info.rows:
        raise ShardError(f"{where}: holds {table.num_rows} rows, the manifest expects {info.rows}; upload it "
                         "again or re-pack", path=where)
    tmp = local.with_name(f".{local.name}.tmp")
    with pa.OSFile(str(tmp), "wb") as out, pa.ipc.new_file(out, table.schema) as writer:
        writer.write_table(table)
    tmp.replace(local)
    return table


def _column(tables: list[pa.Table], name: str, type_: pa.DataType) -> np.ndarray:
    arr = pa.chunked_array([t.column(name).combine_chunks() for t in tables], type=type_) if tables else None
    if arr is None:
        return np.empty(0, np.int64)
    if (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)) and not arr.null_count:
        out = arr.to_numpy()
    else:
        out = np.array(arr.to_pylist() + [None], dtype=object)[:-1]
    out.flags.writeable = False
    return out


class _Mapped:
    """One shard's mapping as served now: its cache generation and zero-copy blocks."""

    def __init__(self, generation: int, blocks: list[_Block]) -> None:
        self.generation = generation
        self.blocks = blocks
        self.starts = [b.first_row for b in blocks]


class CachedDataset(Dataset):
    """A packed dataset in object storage; shards come through `storage`'s ShardCache."""

    def __init__(self, storage: RemoteStorage, manifest: Manifest, cache: ShardCache,
                 meta: list[pa.Table]) -> None:
        self.storage = storage
        self.path = Path(storage.location)
        self.url = storage.location
        self.manifest = manifest
        self.classes = manifest.classes
        self.extra_columns = list(manifest.extra_columns)
        self.cache = cache
        self._starts = np.cumsum([0, *[s.rows for s in manifest.shards]]).tolist()
        self._n = self._starts[-1]
        label_type = manifest.schema().field("label").type
        self._labels = _column(meta, "label", label_type)
        self._heights = _column(meta, "height", pa.int32())
        self._widths = _column(meta, "width", pa.int32())
        self._mapped: dict[str, _Mapped] = {}
        self._lock = threading.Lock()
        self._closed = False
        cache.on_evict(self._forget)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"<stoker dataset {self.url}: {self._n} samples in {len(self.manifest.shards)} shards, cached " \
               f"in {self.cache.dir}>"

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    @property
    def heights(self) -> np.ndarray:
        return self._heights

    @property
    def widths(self) -> np.ndarray:
        return self._widths

    def _forget(self, name: str) -> None:
        """The cache deleted `name`: drop our mapping (views still in use keep it alive until done)."""
        with self._lock:
            self._mapped.pop(name, None)

    def _shard_of(self, i: int) -> tuple[ShardInfo, int]:
        k = bisect.bisect_right(self._starts, i) - 1
        return self.manifest.shards[k], i - self._starts[k]

    def _mapping(self, info: ShardInfo, path: Path, generation: int) -> _Mapped:
        """The mapping of the cached copy `generation` of a shard (the caller holds it: get/release)."""
        with self._lock:
            mapped = self._mapped.get(info.file)
            if mapped is not None and mapped.generation == generation:
                return mapped
        shard = check_mapped_shard(path, info, self.manifest, where=self.storage.join(info.file))
        mapped = _Mapped(generation, _blocks(shard))
        with self._lock:
            if self._closed:
                raise DatasetClosedError(f"{self.url}: the dataset was closed")
            self._mapped[info.file] = mapped
        return mapped

    def _read(self, i: int, fn: Any) -> Any:
        if self._closed:
            raise DatasetClosedError(f"{self.url}: the dataset was closed; open it again")
        info, row = self._shard_of(self._check_index(i))
        path, generation = self.cache.get(info.file)
        try:
            mapped = self._mapping(info, path, generation)
            k = bisect.bisect_right(mapped.starts, row) - 1
            block = mapped.blocks[k]
            return fn(block, row - block.first_row, info)
        finally:
            self.cache.release(info.file)

    def sample(self, i: int) -> Sample:
        """Sample `i`, its bytes a zero-copy view of the cached shard (downloaded first if needed)."""
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

    def plan(self, indices: np.ndarray, lookahead: int) -> None:
        """Tell the cache the order samples will be read in (`lookahead`: how many positions the
        readers may run ahead), so it fetches ahead of need and evicts what this epoch is done with.
        Raises ConfigError when that order needs more shards at once than the cache limit holds."""
        shard_idx = np.searchsorted(self._starts, np.asarray(indices, dtype=np.int64), side="right") - 1
        uniq, first, counts = np.unique(shard_idx, return_index=True, return_counts=True)
        last = len(shard_idx) - 1 - np.unique(shard_idx[::-1], return_index=True)[1]
        names = [self.manifest.shards[k].file for k in uniq]
        sizes = {self.manifest.shards[k].file: self.manifest.shards[k].bytes for k in uniq}
        need = working_set_bytes(dict(zip(names, first.tolist())), dict(zip(names, last.tolist())), sizes,
                                 lookahead)
        if need > self.cache.limit:
            raise ConfigError(
                f"{self.url}: this epoch's order needs up to {need / 1e9:.2f} GB of shards cached at once, "
                f"more than cache_limit={self.cache.limit / 1e9:.2f} GB; use order='shard_window' (reads a few "
                f"shards at a time), or raise cache_limit")
        by_first = [names[j] for j in np.argsort(first, kind="stable")]
        self.cache.plan(by_first, dict(zip(names, counts.tolist())))

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._mapped.clear()
        self.storage.close()


def open_remote(storage: RemoteStorage, *, verify: bool = False, fetch_threads: int = 2,
                timeout: float = 300.0) -> CachedDataset:
    """Open a dataset in object storage: its manifest and per-shard metadata (heights, widths,
    labels), and the shard cache. `verify=True` also downloads and verifies every shard now."""
    manifest = read_manifest(storage)
    cache = storage.open_cache(manifest.shards, threads=fetch_threads, timeout=timeout)
    try:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="stoker-meta") as pool:
            meta = list(pool.map(lambda info: _read_meta(storage, info, cache.dir), manifest.shards))
        ds = CachedDataset(storage, manifest, cache, meta)
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
