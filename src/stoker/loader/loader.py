"""`stoker.Loader`: reader + order + transforms + batch slots, as one iterable of whole passes.

    loader = Loader("data/train-packed", 256, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()])
    for images, labels in loader:        # images: uint8 [B, 3, 224, 224], labels: int64 [B]
        ...

Each batch is planned in one vectorised step (sample order, per-sample random draws, crop boxes from
the stored image sizes, labels); worker threads then decode each sample at the smallest DCT scale
its crop allows and resize it straight into its row of a preallocated (pinned) batch (`render`).
A yielded batch is a view of a ring slot that stays valid as long as it is held (`slots`); labels
and extras are fresh objects.

With `device="cuda"` (or a `DeviceOptions`) a device thread copies each finished slot to the GPU on
the loader's copy stream and converts it there (float, normalized, NCHW or channels_last), a batch
ahead of the training loop; with `DeviceOptions(decode="gpu")` that thread also decodes the JPEGs with
nvJPEG and crops them on the GPU with the same crop plan the CPU path uses.

The Loader only glues: it resolves its option values (`options`) into a frozen `render.RenderSpec`
and the `passes.PassParts`, and each `iter()` asks `passes.Passes` for a whole pass, which reports
where the data stands to the Loader's `Cursor`; none of the stages calls back.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .._torch import HAVE_TORCH, missing_torch, torch
from .._system import threads_per_process
from ..loading.clips import Clips, ClipSamples
from ..errors import ConfigError
from .habits import check_source, dataloader_keywords, pinned_labels
from .options import Sampling, Storage, Targets, Workers
from ..loading.labels import multi_label_spec
from ..order import epoch_order, make_pool, num_batches, rank_indices, samples_per_rank, shard_window_order
from ..reader import CachedDataset, Dataset, PackedDataset, open_for_loading
from ..device.stage import DeviceOptions, as_device_options
from ..loading.render import RenderSpec
from .passes import Cursor, PassParts, Passes
from ..loading.slots import LoaderStats, check_ring_fits
from ..transforms import Normalize, Pipeline

__all__ = ["Loader", "LoaderStats", "Sampling", "Storage", "Targets", "Workers"]

_STATE_FORMAT = "stoker.Loader/1"


def _merge(cls: type, given: Any, loose: dict[str, Any], arg: str) -> Any:
    """The option value `arg=` gave (or the defaults), with the fields DataLoader's keywords set; a
    field set both ways, to different values, is refused."""
    if given is not None and not isinstance(given, cls):
        raise ConfigError(f"{arg}= takes a stoker.{cls.__name__}, got {type(given).__name__}: {given!r:.80}")
    if given is None:
        return cls(**loose)
    default = cls()
    for key, value in loose.items():
        mine = getattr(given, key)
        if not _equal(mine, getattr(default, key)) and not _equal(mine, value):
            raise ConfigError(f"{key} is set twice, {arg}={given!r} and a keyword saying {value!r}; pass it once")
    return replace(given, **loose) if loose else given


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


def _device_options(device: Any, pipeline: Pipeline) -> DeviceOptions | None:
    """The loader's DeviceOptions (None: uint8 batches on the CPU), with every bad combination named."""
    opts = as_device_options(device)
    batch_norm = pipeline.normalizes
    if opts is not None and batch_norm and opts.normalize is not None:
        raise ConfigError("the transforms end with a Normalize and the device options normalize as well; keep one "
                          "(drop normalize= from the DeviceOptions, or the Normalize from the transforms)")
    if opts is not None and opts.decode == "gpu" and pipeline.tail:
        names = ", ".join(op.name for op in pipeline.tail if hasattr(op, "name"))
        raise ConfigError(f"decode='gpu' runs only stoker's geometric transforms on the GPU; {names} "
                          f"work on numpy arrays: use DeviceOptions(decode='cpu') for them")
    if opts is not None and opts.decode == "gpu" and pipeline.resampling != ("bilinear", True):
        interpolation, antialias = pipeline.resampling
        raise ConfigError(f"decode='gpu' resizes with antialiased bilinear only; the transforms ask for "
                          f"interpolation={interpolation!r}, antialias={antialias}: use DeviceOptions(decode='cpu'), "
                          f"or the defaults")
    return opts


