"""`stoker.Loader`: reader + order + transforms + batch slots, as one iterator of batches.

    loader = Loader("data/train-packed", 256, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()])
    for images, labels in loader:        # images: uint8 [B, 224, 224, 3], labels: int64 [B]
        ...

Each batch is planned in one vectorised step (sample order, per-sample random draws, crop boxes from
the stored image sizes, labels); worker threads then decode each sample at the smallest DCT scale
its crop allows and resize it straight into its row of a preallocated (pinned) batch (`render`).
A yielded batch lives in a ring slot: it is valid until the next iteration step (`.clone()` it to
keep it).

With `device="cuda"` (or a `DeviceOptions`) a device thread copies each finished slot to the GPU on
the loader's copy stream and converts it there (float, normalized, NCHW or channels_last), a batch
ahead of the training loop; with `DeviceOptions(decode="gpu")` that thread also decodes the JPEGs with
nvJPEG and crops them on the GPU with the same crop plan the CPU path uses.

The Loader only glues: it resolves its arguments into a frozen `render.RenderSpec` and hands that,
with the dataset, the device stage and the GPU decoder it owns, to the stages; none of them calls back.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ._torch import HAVE_TORCH, missing_torch, torch
from ._system import usable_cpus
from .errors import ConfigError
from .habits import check_source, dataloader_keywords, pinned_labels
from .labels import multi_label_spec
from .order import ORDERS, epoch_order, make_pool, num_batches, rank_indices, samples_per_rank, shard_window_order
from .reader import CachedDataset, Dataset, PackedDataset, open_cached, open_dataset, open_loose
from .device import DeviceOptions, DeviceStage, as_device_options, consumer_fence
from .render import DeviceBuilder, EpochChain, Filler, RenderSpec, batch_extras, run_batch_ops
from .shards import MANIFEST_NAME, looks_like_partial_pack
from .storage import RemoteStorage, open_storage, url_scheme
from .storage.remote import DEFAULT_CACHE_LIMIT, default_cache_dir
from .storage.staging import StagedCopy, stage_for_loader
from .slots import BatchRing, Feeder, LoaderStats, Run, Slot, check_ring_fits
from .transforms import Pipeline, colour, gpu

__all__ = ["Loader", "LoaderStats"]

_STATE_FORMAT = "stoker.Loader/1"
#: "accurate": libjpeg-turbo's exact IDCT and smooth chroma upsampling (what simplejpeg and Pillow
#: give); "fast": its fast IDCT and plain upsampling, a few % less CPU (docs/decoding.md).
DECODE_QUALITIES = ("accurate", "fast")
#: what a batch is handed out as: "torch" tensors (the default, and the only output a device stage
#: makes), or "numpy" arrays (numpy_output: JAX, TensorFlow, NumPy; needs no torch installed)
OUTPUTS = ("torch", "numpy")


def _open_source(source: str | Path | Dataset, remote: dict[str, Any], timeout: float
                 ) -> tuple[Dataset, bool]:
    if isinstance(source, Dataset):
        return source, False
    # refuses a URL no backend serves, never makes it a local path; `remote` applies to URLs only
    storage = open_storage(source, **remote) if url_scheme(source) not in (None, "file") else open_storage(source)
    if isinstance(storage, RemoteStorage):
        return open_cached(storage, timeout=max(timeout, 60.0)), True
    if storage.is_dir() and (storage.exists(MANIFEST_NAME) or looks_like_partial_pack(storage)):
        return open_dataset(storage), True
    return open_loose(source), True


def _device_options(device: Any, pipeline: Pipeline) -> DeviceOptions | None:
    """The loader's DeviceOptions (None: uint8 batches on the CPU), with every bad combination named."""
    opts = as_device_options(device)
    batch_norm = pipeline.batch is not None and any(type(op).__name__ == "Normalize" for op in pipeline.batch.ops)
    if opts is not None and batch_norm and opts.normalize is not None:
        raise ConfigError("the transforms end with a Normalize and the device options normalize as well; keep one "
                          "(drop normalize= from the DeviceOptions, or the Normalize from the transforms)")
    if opts is not None and opts.decode == "gpu" and pipeline.tail:
        names = ", ".join(op.name for op in pipeline.tail if hasattr(op, "name"))
        raise ConfigError(f"decode='gpu' runs only stoker's geometric transforms on the GPU; {names} "
                          f"work on numpy arrays: use DeviceOptions(decode='cpu') for them")
    return opts


def _check_output(output: str, device: Any, pin_memory: bool | None, pipeline: Pipeline) -> None:
    """Refuse an output that cannot be made here, and every option NumPy output cannot honour."""
    if output not in OUTPUTS:
        raise ConfigError(f"output must be one of {OUTPUTS}, got {output!r}")
    if output == "torch":
        if not HAVE_TORCH:
            raise missing_torch("the Loader's default output (torch tensors)",
                                instead="pass Loader(..., output='numpy') for NumPy batches without torch")
        return
    if device is not None:
        raise ConfigError(f"output='numpy' hands out numpy arrays in host memory, but device={device!r} asks for "
                          f"torch tensors on a device; drop device= and place the arrays with your framework "
                          f"(e.g. jax.device_put, docs/jax.md), or use output='torch'")
    if pin_memory:
        raise ConfigError("pin_memory=True pins torch tensors for CUDA copies; output='numpy' hands out plain numpy "
                          "arrays: drop pin_memory=, or use output='torch'")
    if pipeline.batch is not None:
        names = [type(op).__name__ for op in pipeline.batch.ops] + (["Mixup"] if pipeline.batch.mix else [])
        raise ConfigError(f"output='numpy': the batch ops {', '.join(names)} run on torch tensors; drop them from "
                          f"transforms= and apply them in your training step (e.g. (x / 255 - mean) / std with "
                          f"jax.numpy, docs/jax.md), or use output='torch'")


