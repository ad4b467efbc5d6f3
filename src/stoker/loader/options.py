"""The Loader's option values: what to read (`Sampling`), where it lives (`Storage`), what comes with
each image (`Targets`) and how the threads run (`Workers`).

Each is frozen and self-validating, like `DeviceOptions`: shorthand is resolved when it is made, a
bad value fails there with a message that names the fix, and it prints what it holds. Each is
usable alone (`Loader(path, 256, sampling=Sampling(indices=val_ids))`) and none knows the others;
the Loader checks the combinations.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ConfigError
from ..loading.labels import MULTI_LABEL_FORMATS
from ..order import ORDERS
from ..storage.remote import DEFAULT_CACHE_LIMIT

__all__ = ["Sampling", "Storage", "Targets", "Workers", "DECODE_QUALITIES", "ON_ERROR"]

#: "accurate": libjpeg-turbo's exact IDCT and smooth chroma upsampling (what simplejpeg and Pillow
#: give); "fast": its fast IDCT and plain upsampling, a few % less CPU (docs/decoding.md); "exact": the
#: accurate decode at full size (no DCT scaling), so each resize sees torchvision's pixels (within 1).
DECODE_QUALITIES = ("accurate", "fast", "exact")
ON_ERROR = ("raise", "skip")


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _short(value: Any) -> str:
    """A field's value for repr: arrays by length, not by content."""
    if isinstance(value, np.ndarray):
        return f"<{len(value)} {value.dtype}>"
    return repr(value)


class _Printable:
    def __repr__(self) -> str:
        changed = [f"{f.name}={_short(getattr(self, f.name))}" for f in fields(self)  # type: ignore[arg-type]
                   if f.repr and not _same(getattr(self, f.name), f.default)]
        return f"{type(self).__name__}({', '.join(changed)})"


def _same(a: Any, b: Any) -> bool:
    return a is b or (not isinstance(a, np.ndarray) and not isinstance(b, np.ndarray) and a == b)


def _int_or_none(value: Any, name: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum} or None, got {value!r}")
    return int(value)


@dataclass(frozen=True, eq=False, repr=False)
class Sampling(_Printable):
    """Which samples an epoch reads, in what order, on this rank.

    order: "random" (a full shuffle per epoch), "sequential" (dataset order), "shard_random" (blocks of
        shards in a shuffled order) or "shard_window" (shuffled shards, one run per rank).
    seed: the epoch order and every random draw are pure functions of (seed, epoch, sample).
    indices: read only these dataset indices (a Subset); weights: one per sample (or per entry of
        indices), drawn each epoch with replacement (WeightedRandomSampler).
    rank, world_size: default from torch.distributed when it is initialized, else 0 and 1.
    drop_last: drop the last partial batch (and, with several ranks, the tail that would need padding).
    clips: a video pack's clips (`stoker.Clips`: frames per clip, stride or fps, random or uniform,
        clips per video); default `Clips()` for a video pack, refused for images.
    buckets: aspect-ratio buckets (`stoker.AspectBuckets`, or a list of (height, width)): each batch from
        one bucket, each image resized to cover it and cropped (docs/variable-resolution.md).
    """

    order: str = "random"
    seed: int = 0
    indices: Any = None   # resolved: a read-only int64 array, or None
    weights: Any = None   # resolved: a read-only float64 array, or None
    rank: int | None = None
    world_size: int | None = None
    drop_last: bool = False
    clips: Any = None
    buckets: Any = None   # resolved: an AspectBuckets, or None

    def __post_init__(self) -> None:
        if self.buckets is not None:
            from ..buckets import AspectBuckets

            _set(self, "buckets", AspectBuckets.of(self.buckets))
        if self.clips is not None:
            from ..loading.clips import Clips   # here: the option values import nothing heavy until a clip is asked for

            if not isinstance(self.clips, Clips):
                raise ConfigError(f"clips= takes a stoker.Clips, got {type(self.clips).__name__}: {self.clips!r:.80}")
        if self.order not in ORDERS:
            raise ConfigError(f"order must be one of {ORDERS}, got {self.order!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        _set(self, "seed", int(self.seed))
        for name in ("indices", "weights"):
            value = getattr(self, name)
            if value is not None:
                arr = np.array(value)   # a copy the caller cannot change afterwards
                if arr.ndim != 1:
                    raise ConfigError(f"{name} must be one-dimensional, got shape {arr.shape}")
                if name == "indices" and arr.size and arr.dtype.kind not in "iu":
                    raise ConfigError(f"indices must be ints (dataset indices), got {arr.dtype} values")
                arr = arr.astype(np.int64 if name == "indices" else np.float64) if arr.size else arr
                arr.flags.writeable = False
                _set(self, name, arr)
        _set(self, "rank", _int_or_none(self.rank, "rank", 0))
        _set(self, "world_size", _int_or_none(self.world_size, "world_size", 1))
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"drop_last must be True or False, got {self.drop_last!r}")