#: `device="numpy"`: the batches as NumPy arrays in host memory, not torch tensors (numpy_output: JAX,
#: TensorFlow, NumPy), with or without torch installed
NUMPY = "numpy"


def _output(device: Any, pin_memory: bool | None, pipeline: Pipeline) -> str:
    """What the batches are: "torch" tensors (the default, and the only output a device stage makes) or
    "numpy" arrays (`device="numpy"`); refuses what NumPy output cannot honour, and torch output without torch."""
    if not (isinstance(device, str) and device == NUMPY):
        if not HAVE_TORCH:
            raise missing_torch("the Loader's default output (torch tensors)",
                                instead="pass Loader(..., device='numpy') for NumPy batches without torch")
        return "torch"
    if pin_memory:
        raise ConfigError("pin_memory=True pins torch tensors for CUDA copies; device='numpy' hands out plain numpy "
                          "arrays: drop pin_memory= (Workers(pin_memory=)), or leave device= unset for torch tensors")
    if pipeline.batch is not None:
        names = [type(op).__name__ for op in pipeline.batch.ops] + (["Mixup"] if pipeline.batch.mix else [])
        raise ConfigError(f"device='numpy': the batch ops {', '.join(names)} run on torch tensors; drop them from "
                          f"transforms= and apply them in your training step (e.g. (x / 255 - mean) / std with "
                          f"jax.numpy, docs/jax.md), or leave device= unset for torch tensors")
    return NUMPY


