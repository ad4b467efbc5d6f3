"""What a finished slot becomes: the batch handed out, on the device thread.

`DeviceBuilder` is what the Loader's device thread runs on each finished slot, on the copy stream:
upload the uint8 batch, then one `finish` for every output: the pipeline's batch ops (batched
augmentations, Normalize, RandomErasing, Mixup: `handout.run_batch_ops`), convert. The GPU columns'
pipeline (`gpu_pipeline.PipelinedBuilder`) decodes its rows into the batch and finishes it the same way. Its labels, extras and batch ops are the handout's (`loading.handout`),
as are the batches of a Loader without a device stage.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from .._torch import torch
from .stage import DeviceStage, convert, storages_on
from ..loading.handout import batch_extras, labels_of, run_batch_ops
from ..loading.kinds import fold_rows, unfold_rows
from ..loading.render import EpochChain
from ..loading.slots import Slot
from ..loading.stats import LoaderStats, WorkerTimes
from ..transforms.mixing import check_class_labels

_log = logging.getLogger("stoker.loader")


class DeviceBuilder:
    """The device thread's work on one finished slot (inside the copy stream's context): upload the
    pinned batch, then `finish` it (batch ops, convert). The GPU columns' pipeline (`gpu_pipeline`) uploads
    only the CPU's rows and finishes through the same `finish`. Holds no reference to the iterator, so an
    abandoned iterator can be collected."""

    def __init__(self, stage: DeviceStage, chain: EpochChain, lock: threading.RLock, stats: LoaderStats) -> None:
        self.stage = stage  # the loader's copy stream and its options
        self.opts = stage.opts
        self.chain, self.lock, self.stats = chain, lock, stats
        self.encode = chain.multi_label
        self.cuda = self.opts.is_cuda   # read per batch: an attribute, not the property's call
        self.scratch: dict = {}
        self.times = WorkerTimes()
        self.working: dict[int, int] = {}  # the last build's working tensors on the device (measure)

    def __call__(self, slot: Slot) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        n, stage = slot.size, self.stage
        floats, slot.floats = slot.floats, None   # the engine's float output (engine.FloatOut): converted
        if floats is not None:
            x = floats[:n]
        else:
            # on the CPU `.to()` would return the slot itself, which the workers are about to refill
            x = stage.upload(slot.images[:n]) if self.opts.is_cuda else slot.images[:n].clone()
        labels, extras = self.host_items(slot)
        # past this fence the GPU no longer reads the pinned slot: the workers may refill it
        reusable = stage.fence()
        batch = self.finish(slot, x, labels, extras, converted=floats is not None)
        self.stats.device_s += time.perf_counter() - t0
        return batch, reusable

    def finish(self, slot: Slot, x: torch.Tensor, labels: Any, extras: Any, converted: bool = False,
               working: dict[int, int] | None = None) -> tuple:
        """The batch handed out from the uint8 NHWC rows `x` on the device (or the engine's float output,
        `converted`): the pipeline's batch ops (`handout.run_batch_ops`), then `convert` to the asked dtype
        and layout; clips folded into images for both and regrouped after. `working`: the storages the
        build worked in (`measure`), where the caller knows them (the GPU pipeline's ring buffer)."""
        lead = None
        if x.ndim != 4:   # clips: converted as B x T images, then regrouped
            x, lead = fold_rows(x)
        spec = self.chain.spec
        if converted:
            images = x
        elif spec.pipeline.batch is None:
            images = convert(x, self.opts, layout="nhwc")
        else:
            filler, b = self.chain.locate(slot.batch)
            x, labels = run_batch_ops(spec, x, labels, filler.epoch, b)
            # a batch Normalize already made float32; convert() reads floats as 0..1 units, so only lay out
            done = x.dtype.is_floating_point and self.opts.dtype == torch.uint8
            images = x.contiguous(memory_format=self.opts.memory_format) if done else convert(x, self.opts,
                                                                                               layout="nchw")
        self.working = storages_on(x, self.opts.device) if working is None else working
        batch: tuple = (images if lead is None else unfold_rows(images, lead), labels)
        return batch + (extras,) if extras is not None else batch   # extra columns, the sizes of padded images

    def measure(self, batch: Any) -> tuple[int, int]:
        """(bytes of device memory `batch` holds, bytes of the working tensors its build also held):
        the storages of the tensors, each counted once (LoaderStats.device_bytes)."""
        held = storages_on(batch, self.opts.device)
        return sum(held.values()), sum(n for ptr, n in self.working.items() if ptr not in held)

    def host_items(self, slot: Slot) -> tuple[Any, dict[str, Any] | None]:
        """The slot's labels and third batch item (extras), on the device where they are tensors.
        Read before the slot's reuse fence: their uploads are copies from the slot too."""
        extras = batch_extras(slot, self.stage.upload if self.cuda else None) if slot.extras else None
        return self._labels(slot), extras

    def _labels(self, slot: Slot) -> Any:
        if slot.labels is not None and not self.cuda:   # `labels_of`'s own copy, inlined: it runs per batch
            return slot.labels[:slot.size].clone()
        labels = labels_of(slot, self.encode, copy=not self.cuda)   # the upload copies
        if not self.cuda or not isinstance(labels, torch.Tensor):
            return labels
        batch_ops = self.chain.spec.pipeline.batch
        if batch_ops is not None and batch_ops.mix is not None and not labels.dtype.is_floating_point:
            # Mixup's label range check, here on the host: on the GPU it would read the labels back (a sync)
            check_class_labels(labels, batch_ops.mix.num_classes)
        return self.stage.upload(labels)

    @staticmethod
    def upload_rows(slot: Slot, x: torch.Tensor, rows: list[int]) -> None:
        """Copy `rows` (ascending) of the slot's images into `x` (on the device), one asynchronous copy per
        run of consecutive rows; the runs found in NumPy, not row by row."""
        if not rows:
            return
        r = np.asarray(rows, np.int64)
        cut = np.flatnonzero(r[1:] != r[:-1] + 1) + 1
        images = slot.images
        for a, b in zip(r[np.r_[0, cut]].tolist(), (r[np.r_[cut - 1, len(r) - 1]] + 1).tolist()):
            x[a:b].copy_(images[a:b], non_blocking=True)

    def fallback(self, slot: Slot, x: torch.Tensor, failed: list) -> None:
        """The Python path for each (job, exception) the GPU could not decode: rendered into the slot (or
        raised or replaced, as for any failure), then copied into `x`."""
        for job, exc in failed:
            _log.info("GPU decode failed for %r, decoding it on the CPU: %s", job.key, exc)
            self.chain.fill(slot.plan, job.row, slot, self.scratch, self.times)
            self.upload_rows(slot, x, [job.row])