def _check_boxes(boxes: tuple[str, ...], pipeline: Pipeline) -> None:
    """Boxes follow the planned geometry only: refuse ops that would move pixels without them."""
    if not boxes:
        return
    keeps_boxes = (colour.ColorJitter, colour.GaussianBlur, colour.RandomGrayscale, colour.RandomErasing,
                   gpu.ColorJitter, gpu.GaussianBlur, gpu.RandomGrayscale, gpu.Normalize, gpu.RandomErasing)
    movers = [getattr(op, "name", type(op).__name__) for op in pipeline.tail
              if not isinstance(getattr(op, "fn", op), keeps_boxes)]
    if pipeline.batch is not None:
        movers += [type(op).__name__ for op in pipeline.batch.ops if not isinstance(op, keeps_boxes)]
        movers += ["Mixup"] if pipeline.batch.mix is not None else []
    if movers:
        raise ConfigError(f"boxes/masks {boxes} follow stoker's planned crop, resize and flip, but {', '.join(movers)} "
                          f"would move pixels without them; use colour ops only after the geometry "
                          f"(ColorJitter, GaussianBlur, RandomGrayscale, Normalize, RandomErasing)")


def _distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if (rank is None or world_size is None) and HAVE_TORCH:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank, world_size = (0 if rank is None else int(rank)), (1 if world_size is None else int(world_size))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


