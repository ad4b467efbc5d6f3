"""What a finished slot becomes: the batch handed out, on the device thread or the caller's.

`DeviceBuilder` is what the Loader's device thread runs on each finished slot, on the copy stream:
upload the uint8 batch, decode its JPEGs on the GPU (CPU fallback per sample, through the render
stage), run the pipeline's batch ops (batched augmentations, Normalize, RandomErasing, Mixup:
`handout.run_batch_ops`), convert. Its labels, extras and batch ops are the handout's (`loading.handout`),
as are the batches of a Loader without a device stage.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .._torch import torch
from .stage import DeviceStage, convert, storages_on
from ..loading.handout import batch_extras, labels_of, run_batch_ops
from ..loading.jobs import cpu_rows, slot_jobs
from ..loading.kinds import fold_rows, unfold_rows
from ..loading.render import EpochChain
from ..loading.slots import Slot
from ..loading.stats import LoaderStats, WorkerTimes
from ..transforms.mixing import check_class_labels

_log = logging.getLogger("stoker.loader")


class DeviceBuilder:
    """The device thread's work on one finished slot (inside the copy stream's context): upload the
    pinned batch, decode its JPEGs on the GPU (decode="gpu"), convert. Holds no reference to the
    iterator, so an abandoned iterator can be collected."""

    def __init__(self, stage: DeviceStage, decoder: Any, chain: EpochChain, lock: threading.RLock,
                 stats: LoaderStats) -> None:
        self.stage = stage  # the loader's copy stream and its options
        self.opts = stage.opts
        self.gpu = decoder  # a gpu_decode.GpuBatchDecoder, or None (decode="cpu")
        self.chain, self.lock, self.stats = chain, lock, stats
        self.encode = chain.multi_label
        self.scratch: dict = {}
        self.times = WorkerTimes()
        self.working: dict[int, int] = {}  # the last build's working tensors on the device (measure)

    def __call__(self, slot: Slot) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        n, stage = slot.size, self.stage
        floats, slot.floats = slot.floats, None   # the engine's float output (RenderSpec.floats): converted
        if floats is not None:
            x = floats[:n]
        elif self.gpu is not None:
            # the GPU decode writes every JPEG row: only the rows rendered on the CPU cross the bus
            # (all of a 256x224x224 batch would be 38.5 MB), into a batch allocated on the device
            x = torch.empty(slot.images[:n].shape, dtype=slot.images.dtype, device=self.opts.device)
            jobs = slot_jobs(slot, n)   # the rows the workers left for the GPU, in row order
            self._upload_rows(slot, x, cpu_rows(n, jobs))
        else:
            # on the CPU `.to()` would return the slot itself, which the workers are about to refill
            x = stage.upload(slot.images[:n]) if self.opts.is_cuda else slot.images[:n].clone()
        labels, extras = self._host_items(slot)
        x, lead = fold_rows(x)   # clips: converted as B x T images, then regrouped
        # past this fence the GPU no longer reads the pinned slot: the workers may refill it while the
        # GPU decodes and converts (the JPEG bytes of GpuJobs are private copies, not slot memory)
        reusable = stage.fence()
        if self.gpu is not None and self._decode_on_gpu(slot, x, jobs):
            # CPU fallback rows were copied from the slot after that fence, and on_error="skip" may have
            # replaced a sample, label and extras included
            labels, extras = self._host_items(slot)
            reusable = stage.fence()
        spec = self.chain.spec
        if floats is not None:
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
        images = unfold_rows(images, lead)
        batch: tuple = (images, labels)
        if extras is not None:   # extra columns, and the sizes of padded images
            batch += (extras,)
        self.working = storages_on(x, self.opts.device)   # the upload / GPU decode target
        self.stats.device_s += time.perf_counter() - t0
        return batch, reusable

    def measure(self, batch: Any) -> tuple[int, int]:
        """(bytes of device memory `batch` holds, bytes of the working tensors its build also held):
        the storages of the tensors, each counted once (LoaderStats.device_bytes)."""
        held = storages_on(batch, self.opts.device)
        return sum(held.values()), sum(n for ptr, n in self.working.items() if ptr not in held)

    def _host_items(self, slot: Slot) -> tuple[Any, dict[str, Any] | None]:
        """The slot's labels and third batch item (extras), on the device where they are tensors.
        Read before the slot's reuse fence: their uploads are copies from the slot too."""
        extras = batch_extras(slot, self.stage.upload if self.opts.is_cuda else None) if slot.extras else None
        return self._labels(slot), extras

    def _labels(self, slot: Slot) -> Any:
        labels = labels_of(slot, self.encode, copy=not self.opts.is_cuda)   # the upload copies
        if not self.opts.is_cuda or not isinstance(labels, torch.Tensor):
            return labels
        batch_ops = self.chain.spec.pipeline.batch
        if batch_ops is not None and batch_ops.mix is not None and not labels.dtype.is_floating_point:
            # Mixup's label range check, here on the host: on the GPU it would read the labels back (a sync)
            check_class_labels(labels, batch_ops.mix.num_classes)
        return self.stage.upload(labels)

    @staticmethod
    def _upload_rows(slot: Slot, x: torch.Tensor, rows: list[int]) -> None:
        """Copy `rows` of the slot's images into `x` (on the device), one asynchronous copy per run of
        consecutive rows."""
        start = 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1:
                end += 1
            a, b = rows[start], rows[end - 1] + 1
            x[a:b].copy_(slot.images[a:b], non_blocking=True)
            start = end

    def fallback(self, slot: Slot, x: torch.Tensor, failed: list) -> None:
        """The CPU path for each (job, exception) the GPU could not decode: rendered into the slot (or
        raised or replaced, as for any failure), then copied into `x`."""
        for job, exc in failed:
            _log.info("GPU decode failed for %r, decoding it on the CPU: %s", job.key, exc)
            self.chain.fill(slot.plan, job.row, slot, self.scratch, self.times, gpu=False)
            self._upload_rows(slot, x, [job.row])

    def _decode_on_gpu(self, slot: Slot, x: torch.Tensor, jobs: list) -> int:
        """Decode the slot's GpuJobs into `x` (NHWC on the device); returns how many rows fell back to
        the CPU (rendered into the slot, then copied from it)."""
        failed = self.gpu.run(jobs, x.permute(0, 3, 1, 2)) if jobs else []
        self.fallback(slot, x, failed)
        with self.lock:
            self.stats.add(self.times, 0)
            self.stats.gpu_decoded += len(jobs) - len(failed)
            self.stats.gpu_fallbacks += len(failed)
            self.stats.gpu_decoder = self.gpu.decoder.name
        return len(failed)
