"""Decode + augment: one sample into its row of a batch, and the device stage's work on a batch.

Both get what they need handed to them: a frozen `RenderSpec` (batch size, output size, transforms,
seed, on_error, the stored sizes and labels) plus the objects they work with (the dataset, the stats,
the device stage, the GPU decoder). Nothing here reaches back into the Loader that made them.

`Filler` is what the worker threads run: plan a batch in one vectorised step (sample order,
per-sample random draws, crop boxes from the stored image sizes, labels), then read, decode at the
smallest DCT scale the crop allows, crop, resize and flip each sample straight into its row of a
(pinned) ring slot, or replace it deterministically under on_error="skip". With decode="gpu" a JPEG
row becomes a `GpuJob` instead, left for the device thread.

`DeviceBuilder` is what the Loader's device thread runs on each finished slot, on the copy stream:
upload the uint8 batch, decode its JPEGs on the GPU (CPU fallback per sample), run the pipeline's
batch ops (batched augmentations, Normalize, RandomErasing, Mixup: `run_batch_ops`), convert.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ._torch import torch
from . import codecs
from .device import DeviceStage, convert
from .errors import DatasetError, SampleError, UserTransformError
from .gpu_decode import GpuJob
from .labels import MultiLabel
from .order import TAG_DRAW, replacement_index, sample_keys, uniforms
from .reader import CachedDataset, Dataset, PackedDataset
from .slots import LoaderStats, Slot, WorkerTimes
from .transforms import (CropWindow, Pipeline, Plan, apply_tail, crop_window, decode_minimums, resize_window_into,
                         run_user_op)
from .transforms.mixing import check_class_labels
from .transforms.targets import boxes_through, mask_through, polygons_through, stack_label_maps

# one warning per skipped sample, with its reason, on the Loader's logger: the name users configure
_log = logging.getLogger("stoker.loader")
MAX_REPLACEMENTS = 16  # on_error="skip": replacement samples tried before giving up on a position


@dataclass(frozen=True)
class RenderSpec:
    """What decode + augment needs to know, fixed when the Loader is made (arrays are never written)."""

    batch_size: int
    output_size: tuple[int, int]  # (height, width) of every batch row, pixels
    pipeline: Pipeline
    seed: int
    on_error: str  # "raise" or "skip"
    columns: tuple[str, ...]  # extra dataset columns delivered with each batch
    labels: np.ndarray  # one per sample (a private copy for numeric labels)
    heights: np.ndarray | None  # stored image sizes, pixels; None when known only after reading (loose files)
    widths: np.ndarray | None
    gpu_decode: bool = False  # decode="gpu": JPEG rows become GpuJobs for the device thread
    decode_quality: str = "accurate"  # "fast": libjpeg-turbo's fast IDCT and plain chroma upsampling
    multi_label: MultiLabel | None = None  # turns a batch of label lists into one tensor (multi-label data)
    key_by_draw: bool = False  # weighted sampling: random streams per draw, so a repeated sample gets new crops
    members: np.ndarray | None = None  # indices=: a failed sample's stand-in comes from these only
    box_columns: tuple[str, ...] = ()  # extra columns of boxes (x0, y0, x1, y1 as fractions) that follow the crop
    #: extra columns of polygons (with their `_points` and `_box` companions) filled as instance masks
    mask_columns: tuple[str, ...] = ()
    #: binary extra columns of label-map PNGs (class ids per pixel) resampled as masks, batched [B, H, W]
    label_map_columns: tuple[str, ...] = ()
    ignore_index: int = 255  # label maps: the id where the geometry pads (outside the image)
    #: images of different output sizes go top-left into rows of `output_size` (the largest), zero-padded;
    #: each batch's third item then holds "sizes", int64 [B, 2] (height, width) of each image
    pad: bool = False


@dataclass
class BatchPlan:
    indices: np.ndarray  # dataset index per row
    positions: np.ndarray  # position in this rank's epoch list
    keys: np.ndarray  # uint64 random-stream key per row
    u: np.ndarray  # uniform draws [rows, pipeline.draws]
    geometry: Plan | None  # None when image sizes are only known after reading (loose files)


class Filler:
    """The per-pass work: plan a batch, render one sample. Shared by the worker threads; it holds
    no reference to the iterator, so an abandoned iterator can be collected."""

    def __init__(self, spec: RenderSpec, dataset: Dataset, epoch: int, indices: np.ndarray, first_sample: int) -> None:
        self.spec = spec
        self.gpu = spec.gpu_decode
        self.ds = dataset
        self.n = len(dataset)
        self.pipe = spec.pipeline
        self.seed, self.epoch = spec.seed, epoch
        self.indices = indices  # this rank's dataset indices for the epoch, in order
        self.first = first_sample  # the pass starts at this position of the epoch's list (a resume)
        self.batch_size = spec.batch_size
        self.heights, self.widths = spec.heights, spec.widths
        self.labels = spec.labels
        self.columns = spec.columns
        self.multi_label = spec.multi_label
        self.on_error = spec.on_error
        self.out_h, self.out_w = spec.output_size
        self.draws = max(self.pipe.draws, 1)
        self.fast = spec.decode_quality == "fast"

    def _geometry(self, idx: np.ndarray, u: np.ndarray) -> Plan | None:
        if self.heights is None:
            return None
        return self.pipe.plan(self.heights[idx], self.widths[idx], u)

    def prepare(self, b: int, slot: Slot) -> BatchPlan:
        lo = self.first + b * self.batch_size
        positions = np.arange(lo, lo + slot.size)
        idx = self.indices[lo:lo + slot.size]
        keys = (sample_keys(self.seed, self.epoch, positions, tag=TAG_DRAW) if self.spec.key_by_draw
                else sample_keys(self.seed, self.epoch, idx))
        u = uniforms(keys, self.draws)
        if slot.labels_np is not None:
            slot.labels_np[:slot.size] = self.labels[idx]
        else:
            slot.objects[:slot.size] = self.labels[idx].tolist()
        slot.extras = {c: [self.ds.extra(int(i), c) for i in idx] for c in self.columns}
        geometry = self._geometry(idx, u)
        if self.spec.pad:
            slot.extras["sizes"] = geometry.size.astype(np.int64)  # a tensor or an array at hand-out
        for c in self.spec.box_columns:
            slot.extras[c] = [self._boxes(v, int(i), geometry, r) for r, (i, v) in enumerate(zip(idx, slot.extras[c]))]
        # masks are filled by the worker threads (fill), from these three columns read here
        for c in self.spec.mask_columns:
            slot.extras[c] = [self._polygons(int(i), c) for i in idx]
        for c in self.spec.label_map_columns:  # decoded by the worker threads (fill)
            slot.extras[c] = LabelMaps([()] * slot.size)
        if self.gpu:
            slot.jobs = [None] * slot.size
        return BatchPlan(idx, positions, keys, u, geometry)

    def _boxes(self, value: Any, idx: int, geometry: Plan, row: int) -> np.ndarray:
        """One sample's boxes (fractions of its stored size) in its output's pixels: float32 [k, 4]."""
        frac = np.asarray(value if value is not None else (), np.float64).reshape(-1, 4)
        w, h = float(self.widths[idx]), float(self.heights[idx])
        return boxes_through(frac * (w, h, w, h), geometry.box[row], geometry.size[row], bool(geometry.flip[row]))

    def _polygons(self, idx: int, column: str) -> tuple:
        """One sample's polygons: (points, lengths, owners, instance count). With boxes, the count is the
        number of boxes of the first box column, so mask rows line up with box rows."""
        lengths = self.ds.extra(idx, column + "_points") or ()
        owners = self.ds.extra(idx, column + "_box") or ()
        if self.spec.box_columns:
            count = len(self.ds.extra(idx, self.spec.box_columns[0]) or ()) // 4
        else:
            count = max(owners, default=-1) + 1
        return self.ds.extra(idx, column) or (), lengths, owners, count

    def _masks(self, polygons: tuple, idx: int, geometry: Plan, row: int) -> np.ndarray:
        """One sample's instance masks uint8 [k, H, W] in its output's pixels."""
        points, lengths, owners, count = polygons
        if len(owners) != len(lengths) or sum(lengths) * 2 != len(points) or max(owners, default=-1) >= count:
            raise ValueError(f"polygon columns disagree: {len(points)} coordinates, {len(lengths)} polygons "
                             f"of {sum(lengths)} vertices, owners up to {max(owners, default=-1)} for {count} "
                             f"instances")
        return polygons_through(points, lengths, owners, count, (self.heights[idx], self.widths[idx]),
                                geometry.box[row], geometry.size[row], bool(geometry.flip[row]))

    def _label_map(self, idx: int, column: str, geometry: Plan, row: int) -> np.ndarray:
        """One sample's label map (class ids [H, W], uint8 or int32) in its output's pixels: the image's
        crop window, nearest neighbour, flipped with it, `ignore_index` where the geometry pads."""
        data = self.ds.extra(idx, column)
        if data is None:
            raise ValueError(f"no label map in column {column!r}")
        ids = codecs.decode_label_map(data, f"label map {column!r}")
        if ids.shape != (self.heights[idx], self.widths[idx]):
            raise ValueError(f"label map {column!r} is {ids.shape[1]}x{ids.shape[0]}, the image "
                             f"{self.widths[idx]}x{self.heights[idx]}; re-pack the dataset")
        if ids.dtype == np.uint8 and self.spec.ignore_index > 255:
            ids = ids.astype(np.int32)
        return mask_through(ids, geometry.box[row], geometry.size[row], bool(geometry.flip[row]),
                            fill=self.spec.ignore_index)

    def fill(self, plan: BatchPlan, row: int, slot: Slot, scratch: dict, times: WorkerTimes,
             gpu: bool | None = None) -> None:
        idx = int(plan.indices[row])
        geo = plan.geometry
        box = _row_box(geo, row)
        try:
            if self.gpu if gpu is None else gpu:
                self.queue_gpu(idx, int(plan.keys[row]), plan.u[row], box, row, slot, scratch, times)
            else:
                self.render(idx, int(plan.keys[row]), plan.u[row], box, slot.images_np[row], scratch, times)
            for c in self.spec.mask_columns:
                if isinstance(slot.extras[c][row], tuple):  # not yet filled (a GPU fallback refills the row)
                    slot.extras[c][row] = self._masks(slot.extras[c][row], idx, geo, row)
            for c in self.spec.label_map_columns:
                if isinstance(slot.extras[c][row], tuple):
                    slot.extras[c][row] = self._label_map(idx, c, geo, row)
        except UserTransformError as exc:  # a bug in the user's code: no data fix, never skipped
            raise self.transform_error(idx, exc) from (exc.__cause__ or exc)
        except Exception as exc:
            if self.on_error == "raise":
                raise self.sample_error(idx, exc) from exc
            self.replace(plan, row, slot, scratch, times, exc)

    def queue_gpu(self, idx: int, key: int, u: np.ndarray, box: tuple | None, row: int, slot: Slot,
                  scratch: dict, times: WorkerTimes) -> None:
        """decode="gpu": leave a JPEG to the device thread (a GpuJob with a writable copy of its bytes);
        anything else is rendered on the CPU now, into the slot."""
        t0 = time.perf_counter()
        s = self.ds.sample(idx)
        t1 = time.perf_counter()
        times.read += t1 - t0
        if s.encoding != "jpeg":
            self.render(idx, key, u, box, slot.images_np[row], scratch, times, sample=s)
            return
        box, size = self._box(s, u, box)
        if size != (self.out_h, self.out_w):
            raise ValueError(f"transforms give {size[0]}x{size[1]} for this {s.height}x{s.width} image, "
                             f"the batch is {self.out_h}x{self.out_w}")
        data = torch.frombuffer(bytearray(s.data), dtype=torch.uint8)  # a copy: the shard mapping stays read-only
        slot.jobs[row] = GpuJob(row, data, tuple(box[0]), box[1], s.height, s.width, s.key)
        times.read += time.perf_counter() - t1

    def _box(self, s: Any, u: np.ndarray, box: tuple | None) -> tuple[tuple, tuple[int, int]]:
        if box is None:  # sizes known only now (loose files): plan this one sample
            p = self.pipe.plan(np.array([s.height]), np.array([s.width]), u[None, :])
            return (p.box[0].tolist(), bool(p.flip[0])), (int(p.size[0, 0]), int(p.size[0, 1]))
        return box, (box[2] if self.spec.pad else (self.out_h, self.out_w))

    def render(self, idx: int, key: int, u: np.ndarray, box: tuple | None, dst: np.ndarray, scratch: dict,
               times: WorkerTimes, sample: Any = None) -> None:
        """Read, decode (only the resolution the crop needs) and transform sample `idx` into `dst`."""
        t0 = time.perf_counter()
        s = self.ds.sample(idx) if sample is None else sample
        t1 = time.perf_counter()
        box, size = self._box(s, u, box)
        region, win = self.decode(s, box[0], size, scratch)
        t2 = time.perf_counter()
        if self.spec.pad:   # this image's own size, top-left in its row; zero the rest (slots are reused)
            dst[size[0]:] = 0
            dst[:size[0], size[1]:] = 0
            dst = dst[:size[0], :size[1]]
        tail = self.pipe.tail
        if not self.pipe.tail_geometric:
            if size != dst.shape[:2]:
                raise ValueError(f"transforms give {size[0]}x{size[1]} for this {s.height}x{s.width} image, "
                                 f"the batch is {dst.shape[0]}x{dst.shape[1]}")
            resize_window_into(region, win, dst, box[1])
            for op in tail:
                out = run_user_op(op, dst, key)
                if out is not dst:
                    self._check_shape(out, dst, op.name)
                    dst[...] = out
        else:
            mid = np.empty((size[0], size[1], 3), np.uint8)
            resize_window_into(region, win, mid, box[1])
            out = apply_tail(tail, self.pipe.offsets[len(self.pipe.prefix):], mid, u, key)
            self._check_shape(out, dst, "the transforms")
            dst[...] = out
        t3 = time.perf_counter()
        times.read += t1 - t0
        times.decode += t2 - t1
        times.augment += t3 - t2

    @staticmethod
    def _check_shape(out: np.ndarray, dst: np.ndarray, what: str) -> None:
        if out.shape != dst.shape:
            raise ValueError(f"{what} returned an array of shape {out.shape}; the batch needs {dst.shape} "
                             f"(every sample must come out the same size)")

    def decode(self, s: Any, box: Sequence[float], size: tuple[int, int],
               scratch: dict) -> tuple[np.ndarray, CropWindow]:
        """The source pixels the crop reads (`win.src` of the image at the decoded scale) and the window.

        A JPEG is decoded at the smallest DCT scale the box allows and, where the region decoder is
        installed, only the box's rectangle of it; its pixels are exactly that rectangle of the whole
        scaled image, so the batch is the same with or without it."""
        if s.encoding == "jpeg":
            h, w = s.height, s.width
            mh, mw = decode_minimums(box, size[0], size[1], h, w)
            n = codecs.jpeg_scale_eighths(h, w, mh, mw)
            sh, sw = math.ceil(h * n / 8), math.ceil(w * n / 8)
            win = crop_window(box, sh, sw, h, w, size[0], size[1])
            y0, y1, x0, x1 = win.src
            region = codecs.decode_jpeg_region(s.data, s.key, height=h, width=w, scale=n, window=win.src,
                                               out=self._scratch(scratch, (y1 - y0) * (x1 - x0) * 3),
                                               fast=self.fast)
            if region is not None:
                return region, win
            img = codecs.decode_rgb(s.data, "jpeg", s.key, height=h, width=w, min_height=mh, min_width=mw,
                                    out=self._scratch(scratch, sh * sw * 3), fast=self.fast)
        else:
            img = codecs.decode_rgb(s.data, s.encoding, s.key, height=s.height, width=s.width)
            if img.shape[:2] != (s.height, s.width):
                raise ValueError(f"decoded size {img.shape[1]}x{img.shape[0]} differs from the stored size "
                                 f"{s.width}x{s.height}; re-pack the dataset")
        # the whole image was decoded (at some scale, or full size by Pillow): cut the window from it
        win = crop_window(box, img.shape[0], img.shape[1], s.height, s.width, size[0], size[1])
        y0, y1, x0, x1 = win.src
        return img[y0:y1, x0:x1], win

    @staticmethod
    def _scratch(scratch: dict, need: int) -> np.ndarray:
        """`need` bytes of this worker's decode buffer, which grows to the largest image once, then stays."""
        buf = scratch.get("decode")
        if buf is None or buf.size < need:
            buf = scratch["decode"] = np.empty(max(need, 1 << 20), np.uint8)
        return buf[:need]

    def replace(self, plan: BatchPlan, row: int, slot: Slot, scratch: dict, times: WorkerTimes,
                first: Exception) -> None:
        """on_error="skip": fill the row with a stand-in chosen only from (seed, epoch, position)."""
        pos = int(plan.positions[row])
        for attempt in range(MAX_REPLACEMENTS):
            members = self.spec.members
            r = (replacement_index(self.seed, self.epoch, pos, attempt, self.n) if members is None else
                 int(members[replacement_index(self.seed, self.epoch, pos, attempt, len(members))]))
            key = sample_keys(self.seed, self.epoch, np.array([r]))
            u = uniforms(key, self.draws)
            geo = self._geometry(np.array([r]), u)
            box = _row_box(geo, 0)
            try:
                self.render(r, int(key[0]), u[0], box, slot.images_np[row], scratch, times)
                maps = {c: self._label_map(r, c, geo, 0) for c in self.spec.label_map_columns}
            except UserTransformError as exc:
                raise self.transform_error(r, exc) from (exc.__cause__ or exc)
            except Exception:
                continue
            if slot.labels_np is not None:
                slot.labels_np[row] = self.labels[r]
            else:
                slot.objects[row] = self.labels[r]
            for c in self.columns:
                slot.extras[c][row] = self.ds.extra(r, c)
                if c in self.spec.box_columns:
                    slot.extras[c][row] = self._boxes(slot.extras[c][row], r, geo, 0)
                elif c in self.spec.mask_columns:
                    slot.extras[c][row] = self._masks(self._polygons(r, c), r, geo, 0)
                elif c in maps:
                    slot.extras[c][row] = maps[c]
            key_, shard, srow = self._describe(int(plan.indices[row]), first)
            times.skipped += 1
            times.skipped_keys.append(key_ or "?")
            _log.warning("on_error='skip': sample %r (shard %s, row %d) replaced by index %d: %s: %s",
                         key_, shard, srow, r, type(first).__name__, first)
            return
        raise self.sample_error(int(plan.indices[row]), first,
                                f"; {MAX_REPLACEMENTS} replacement samples failed as well") from first

    def _describe(self, idx: int, exc: BaseException) -> tuple[str | None, str, int]:
        shard, row = self.ds.location(idx)
        key = getattr(exc, "key", None)
        if key is None and isinstance(self.ds, (PackedDataset, CachedDataset)):
            try:
                key = self.ds.sample(idx).key
            except DatasetError:  # the shard itself is what failed (deleted, truncated): no key to read
                key = None
        return key, shard, row

    def transform_error(self, idx: int, exc: UserTransformError) -> UserTransformError:
        key, shard, row = self._describe(idx, exc)
        return UserTransformError(f"{exc} on sample {key!r} (shard {shard}, row {row}, index {idx}). This is an "
                                  f"error in the transform's code, not in the data: fix {exc.transform} "
                                  f"(on_error='skip' replaces only samples whose data fails)",
                                  transform=exc.transform, key=key, shard=shard, row=row, index=idx)

    def sample_error(self, idx: int, exc: BaseException, extra: str = "") -> SampleError:
        key, shard, row = self._describe(idx, exc)
        notes = "".join(f" ({n})" for n in getattr(exc, "__notes__", ()))  # e.g. which transform raised it
        return SampleError(f"sample {key!r} (shard {shard}, row {row}, index {idx}) failed: "
                           f"{type(exc).__name__}: {exc}{notes}{extra}. Pass on_error='skip' to replace failing "
                           f"samples, or re-pack to drop them", key=key, shard=shard, row=row, index=idx)


