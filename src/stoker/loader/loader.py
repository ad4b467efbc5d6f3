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

The Loader only glues: it resolves its option values (`options`) once into a frozen `plan.LoadPlan`
(`plan.ask`, then `plan.resolve` with the opened dataset: the one place that refuses combinations),
and each `iter()` asks `passes.Passes` for a whole pass, which reports where the data stands to the
Loader's `Cursor`; none of the stages calls back.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .._torch import torch
from ..device.stage import DeviceOptions
from .state import check_state
from ..errors import ConfigError
from ..loading.route import Route
from ..loading.stats import LoaderStats
from ..order import samples_per_rank
from ..dataset import Dataset
from ..mix import Mix
from .habits import (EpochSampler, check_image_folder, check_source, dataloader_keywords, follow_set_epoch,
                     image_folder)
from .open import open_for_loading
from .options import Sampling, Storage, Targets, Workers
from .passes import Cursor, GpuDecoders, Passes
from .plan import LoadPlan, ask, resolve

__all__ = ["Loader", "LoaderStats", "Sampling", "Storage", "Targets", "Workers"]

_STATE_FORMAT = "stoker.Loader/1"


class Loader:
    """Batches of decoded, augmented images from a packed dataset, an ImageFolder tree or a file list.

    Each `iter()` is a whole pass of the current epoch (an early stop does not shorten the next one;
    `load_state_dict()` is the only way to start part-way). Each step yields `(images, labels)`:
    images `uint8 [B, 3, H, W]`, a channels_last view of a pinned ring slot that stays valid as long
    as it is held; labels `int64 [B]` (float64 for float labels, a list for string labels, multi-hot
    or soft targets per `Targets`), always fresh; plus `{column: values}` as a third item when
    `columns` names extra columns (or `Targets` asks for boxes, masks, sizes).

    `source`: a packed folder or URL (``s3://...``), an unpacked source `stoker pack` reads, a
    `stoker.Dataset`, or a torchvision `ImageFolder` (read as its folder, its transform and labels kept). `transforms`: one transform, a list or a Compose-like object (docs/transforms.md).
    `order`, `seed`: the two `Sampling` fields kept at hand. The rest are option values, each frozen,
    checked where it is made and usable alone (`stoker.loader.options`): `sampling=Sampling(...)` (order,
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

    def __init__(self, source: str | Path | Dataset | Mix, batch_size: int, *, transforms: Sequence[Any] | None = None,
                 order: str | None = None, seed: int | None = None, sampling: Sampling | None = None,
                 device: str | int | torch.device | DeviceOptions | None = None, columns: Sequence[str] = (),
                 targets: Targets | None = None, storage: Storage | None = None,
                 workers: Workers | int | None = None, **dataloader: Any) -> None:
        loose = dataloader_keywords(dataloader)   # DataLoader's keywords, as fields of the option values
        given, (source, transforms) = source, image_folder(source, transforms, loose)   # DataLoader's dataset
        if not isinstance(source, Mix):
            check_source(source)
        asked = ask(source, batch_size, transforms=transforms, order=order, seed=seed, sampling=sampling,
                    device=device, columns=columns, targets=targets, storage=storage, workers=workers, loose=loose)
        self._opened = open_for_loading(source, asked.storage, rank=asked.rank, world_size=asked.world_size,
                                        timeout=asked.workers.timeout)
        self.dataset = self._opened.dataset
        check_image_folder(given, self.dataset)
        try:
            decoders = GpuDecoders()   # the route's GPU decoder probe; a missing library named when the Loader is made
            self.plan: LoadPlan = resolve(asked, self.dataset, decoders.probe)
            self.stats = LoaderStats(route=self.plan.route, gpu_split=self.plan.route.cpu_only)
            # where the data stands (the epoch, the samples of it yielded), written by the passes
            self._cursor = Cursor()
            self._passes = Passes(self.plan, self.dataset, self.stats, self._cursor, decoders)
        except BaseException:
            self.close()
            raise
        #: what DataLoader users and trainers read from a loader's sampler: len, set_epoch, the epoch's indices
        self.sampler = EpochSampler(self)
        #: restored by `load_state_dict` (a sampler's set_epoch then leaves the position standing,
        #: `habits.move_to_epoch`) until `set_epoch` moves it
        self.restored = self._sampler_warned = False
        if dataloader.get("sampler") is not None:
            follow_set_epoch(dataloader["sampler"], self)

    #: DataLoader's attribute, for the code that reads it beside `sampler` (Lightning does): None, stoker
    #: makes its batches itself (`batch_size`, `drop_last`)
    batch_sampler = None

    # what the plan fixed, read where it lives
    sampling = property(lambda self: self.plan.asked.sampling, doc="The Sampling options (merged).")
    workers = property(lambda self: self.plan.asked.workers, doc="The Workers options (merged).")
    targets = property(lambda self: self.plan.asked.targets, doc="The Targets options (merged).")
    storage = property(lambda self: self.plan.asked.storage, doc="The Storage options.")
    pipeline = property(lambda self: self.plan.asked.pipeline, doc="The compiled transforms.")
    columns = property(lambda self: self.plan.asked.columns, doc="Extra columns in each batch's third item.")
    device = property(lambda self: self.plan.device, doc="The DeviceOptions; None: batches in host memory.")
    output = property(lambda self: self.plan.output, doc='What the batches are: "torch" or "numpy".')
    batch_size = property(lambda self: self.plan.batch_size, doc="Samples per batch.")
    seed = property(lambda self: self.plan.seed, doc="The seed of the order and the augmentations.")
    order = property(lambda self: self.plan.order, doc="The epoch order's name.")
    drop_last = property(lambda self: self.plan.epochs.drop_last, doc="Whether a short last batch is dropped.")
    rank = property(lambda self: self.plan.epochs.rank, doc="This process's rank.")
    world_size = property(lambda self: self.plan.epochs.world_size, doc="The number of ranks.")
    clips = property(lambda self: self.plan.kind.options, doc="A video pack's clip options; None for images.")
    output_size = property(lambda self: self.plan.output_size, doc="(height, width) of every image.")
    num_threads = property(lambda self: self.plan.num_threads, doc="Worker threads.")
    prefetch = property(lambda self: self.plan.prefetch, doc="Batches prepared ahead.")
    persistent = property(lambda self: self.plan.persistent, doc="Whether threads run on into the next epoch.")
    pin_memory = property(lambda self: self.plan.pin_memory, doc="Whether the ring's slots are pinned.")
    processes = property(lambda self: self.plan.processes, doc="Worker processes (0: threads in this one).")
    timeout = property(lambda self: self.plan.timeout, doc="Seconds a batch may take before a timeout.")
    collate_fn = property(lambda self: self.plan.collate, doc="The user's batching of the extra columns.")

    @property
    def classes(self) -> list[str] | None:
        """The class names (label k is classes[k]): `classes=` when given, else the dataset's."""
        return list(self.plan.classes) if self.plan.classes is not None else self.dataset.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label, as torchvision's ImageFolder has it."""
        return {name: k for k, name in enumerate(self.classes or ())}

    # ---- epochs and state ------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self.plan.epochs.batches(self.epoch)
    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration reads."""
        return self._cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` from its start on the next `iter()`. Without calls, an `iter()` after a
        finished pass reads the next epoch, and one after a pass left part-way reads its epoch again
        from the start."""
        self._requeue(epoch, None)
        self._cursor.move(epoch)
        self.restored = False

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
                **self.plan.epochs.progress(epoch, sample),
                "seed": self.seed, "batch_size": self.batch_size, "world_size": self.world_size,
                "num_samples": len(self.dataset), "order": self.order, "drop_last": self.drop_last,
                "pool": self.plan.epochs.pool.fingerprint,
                **self.plan.kind.state(),   # a video pack's clips
                **({"buckets": repr(self.plan.spec.buckets.sizes)} if self.plan.spec.buckets is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next `iter()` (only that one) yields exactly the samples of `state`'s epoch not
        yet yielded.
        A different `batch_size` is allowed with `drop_last=False` (the samples left are the same;
        only their grouping into batches changes); so is a different world size (elastic: what is left
        of the epoch over all ranks, `remaining`, is split over the new ranks; docs/loader.md);
        everything else must match."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ConfigError(f"not a stoker Loader state (expected format {_STATE_FORMAT!r}): {state!r:.200}")
        check_state(state)
        mine = self.state_dict()
        elastic = state.get("remaining") is not None and mine.get("remaining") is not None and (
            state.get("world_size") != self.world_size or bool(state.get("requeued")))
        keys = ["seed", "num_samples", "order", "drop_last", "pool"] + ([] if elastic else ["world_size"])
        keys += list(self.plan.kind.state())   # a video pack: which clips an epoch holds
        if "buckets" in mine or "buckets" in state:   # aspect buckets: the same buckets lay the epoch out
            keys.append("buckets")
        if self.drop_last or "buckets" in mine:  # which samples an epoch drops (or repeats) depends on the batch size
            keys.append("batch_size")
        diff = {k: (state.get(k), mine[k]) for k in keys if state.get(k) != mine[k]}
        if diff:
            hint = ("; build the Loader with the saved settings to resume exactly"
                    + (" (a new batch_size can resume only with drop_last=False: with drop_last=True the "
                       "samples an epoch leaves out depend on it)" if "batch_size" in diff else "")
                    + (f" (order={self.order!r}{' with clips_per_video > 1' if self.plan.epochs.per_item > 1 else ''} "
                       "lays an epoch out per world size, so it resumes on the saved number of ranks only)"
                       if "world_size" in diff and mine.get("remaining") is None else ""))
            raise ConfigError("the saved loader state does not match this Loader (saved, now): "
                              + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in diff.items()) + hint)
        epoch = int(state["epoch"])
        self._requeue(epoch, state["remaining"] if elastic else None)
        if elastic:   # what no rank has read yet, split over this world from its start
            self._cursor.move(epoch + 1 if self.plan.epochs.samples(epoch) == 0 else epoch)
            self.restored = True
            return
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
        self.restored = True

    def _requeue(self, epoch: int, remaining: Any) -> None:
        """The plan with `epoch` reduced to `remaining` (None: whole epochs again); a persistent pipeline
        running ahead on the old layout is stopped."""
        epochs = self.plan.epochs.resumed(epoch, remaining)
        if epochs.queue is None and self.plan.epochs.queue is None:
            return
        self._passes.stop_live()
        self.plan = replace(self.plan, epochs=epochs)
        self._passes.plan = self.plan

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """Dataset indices this rank reads in `epoch` (default: the current one), in order."""
        return self.plan.epochs.indices(self._cursor.epoch if epoch is None else epoch)

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple]:
        """A whole pass of the current epoch (see docs/loader.md, "Passes")."""
        return self._passes.begin(self.device)

    def iter_on(self, device: str | int | torch.device | DeviceOptions) -> Iterator[tuple]:
        """One pass whose batches arrive on `device` (a device or `DeviceOptions`), for a Loader made
        without `device=`: what `stoker.prefetch(loader, device)` iterates. The ring's pinned memory
        is reused, so the device copy happens here, on the loader's copy stream, before a slot is
        refilled."""
        return self._passes.begin(self.plan.for_device(device))

    def close(self) -> None:
        """Stop any running iteration and release the dataset (when the Loader opened it). Idempotent."""
        passes = getattr(self, "_passes", None)
        if passes is not None:
            passes.close()
        opened = getattr(self, "_opened", None)
        if opened is not None:
            opened.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def data_wait(self, across_ranks: bool | None = None) -> dict[str, Any]:
        """Each step's exposed data wait (time in `next()`) as running figures, readable at any step:
        `data_wait_share` (of the wall time since the first step), `data_wait_ms` and `data_wait_max_ms`
        (over the last 100 steps), `data_wait_steps`; add them to your logger as they are
        (`wandb.log(loader.data_wait())`, or `writer.add_scalar` per key). `across_ranks` (default: where
        torch.distributed is initialised) gathers every rank's figures, one small collective that every
        rank must call at the same step, and adds their max and mean and `slowest_rank`, the rank that
        waited the largest share."""
        mine = self.stats.data_wait()
        dist = torch.distributed if hasattr(torch, "distributed") else None
        ready = dist is not None and dist.is_available() and dist.is_initialized()
        if across_ranks is None:
            across_ranks = ready
        if not across_ranks:
            return mine
        if not ready:
            raise ConfigError("data_wait(across_ranks=True) needs torch.distributed initialised "
                              "(torch.distributed.init_process_group); call data_wait() for this rank's figures")
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out: dict[str, Any] = dict(mine)
        for key in ("data_wait_share", "data_wait_ms", "data_wait_max_ms"):
            values = [float(r[key]) for r in every]
            out[f"{key}_max"], out[f"{key}_mean"] = max(values), sum(values) / len(values)
        out["slowest_rank"] = max(range(len(every)), key=lambda r: every[r]["data_wait_share"])
        return out

    @property
    def route(self) -> Route:
        """How each row becomes pixels (`stoker.loading.route.Route`): decided once, when the Loader was made."""
        return self.plan.route

    def __repr__(self) -> str:
        h, w = self.output_size
        return (f"<stoker.Loader {len(self.dataset)} samples, batch {self.batch_size}, {h}x{w}, "
                f"{self.num_threads} threads, rank {self.rank}/{self.world_size}, epoch {self.epoch}; "
                f"route: {self.plan.route}>")
