"""A Loader's options resolved once into one frozen `LoadPlan`, and the one place that refuses
combinations of them.

    asked = ask(source, batch_size, transforms=..., sampling=..., device=..., ...)  # the options alone
    dataset = open_for_loading(source, asked.storage, ...)                          # the source
    plan = resolve(asked, dataset)                                                   # with the data

`ask` merges the option values (and the fields DataLoader's keywords set, `habits`) and refuses what they cannot do
together before anything is opened; `resolve` refuses what they cannot do with this dataset and
fixes the kind of sample (`loading.kinds`: an image, or a video pack's clip), what to render
(`RenderSpec`), the ring's shape, the epoch order (`EpochOrder`, a pure value) and the output kind.
Each refusal is a ConfigError naming the fix as the Python argument to change. Option values still
check their own fields where they are made (`options`, `DeviceOptions`, `Clips`); the process mode's own
limits are `procs.check_process_mode`'s.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from .._system import threads_per_process
from .._torch import HAVE_TORCH, missing_torch, torch
from ..device.stage import DeviceOptions, as_device_options
from ..errors import ConfigError
from ..loading.clips import Clips, ClipKind
from ..loading.kinds import IMAGES, SampleKind
from ..loading.labels import multi_label_spec
from ..loading.render import Bucketed, RenderSpec
from ..loading.route import Route, decide
from ..loading.slots import check_ring_fits
from ..buckets import EXTRAS, assign, balance, bucket_batches
from ..order import (Pool, epoch_order, from_ranges, layout_positions, make_pool, num_batches, rank_indices,
                     samples_per_rank, shard_window_order, to_ranges, unseen_positions)
from ..dataset import Dataset
from ..storage import url_scheme
from ..transforms import CoverCrop, Normalize, Pipeline
from ..transforms.kinds import engine_program
from .habits import pinned_labels
from .options import Sampling, Storage, Targets, Workers

__all__ = ["NUMPY", "Asked", "EpochOrder", "LoadPlan", "ask", "resolve"]

#: `device="numpy"`: the batches as NumPy arrays in host memory, not torch tensors (JAX, TensorFlow,
#: NumPy), with or without torch installed. An output, not a device: `LoadPlan.output`.
NUMPY = "numpy"


@dataclass(frozen=True)
class Asked:
    """A Loader's options merged and checked together, before its source is opened."""

    batch_size: int
    sampling: Sampling
    workers: Workers
    targets: Targets
    storage: Storage
    columns: tuple[str, ...]   # extra columns asked for, then the boxes= / masks= columns
    pipeline: Pipeline
    output: str   # "torch" or NUMPY
    device: DeviceOptions | None   # None: no device stage (uint8 batches in host memory)
    rank: int
    world_size: int

    @property
    def gpu_decode(self) -> bool:
        """Whether the JPEGs are decoded on the GPU (`DeviceOptions(decode="gpu")`): asked here only."""
        return self.device is not None and self.device.gpu_decode