class Loader:
    """Batches of decoded, augmented images from a packed dataset, an ImageFolder tree or a file list.

    Yields `(images, labels)`: images `uint8 [B, H, W, 3]` (pinned memory when CUDA is available),
    labels `int64 [B]` (float64 for float labels, a list for string labels), plus a dict of
    lists `{column: values}` as a third item when `columns` names extra shard columns.
    Multi-label datasets (lists of class indices) give `float32 [B, num_classes]` multi-hot rows
    (`multi_label="multi-hot"`), `int64 [B, K]` indices padded with -1 (`"indices"`), or the lists
    (`"list"`); `num_classes` defaults to the manifest's classes (see `stoker.labels`). Soft targets
    (rows of floats, one per class) give `float32 [B, C]`.

    `source` may be a URL (``s3://bucket/ds``, ``gs://...``, any fsspec URL; ``pip install
    'stoker[remote]'``): shards are downloaded ahead of need into `cache_dir` (default
    ~/.cache/stoker/...; with several ranks, a `rank-N` folder in it per rank), verified, and kept to
    `cache_limit` bytes per rank ("50GB"); `storage_options` go to
    fsspec (credentials otherwise come from the backend's usual environment and config files).
    `stage="/dev/shm"` first copies a local packed dataset there once (verified, shared by the
    node's ranks, removed by the last to close).

    `order`: "random" (a full shuffle per epoch), "sequential" (dataset order), "shard_random"
    (blocks of shards in a shuffled order: for datasets bigger than the page cache) or
    "shard_window" (shuffled shards, one run of them per rank, samples shuffled within windows of
    4 shards: each rank downloads ~1/world_size of the shards; for object storage). `device`: None (the uint8
    batches above), a device ("cuda", "cuda:1", "cpu": images `uint8 [B, 3, H, W]` there, numeric
    labels too) or a `DeviceOptions` (normalize, dtype, memory_format, decode="gpu", gpu_decoder).
    `output="numpy"`: the same batches as numpy arrays (images a `uint8 [B, 3, H, W]` view of the ring
    slot, labels and extras fresh arrays), for JAX or NumPy, with no torch installed (`numpy_output`).
    `persistent=True`: the threads run straight on into the next epoch, preparing its first batches
    while this one drains (like a DataLoader's persistent workers, without the restart between
    epochs); the batches are the same as without it, and `state_dict()` resumes the same way. The
    threads then live until `close()` (or the Loader is collected), a `break`, or a `set_epoch` /
    `load_state_dict` that moves elsewhere.

    `transforms`: one transform, a list or a Compose-like object (see docs/transforms.md): planned
    geometry, per-sample ops, then batch ops (Normalize, RandomErasing, Mixup). `boxes`: extra columns
    of boxes (x0, y0, x1, y1 as fractions of the image, as the "coco" source packs them) that follow
    each sample's crop, resize and flip; each arrives in the third item as a list of float32 [k, 4]
    arrays in output pixels. `masks`: extra columns of polygons (as the "coco" source packs them:
    `masks` with `masks_points` and `masks_box`) filled at the output size after the same crop, resize
    and flip; each arrives in the third item as a list of uint8 [k, H, W] instance masks (k: the
    sample's boxes when `boxes` is given, so mask rows line up with box rows). A binary `masks` column
    (label-map PNGs, packed from a CSV's mask column) gives class ids through the same crop window
    (nearest neighbour), `ignore_index` (255) where the geometry pads, as one tensor [B, H, W] (uint8,
    int32 for 16-bit ids) when the sizes agree, else a list.
    `transforms.targets.pad_batch` turns such a list into one padded tensor plus sizes. `pad=True`:
    images whose transforms do not end in a fixed size (e.g. `Resize(800)`, the shorter side) are batched
    top-left in zero-padded rows as large as the largest output in the dataset, with each image's
    (height, width) in the third item as "sizes" (int64 [B, 2]).
    `decode_quality`: "accurate" or "fast" (CPU JPEG decode; see `DECODE_QUALITIES`).

    DataLoader habits: `indices` reads only those dataset indices (a `Subset`), `weights` (one per
    sample, or per entry of `indices`) draws each epoch with replacement like `WeightedRandomSampler`,
    `collate_fn(extras)` turns the `{column: [values]}` of `columns` into the batch's third item, and
    `num_workers` is accepted for `num_threads` (threads, not processes).
    """

    def __init__(self, source: str | Path | Dataset, batch_size: int, *, transforms: Sequence[Any] | None = None,
                 order: str = "random", seed: int = 0, drop_last: bool = False, num_threads: int | None = None,
                 prefetch: int = 2, columns: Sequence[str] = (), on_error: str = "raise",
                 rank: int | None = None, world_size: int | None = None, pin_memory: bool | None = None,
                 timeout: float = 120.0, device: str | int | torch.device | DeviceOptions | None = None,
                 output: str = "torch",
                 cache_dir: str | Path | None = None, cache_limit: int | str = DEFAULT_CACHE_LIMIT,
                 storage_options: dict[str, Any] | None = None, stage: str | Path | None = None,
                 multi_label: str = "multi-hot", num_classes: int | None = None,
                 decode_quality: str = "accurate", boxes: str | Sequence[str] = (),
                 masks: str | Sequence[str] = (), ignore_index: int = 255, pad: bool = False,
                 persistent: bool = False,
                 indices: Sequence[int] | np.ndarray | None = None, weights: Sequence[float] | np.ndarray | None = None,
                 collate_fn: Callable[[dict[str, list]], Any] | None = None, shuffle: bool | None = None,
                 num_workers: int | None = None, classes: Sequence[str] | None = None, **dataloader: Any) -> None:
        check_source(source)
        mapped = dataloader_keywords(dataloader)
        if "persistent" in mapped:
            persistent = mapped["persistent"]
        if ("indices" in mapped and indices is not None) or ("weights" in mapped and weights is not None):
            raise ConfigError("pass the samples once: sampler= or indices=/weights=, not both")
        order = mapped.get("order", order)
        indices, weights = mapped.get("indices", indices), mapped.get("weights", weights)
        if classes is not None and (isinstance(classes, str) or len(set(classes)) != len(classes)):
            raise ConfigError(f"classes= is a list of distinct class names (label k is classes[k]), got {classes!r}")
        self._pinned = None if classes is None else [str(c) for c in classes]
        if num_workers is not None:  # DataLoader's name: worker threads here, not processes
            if num_threads is not None:
                raise ConfigError("pass num_threads= or its DataLoader spelling num_workers=, not both")
            if not isinstance(num_workers, int) or num_workers < 0:
                raise ConfigError(f"num_workers must be an int >= 0, got {num_workers!r}; stoker's name is "
                                  f"num_threads (worker threads, not processes)")
            num_threads = max(num_workers, 1)   # 0 (DataLoader: load in the main process) -> one thread
        if collate_fn is not None and (not callable(collate_fn) or not columns):
            raise ConfigError("collate_fn receives the batch's extra columns ({column: [values]}) and returns "
                              "the batch's third item: pass a callable, and name the columns in columns=[...]"
                              " (images and labels are batched by stoker itself)")
        self.collate_fn = collate_fn
        if shuffle is not None:  # the 0.1 spelling, kept while it costs nothing
            warnings.warn("Loader(shuffle=) is deprecated: pass order='random' or order='sequential'",
                          DeprecationWarning, stacklevel=2)
            if not shuffle:
                order = "sequential"
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if order not in ORDERS:
            raise ConfigError(f"order must be one of {ORDERS}, got {order!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"prefetch must be an int >= 1 (batches prepared ahead), got {prefetch!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ConfigError(f"num_threads must be a positive int or None (all usable CPUs), got {num_threads!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be positive seconds, got {timeout!r}")
        if not isinstance(persistent, bool):
            raise ConfigError(f"persistent must be True or False, got {persistent!r}")
        self.persistent = persistent
        self._live: _Pipeline | None = None  # persistent: the pipeline running on into the next epoch
        if decode_quality not in DECODE_QUALITIES:
            raise ConfigError(f"decode_quality must be one of {DECODE_QUALITIES}, got {decode_quality!r}")
        self.decode_quality = decode_quality
        self.pipeline = Pipeline(transforms)
        _check_output(output, device, pin_memory, self.pipeline)
        self.output = output
        self.device = _device_options(device, self.pipeline)
        self.boxes = (boxes,) if isinstance(boxes, str) else tuple(boxes)
        self.masks = (masks,) if isinstance(masks, str) else tuple(masks)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)) \
                or not 0 <= ignore_index < 2**31:
            raise ConfigError(f"ignore_index must be an int in 0..2**31-1 (the class id label maps get where the "
                              f"geometry pads), got {ignore_index!r}")
        self.ignore_index = int(ignore_index)
        self.pad = bool(pad)
        if self.pad and self.pipeline.tail_geometric:
            raise ConfigError("pad=True batches the sizes stoker plans; a geometric transform after a user callable "
                              "is planned per sample only: move it before the callable")
        if self.pad and "sizes" in columns:
            raise ConfigError("pad=True hands the image sizes out as extras['sizes'], which would hide the column "
                              "'sizes' asked for in columns=; rename that column when packing, or drop pad=True")
        if self.pad and self.device is not None and self.device.decode == "gpu":
            raise ConfigError("pad=True is not available with decode='gpu'; use DeviceOptions(decode='cpu')")
        _check_boxes(self.boxes + self.masks, self.pipeline)
        columns = (*columns, *(c for c in self.boxes + self.masks if c not in columns))
        self._multi_label_args = (multi_label, num_classes)   # checked against the labels in _setup
        self._pool_args = (indices, weights)   # checked against the dataset's size in _setup
        self._staged: StagedCopy | None = None
        if stage is not None:
            if isinstance(source, Dataset) or url_scheme(source) not in (None, "file"):
                raise ConfigError(f"stage={str(stage)!r} copies a packed dataset folder; pass its path as the "
                                  f"source (a URL is cached through cache_dir= instead)")
            self._staged = stage_for_loader(source, stage)
            source = self._staged.path
        remote = {"cache_dir": cache_dir, "cache_limit": cache_limit, "storage_options": storage_options}
        if not isinstance(source, Dataset) and url_scheme(source) not in (None, "file"):
            rank_, world = _distributed(rank, world_size)
            if world > 1:  # each rank keeps its own cache (and limit): no rank deletes a file another maps
                remote["cache_dir"] = Path(cache_dir or default_cache_dir(str(source))) / f"rank-{rank_}"
        try:
            self.dataset, self._owns_dataset = _open_source(source, remote, timeout)
        except BaseException:
            if self._staged is not None:
                self._staged.close()
            raise
        try:
            self._setup(batch_size, seed, drop_last, num_threads, prefetch, columns, on_error,
                        rank, world_size, order, pin_memory, timeout)
        except BaseException:
            self.close()
            raise

    def _setup(self, batch_size: int, seed: int, drop_last: bool, num_threads: int | None,
               prefetch: int, columns: Sequence[str], on_error: str, rank: int | None, world_size: int | None,
               order: str, pin_memory: bool | None, timeout: float) -> None:
        ds = self.dataset
        self.batch_size, self.seed, self.drop_last = batch_size, int(seed), drop_last
        self.num_threads = num_threads or usable_cpus()
        self.prefetch, self.on_error, self.timeout = prefetch, on_error, float(timeout)
        self.order = order
        self.columns = tuple(columns)
        missing = [c for c in self.columns if c not in ds.extra_columns]
        if missing:
            raise ConfigError(f"{ds.path}: no column(s) {missing}; the dataset has extra columns {ds.extra_columns}")
        self.rank, self.world_size = _distributed(rank, world_size)
        if self.output == "numpy":   # plain arrays: no CUDA copy reads them, torch may be absent
            pin_memory = False
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError("pin_memory=True needs CUDA, and torch finds no CUDA device here (a CPU-only "
                              "torch build, or no driver); pass pin_memory=None (pinned only when CUDA is "
                              "available) or pin_memory=False")
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._stage: DeviceStage | None = None  # one copy stream per loader, made on first use
        self._gpu: Any = None  # the GpuBatchDecoder (decode="gpu")
        if self.device is not None and self.device.decode == "gpu":
            self._gpu_for(self.device)  # a missing decoder library fails here, with its install hint
        if len(ds) == 0:
            raise ConfigError(f"{ds.path}: the dataset is empty; nothing to load")
        self._pool = make_pool(len(ds), *self._pool_args)
        if self._pool.fingerprint is not None and order in ("shard_random", "shard_window"):
            raise ConfigError(f"order={order!r} reads whole shard blocks, so it cannot follow indices= or "
                              "weights=; use order='random' (or pack the subset as its own dataset)")
        if self._pool.weighted and order != "random":
            raise ConfigError(f"weights= draws each epoch's samples at random (with replacement), so "
                              f"order={order!r} cannot apply; leave order='random'")
        heights = None if ds.heights is None else np.asarray(ds.heights, dtype=np.int64)
        widths = None if ds.widths is None else np.asarray(ds.widths, dtype=np.int64)
        self.output_size = self._resolve_output_size(heights, widths)
        check_ring_fits(prefetch + 1, batch_size, *self.output_size)   # at once, not at the first batch
        labels = ds.labels
        if self._pinned is not None:
            labels = pinned_labels(labels, ds.classes, self._pinned, ds.path)
        if labels.dtype.kind in "iufb":
            # a copy (8 bytes a sample), not a view of the mapped shard: batches are labelled without
            # touching the mapping, which a shard truncated mid-epoch would turn into a SIGBUS
            labels = np.array(labels)
        self._label_dtype = labels.dtype if labels.dtype.kind in "iufb" else None
        if (self.boxes or self.masks) and heights is None:
            raise ConfigError(f"{ds.path}: boxes= and masks= need the image sizes a packed dataset stores; pack the "
                              f"data first (stoker pack SRC OUT)")
        # a binary masks= column holds label-map PNGs (a CSV's mask column); any other, polygons (coco)
        types = ds.manifest.extra_columns if isinstance(ds, (PackedDataset, CachedDataset)) else {}
        label_maps = tuple(c for c in self.masks if types.get(c) == "binary")
        polygons = tuple(c for c in self.masks if c not in label_maps)
        companions = [f"{c}{end}" for c in polygons for end in ("_points", "_box") if f"{c}{end}" not in
                      ds.extra_columns]
        if companions:
            raise ConfigError(f"{ds.path}: masks={polygons} needs the polygon columns {companions} beside it (as "
                              f"the coco source packs them); the dataset has extra columns {ds.extra_columns}")
        multi = multi_label_spec(labels, self.classes, *self._multi_label_args)
        self._spec = RenderSpec(batch_size, self.output_size, self.pipeline, self.seed, on_error, self.columns,
                                labels, heights, widths, multi_label=multi, decode_quality=self.decode_quality,
                                box_columns=self.boxes, mask_columns=polygons, label_map_columns=label_maps,
                                ignore_index=self.ignore_index, pad=self.pad,
                                key_by_draw=self._pool.weighted, members=self._pool.members())
        self._shard_rows = [s.rows for s in ds.manifest.shards] \
            if isinstance(ds, (PackedDataset, CachedDataset)) else None
        # where the next iter() starts: the epoch, and how many of its samples (on this rank) were yielded
        self._epoch, self._cursor = 0, 0
        self._resume: int | None = None  # load_state_dict(): the sample the next pass starts at
        self.stats = LoaderStats()
        self._ring: BatchRing | None = None
        self._iters: weakref.WeakSet[_LoaderIter] = weakref.WeakSet()  # the passes made, while they live
        self._lock = threading.RLock()  # re-entrant: Ctrl-C inside its with-statement cannot lock us out

    def _resolve_output_size(self, h: np.ndarray | None, w: np.ndarray | None) -> tuple[int, int]:
        fixed = self.pipeline.fixed_size
        if fixed is not None:
            return fixed
        if self.pad and h is not None and len(h):
            # the largest output of any image (sizes of non-fixed plans do not depend on the draws)
            plan = self.pipeline.plan(h, w, np.zeros((len(h), max(self.pipeline.draws, 1))))
            return int(plan.size[:, 0].max()), int(plan.size[:, 1].max())
        if h is not None and len(h) and (h == h[0]).all() and (w == w[0]).all():
            return self.pipeline.output_size(int(h[0]), int(w[0]))
        if self.pad:
            raise ConfigError(f"{self.dataset.path}: pad=True needs the image sizes a packed dataset stores; pack "
                              f"the data first (stoker pack SRC OUT)")
        raise ConfigError(f"{self.dataset.path}: images differ in size and the transforms do not end in a fixed "
                          f"size, so they cannot be batched; end the transforms with RandomResizedCrop(size), "
                          f"CenterCrop(size) or Resize((height, width)), or pass pad=True to batch them padded "
                          f"with their sizes")

    @property
    def classes(self) -> list[str] | None:
        """The class names (label k is classes[k]): `classes=` when given, else the dataset's."""
        return self._pinned if self._pinned is not None else self.dataset.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label, as torchvision's ImageFolder has it."""
        return {name: k for k, name in enumerate(self.classes or ())}

    # ---- epochs and state ------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return num_batches(samples_per_rank(self._pool.size, self.world_size, self.drop_last),
                           self.batch_size, self.drop_last)

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration reads."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` from its start on the next `iter()`. Without calls, an `iter()` after a
        finished pass reads the next epoch, and one after a pass left part-way reads its epoch again
        from the start."""
        self._epoch, self._cursor, self._resume = int(epoch), 0, None

    def _epoch_samples(self) -> int:
        """Samples of one epoch on this rank (what `epoch_indices` returns, without computing the order)."""
        if self.drop_last:
            return len(self) * self.batch_size
        return samples_per_rank(self._pool.size, self.world_size, False)

    def state_dict(self) -> dict[str, Any]:
        """Where the data stands: the epoch, and the samples (and batches) of it the latest pass
        yielded on this rank, plus the settings that must match on resume. Taken during a pass (a
        checkpoint in the training loop) or after it stopped (a `break`, an exception), it records
        that pass's position; `load_state_dict()` of it makes the next `iter()` continue from there,
        the only way a pass starts part-way (a plain `iter()` reads its epoch from the start)."""
        batch = -(-self._cursor // self.batch_size)
        return {"format": _STATE_FORMAT, "epoch": self._epoch, "batch": batch, "sample": self._cursor,
                "seed": self.seed, "batch_size": self.batch_size, "world_size": self.world_size,
                "num_samples": len(self.dataset), "order": self.order, "drop_last": self.drop_last,
                "pool": self._pool.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next `iter()` (only that one) yields exactly the samples of `state`'s epoch not
        yet yielded.
        A different `batch_size` is allowed with `drop_last=False` (the samples left are the same;
        only their grouping into batches changes); everything else must match."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ConfigError(f"not a stoker Loader state (expected format {_STATE_FORMAT!r}): {state!r:.200}")
        mine = self.state_dict()
        keys = ["seed", "world_size", "num_samples", "order", "drop_last", "pool"]
        if self.drop_last:  # which samples an epoch drops depends on the batch size
            keys.append("batch_size")
        diff = {k: (state.get(k), mine[k]) for k in keys if state.get(k) != mine[k]}
        if diff:
            hint = ("; build the Loader with the saved settings to resume exactly"
                    + (" (a new batch_size can resume only with drop_last=False: with drop_last=True the "
                       "samples an epoch leaves out depend on it)" if "batch_size" in diff else ""))
            raise ConfigError("the saved loader state does not match this Loader (saved, now): "
                              + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in diff.items()) + hint)
        epoch = int(state["epoch"])
        sample = state.get("sample")
        if sample is None:  # a state saved before the sample cursor existed: batches of the saved size
            sample = min(int(state["batch"]) * int(state["batch_size"]),
                         samples_per_rank(len(self.dataset), self.world_size, self.drop_last))
        total = len(self.epoch_indices(epoch))
        if not 0 <= int(sample) <= total:
            raise ConfigError(f"saved sample cursor {sample} is outside epoch {epoch}'s {total} samples on this rank")
        self._epoch, self._cursor = (epoch + 1, 0) if int(sample) == total else (epoch, int(sample))
        self._resume = self._cursor or None

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """Dataset indices this rank reads in `epoch` (default: the current one), in order."""
        epoch = self._epoch if epoch is None else epoch
        pool = self._pool
        if self.order == "shard_window":
            idx = shard_window_order(self._shard_rows or [len(self.dataset)], seed=self.seed, epoch=epoch,
                                     rank=self.rank, world_size=self.world_size, drop_last=self.drop_last)
            return idx[:len(idx) // self.batch_size * self.batch_size] if self.drop_last else idx
        if pool.weighted:
            perm = pool.draw(self.seed, epoch)
        else:
            perm = epoch_order(pool.size, seed=self.seed, epoch=epoch, order=self.order, shard_rows=self._shard_rows)
            if pool.indices is not None:
                perm = pool.indices[perm]
        idx = rank_indices(perm, self.rank, self.world_size, drop_last=self.drop_last,
                           contiguous=self.order == "shard_random")
        if self.drop_last:
            idx = idx[:len(idx) // self.batch_size * self.batch_size]
        return idx

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple]:
        return self._iterate(self.device)

    def iter_on(self, device: str | int | torch.device | DeviceOptions) -> Iterator[tuple]:
        """One pass whose batches arrive on `device` (a device or `DeviceOptions`), for a Loader made
        without `device=`: what `stoker.prefetch(loader, device)` iterates. The ring's pinned memory
        is reused, so the device copy happens here, on the loader's copy stream, before a slot is
        refilled."""
        if self.output == "numpy":
            raise ConfigError("this Loader hands out numpy arrays (output='numpy'); stoker.prefetch and iter_on "
                              "move torch tensors: make the Loader with output='torch' for them")
        opts = as_device_options(device)
        if opts is None:
            raise ConfigError(f"iter_on needs a device or DeviceOptions, got {device!r}")
        if self.device is not None:
            raise ConfigError(f"this Loader already delivers batches to {self.device.device}; iterate it "
                              f"directly instead of wrapping it in stoker.prefetch")
        _device_options(opts, self.pipeline)
        if opts.decode == "gpu":
            self._gpu_for(opts)
        return self._iterate(opts)

    def _iterate(self, opts: DeviceOptions | None) -> Iterator[tuple]:
        with self._lock:
            # every iter() is a whole pass of the current epoch; only load_state_dict() starts one part-way
            start, self._resume = self._resume or 0, None
            self._cursor = start
            # a pass still running (an iterator not exhausted, closed or dropped) keeps its threads and
            # its ring: this one gets its own, as a second DataLoader iterator would
            busy = any(not it._closed and it._b < it._n for it in list(self._iters))
            it = _LoaderIter(self, self._epoch, start, opts, private=busy)
            self._iters.add(it)
            return it

    def _ring_for_run(self, extra: int = 0, private: bool = False) -> BatchRing:
        """The batch ring: `prefetch` batches being prepared, the one the caller is using and the one
        its loop variable still holds while the next is fetched (FFCV's `batches_ahead + 2`), plus
        `extra`. `private`: a ring of its own, for a pass that runs beside another."""
        h, w = self.output_size
        n_slots = self.prefetch + 2 + extra
        buffers = None
        if self.output == "numpy":
            from .numpy_output import NumpyBuffers   # loaded by NumPy output only

            buffers = NumpyBuffers()
        if private:
            return BatchRing(n_slots, self.batch_size, h, w, label_dtype=self._label_dtype,
                             pin_memory=self.pin_memory, stats=self.stats, buffers=buffers)
        if self._ring is None or not self._ring.matches(n_slots, self.batch_size, h, w, self._label_dtype,
                                                        self.pin_memory):
            self._ring = BatchRing(n_slots, self.batch_size, h, w, label_dtype=self._label_dtype,
                                   pin_memory=self.pin_memory, stats=self.stats, buffers=buffers)
        return self._ring

    def _stage_for(self, opts: DeviceOptions) -> DeviceStage:
        """The DeviceStage: one copy stream per loader, kept across epochs (the CUDA caching
        allocator pools memory per stream)."""
        if self._stage is None or self._stage.opts != opts:
            self._stage = DeviceStage(opts)
        return self._stage

    def _pipeline_for(self, epoch: int, start: int, opts: DeviceOptions | None, private: bool = False
                      ) -> tuple["_Pipeline", int]:
        """The pipeline for (epoch, from sample start) and the run batch index it starts at: the
        persistent one when it is exactly there already, else a new one. `private`: another pass
        is running; this one gets its own threads and ring and leaves the other's alone."""
        if private:
            return _Pipeline(self, epoch, start, opts, persistent=False, private=True), 0
        live, self._live = self._live, None
        if live is not None:
            g = live.find(epoch, start)
            running = live.run is not None and not live.run.stop_event.is_set() and live.run.alive() > 0
            if running and live.opts == opts and g is not None and g == live.next_g:
                live.append(self, epoch + 1)  # keep one epoch ahead
                self._live = live
                return live, g
            live.stop()
        # a dataset in object storage gives its cache each epoch's order when that epoch starts (the
        # plan decides what is downloaded and evicted), so its pipelines do not run on into the next
        pipe = _Pipeline(self, epoch, start, opts,
                         persistent=self.persistent and not isinstance(self.dataset, CachedDataset))
        if pipe.persistent and pipe.run is not None:
            self._live = pipe
            weakref.finalize(self, pipe.stop)  # the Loader collected: its threads stop
        return pipe, 0

    def _gpu_for(self, opts: DeviceOptions) -> Any:
        """The GpuBatchDecoder for decode="gpu", made once (gpu_decode loads only when asked for)."""
        from .gpu_decode import GpuBatchDecoder, make_decoder

        if self._gpu is None:
            spec = opts.gpu_decoder
            decoder = make_decoder(spec, opts.device) if isinstance(spec, str) else spec
            self._gpu = GpuBatchDecoder(decoder, opts.device)
        return self._gpu

    def close(self) -> None:
        """Stop any running iteration and release the dataset (when the Loader opened it). Idempotent."""
        for it in list(getattr(self, "_iters", ())):
            it.close()
        live, self._live = getattr(self, "_live", None), None
        if live is not None:
            live.stop()
        if getattr(self, "_owns_dataset", False):
            self.dataset.close()
            self._owns_dataset = False
        staged, self._staged = getattr(self, "_staged", None), None
        if staged is not None:
            staged.close()
        self._ring = None
        self._stage = self._gpu = None

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        h, w = self.output_size
        where = "" if self.device is None else f", to {self.device.device}, decode {self.device.decode}"
        return (f"<stoker.Loader {len(self.dataset)} samples, batch {self.batch_size}, {h}x{w}, "
                f"{self.num_threads} threads, rank {self.rank}/{self.world_size}, epoch {self._epoch}{where}>")


class _Pipeline:
    """The worker threads (and the device thread) of one or more epochs' batches in a row.

    Run batch g: the batches of (epoch, from `start`) first, then, for a persistent Loader, whole
    epochs appended one at a time (`append`), so the workers prepare epoch N+1's first batches while
    the training loop drains epoch N. Every batch comes from its epoch's own Filler: the same batches,
    bit for bit, as a fresh `iter()` of that epoch would give."""

    def __init__(self, loader: Loader, epoch: int, start: int, opts: DeviceOptions | None, persistent: bool,
                 private: bool = False) -> None:
        self.opts = opts
        self.persistent = persistent
        spec = loader._spec
        if opts is not None and opts.decode == "gpu":
            spec = replace(spec, gpu_decode=True)
        self.spec = spec
        self.chain = EpochChain(spec)
        self.epochs: list[tuple[int, int, int, int]] = []  # (epoch, first run batch, batches, first sample)
        sizes = self._segment(loader, epoch, start)
        self.run: Run | None = None
        self.feeder: Feeder | None = None
        self.lease = 0  # which iterator holds the pipeline (see _LoaderIter)
        self.next_g = 0  # the run batch the next iterator starts at (persistent: where the last one ended)
        if not sizes:
            return
        threads = min(loader.num_threads, max(1, sum(sizes)))
        # with a device stage, one more slot: the one whose copy to the device is in flight
        ring = loader._ring_for_run(extra=0 if opts is None else 1, private=private)
        self.run = Run(ring, sizes, threads, self.chain.prepare, self.chain.fill, loader.stats.add, loader.timeout,
                       open_ended=persistent)
        if opts is not None:
            stage = loader._stage_for(opts)
            decoder = loader._gpu_for(opts) if spec.gpu_decode else None
            build = DeviceBuilder(stage, decoder, self.chain, self.run.lock, loader.stats)
            self.feeder = Feeder(self.run, stage, build, loader.prefetch, loader.timeout)
        if persistent:
            self.append(loader, epoch + 1)
        self._started = False

    def start(self) -> None:
        """Start the threads (once; call after whoever stops them holds the pipeline, so Ctrl-C landing
        in between cannot leave threads no one stops)."""
        if self.run is None or self._started:
            return
        self._started = True
        self.run.start()
        if self.feeder is not None:
            self.feeder.start()

    def _segment(self, loader: Loader, epoch: int, start: int) -> list[int]:
        """Batch sizes of `epoch` from its sample `start` on (a resume may start between batches)."""
        indices = loader.epoch_indices(epoch)
        if isinstance(loader.dataset, CachedDataset):  # downloads follow the order; done shards make room
            ahead = (loader.prefetch + 2) * loader.batch_size + loader.num_threads
            loader.dataset.plan(indices[start:], lookahead=ahead)
        bs, left = loader.batch_size, max(len(indices) - start, 0)
        sizes = [min(bs, left - k * bs) for k in range(-(-left // bs))]
        first = self.epochs[-1][1] + self.epochs[-1][2] if self.epochs else 0
        self.chain.add(Filler(self.spec, loader.dataset, epoch, indices, start), first)
        self.epochs.append((epoch, first, len(sizes), start))
        return sizes

    def append(self, loader: Loader, epoch: int) -> None:
        """Queue the whole of `epoch` after the batches already planned (persistent Loaders)."""
        assert self.run is not None
        with self.run.cond:
            self.run.extend(self._segment(loader, epoch, 0))

    def find(self, epoch: int, start: int) -> int | None:
        """The run batch index of (epoch, from sample start), if this pipeline has it ahead."""
        for e, first, n, s0 in self.epochs:
            k, r = divmod(start - s0, self.spec.batch_size)
            if e == epoch and r == 0 and 0 <= k < n:
                return first + k
        return None

    def stop(self) -> None:
        if self.run is not None:
            (self.feeder or self.run).stop(2.0)


def _end_lease(pipe: _Pipeline, lease: int, keep: list[bool], last: list[int]) -> None:
    """An iterator's end (closed, exhausted or dropped): guard the slot of the last batch it handed out
    (an `images.cuda(non_blocking=True)` may still read it), then stop its pipeline unless it was
    handed on (`keep`) or another iterator holds it."""
    if pipe.run is not None and pipe.feeder is None and last[0] >= 0:
        pipe.run.guard(last[0], consumer_fence())
    if pipe.lease == lease and not keep[0]:
        pipe.stop()


class _LoaderIter:
    """One pass over an epoch (from its start, or from where `load_state_dict` put it). Closing it (or
    dropping it) stops its threads, unless it ran to the end of its epoch in a persistent Loader: the
    pipeline then goes on with the next epoch."""

    def __init__(self, loader: Loader, epoch: int, start: int, opts: DeviceOptions | None = None,
                 private: bool = False) -> None:
        self._loader = loader
        self._epoch = epoch
        bs = loader.batch_size
        left = max(loader._epoch_samples() - start, 0)
        sizes = [min(bs, left - k * bs) for k in range(-(-left // bs))]
        self._n = len(sizes)
        self._start = start   # samples of the epoch before this pass (a resumed pass)
        self._first_batch = start // bs   # the epoch's batch number of this pass's first batch (batch ops' key)
        self._ends = np.cumsum(sizes, dtype=np.int64) + start if sizes else np.zeros(0, np.int64)
        self._b = 0
        self._closed = False
        pipe, g0 = loader._pipeline_for(epoch, start, opts, private)
        self._pipe, self._g0 = pipe, g0
        self._run, self._feeder = pipe.run, pipe.feeder
        pipe.lease += 1
        self._keep = [False]  # set when the epoch ends in a persistent pipeline: hand it on, do not stop it
        self._last = [-1]  # the run batch handed out last (its slot is guarded at the end)
        self._finalizer = weakref.finalize(self, _end_lease, pipe, pipe.lease, self._keep, self._last)
        self._collate = loader.collate_fn
        self._encode = loader._spec.multi_label
        self._numpy: Callable[..., tuple] | None = None
        if loader.output == "numpy":
            from .numpy_output import numpy_batch   # loaded by NumPy output only

            self._numpy = numpy_batch
        pipe.start()

    def __iter__(self) -> "_LoaderIter":
        return self

    def __next__(self) -> tuple:
        if self._closed or self._run is None or self._b >= self._n:
            self.close()
            raise StopIteration
        loader = self._loader
        t0 = time.perf_counter()
        g = self._g0 + self._b
        try:
            if self._feeder is not None:
                batch = self._feeder.get(g)
            else:
                # the yielded batch is a pinned ring slot the caller may have copied asynchronously
                # (`images.cuda(non_blocking=True)`): its refill waits for that copy (Slot.guard)
                slot = self._run.next_batch(g, consumer_fence() if self._b else None)
                self._last[0] = g
        except BaseException:  # SampleError, timeout, Ctrl-C: stop the threads before propagating
            self.close()
            raise
        loader.stats.consumer_wait_s += time.perf_counter() - t0
        loader.stats.batches += 1
        self._b += 1
        if self._b == self._n:  # the whole epoch was read (even if this iterator is then dropped, not
            # exhausted): a persistent pipeline goes on into the next one
            self._keep[0] = self._pipe.persistent
            self._pipe.next_g = g + 1
        with loader._lock:
            if loader._epoch == self._epoch:  # where the data stands, for state_dict()
                loader._cursor = int(self._ends[self._b - 1])
                if self._b == self._n:  # the epoch is complete: the next iter() reads the next one
                    loader._epoch, loader._cursor = self._epoch + 1, 0
        if self._feeder is not None:
            out = batch
        else:
            out = self._batch(slot) if self._numpy is None else self._numpy(slot, self._encode)
        if self._collate is not None:   # the user's batching of the extra columns, on this (their) thread
            out = (*out[:2], self._collate(out[2]))
        return out

    def _batch(self, slot: Slot) -> tuple:
        """The caller's batch: images a [B, 3, H, W] view of the slot (channels_last strides, no copy;
        the slot is refilled only once nothing references it), labels and extras fresh objects."""
        n = slot.size
        images: Any = slot.images if n == slot.images.shape[0] else slot.images[:n]
        if slot.labels is not None:
            labels: Any = slot.labels[:n].clone()
        else:
            labels = list(slot.objects[:n]) if self._encode is None else self._encode(slot.objects[:n])
        spec = self._loader._spec
        if spec.pipeline.batch is not None:  # no device stage: the batch ops run here, on the CPU
            images, labels = run_batch_ops(spec, images, labels, self._epoch, self._first_batch + self._b - 1)
        else:
            images = images.permute(0, 3, 1, 2)
        if slot.extras:   # extra columns, and the sizes of padded images
            return images, labels, batch_extras(slot)
        return images, labels

    def close(self) -> None:
        """Stop the worker threads (prompt: they check a stop flag at least every 0.1 s); a persistent
        Loader's pipeline whose epoch was read to the end keeps running into the next one instead.
        The slot of the last batch yielded is guarded by the GPU work queued so far (the ring outlives
        this iterator)."""
        self._closed = True
        self._finalizer()