@dataclass(frozen=True, repr=False)
class Storage(_Printable):
    """Where a dataset lives and how it is brought close.

    cache_dir, cache_limit, storage_options: for a URL source (s3://, gs://, any fsspec URL): where
        verified shards are cached (default ~/.cache/stoker/<hash>; with several ranks a rank-N folder
        in it), the most bytes each rank keeps ("50GB", or an int), and the fsspec backend's options.
    stage: e.g. "/dev/shm": copy a local packed dataset there once (verified, shared by the node's
        ranks, removed by the last to close).
    """

    cache_dir: str | Path | None = None
    cache_limit: int | str = DEFAULT_CACHE_LIMIT
    storage_options: dict[str, Any] | None = field(default=None, hash=False)
    stage: str | Path | None = None

    def __post_init__(self) -> None:
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, got {self.storage_options!r}")
        if isinstance(self.cache_limit, bool) or not isinstance(self.cache_limit, (int, str)):
            raise ConfigError(f"cache_limit must be bytes (an int) or a size such as '50GB', got {self.cache_limit!r}")

    def remote(self) -> dict[str, Any]:
        """The keywords a URL's RemoteStorage takes."""
        return {"cache_dir": self.cache_dir, "cache_limit": self.cache_limit, "storage_options": self.storage_options}