def ask(source: Any, batch_size: int, *, transforms: Sequence[Any] | None, order: str | None, seed: int | None,
        sampling: Sampling | None, device: Any, columns: Sequence[str], targets: Targets | None,
        storage: Storage | None, workers: Workers | int | None, loose: dict[str, dict[str, Any]]) -> Asked:
    """The Loader's arguments as one checked `Asked`; a ConfigError for any combination they cannot do.
    `loose`: the option fields DataLoader's keywords set (`habits.dataloader_keywords`)."""
    for name, value in (("order", order), ("seed", seed)):   # the common two, kept at hand
        if value is not None:
            if name in loose["sampling"]:
                raise ConfigError(f"pass the {name} once: {name}= or the DataLoader keyword that implies it")
            loose["sampling"][name] = value
    sampling = _merge(Sampling, sampling, loose["sampling"], "sampling")
    workers = _merge(Workers, None if workers is None else Workers.of(workers), loose["workers"], "workers")
    targets = _merge(Targets, targets, loose["targets"], "targets")
    storage = _merge(Storage, storage, {}, "storage")
    if storage.stage is not None and isinstance(source, Dataset):
        raise ConfigError(f"Storage(stage={str(storage.stage)!r}) copies a packed dataset folder; pass its path "
                          f"as the source, not an opened dataset")
    if storage.stage is not None and url_scheme(source) not in (None, "file"):
        raise ConfigError(f"Storage(stage={str(storage.stage)!r}) copies a local packed dataset folder; a URL is "
                          f"cached through Storage(cache_dir=...) instead")
    if targets.collate_fn is not None and (not callable(targets.collate_fn) or not columns):
        raise ConfigError("collate_fn receives the batch's extra columns ({column: [values]}) and returns "
                          "the batch's third item: pass a callable, and name the columns in columns=[...]"
                          " (images and labels are batched by stoker itself). A collate_fn that mixes images "
                          "(torchvision's MixUp/CutMix around default_collate) is a batch op here: end "
                          "transforms= with stoker.MixUp(alpha=0.2, num_classes=N) or stoker.CutMix(alpha=1.0, "
                          "num_classes=N), or stoker.Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=N) "
                          "for a random choice of the two, and drop collate_fn=")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
    pipeline = Pipeline(transforms)
    output = _output(device, workers.pin_memory, pipeline)
    opts = None if output == NUMPY else device_options(device, pipeline)
    if targets.pad and pipeline.tail_geometric:
        raise ConfigError("pad=True batches the sizes stoker plans; a geometric transform after a user callable "
                          "is planned per sample only: move it before the callable")
    if targets.pad and "sizes" in columns:
        raise ConfigError("pad=True hands the image sizes out as extras['sizes'], which would hide the column "
                          "'sizes' asked for in columns=; rename that column when packing, or drop pad=True")
    if targets.pad and opts is not None and opts.gpu_decode:
        raise ConfigError("pad=True is not available with decode='gpu'; use DeviceOptions(decode='cpu')")
    followed = targets.boxes + targets.masks
    pipeline.check_targets(followed)   # boxes follow the planned geometry only: ops that move pixels refused
    columns = (*columns, *(c for c in followed if c not in columns))
    if targets.captions is not None and targets.captions not in columns:
        columns = (*columns, targets.captions)
    rank, world_size = _distributed(sampling.rank, sampling.world_size)
    return Asked(batch_size, sampling, workers, targets, storage, tuple(columns), pipeline, output, opts,
                 rank, world_size)


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


def device_options(device: Any, pipeline: Pipeline) -> DeviceOptions | None:
    """The loader's DeviceOptions (None: uint8 batches on the CPU), with every bad combination named."""
    opts = as_device_options(device)
    batch_norm = pipeline.normalizes
    if opts is not None and batch_norm and opts.normalize is not None:
        raise ConfigError("the transforms end with a Normalize and the device options normalize as well; keep one "
                          "(drop normalize= from the DeviceOptions, or the Normalize from the transforms)")
    if opts is not None and opts.gpu_decode and pipeline.tail:
        names = ", ".join(op.name for op in pipeline.tail if hasattr(op, "name"))
        raise ConfigError(f"decode='gpu' runs only stoker's geometric transforms on the GPU; {names} "
                          f"work on numpy arrays: use DeviceOptions(decode='cpu') for them")
    if opts is not None and opts.gpu_decode and pipeline.resampling != ("bilinear", True):
        interpolation, antialias = pipeline.resampling
        raise ConfigError(f"decode='gpu' resizes with antialiased bilinear only; the transforms ask for "
                          f"interpolation={interpolation!r}, antialias={antialias}: use DeviceOptions(decode='cpu'), "
                          f"or the defaults")
    return opts


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


