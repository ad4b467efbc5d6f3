"""What every dataset a Loader reads is: a `Dataset` (packed shards, shards in object storage, loose
files) handing out `Sample`s, and `Opened`: one opened for a Loader. The packed kinds live in `reader`,
loose files in `loose`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence, Union

import numpy as np

from . import codecs
from .errors import ConfigError
from .shards import Manifest
from .video import VIDEO_ENCODING

Bytes = Union[memoryview, np.ndarray, bytes]


class Sample(NamedTuple):
    """One sample as stored. ``data`` is a zero-copy view for packed datasets."""

    index: int
    key: str
    data: Bytes
    encoding: str
    height: int  # pixels of what is stored (upright for loose files)
    width: int
    label: Any
    shard: str  # shard file name, or the source path for loose files
    row: int  # row inside the shard, or the index in the source listing


#: what a row of `Dataset.pixel_spans` is: a JPEG, stored raw pixels (height x width x 3), or anything else
JPEG_ROW, RAW_ROW, OTHER_ROW = 0, 1, 255


class Dataset:
    """Common interface of packed and loose datasets (see :func:`open_dataset`, :func:`open_loose`)."""

    classes: list[str] | None
    extra_columns: list[str]
    path: Path
    manifest: Manifest | None = None   # packed data: its manifest

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label, as torchvision's ImageFolder has it (empty without class names)."""
        return {name: k for k, name in enumerate(self.classes or ())}

    def sample(self, i: int) -> Sample:
        raise NotImplementedError

    def jpeg_spans(self, indices: np.ndarray) -> tuple[Sequence[Any], np.ndarray]:
        """Where the stored bytes of samples `indices` are, for the native engine and the GPU's rows
        (`loading.engine`, `loading.jobs.gpu_rows`): `(blocks, spans)`, spans int64 [k, 3] holding
        each sample's (index into `blocks`, first byte, end byte), block -1 for any other encoding or
        a sample that cannot be read (its per-sample read reports it). Here each JPEG is its own
        block (its `sample(i).data`); a packed dataset hands over its mapped blocks instead."""
        blocks: list[Any] = []
        spans = np.full((len(indices), 3), -1, np.int64)
        for j, i in enumerate(np.asarray(indices).tolist()):
            try:
                s = self.sample(i)
            except Exception:  # noqa: BLE001 - read again, and reported, by the per-sample path
                continue
            if s.encoding == "jpeg":
                spans[j] = len(blocks), 0, memoryview(s.data).nbytes
                blocks.append(s.data)
        return blocks, spans

    def pixel_spans(self, indices: np.ndarray) -> tuple[Sequence[Any], np.ndarray, np.ndarray]:
        """`jpeg_spans` with the rows of stored raw pixels too (the native engine reads both): `(blocks,
        spans, kinds)`, kinds uint8 per row, `JPEG_ROW`, `RAW_ROW` or `OTHER_ROW` (its span's block -1).
        Here only the JPEGs: a packed dataset hands over its raw rows as well."""
        blocks, spans = self.jpeg_spans(indices)
        return blocks, spans, np.where(spans[:, 0] >= 0, JPEG_ROW, OTHER_ROW).astype(np.uint8)

    @property
    def maps_jpegs(self) -> bool:
        """Whether `jpeg_spans` hands over mapped blocks (a packed dataset's shards) rather than reading
        each sample: what the native engine's route asks of the data (`loading.route`)."""
        return type(self).jpeg_spans is not Dataset.jpeg_spans

    @property
    def labels(self) -> np.ndarray:
        raise NotImplementedError

    @property
    def heights(self) -> np.ndarray | None:
        return None

    @property
    def widths(self) -> np.ndarray | None:
        return None

    @property
    def packed(self) -> bool:
        """Whether the data was packed: shards under a manifest (stored sizes, keys, column types)."""
        return self.manifest is not None

    @property
    def column_types(self) -> dict[str, str]:
        """The extra columns' stored types (packed data); empty when the data was not packed."""
        return {} if self.manifest is None else dict(self.manifest.extra_columns)

    @property
    def shard_rows(self) -> list[int] | None:
        """Rows per shard, in order (packed data); None when the data is not in shards."""
        return None if self.manifest is None else [s.rows for s in self.manifest.shards]

    @property
    def plans_downloads(self) -> bool:
        """Whether each epoch's order is handed to `plan()` as the epoch starts (data in object storage)."""
        return False

    def extra(self, i: int, name: str) -> Any:
        raise NotImplementedError

    def location(self, i: int) -> tuple[str, int]:
        raise NotImplementedError

    def __getitem__(self, i: int) -> tuple[np.ndarray, Any]:
        """`(image, label)` of sample `i`, like a torch Dataset: the image decoded, upright RGB
        `uint8 [H, W, 3]` (a copy; `sample(i)` gives the stored bytes instead). Negative `i` counts
        from the end. Decoding one at a time is for looking at data; the Loader is what trains fast."""
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"dataset indices are ints, got {type(i).__name__}; for a subset pass "
                            f"sampling=stoker.Sampling(indices=[...]) to stoker.Loader")
        s = self.sample(int(i))
        if s.encoding == VIDEO_ENCODING:
            raise ConfigError(f"sample {i} ({s.key}) is a video: read clips of it with stoker.clips.read_clip, or "
                              "its stored bytes with dataset.sample(i).data")
        image = codecs.decode_rgb(s.data, s.encoding, s.key, height=s.height, width=s.width)
        label = s.label.item() if isinstance(s.label, np.generic) else s.label
        return np.array(image), label

    def close(self) -> None:
        """Release mapped files; further access is an error."""

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_index(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        return i


@dataclass
class Opened:
    """A Loader's source, opened: the dataset, whether closing is ours, and the staged copy it reads
    (removed when the last user closes it)."""

    dataset: Dataset
    owned: bool
    staged: Any = None   # staging.StagedCopy

    def close(self) -> None:
        """Close the dataset (when opened here) and release the staged copy. Idempotent."""
        if self.owned:
            self.dataset.close()
            self.owned = False
        staged, self.staged = self.staged, None
        if staged is not None:
            staged.close()