def _names(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{what} names extra columns (str), got {value!r}")
    return names


@dataclass(frozen=True, repr=False)
class Targets(_Printable):
    """What comes with each image besides its label, and how labels are encoded.

    boxes: extra columns of boxes (x0, y0, x1, y1 as fractions) moved through each sample's crop,
        resize and flip. masks: polygon columns (coco) or label-map PNG columns, moved the same way.
    ignore_index: the class id label maps get where the geometry pads.
    pad: batch images of different output sizes top-left in zero-padded rows, sizes in extras["sizes"].
    multi_label: "multi-hot", "indices" or "list" for datasets of lists of class indices;
        num_classes: width of multi-hot rows (default: the dataset's classes).
    classes: pin the class list (label k is classes[k]): a split missing a class keeps the others' labels.
    collate_fn: collate_fn({column: [values]}) gives the batch's third item (needs columns=).
    captions: a text column (a WebDataset's `txt`, a COCO captions pack's `captions`, a CSV or Parquet
        column), handed out as extras[captions], a list of str per batch; where a sample holds several (a
        list<string> value, or a JSON list of strings), one of them, chosen per (seed, epoch, sample)
        (docs/text.md).
    tokenizer: tokenizer(list of str) -> {"input_ids": ..., "attention_mask": ..., ...}, called once per batch
        on the batch's captions in the thread that iterates the Loader; its items join the extras (its time:
        `loader.stats.tokenize_s`).
    """

    boxes: tuple[str, ...] = ()
    masks: tuple[str, ...] = ()
    ignore_index: int = 255
    pad: bool = False
    multi_label: str = "multi-hot"
    num_classes: int | None = None
    classes: tuple[str, ...] | None = None
    collate_fn: Callable[[dict[str, list]], Any] | None = field(default=None, hash=False)
    captions: str | None = None
    tokenizer: Callable[[list[str]], Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.captions is not None and (not isinstance(self.captions, str) or not self.captions):
            raise ConfigError(f"captions= names a text column (a WebDataset pack's 'txt', say), got {self.captions!r}")
        if self.tokenizer is not None and (not callable(self.tokenizer) or self.captions is None):
            raise ConfigError("tokenizer= is a callable on a batch's captions: pass it with captions='COLUMN' "
                              f"(the text column it reads), got tokenizer={self.tokenizer!r:.80}, "
                              f"captions={self.captions!r}")
        _set(self, "boxes", _names(self.boxes, "boxes"))
        _set(self, "masks", _names(self.masks, "masks"))
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, (int, np.integer)) \
                or not 0 <= self.ignore_index < 2**31:
            raise ConfigError(f"ignore_index must be an int in 0..2**31-1 (the class id label maps get where the "
                              f"geometry pads), got {self.ignore_index!r}")
        _set(self, "ignore_index", int(self.ignore_index))
        if not isinstance(self.pad, bool):
            raise ConfigError(f"pad must be True or False, got {self.pad!r}")
        if self.multi_label not in MULTI_LABEL_FORMATS:
            raise ConfigError(f"multi_label={self.multi_label!r}: expected one of {', '.join(MULTI_LABEL_FORMATS)}")
        _set(self, "num_classes", _int_or_none(self.num_classes, "num_classes", 1))
        if self.classes is not None:
            if isinstance(self.classes, str) or len(set(self.classes)) != len(self.classes):
                raise ConfigError(f"classes= is a list of distinct class names (label k is classes[k]), got "
                                  f"{self.classes!r}")
            _set(self, "classes", tuple(str(c) for c in self.classes))
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise ConfigError(f"collate_fn must be callable, got {self.collate_fn!r}")


@dataclass(frozen=True, repr=False)
class Workers(_Printable):
    """How the worker threads run. `Loader(workers=8)` is short for `Workers(num_threads=8)`.

    num_threads: worker threads (default: the CPUs this process may use, less the cores a GPU training
        process keeps for itself); with processes=N, all N processes' threads together, shared out evenly.
    prefetch: batches prepared ahead of the one you hold (the ring has prefetch + 2 slots, one more with a
        device, two with GPU decode; with processes=N, prefetch + 1 + N and those).
    persistent: the threads run on into the next epoch (DataLoader's persistent_workers).
    pin_memory: default pinned when CUDA is available; True without CUDA warns and pins nothing (as DataLoader).
    timeout: seconds to wait for one batch before LoaderTimeoutError.
    on_error: "raise", or "skip" (a failed sample is replaced, deterministically, and counted).
    decode_quality: "exact" (the default: JPEGs decoded at full size, so each resize sees torchvision's
        pixels: the same values as torchvision's pipeline), "accurate" (decoded at the smallest DCT scale
        the crop allows, about 2x the output: up to 13% faster where outputs are far smaller than the
        images, e.g. 64 px from 400 px photographs, at about 1.3 levels mean difference from torchvision's
        there) or "fast" (also libjpeg's fast IDCT); docs/decoding.md has the measurements.
    nice: the Linux nice value of the native engine's threads, 0 to 19 (None: STOKER_ENGINE_NICE, else
        `engine.NICE`): higher yields a contended core to the training loop's threads sooner, but starves
        the pool under other CPU load (docs/loader.md, "The native batch engine", has the measurements).
    max_threads: the most threads the native engine's pool runs while other processes take its cores
        (None: 4 x num_threads; num_threads or fewer: it never grows). At equal priority a busy core is
        shared among the runnable threads, so beside other busy programs the pool starts more threads to
        keep its share, and drops back to num_threads when they stop, or when more threads gain nothing
        (docs/loader.md, "The pool beside other programs"). With processes=N, all N processes' together.
    processes: 0 (the threads run in this process) or N >= 1: the threads run in N child processes
    (started with "spawn"), writing into shared memory this process hands out as the batches, so the
    Python they run per sample (video clips, user transforms) no longer competes with the training
    loop's for the GIL, nor, with N > 1, with each other's. The batches are the same, bit for bit,
    whatever N and num_threads (docs/loader.md says when which is the better choice). The workers
    render with the native batch engine where it serves, as threads do. Refused when the Loader is
    made: a dataset other than a pack on local storage, transforms that cannot be pickled or imported,
    a daemonic process, DeviceOptions(decode="gpu"), a script without its `__main__` guard; with
    decode="auto" the batches are decoded on the CPU alone.
    """

    num_threads: int | None = None
    prefetch: int = 2
    persistent: bool = False
    pin_memory: bool | None = None
    timeout: float = 120.0
    on_error: str = "raise"
    decode_quality: str = "exact"
    processes: int = 0
    nice: int | None = None
    max_threads: int | None = None

    def __post_init__(self) -> None:
        if self.nice is not None and (isinstance(self.nice, bool) or not isinstance(self.nice, (int, np.integer))
                                      or not 0 <= self.nice <= 19):
            raise ConfigError(f"nice must be None (STOKER_ENGINE_NICE, else the default) or an int from 0 (the "
                              f"training process's own priority) to 19 (the lowest), got {self.nice!r}")
        _set(self, "num_threads", _int_or_none(self.num_threads, "num_threads (worker threads)", 1))
        _set(self, "max_threads", _int_or_none(self.max_threads, "max_threads (the engine pool's most threads)", 1))
        if self.max_threads is not None and self.num_threads is not None and self.max_threads < self.num_threads:
            raise ConfigError(f"max_threads={self.max_threads} is below num_threads={self.num_threads}: max_threads "
                              f"is the most the pool grows to beside other busy programs; give max_threads="
                              f"{self.num_threads} (never grow) or more")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, (int, np.integer)) or self.prefetch < 1:
            raise ConfigError(f"prefetch must be an int >= 1 (batches prepared ahead), got {self.prefetch!r}")
        _set(self, "prefetch", int(self.prefetch))
        if not isinstance(self.persistent, bool):
            raise ConfigError(f"persistent must be True or False, got {self.persistent!r}")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise ConfigError(f"pin_memory must be None, True or False, got {self.pin_memory!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float, np.integer, np.floating)) \
                or not self.timeout > 0:
            raise ConfigError(f"timeout must be positive seconds, got {self.timeout!r}")
        _set(self, "timeout", float(self.timeout))
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.decode_quality not in DECODE_QUALITIES:
            raise ConfigError(f"decode_quality must be one of {DECODE_QUALITIES}, got {self.decode_quality!r}")
        if isinstance(self.processes, bool) or not isinstance(self.processes, (int, np.integer)) or self.processes < 0:
            raise ConfigError(f"processes must be 0 (worker threads in this process) or N >= 1 (the worker threads "
                              f"in N child processes), got {self.processes!r}")
        _set(self, "processes", int(self.processes))
        if self.num_threads is not None and self.num_threads < self.processes:
            raise ConfigError(f"num_threads counts the worker threads of all {self.processes} worker processes "
                              f"together, at least one each: got num_threads={self.num_threads} for "
                              f"processes={self.processes}; raise num_threads= to {self.processes} or more, or "
                              f"lower processes=")

    @classmethod
    def of(cls, value: "Workers | int | None") -> "Workers":
        """`workers=`: a Workers, an int (the thread count) or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return cls(num_threads=int(value))
        raise ConfigError(f"workers must be a stoker.Workers or an int (worker threads), got {value!r}")