class EpochChain:
    """The plan-and-fill functions of a Run whose batches span epochs one after another (a persistent
    Loader goes on into the next epoch): run batch g is batch g - first of its epoch's Filler. Plans
    carry their Filler, so `fill` (and the device thread's CPU fallback) use the right epoch's."""

    def __init__(self, spec: RenderSpec) -> None:
        self.spec = spec  # the same for every epoch (so are its columns and multi-label encoding)
        self.columns = spec.columns
        self.multi_label = spec.multi_label
        self.fillers: list[Filler] = []
        self.firsts: list[int] = []  # run batch index of each Filler's first batch, increasing

    def add(self, filler: Filler, first: int) -> None:
        """Batches from run batch `first` on belong to `filler` (call under the run's lock)."""
        self.fillers.append(filler)
        self.firsts.append(first)

    def prepare(self, g: int, slot: Slot) -> tuple[Filler, BatchPlan]:
        k = bisect.bisect_right(self.firsts, g) - 1
        filler = self.fillers[k]
        return filler, filler.prepare(g - self.firsts[k], slot)

    def locate(self, g: int) -> tuple[Filler, int]:
        """Run batch g's Filler and its batch index within that Filler's epoch."""
        k = bisect.bisect_right(self.firsts, g) - 1
        filler = self.fillers[k]
        return filler, filler.first // filler.batch_size + g - self.firsts[k]

    def fill(self, plan: tuple[Filler, BatchPlan], row: int, slot: Slot, scratch: dict, times: WorkerTimes,
             gpu: bool | None = None) -> None:
        filler, batch_plan = plan
        filler.fill(batch_plan, row, slot, scratch, times, gpu)