def _check_boxes(boxes: tuple[str, ...], pipeline: Pipeline) -> None:
    """Boxes follow the planned geometry only: refuse ops that would move pixels without them."""
    pipeline.check_targets(boxes)


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

    Each `iter()` is a whole pass of the current epoch (an early stop does not shorten the next one;
    `load_state_dict()` is the only way to start part-way). Each step yields `(images, labels)`:
    images `uint8 [B, 3, H, W]`, a channels_last view of a pinned ring slot that stays valid as long
    as it is held; labels `int64 [B]` (float64 for float labels, a list for string labels, multi-hot
    or soft targets per `Targets`), always fresh; plus `{column: values}` as a third item when
    `columns` names extra columns (or `Targets` asks for boxes, masks, sizes).

    `source`: a packed folder or URL (``s3://...``), an unpacked source `stoker pack` reads, or a
    `stoker.Dataset`. `transforms`: one transform, a list or a Compose-like object (docs/transforms.md).
    `order`, `seed`: the two `Sampling` fields kept at hand. The rest are option values, each frozen,
    checked where it is made and usable alone (`stoker.options`): `sampling=Sampling(...)` (order,
    seed, indices, weights, rank, world_size, drop_last, clips: on a video pack a `stoker.Clips`,
    each sample a clip, images `uint8 [B, T, 3, H, W]`, docs/video.md), `storage=Storage(...)` (cache_dir,
    cache_limit, storage_options, stage), `targets=Targets(...)` (boxes, masks, ignore_index, pad,
    multi_label, num_classes, classes, collate_fn), `workers=Workers(...)` or an int (num_threads,
    prefetch, persistent, pin_memory, timeout, on_error, decode_quality). `device`: None (the uint8
    batches above), "numpy" (the same batches as NumPy arrays, no torch needed: JAX, docs/jax.md),
    a device ("cuda", "cuda:1", "cpu") or a `DeviceOptions` (normalize, dtype,
    memory_format, decode="gpu"). DataLoader's keywords map onto the options or raise a ConfigError
    naming stoker's argument (`habits`); so do the 0.1 keywords, naming their new spelling.
    """

    def __init__(self, source: str | Path | Dataset, batch_size: int, *, transforms: Sequence[Any] | None = None,
                 order: str | None = None, seed: int | None = None, sampling: Sampling | None = None,
                 device: str | int | torch.device | DeviceOptions | None = None, columns: Sequence[str] = (),
                 targets: Targets | None = None, storage: Storage | None = None,
                 workers: Workers | int | None = None, **dataloader: Any) -> None:
        check_source(source)
        loose = dataloader_keywords(dataloader)   # DataLoader's keywords, as fields of the options below
        for name, value in (("order", order), ("seed", seed)):   # the common two, kept at hand
            if value is not None:
                if name in loose["sampling"]:
                    raise ConfigError(f"pass the {name} once: {name}= or the DataLoader keyword that implies it")
                loose["sampling"][name] = value
        self.sampling = _merge(Sampling, sampling, loose["sampling"], "sampling")
        self._clips_arg = self.sampling.clips
        self.workers = _merge(Workers, None if workers is None else Workers.of(workers), loose["workers"], "workers")
        self.targets = _merge(Targets, targets, loose["targets"], "targets")
        self.storage = _merge(Storage, storage, {}, "storage")
        order, seed, indices, weights = (self.sampling.order, self.sampling.seed, self.sampling.indices,
                                         self.sampling.weights)
        rank, world_size, drop_last = self.sampling.rank, self.sampling.world_size, self.sampling.drop_last
        w = self.workers
        num_threads, prefetch, persistent, pin_memory = w.num_threads, w.prefetch, w.persistent, w.pin_memory
        timeout, on_error, decode_quality = w.timeout, w.on_error, w.decode_quality
        t = self.targets
        boxes, masks, ignore_index, pad, multi_label, num_classes = (t.boxes, t.masks, t.ignore_index, t.pad,
                                                                     t.multi_label, t.num_classes)
        collate_fn = t.collate_fn
        self._pinned = None if t.classes is None else list(t.classes)
        if collate_fn is not None and (not callable(collate_fn) or not columns):
            raise ConfigError("collate_fn receives the batch's extra columns ({column: [values]}) and returns "
                              "the batch's third item: pass a callable, and name the columns in columns=[...]"
                              " (images and labels are batched by stoker itself)")
        self.collate_fn = collate_fn
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        self.persistent = persistent
        self.decode_quality = decode_quality
        self.pipeline = Pipeline(transforms)
        self.output = _output(device, pin_memory, self.pipeline)
        self.device = None if self.output == NUMPY else _device_options(device, self.pipeline)
        self.boxes, self.masks = boxes, masks
        self.ignore_index = ignore_index
        self.pad = pad
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
        rank_, world = _distributed(rank, world_size)
        self._opened = open_for_loading(source, self.storage, rank=rank_, world_size=world, timeout=timeout)
        self.dataset = self._opened.dataset
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
        self.num_threads = num_threads or threads_per_process()
        self.prefetch, self.on_error, self.timeout = prefetch, on_error, float(timeout)
        self.order = order
        self.columns = tuple(columns)
        self.clips = self._video_clips(ds)
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
        frames = 0 if self.clips is None else self.clips.frames
        check_ring_fits(prefetch + 2, batch_size, *self.output_size, frames)   # at once, not at the first batch
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
        mix = self.pipeline.batch.mix if self.pipeline.batch is not None else None
        if mix is not None and mix.multi_label is None and multi is not None:
            # the dataset says what its float rows are: soft targets (probabilities) are smoothed toward
            # 1/C, multi-hot rows toward 0.5 (timm's multi_label=True)
            self.pipeline.batch.mix = replace(mix, multi_label=multi.format != "soft")
        self._spec = RenderSpec(batch_size, self.output_size, self.pipeline, self.seed, on_error, self.columns,
                                labels, heights, widths, multi_label=multi, decode_quality=self.decode_quality,
                                box_columns=self.boxes, mask_columns=polygons, label_map_columns=label_maps,
                                ignore_index=self.ignore_index, pad=self.pad,
                                key_by_draw=self._pool.weighted, members=self._pool.members(),
                                clips=None if self.clips is None else ClipSamples(self.clips))
        self._shard_rows = [s.rows for s in ds.manifest.shards] \
            if isinstance(ds, (PackedDataset, CachedDataset)) else None
        self.processes = self.workers.processes
        child_spec = None
        if self.processes:   # the worker threads in a child process: refuse here what cannot cross
            from ..loading.procs import check_process_mode

            child_spec = check_process_mode(self._spec, ds, device=self.device)
        self.stats = LoaderStats()
        # where the data stands (the epoch, the samples of it yielded), written by the passes
        self._cursor = Cursor()
        self._passes = Passes(PassParts(
            self._spec, ds, self.epoch_indices, self._epoch_samples(), batch_size, self.num_threads, prefetch,
            self.timeout, self._label_dtype, self.pin_memory,
            # a dataset in object storage gives its cache each epoch's order when that epoch starts
            persistent=self.persistent and not isinstance(ds, CachedDataset), stats=self.stats,
            collate=self.collate_fn, order=self.order, buffers=self._buffers(), child_spec=child_spec),
            self._cursor)
        if self.device is not None and self.device.decode == "gpu":
            self._passes.gpu(self.device)  # a missing decoder library fails here, with its install hint

    def _video_clips(self, ds: Dataset) -> Clips | None:
        """The clip options of a video pack (`Sampling(clips=)`, or `Clips()`'s defaults); None for images. Refuses
        what clips cannot honour here, when the Loader is made, naming what to change."""
        from ..video import VIDEO_INDEX_COLUMN, require_av

        if VIDEO_INDEX_COLUMN not in ds.extra_columns:
            if self._clips_arg is not None:
                raise ConfigError(f"{ds.path} holds images, not videos; Sampling(clips=) applies to a video pack "
                                  f"(stoker pack of video files): drop clips=")
            return None
        require_av()   # PyAV decodes the clips: missing, the install hint now rather than per sample
        # each of these would treat a clip's frames as unrelated images
        refused = [("boxes=/masks= (stoker.Targets)", bool(self.boxes or self.masks)), ("pad=True", self.pad),
                   ("decode='gpu' (DeviceOptions)", self.device is not None and self.device.decode == "gpu")]
        batch = self.pipeline.batch
        if batch is not None:
            names = [type(op).__name__ for op in batch.ops if not isinstance(op, Normalize)]
            refused.append((", ".join(names + (["Mixup"] if batch.mix else [])) + " (batch ops)",
                            bool(names) or batch.mix is not None))
        for what, asked in refused:
            if asked:
                raise ConfigError(f"{ds.path} holds videos: {what} cannot apply to clips yet (of the batch ops, "
                                  f"clips take Normalize only); drop it for a video pack (docs/video.md)")
        clips = Clips() if self._clips_arg is None else self._clips_arg
        taken = [c for c in ("video", "clip") if c in self.columns]
        if taken and clips.clips_per_video > 1:
            raise ConfigError(f"{ds.path}: with clips_per_video > 1 the batch's extras 'video' and 'clip' say which "
                              f"video and clip each row holds, and would hide the column(s) {taken} asked for in "
                              f"columns=; rename them when packing")
        return clips

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
            raise ConfigError(f"{self.dataset.path}: Targets(pad=True) needs the image sizes a packed dataset stores; pack "
                              f"the data first (stoker pack SRC OUT)")
        raise ConfigError(f"{self.dataset.path}: images differ in size and the transforms do not end in a fixed "
                          f"size, so they cannot be batched; end the transforms with RandomResizedCrop(size), "
                          f"CenterCrop(size) or Resize((height, width)), or {'pass' if h is not None else 'pack them (stoker.pack) and pass'} "
                          f"targets=stoker.Targets(pad=True) to batch them padded with their sizes")

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
        return num_batches(samples_per_rank(self._pool.size, self.world_size, self.drop_last) * self._per_video,
                           self.batch_size, self.drop_last)

    @property
    def _per_video(self) -> int:
        """Samples per dataset row in an epoch: a video pack's clips per video, else 1."""
        return 1 if self.clips is None else self.clips.clips_per_video

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration reads."""
        return self._cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` from its start on the next `iter()`. Without calls, an `iter()` after a
        finished pass reads the next epoch, and one after a pass left part-way reads its epoch again
        from the start."""
        self._cursor.move(epoch)

    def _epoch_samples(self) -> int:
        """Samples of one epoch on this rank (what `epoch_indices` returns, without computing the order)."""
        if self.drop_last:
            return len(self) * self.batch_size
        return samples_per_rank(self._pool.size, self.world_size, False) * self._per_video

    def state_dict(self) -> dict[str, Any]:
        """Where the data stands: the epoch, and the samples (and batches) of it the latest pass
        yielded on this rank, plus the settings that must match on resume. Taken during a pass (a
        checkpoint in the training loop) or after it stopped (a `break`, an exception), it records
        that pass's position; `load_state_dict()` of it makes the next `iter()` continue from there,
        the only way a pass starts part-way (a plain `iter()` reads its epoch from the start)."""
        with self._cursor.lock:
            epoch, sample = self._cursor.epoch, self._cursor.sample
        batch = -(-sample // self.batch_size)
        return {"format": _STATE_FORMAT, "epoch": epoch, "batch": batch, "sample": sample,
                "seed": self.seed, "batch_size": self.batch_size, "world_size": self.world_size,
                "num_samples": len(self.dataset), "order": self.order, "drop_last": self.drop_last,
                "pool": self._pool.fingerprint,
                **({} if self.clips is None else {"clips": repr(self.clips)})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next `iter()` (only that one) yields exactly the samples of `state`'s epoch not
        yet yielded.
        A different `batch_size` is allowed with `drop_last=False` (the samples left are the same;
        only their grouping into batches changes); everything else must match."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ConfigError(f"not a stoker Loader state (expected format {_STATE_FORMAT!r}): {state!r:.200}")
        mine = self.state_dict()
        keys = ["seed", "world_size", "num_samples", "order", "drop_last", "pool"]
        if self.clips is not None:   # which clips an epoch holds
            keys.append("clips")
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
        if int(sample) == total:
            self._cursor.move(epoch + 1)
        else:
            self._cursor.move(epoch, int(sample), resume=True)

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """Dataset indices this rank reads in `epoch` (default: the current one), in order."""
        epoch = self._cursor.epoch if epoch is None else epoch
        pool = self._pool
        if self.order == "shard_window":
            idx = shard_window_order(self._shard_rows or [len(self.dataset)], seed=self.seed, epoch=epoch,
                                     rank=self.rank, world_size=self.world_size, drop_last=self.drop_last)
            idx = np.repeat(idx, self._per_video)   # a video's clips one after another (clips.ClipSamples)
            return idx[:len(idx) // self.batch_size * self.batch_size] if self.drop_last else idx
        if pool.weighted:
            perm = pool.draw(self.seed, epoch)
        else:
            perm = epoch_order(pool.size, seed=self.seed, epoch=epoch, order=self.order, shard_rows=self._shard_rows)
            if pool.indices is not None:
                perm = pool.indices[perm]
        idx = rank_indices(perm, self.rank, self.world_size, drop_last=self.drop_last,
                           contiguous=self.order == "shard_random")
        idx = np.repeat(idx, self._per_video)   # a video's clips one after another (clips.ClipSamples)
        if self.drop_last:
            idx = idx[:len(idx) // self.batch_size * self.batch_size]
        return idx

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple]:
        """A whole pass of the current epoch (see docs/loader.md, "Passes")."""
        return self._passes.begin(self.device)

    def iter_on(self, device: str | int | torch.device | DeviceOptions) -> Iterator[tuple]:
        """One pass whose batches arrive on `device` (a device or `DeviceOptions`), for a Loader made
        without `device=`: what `stoker.prefetch(loader, device)` iterates. The ring's pinned memory
        is reused, so the device copy happens here, on the loader's copy stream, before a slot is
        refilled."""
        if self.output == NUMPY:
            raise ConfigError("this Loader hands out numpy arrays (device='numpy'); stoker.prefetch and iter_on "
                              "move torch tensors: make the Loader without device='numpy' for them")
        opts = as_device_options(device)
        if opts is None:
            raise ConfigError(f"iter_on needs a device or DeviceOptions, got {device!r}")
        if self.device is not None:
            raise ConfigError(f"this Loader already delivers batches to {self.device.device}; iterate it "
                              f"directly instead of wrapping it in stoker.prefetch")
        _device_options(opts, self.pipeline)
        if opts.decode == "gpu":
            self._passes.gpu(opts)
        return self._passes.begin(opts)

    def close(self) -> None:
        """Stop any running iteration and release the dataset (when the Loader opened it). Idempotent."""
        passes = getattr(self, "_passes", None)
        if passes is not None:
            passes.close()
        opened = getattr(self, "_opened", None)
        if opened is not None:
            opened.close()

    def _buffers(self) -> Any:
        """What makes the ring's slots: None (torch tensors), or numpy arrays for device="numpy"."""
        if self.output != NUMPY:
            return None
        from ..loading.numpy_output import NumpyBuffers   # loaded by NumPy output only

        return NumpyBuffers()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        h, w = self.output_size
        where = "" if self.device is None else f", to {self.device.device}, decode {self.device.decode}"
        return (f"<stoker.Loader {len(self.dataset)} samples, batch {self.batch_size}, {h}x{w}, "
                f"{self.num_threads} threads{' in a worker process' if self.processes else ''}, "
                f"rank {self.rank}/{self.world_size}, epoch {self.epoch}{where}>")