@dataclass(frozen=True)
class EpochOrder:
    """Which dataset indices this rank reads in each epoch, in order: a pure function of the epoch."""

    pool: Pool   # the samples an epoch draws from (all, `indices=`, or weighted draws)
    order: str
    seed: int
    rank: int
    world_size: int
    drop_last: bool
    batch_size: int
    per_item: int   # epoch positions per dataset row (`SampleKind.per_item`): a video pack's clips per video, else 1
    shard_rows: tuple[int, ...] | None   # rows per shard (packed data), for the shard-aware orders
    rows: int   # rows of the dataset
    #: after an elastic resume: (epoch, the positions of its global order no rank had read), split over this world
    queue: tuple[int, np.ndarray] | None = field(default=None, compare=False)
    #: aspect-ratio buckets: each dataset row's bucket (int32; `buckets.assign`), else None
    buckets: np.ndarray | None = field(default=None, compare=False)

    def _bucket_layout(self, epoch: int) -> np.ndarray:
        """Aspect buckets: the epoch's global batches before the ranks' balance, int64 [G, batch_size]
        (`buckets.bucket_batches`); the positions of a state's `remaining` index it flattened."""
        shuffle = (None if self.order == "sequential" else
                   lambda g: epoch_order(g, seed=self.seed, epoch=epoch, order="random"))
        return bucket_batches(self._global(epoch), self.buckets, self.batch_size, self.drop_last, 1, shuffle)

    def _bucket_rank(self, epoch: int) -> np.ndarray:
        """Aspect buckets: this rank's dataset indices in `epoch`, whole batches of one bucket each."""
        layout = self._bucket_layout(epoch)
        queue = self._queued(epoch)
        if queue is not None:   # an elastic resume: the batches no rank had read, over this world
            flat = layout.reshape(-1)
            keep = queue[queue < len(flat)]
            layout = flat[keep[:len(keep) // self.batch_size * self.batch_size]].reshape(-1, self.batch_size)
        return balance(layout, self.world_size, self.drop_last)[self.rank::self.world_size].reshape(-1)

    def _global(self, epoch: int) -> np.ndarray:
        """The epoch's global order (before ranks take their parts): dataset indices."""
        pool = self.pool
        if pool.weighted:
            return pool.draw(self.seed, epoch)
        perm = epoch_order(pool.size, seed=self.seed, epoch=epoch, order=self.order,
                           shard_rows=None if self.shard_rows is None else list(self.shard_rows))
        return perm if pool.indices is None else pool.indices[perm]

    def _queued(self, epoch: int | None) -> np.ndarray | None:
        return self.queue[1] if self.queue is not None and self.queue[0] == epoch else None

    def indices(self, epoch: int) -> np.ndarray:
        """Dataset indices this rank reads in `epoch`, in order (a video's clips one after another)."""
        if self.buckets is not None:
            return self._bucket_rank(epoch)
        contiguous = self.order == "shard_random"
        queue = self._queued(epoch)
        if queue is not None:   # an elastic resume: what is left of the epoch, split over this world
            return self._global(epoch)[layout_positions(queue, self.rank, self.world_size, drop_last=self.drop_last,
                                                        contiguous=contiguous, batch_size=self.batch_size)]
        if self.order == "shard_window":
            idx = shard_window_order(list(self.shard_rows or [self.rows]), seed=self.seed, epoch=epoch,
                                     rank=self.rank, world_size=self.world_size, drop_last=self.drop_last)
        else:
            idx = rank_indices(self._global(epoch), self.rank, self.world_size, drop_last=self.drop_last,
                               contiguous=contiguous)
        idx = np.repeat(idx, self.per_item)   # a video's clips one after another (clips.ClipKind)
        return idx[:len(idx) // self.batch_size * self.batch_size] if self.drop_last else idx

    def batches(self, epoch: int = 0) -> int:
        """Batches per epoch on this rank (aspect buckets: of `epoch`, whose draws may change the count)."""
        if self.buckets is not None:
            return len(self._bucket_rank(epoch)) // self.batch_size
        return num_batches(samples_per_rank(self.pool.size, self.world_size, self.drop_last) * self.per_item,
                           self.batch_size, self.drop_last)

    def samples(self, epoch: int | None = None) -> int:
        """Samples of one epoch on this rank (what `indices` returns, without computing the order)."""
        if self.buckets is not None:
            return len(self._bucket_rank(0 if epoch is None else epoch))
        queue = self._queued(epoch)
        if queue is not None:
            per = samples_per_rank(len(queue), self.world_size, self.drop_last)
            return per // self.batch_size * self.batch_size if self.drop_last else per
        if self.drop_last:
            return self.batches() * self.batch_size
        return samples_per_rank(self.pool.size, self.world_size, False) * self.per_item

    def progress(self, epoch: int, sample: int) -> dict[str, Any]:
        """A state's description of `epoch` over all ranks once every rank read `sample` samples (ranks
        step together): `remaining`, the [start, stop) ranges of the global order no rank has read, which
        any world size continues (`resumed`); `requeued` when the epoch was itself resumed so. None where
        the layout depends on the world size (shard_window, several clips per video)."""
        if self.order == "shard_window" or self.per_item > 1:
            return {"remaining": None}
        if self.buckets is not None:   # every rank read the same number of whole batches: the first of the layout
            queue = self._queued(epoch)
            total = len(queue) if queue is not None else self._bucket_layout(epoch).size
            done = min(total, sample * self.world_size)
            left = (queue[done:] if queue is not None else np.arange(done, total, dtype=np.int64))
            return {"remaining": to_ranges(left), **({"requeued": True} if queue is not None else {})}
        queue = self._queued(epoch)
        left = unseen_positions(np.arange(self.pool.size, dtype=np.int64) if queue is None else queue, sample,
                                self.world_size, drop_last=self.drop_last, contiguous=self.order == "shard_random")
        return {"remaining": to_ranges(left), **({"requeued": True} if queue is not None else {})}

    def resumed(self, epoch: int, remaining: Sequence[Sequence[int]] | None) -> "EpochOrder":
        """This order with `epoch` reduced to the positions `remaining` (None: every epoch whole)."""
        if remaining is None:
            return replace(self, queue=None)
        total = self._bucket_layout(epoch).size if self.buckets is not None else self.pool.size
        return replace(self, queue=(epoch, from_ranges(remaining, total)))


@dataclass(frozen=True)
class LoadPlan:
    """Everything a Loader resolved when it was made: what to render (`spec`), the ring's shape, the epoch
    order (`epochs`), the output kind and device, the threads. Nothing reads the options after this."""

    asked: Asked
    spec: RenderSpec   # what to render: the output size, the transforms, the labels and targets
    epochs: EpochOrder
    label_dtype: Any   # numpy dtype of numeric labels (the ring's label arrays), or None
    pin_memory: bool
    num_threads: int
    persistent: bool   # threads run on into the next epoch (never for a dataset in object storage)
    classes: tuple[str, ...] | None   # `Targets(classes=)`, pinned; None: the dataset's own
    #: Workers(processes=N): the pickled RenderSpec for the worker processes (procs.py); None: threads here
    child_spec: bytes | None = None

    # the values that live once, read from where they live
    route = property(lambda self: self.spec.route)   # how each row becomes pixels (`loading.route`)
    batch_size = property(lambda self: self.asked.batch_size)
    seed = property(lambda self: self.asked.sampling.seed)
    order = property(lambda self: self.asked.sampling.order)
    output = property(lambda self: self.asked.output)
    device = property(lambda self: self.asked.device)
    prefetch = property(lambda self: self.asked.workers.prefetch)
    timeout = property(lambda self: float(self.asked.workers.timeout))
    processes = property(lambda self: self.asked.workers.processes)
    collate = property(lambda self: self.asked.targets.collate_fn)
    tokenizer = property(lambda self: self.asked.targets.tokenizer)
    output_size = property(lambda self: self.spec.output_size)
    kind = property(lambda self: self.spec.kind)   # what a row holds: an image, or a video pack's clip

    @property
    def buffers(self) -> Any:
        """What makes the ring's slots: None (torch tensors), or numpy arrays for the NumPy output."""
        if self.output != NUMPY:
            return None
        from ..loading.numpy_output import NumpyBuffers   # loaded by NumPy output only

        return NumpyBuffers()

    def for_device(self, device: Any) -> DeviceOptions:
        """The DeviceOptions of a pass moved to `device` by `stoker.prefetch(loader, device)` (`Loader.iter_on`)."""
        if self.output == NUMPY:
            raise ConfigError("this Loader hands out numpy arrays (device='numpy'); stoker.prefetch and iter_on "
                              "move torch tensors: make the Loader without device='numpy' for them")
        opts = as_device_options(device)
        if opts is None:
            raise ConfigError(f"iter_on needs a device or DeviceOptions, got {device!r}")
        if self.device is not None:
            raise ConfigError(f"this Loader already delivers batches to {self.device.device}; iterate it "
                              f"directly instead of wrapping it in stoker.prefetch")
        device_options(opts, self.asked.pipeline)
        return opts


#: a GPU decoder probe: None where one works here for these options, else why not (decode="gpu": it raises)
DecoderProbe = Callable[[DeviceOptions], "str | None"]


def resolve(asked: Asked, ds: Dataset, decoder: DecoderProbe) -> LoadPlan:
    """`asked` with its dataset: the frozen plan, or a ConfigError for what they cannot do together.
    `decoder`: the GPU decoder probe the route asks where the GPU could take rows."""
    kind = _sample_kind(asked, ds)
    missing = [c for c in asked.columns if c not in ds.extra_columns]
    if missing:
        raise ConfigError(f"{ds.path}: no column(s) {missing}; the dataset has extra columns {ds.extra_columns}")
    text = asked.targets.captions
    if text is not None and ds.column_types.get(text, "string") not in ("string", "list<string>"):
        raise ConfigError(f"{ds.path}: Targets(captions={text!r}) reads text, and the column {text!r} holds "
                          f"{ds.column_types[text]} values; name a string or list<string> column (a WebDataset "
                          f"pack's 'txt', a COCO captions pack's 'captions', a CSV or Parquet text column)")
    pin_memory = False if asked.output == NUMPY else asked.workers.pin_memory   # no CUDA copy reads numpy arrays
    if pin_memory and not torch.cuda.is_available():   # DataLoader's habit: the same script on a laptop
        warnings.warn("pin_memory=True: torch finds no CUDA device here (a CPU-only torch build, or no driver), so "
                      "the batches are not pinned, as DataLoader does; pin_memory=None pins them only where CUDA "
                      "is available", UserWarning, stacklevel=4)
        pin_memory = False
    pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    if len(ds) == 0:
        raise ConfigError(f"{ds.path}: the dataset is empty; nothing to load")
    s, t, pipeline = asked.sampling, asked.targets, asked.pipeline
    if hasattr(ds, "pool"):   # a Mix draws its own epochs (mix.MixPlan)
        if s.indices is not None or s.weights is not None or s.order != "random":
            raise ConfigError("a Mix draws each epoch from its sources by their weights (Mix(weights=)) and "
                              "shuffles the draws together: drop Sampling(indices=, weights=) and order=")
        pool = ds.pool()
    else:
        pool = make_pool(len(ds), s.indices, s.weights)
    if pool.fingerprint is not None and s.order in ("shard_random", "shard_window"):
        raise ConfigError(f"order={s.order!r} reads whole shard blocks, so it cannot follow indices= or "
                          "weights=; use order='random' (or pack the subset as its own dataset)")
    if pool.weighted and s.order != "random":
        raise ConfigError(f"weights= draws each epoch's samples at random (with replacement), so "
                          f"order={s.order!r} cannot apply; leave order='random'")
    heights = None if ds.heights is None else np.asarray(ds.heights, dtype=np.int64)
    widths = None if ds.widths is None else np.asarray(ds.widths, dtype=np.int64)
    bucketed = None
    if getattr(kind, "row_size", None) is not None:   # token budgets: rows of patches (loading.tokens)
        output_size = kind.row_size
    elif s.buckets is not None:   # aspect buckets: each batch its bucket's size; the ring holds the largest
        bucketed = _bucketed(asked, ds, kind, heights, widths)
        output_size = max(bucketed.sizes, key=lambda hw: hw[0] * hw[1])
        asked = replace(asked, pipeline=bucketed.pipelines[bucketed.sizes.index(output_size)])
        pipeline = asked.pipeline
    else:
        output_size = _output_size(asked, ds, heights, widths)
    check_ring_fits(asked.workers.prefetch + 2, asked.batch_size, *output_size, kind.frames)   # now, not at batch 1
    pinned = None if t.classes is None else tuple(t.classes)
    labels = ds.labels if pinned is None else pinned_labels(ds.labels, ds.classes, list(pinned), ds.path)
    if labels.dtype.kind in "iufb":
        # a copy (8 bytes a sample), not a view of the mapped shard: batches are labelled without
        # touching the mapping, which a shard truncated mid-epoch would turn into a SIGBUS
        labels = np.array(labels)
    if (t.boxes or t.masks) and heights is None:
        raise ConfigError(f"{ds.path}: boxes= and masks= need the image sizes a packed dataset stores; pack the "
                          f"data first (stoker pack SRC OUT)")
    # a binary masks= column holds label-map PNGs (a CSV's mask column); any other, polygons (coco)
    label_maps = tuple(c for c in t.masks if ds.column_types.get(c) == "binary")
    polygons = tuple(c for c in t.masks if c not in label_maps)
    companions = [f"{c}{end}" for c in polygons for end in ("_points", "_box") if f"{c}{end}" not in
                  ds.extra_columns]
    if companions:
        raise ConfigError(f"{ds.path}: masks={polygons} needs the polygon columns {companions} beside it (as "
                          f"the coco source packs them); the dataset has extra columns {ds.extra_columns}")
    multi = multi_label_spec(labels, list(pinned) if pinned is not None else ds.classes, t.multi_label,
                             t.num_classes)
    mix = pipeline.batch.mix if pipeline.batch is not None else None
    if mix is not None and mix.multi_label is None and multi is not None:
        # the dataset says what its float rows are: soft targets (probabilities) are smoothed toward
        # 1/C, multi-hot rows toward 0.5 (timm's multi_label=True); the asked pipeline stays as it was
        pipeline = pipeline.with_mix(replace(mix, multi_label=multi.format != "soft"))
        asked = replace(asked, pipeline=pipeline)
    w = asked.workers
    spec = RenderSpec(asked.batch_size, output_size, pipeline, int(s.seed), w.on_error, asked.columns,
                      labels, heights, widths, multi_label=multi, decode_quality=w.decode_quality,
                      box_columns=t.boxes, mask_columns=polygons, label_map_columns=label_maps,
                      ignore_index=t.ignore_index, pad=t.pad, key_by_draw=pool.weighted, members=pool.members(),
                      kind=kind, buckets=bucketed, captions=text)
    spec = replace(spec, route=route_of(asked, spec, ds, asked.device, decoder))
    rows = ds.shard_rows
    epochs = EpochOrder(pool, s.order, int(s.seed), asked.rank, asked.world_size, s.drop_last, asked.batch_size,
                        kind.per_item, None if rows is None else tuple(rows), len(ds),
                        buckets=None if bucketed is None else bucketed.of)
    child_spec = None
    if w.processes:   # the worker threads in a child process: refuse here what cannot cross
        from ..loading.procs import check_process_mode

        child_spec = check_process_mode(spec, ds, device=asked.device, processes=w.processes)
    return LoadPlan(asked, spec, epochs, labels.dtype if labels.dtype.kind in "iufb" else None, pin_memory,
                    # on a GPU host the training process keeps cores of its own (_system.TRAINER_THREADS); with
                    # worker processes, the count is all of theirs together (at least one thread each)
                    w.num_threads or max(w.processes, threads_per_process(
                        getattr(getattr(asked.device, "device", None), "type", "") == "cuda")),
                    # a dataset in object storage gives its cache each epoch's order when that epoch starts
                    w.persistent and not ds.plans_downloads, pinned, child_spec)


def _bucketed(asked: Asked, ds: Dataset, kind: SampleKind, heights: np.ndarray | None, widths: np.ndarray | None
              ) -> Bucketed:
    """`Sampling(buckets=)` with this dataset: each row's bucket, each bucket's pipeline (its `CoverCrop`
    first) and engine program; a ConfigError for what buckets cannot do here, naming what to change."""
    s, t, pipeline = asked.sampling, asked.targets, asked.pipeline
    refused = [("images of a packed dataset (its stored sizes decide the buckets without a decode; stoker pack "
                "SRC OUT first)", heights is None),
               (f"order={s.order!r} (use 'random' or 'sequential')", s.order in ("shard_random", "shard_window")),
               ("video clips", kind is not IMAGES), ("pad=True (each batch is its bucket's size)", t.pad),
               ("boxes= and masks=", bool(t.boxes or t.masks))]
    for what, bad in refused:
        if bad:
            raise ConfigError(f"Sampling(buckets=) cannot take {what}" if "packed" not in what else
                              f"{ds.path}: Sampling(buckets=) needs {what}")
    sizing = [op for op in pipeline.ops if getattr(op, "stage", None) == "plan" and
              op.fixed_size((7919, 7907)) != (7919, 7907)]
    if sizing:
        raise ConfigError(f"Sampling(buckets=) sizes each image to its bucket; the transforms also size it "
                          f"({', '.join(type(op).__name__ for op in sizing)}): drop them (a RandomHorizontalFlip and "
                          f"the per-sample and batch ops stay)")
    taken = [c for c in EXTRAS if c in asked.columns]
    if taken:
        raise ConfigError(f"a bucketed batch hands out extras {list(EXTRAS)}, which would hide the column(s) {taken} "
                          f"asked for in columns=; rename them when packing")
    buckets = s.buckets
    sizes = buckets.resolutions()
    of = assign(heights, widths, sizes, keys=lambda i: repr(ds.sample(i).key))
    pipelines = tuple(pipeline.prepended(CoverCrop(size, crop=buckets.crop)) for size in sizes)
    return Bucketed(sizes, of, pipelines, tuple(engine_program(p.prefix, p.offsets) for p in pipelines),
                    buckets.crop == "random")


def _patch_kind(asked: Asked, ds: Dataset) -> SampleKind | None:
    """`TokenBudget` in the transforms: rows of patches (`loading.tokens.PatchKind`), or None without one;
    a ConfigError for what token budgets cannot do here, naming what to change."""
    from ..loading.tokens import PatchKind, TokenBudget, grids_of

    pipeline, t = asked.pipeline, asked.targets
    budgets = [op for op in pipeline.ops if isinstance(op, TokenBudget)]
    if not budgets:
        return None
    sizing = [type(op).__name__ for op in pipeline.ops if getattr(op, "stage", None) == "plan"
              and not isinstance(op, TokenBudget) and op.fixed_size((7919, 7907)) != (7919, 7907)]
    refused = [(f"other ops that size the image ({', '.join(sizing)})", bool(sizing)),
               ("a second TokenBudget", len(budgets) > 1), ("pad=True", t.pad),
               ("boxes= and masks=", bool(t.boxes or t.masks)), ("Sampling(buckets=)", asked.sampling.buckets is not None)]
    for what, bad in refused:
        if bad:
            raise ConfigError(f"TokenBudget sizes each image to its token budget and hands out patch sequences: "
                              f"drop {what}")
    if ds.heights is None:
        raise ConfigError(f"{ds.path}: TokenBudget plans each image's grid from the stored sizes of a packed dataset; "
                          f"pack the data first (stoker pack SRC OUT)")
    return PatchKind(budgets[0], grids_of(ds.heights, ds.widths, budgets[0]))


def _sample_kind(asked: Asked, ds: Dataset) -> SampleKind:
    """What a row holds (`loading.kinds`): an image, or on a video pack a clip (`Sampling(clips=)`, or
    `Clips()`'s defaults). Refuses what clips cannot honour here, when the Loader is made, naming what to
    change: the one place that tells a video pack from images."""
    from ..video import VIDEO_INDEX_COLUMN, require_av

    given, t = asked.sampling.clips, asked.targets
    if VIDEO_INDEX_COLUMN not in ds.extra_columns:
        if given is not None:
            raise ConfigError(f"{ds.path} holds images, not videos; Sampling(clips=) applies to a video pack "
                              f"(stoker pack of video files): drop clips=")
        return _patch_kind(asked, ds) or IMAGES
    require_av()   # PyAV decodes the clips: missing, the install hint now rather than per sample
    # each of these would treat a clip's frames as unrelated images
    refused = [("boxes=/masks= (stoker.Targets)", bool(t.boxes or t.masks)), ("pad=True", t.pad),
               ("decode='gpu' (DeviceOptions)", asked.gpu_decode)]
    batch = asked.pipeline.batch
    if batch is not None:
        names = [type(op).__name__ for op in batch.ops if not isinstance(op, Normalize)]
        refused.append((", ".join(names + (["Mixup"] if batch.mix else [])) + " (batch ops)",
                        bool(names) or batch.mix is not None))
    for what, asked_for in refused:
        if asked_for:
            raise ConfigError(f"{ds.path} holds videos: {what} cannot apply to clips yet (of the batch ops, "
                              f"clips take Normalize only); drop it for a video pack (docs/video.md)")
    clips = Clips() if given is None else given
    taken = [c for c in ("video", "clip") if c in asked.columns]
    if taken and clips.clips_per_video > 1:
        raise ConfigError(f"{ds.path}: with clips_per_video > 1 the batch's extras 'video' and 'clip' say which "
                          f"video and clip each row holds, and would hide the column(s) {taken} asked for in "
                          f"columns=; rename them when packing")
    return ClipKind(clips)


def _output_size(asked: Asked, ds: Dataset, h: np.ndarray | None, w: np.ndarray | None) -> tuple[int, int]:
    pipeline, pad = asked.pipeline, asked.targets.pad
    fixed = pipeline.fixed_size
    if fixed is not None:
        return fixed
    if pad and h is not None and len(h):
        # the largest output of any image (sizes of non-fixed plans do not depend on the draws)
        plan = pipeline.plan(h, w, np.zeros((len(h), max(pipeline.draws, 1))))
        return int(plan.size[:, 0].max()), int(plan.size[:, 1].max())
    if h is not None and len(h) and (h == h[0]).all() and (w == w[0]).all():
        return pipeline.output_size(int(h[0]), int(w[0]))
    if pad:
        raise ConfigError(f"{ds.path}: Targets(pad=True) needs the image sizes a packed dataset stores; pack "
                          f"the data first (stoker pack SRC OUT)")
    raise ConfigError(f"{ds.path}: images differ in size and the transforms do not end in a fixed "
                      f"size, so they cannot be batched; end the transforms with RandomResizedCrop(size), "
                      f"CenterCrop(size) or Resize((height, width)), or {'pass' if h is not None else 'pack them (stoker.pack) and pass'} "
                      f"targets=stoker.Targets(pad=True) to batch them padded with their sizes")



def route_of(asked: Asked, spec: RenderSpec, ds: Dataset, opts: DeviceOptions | None, decoder: DecoderProbe) -> Route:
    """The route of `spec`'s rows with device options `opts` (`loading.route.decide`): the plan's own, and
    that of a pass moved to another device (`Loader.iter_on`)."""
    return decide(spec, ds, decode="cpu" if opts is None else opts.decode,
                  gpu_share=None if opts is None else opts.gpu_share, processes=asked.workers.processes,
                  stage=_stage(asked, opts), decoder=lambda: decoder(opts))


def _stage(asked: Asked, opts: DeviceOptions | None) -> str:
    """What the device stage does with a finished batch, in a few words."""
    batch = asked.pipeline.batch
    ops = [] if batch is None else [type(op).__name__ for op in batch.ops] + (["Mixup"] if batch.mix else [])
    if asked.output == NUMPY:
        return "none (NumPy arrays in host memory)"
    if opts is None:
        return "none (uint8 batches in host memory" + (f"; {', '.join(ops)} on the CPU" if ops else "") + ")"
    steps = [f"to {opts.device}", *ops]
    if opts.normalize is not None:
        steps.append("normalize")
    if opts.dtype is not None:
        steps.append(str(opts.dtype).replace("torch.", ""))
    return " + ".join(steps)
