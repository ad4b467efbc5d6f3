"""A Loader's source opened with its `Storage` options: a Dataset as given, a URL through the shard
cache, a packed folder (staged first when asked), a `Mix` (each source so, joined), anything else as
loose files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ..dataset import Dataset, Opened
from ..errors import SourceError
from ..loose import open_loose
from ..mix import Mix, MixedDataset
from ..reader import open_cached, open_dataset


def open_for_loading(source: str | Path | Dataset | Mix, options: Any = None, *, rank: int = 0, world_size: int = 1,
                     timeout: float = 120.0) -> Opened:
    """Open what a Loader reads, with its storage options (`stoker.Storage`): a Dataset as given; a
    Mix as each of its sources is opened (`open_mix`); a
    URL cached per `options` (each rank in its own `rank-N` folder when there are several, so no
    rank deletes a file another maps); a packed folder, first staged into `options.stage` when set;
    anything else as loose files (`open_loose`). `options.stage` with a Dataset or a URL is refused by
    `plan.ask`, before this."""
    from ..shards import MANIFEST_NAME, looks_like_partial_pack
    from ..storage import open_storage, url_scheme
    from ..storage.remote import default_cache_dir
    from ..staging import stage_for_loader
    from .options import Storage

    options = Storage() if options is None else options
    if isinstance(source, Mix):
        return open_mix(source, options, rank=rank, world_size=world_size, timeout=timeout)
    if isinstance(source, Dataset):
        return Opened(source, owned=False)
    if url_scheme(source) not in (None, "file"):
        remote = options.remote()
        if world_size > 1:
            remote["cache_dir"] = Path(remote["cache_dir"] or default_cache_dir(str(source))) / f"rank-{rank}"
        # refuses a URL no backend serves, never makes it a local path
        return Opened(open_cached(open_storage(source, **remote), timeout=max(timeout, 60.0)), owned=True)
    staged = stage_for_loader(source, options.stage) if options.stage is not None else None
    try:
        where = staged.path if staged is not None else source
        storage = open_storage(where)
        if storage.is_dir() and (storage.exists(MANIFEST_NAME) or looks_like_partial_pack(storage)):
            return Opened(open_dataset(storage), owned=True, staged=staged)
        try:
            return Opened(open_loose(where), owned=True, staged=staged)
        except SourceError as exc:  # "pass kind=..." is open_loose's and pack's spelling, not the Loader's
            from ..spelling import loader_source_error
            raise loader_source_error(exc, where) from None
    except BaseException:
        if staged is not None:
            staged.close()
        raise


def open_mix(mix: Mix, storage: Any = None, *, rank: int = 0, world_size: int = 1, timeout: float = 120.0) -> Opened:
    """Open every source of a Mix with the Loader's `Storage` options (a cache folder of its own per source)."""
    opened: list[Opened] = []
    try:
        for name, where in mix.sources.items():
            options = storage
            if storage is not None and storage.cache_dir is not None:
                options = replace(storage, cache_dir=Path(storage.cache_dir) / name)
            opened.append(open_for_loading(where, options, rank=rank, world_size=world_size, timeout=timeout))
        return Opened(MixedDataset(mix, opened), owned=True)
    except BaseException:
        for o in opened:
            o.close()
        raise
