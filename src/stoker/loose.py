"""Unpacked images (an ImageFolder tree, a `path label` list, a CSV, a tar) served through the same
`Dataset` interface as a packed dataset, each file read when asked: `open_loose(src)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from . import codecs
from .dataset import Dataset, Sample
from .errors import ImageError, SourceError
from .storage.local import read_regular


class LooseDataset(Dataset):
    """Images read file by file from a source listing (ImageFolder tree, file list, CSV, tar)."""

    def __init__(self, source: Any, max_pixels: int = codecs.MAX_PIXELS) -> None:
        self.source = source
        self.path = Path(source.root)
        self.classes = source.classes
        self.extra_columns = list(source.extra_columns)
        self._items = source.items
        self._max_pixels = max_pixels
        self._labels: np.ndarray | None = None
        codecs.quiet_decoder_messages()   # users' raw files: libtiff/Pillow must not flood stderr

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"<stoker loose dataset {self.source.description}: {len(self)} files>"

    @property
    def labels(self) -> np.ndarray:
        if self._labels is None:
            values = [it.label for it in self._items]
            kind = self.source.label_type
            if kind == "none":
                arr = np.full(len(values), -1, np.int64)
            elif kind in ("int64", "float64"):
                arr = np.asarray(values, dtype=kind)
            else:
                arr = np.array(values + [None], dtype=object)[:-1]
            arr.flags.writeable = False
            self._labels = arr
        return self._labels

    def sample(self, i: int) -> Sample:
        """Read and probe file ``i``. Encoding is "jpeg" for an upright RGB/gray JPEG (fast
        path), else "image" (decoded by Pillow); height/width are the upright size."""
        i = self._check_index(i)
        item = self._items[i]
        where = str(item.path) if item.path is not None else item.key
        try:
            data = item.read()
        except OSError as exc:
            raise ImageError(item.key, f"cannot read {where}: {exc.strerror or exc}") from None
        info = codecs.probe(data, item.key, max_pixels=self._max_pixels)
        encoding = "jpeg" if codecs.is_plain_jpeg(info) else "image"
        h, w = info.upright_shape
        label = item.label if self.source.label_type != "none" else -1
        return Sample(i, item.key, data, encoding, h, w, label, where, i)

    def extra(self, i: int, name: str) -> Any:
        if name not in self.extra_columns:
            raise KeyError(f"{self.path}: no extra column {name!r}; this source has {self.extra_columns}")
        item = self._items[self._check_index(i)]
        if name in item.label_maps:  # a CSV's mask column: the label map's bytes, as a pack stores them
            return read_regular(item.label_maps[name])
        return item.extras.get(name)

    def location(self, i: int) -> tuple[str, int]:
        item = self._items[self._check_index(i)]
        return (str(item.path) if item.path is not None else item.key), i


def open_loose(source: Any, **source_options: Any) -> LooseDataset:
    """Serve unpacked images (ImageFolder tree, ``path label`` list, CSV, tar) with the reader
    interface. ``source`` is a path (see :func:`stoker.sources.open_source`) or an opened Source."""
    from .sources import open_source

    if isinstance(source, (str, Path)):
        source = open_source(source, **source_options)
    if not source.items:
        raise SourceError(f"{source.description}: no images found", path=source.root)
    return LooseDataset(source)