class LabelMaps(list):
    """A batch's label maps (one per row, filled by the worker threads); `batch_extras` stacks them
    into one tensor when their sizes agree."""


def _row_box(geometry: Plan | None, row: int) -> tuple | None:
    """One row of a plan as (box, flip, (height, width)) in Python numbers (cheaper per sample)."""
    if geometry is None:
        return None
    return geometry.box[row].tolist(), bool(geometry.flip[row]), (int(geometry.size[row, 0]),
                                                                  int(geometry.size[row, 1]))


def batch_extras(slot: Slot, upload: Any = None) -> dict[str, Any]:
    """The third batch item: extra columns as lists, the padded images' sizes as a tensor (uploaded
    with `upload` when given)."""
    out: dict[str, Any] = {}
    for c, v in slot.extras.items():
        if isinstance(v, LabelMaps):
            v = stack_label_maps(v)
        elif isinstance(v, np.ndarray):   # pad=True's sizes
            v = torch.from_numpy(v)
        out[c] = (upload(v) if upload else v) if isinstance(v, torch.Tensor) else list(v)
    return out


def run_batch_ops(spec: RenderSpec, images: torch.Tensor, labels: Any, epoch: int, batch: int) -> tuple[Any, Any]:
    """The pipeline's batch ops on one batch (NHWC in, NCHW out), their draws keyed by (seed, epoch,
    batch index of the epoch); with a Mixup the labels come back as soft targets [B, num_classes]."""
    ops = spec.pipeline.batch
    if ops.mix is not None and not isinstance(labels, torch.Tensor):
        raise SampleError(f"Mixup needs numeric class labels, batch {batch} of epoch {epoch} has "
                          f"{type(labels[0]).__name__} labels; drop the Mixup or pack integer labels")
    out = ops(images.permute(0, 3, 1, 2), labels if ops.mix is not None else None, epoch=epoch, batch=batch,
              seed=spec.seed)
    return out if isinstance(out, tuple) else (out, labels)


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

    def __call__(self, slot: Slot) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        n, stage = slot.size, self.stage
        # on the CPU `.to()` would return the slot itself, which the workers are about to refill
        x = stage.upload(slot.images[:n]) if self.opts.is_cuda else slot.images[:n].clone()
        labels, extras = self._host_items(slot)
        # past this fence the GPU no longer reads the pinned slot: the workers may refill it while the
        # GPU decodes and converts (the JPEG bytes of GpuJobs are private copies, not slot memory)
        reusable = stage.fence()
        if self.gpu is not None and self._decode_on_gpu(slot, x):
            # CPU fallback rows were copied from the slot after that fence, and on_error="skip" may have
            # replaced a sample, label and extras included
            labels, extras = self._host_items(slot)
            reusable = stage.fence()
        spec = self.chain.spec
        if spec.pipeline.batch is None:
            images = convert(x, self.opts, layout="nhwc")
        else:
            filler, b = self.chain.locate(slot.batch)
            x, labels = run_batch_ops(spec, x, labels, filler.epoch, b)
            # a batch Normalize already made float32; convert() reads floats as 0..1 units, so only lay out
            done = x.dtype.is_floating_point and self.opts.dtype == torch.uint8
            images = x.contiguous(memory_format=self.opts.memory_format) if done else convert(x, self.opts,
                                                                                               layout="nchw")
        batch: tuple = (images, labels)
        if extras is not None:   # extra columns, and the sizes of padded images
            batch += (extras,)
        self.stats.device_s += time.perf_counter() - t0
        return batch, reusable

    def _host_items(self, slot: Slot) -> tuple[Any, dict[str, Any] | None]:
        """The slot's labels and third batch item (extras), on the device where they are tensors.
        Read before the slot's reuse fence: their uploads are copies from the slot too."""
        extras = batch_extras(slot, self.stage.upload if self.opts.is_cuda else None) if slot.extras else None
        return self._labels(slot), extras

    def _labels(self, slot: Slot) -> Any:
        n, stage = slot.size, self.stage
        if slot.labels is None and self.encode is not None:  # multi-label rows -> one tensor
            labels = self.encode(slot.objects[:n])
            return stage.upload(labels) if self.opts.is_cuda and isinstance(labels, torch.Tensor) else labels
        if slot.labels is None:
            return list(slot.objects[:n])
        if not self.opts.is_cuda:
            return slot.labels[:n].clone()
        batch_ops = self.chain.spec.pipeline.batch
        if batch_ops is not None and batch_ops.mix is not None and not slot.labels.dtype.is_floating_point:
            # Mixup's label range check, here on the host: on the GPU it would read the labels back (a sync)
            check_class_labels(slot.labels[:n], batch_ops.mix.num_classes)
        return stage.upload(slot.labels[:n])

    def _decode_on_gpu(self, slot: Slot, x: torch.Tensor) -> int:
        """Decode the slot's GpuJobs into `x` (NHWC on the device); returns how many rows fell back to
        the CPU (rendered into the slot, then copied from it)."""
        jobs = [j for j in slot.jobs[:slot.size] if j is not None]
        failed = self.gpu.run(jobs, x.permute(0, 3, 1, 2)) if jobs else []
        for job, exc in failed:  # the CPU path for this sample: raise or replace, as for any failure
            _log.info("GPU decode failed for %r, decoding it on the CPU: %s", job.key, exc)
            self.chain.fill(slot.plan, job.row, slot, self.scratch, self.times, gpu=False)
            x[job.row].copy_(slot.images[job.row], non_blocking=True)
        with self.lock:
            self.stats.add(self.times, 0)
            self.stats.gpu_decoded += len(jobs) - len(failed)
            self.stats.gpu_fallbacks += len(failed)
            self.stats.gpu_decoder = self.gpu.decoder.name
        return len(failed)
