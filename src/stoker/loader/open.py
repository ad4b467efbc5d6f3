"""A Loader's source opened with its `Storage` options: a Dataset as given, a URL through the shard
cache, a packed folder (staged first when asked), anything else as loose files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dataset import Dataset
from ..errors import SourceError
from ..loose import open_loose
from ..reader import open_cached, open_dataset


@dataclass
class Opened:
    """A Loader's source, opened: the dataset, whether closing is ours, and the staged copy it reads
    (removed when the last user closes it)."""

    dataset: Dataset
    owned: bool
    staged: Any = None   # storage.staging.StagedCopy

    def close(self) -> None:
        """Close the dataset (when opened here) and release the staged copy. Idempotent."""
        if self.owned:
            self.dataset.close()
            self.owned = False
        staged, self.staged = self.staged, None
        if staged is not None:
            staged.close()


def open_for_loading(source: str | Path | Dataset, options: Any = None, *, rank: int = 0, world_size: int = 1,
                     timeout: float = 120.0) -> Opened:
    """Open what a Loader reads, with its storage options (`stoker.Storage`): a Dataset as given; a
    URL cached per `options` (each rank in its own `rank-N` folder when there are several, so no
    rank deletes a file another maps); a packed folder, first staged into `options.stage` when set;
    anything else as loose files (`open_loose`). `options.stage` with a Dataset or a URL is refused by
    `plan.ask`, before this."""
    from ..shards import MANIFEST_NAME, looks_like_partial_pack
    from ..storage import open_storage, url_scheme
    from ..storage.remote import default_cache_dir
    from ..storage.staging import stage_for_loader
    from .options import Storage

    options = Storage() if options is None else options
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
