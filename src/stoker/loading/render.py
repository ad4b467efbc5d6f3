"""Decode + augment: samples into their rows of a batch.

It gets what it needs handed to it: a frozen `RenderSpec` (batch size, output size, transforms,
seed, on_error, the stored sizes and labels, the target columns) plus the dataset it reads. Nothing
here reaches back into the Loader that made it.

`Filler` is what the worker threads run: plan a batch in one vectorised step (sample order,
per-sample random draws, crop boxes from the stored image sizes, labels), then read, decode at the
smallest DCT scale the crop allows, crop, resize and flip each sample straight into its row of a
(pinned) ring slot, or replace it deterministically under on_error="skip": the Python path of the
route (`route.Route`). Where the route gives the GPU a share, its JPEG rows are left for the device
thread instead, in one call per claim (`jobs.GpuRows`: planned natively, `jobs.RowPlanner`, or from the
batch's plan). Targets (boxes, instance masks, label maps: `transforms.targets`) are read while the
batch is planned and placed in each sample's output by the worker that renders it, through one
protocol (`Target`), whatever their kind.

What a finished slot becomes (the batch ops, the extras, the device thread's work) is
`handout.py`'s and `device/build.py`'s.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from .. import codecs, native
from ..errors import DatasetError, OutputError, SampleError, UserTransformError
from .jobs import RowPlanner, gpu_rows
from .kinds import IMAGES, ImageKind, SampleKind
from .labels import MultiLabel
from .route import Route
from ..order import TAG_CAPTION, TAG_DRAW, TAG_SAMPLE, replacement_index, sample_keys, stream_key, uniforms
from ..dataset import Dataset
from .slots import Slot
from .stats import WorkerTimes
from ..transforms import (Pipeline, Plan, Resampling, apply_tail, decode_minimums,
                         resample_region_into, resampling,
                         run_user_op)
from ..transforms.geometry import cover_crop
from ..transforms.targets import Boxes, InstanceMasks, LabelMap, Placement, Target, TargetRows

# one warning per skipped sample, with its reason, on the Loader's logger: the name users configure
_log = logging.getLogger("stoker.loader")
MAX_REPLACEMENTS = 16  # on_error="skip": replacement samples tried before giving up on a position


@dataclass(frozen=True)
class Bucketed:
    """Aspect-ratio buckets as the workers render them (`stoker.buckets`): each bucket's (height, width),
    its pipeline (the Loader's transforms after the bucket's `CoverCrop`) and engine program, and each
    dataset row's bucket. A batch's rows are all of one bucket."""

    sizes: tuple[tuple[int, int], ...]
    of: np.ndarray = field(compare=False)   # int32, one per dataset row
    pipelines: tuple[Pipeline, ...] = field(compare=False)
    programs: tuple[Any, ...] = field(compare=False)   # float64 engine programs, or None where not native
    random: bool = True   # the crop's place drawn (else centred)

    def extras(self, k: int, heights: np.ndarray, widths: np.ndarray, u: np.ndarray | None
               ) -> dict[str, np.ndarray]:
        """`original_size` (stored height, width) and `crop_top_left` (in the resized image) of rows in
        bucket `k` (stored sizes as float64) with draws `u` (the CoverCrop's are the first two columns),
        int64 [n, 2] each; `u` None: the corners are left for the engine to write (`corners`)."""
        out = np.empty((2, len(heights), 2), np.int64)
        out[0, :, 0], out[0, :, 1] = heights, widths
        if u is not None:
            self.corners(k, heights, widths, u, out[1])
        return {"original_size": out[0], "crop_top_left": out[1]}

    def corners(self, k: int, heights: np.ndarray, widths: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
        """The crop corners of rows in bucket `k` into `out` (int64 [n, 2]), as `extras` computes them."""
        _, _, out[:, 0], out[:, 1] = cover_crop(self.sizes[k], heights, widths, u, self.random)


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
    #: "fast": libjpeg-turbo's fast IDCT and plain chroma upsampling; "exact": JPEGs decoded at full size
    #: (no DCT scaling), so the resampling sees torchvision's pixels
    decode_quality: str = "exact"
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
    #: further kinds of targets (`transforms.targets.Target`), after those the column fields above name
    targets: tuple[Target, ...] = ()
    #: what a row holds and how it is rendered (`kinds.SampleKind`): an image, or a video pack's clip
    kind: SampleKind = IMAGES
    #: how each row becomes pixels (`route.Route`), decided once by `route.decide` when the Loader is made
    route: Route = Route()
    #: aspect-ratio buckets (`Bucketed`): each batch's output size and pipeline are its bucket's; None: one size
    buckets: Bucketed | None = None
    #: `Targets(captions=)`: the text column whose value per sample is one caption (of several: chosen per epoch)
    captions: str | None = None

    @property
    def gpu_decode(self) -> bool:
        """Whether a share of each batch's JPEG rows is decoded on the GPU (the route's GPU columns)."""
        return self.route.gpu_decode

    @property
    def frames(self) -> int:
        """Frames per row: a clip's T, or 0 for images (`slots.row_shape`)."""
        return self.kind.frames

    def target_kinds(self) -> tuple[Target, ...]:
        """One `Target` per target column: boxes, polygon instance masks (one per box of the first box
        column, when there is one), label maps, then `targets`."""
        count_from = self.box_columns[0] if self.box_columns else None
        return (*(Boxes(c) for c in self.box_columns), *(InstanceMasks(c, count_from) for c in self.mask_columns),
                *(LabelMap(c, self.ignore_index) for c in self.label_map_columns), *self.targets)


@dataclass
class BatchPlan:
    indices: np.ndarray  # dataset index per row
    positions: np.ndarray  # position in this rank's epoch list
    keys: np.ndarray  # uint64 random-stream key per row
    u: np.ndarray  # uniform draws [rows, pipeline.draws]
    geometry: Plan | None  # None when image sizes are only known after reading (loose files)
    bucket: int = -1  # aspect buckets: the batch's bucket (its size, pipeline and program); -1: none
    filler: Any = None  # the Filler of the batch's epoch (`EpochChain.prepare`), whose `fill` renders its rows
    gpu_from: int = 0  # the route's GPU columns: the JPEG rows from this one on go to the GPU
    #: the GPU's rows, a chunk at a time (`jobs.GpuRows`), appended by the worker threads without a lock
    gpu_rows: list = field(default_factory=list)
    # seconds the workers spent rendering the rows the GPU shares the batch with on the CPU (appended without a
    # lock; read by the device thread once the batch is complete). Those preparing the GPU's rows go with the
    # worker's own counters (`WorkerTimes.plan`, flushed into the GPU phases' plan_s once a batch is complete)
    cpu_render_s: list = field(default_factory=list)


class Filler:
    """The per-pass work: plan a batch, render one sample. Shared by the worker threads; it holds
    no reference to the iterator, so an abandoned iterator can be collected."""

    def __init__(self, spec: RenderSpec, dataset: Dataset, epoch: int, indices: np.ndarray, first_sample: int,
                 split: Any = None) -> None:
        self.spec = spec
        self.gpu = spec.gpu_decode
        self.split = split  # the route's GPU columns: which rows of each batch go to the GPU (gpu_split.SplitControl)
        self.ds = dataset
        self.n = len(dataset)
        self.pipe = spec.pipeline
        self.seed, self.epoch = spec.seed, epoch
        self.indices = np.ascontiguousarray(indices, np.int64)  # this rank's dataset indices for the epoch, in order
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
        self.targets = {t.column: t for t in spec.target_kinds()}
        self.full_size = spec.decode_quality == "exact"
        self.kind = spec.kind  # what a row holds: an image, or a clip planned on its own (kinds.SampleKind)
        # whether the kind adds columns to a batch (an image adds none: `prepare` then does not ask)
        self.kind_extras = type(spec.kind).extras is not ImageKind.extras
        # each position of the epoch's list, read-only: a batch's positions are a slice of it, not a new array
        self.positions = _counting(len(self.indices) + spec.batch_size)
        # aspect buckets: the stored sizes as floats, once, for each batch's conditioning (`Bucketed.extras`)
        self.float_sizes = (None if spec.buckets is None else
                             (spec.heights.astype(np.float64), spec.widths.astype(np.float64)))
        # the route's GPU columns with the engine's program: each batch's GPU rows planned natively
        # (`jobs.RowPlanner`), not from the batch's NumPy plan
        self.planner = None
        if self.gpu and spec.route.program is not None and native.plans_rows():
            tag = TAG_DRAW if spec.key_by_draw else TAG_SAMPLE
            self.heights = np.ascontiguousarray(spec.heights, np.int64)
            self.widths = np.ascontiguousarray(spec.widths, np.int64)
            self.planner = RowPlanner(spec.route.program, int(stream_key(self.seed, epoch, tag)[0]), self.heights,
                                      self.widths, spec.key_by_draw, native.gather_c())

    def _sizes(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Stored (heights, widths) of samples `idx`; None when known only after reading (loose files)."""
        return None if self.heights is None else (self.heights[idx], self.widths[idx])

    def _geometry(self, sizes: tuple[np.ndarray, np.ndarray] | None, u: np.ndarray, bucket: int = -1) -> Plan | None:
        if sizes is None or not self.kind.plans_batch:
            return None
        pipe = self.pipe if bucket < 0 else self.spec.buckets.pipelines[bucket]
        return pipe.plan(*sizes, u)

    def prepare(self, b: int, slot: Slot, deferred: bool = False) -> BatchPlan:
        """Batch b's plan, and its labels and extras into `slot`. `deferred`: the batch engine plans
        each row itself (engine.py), and so does the native planner the GPU's rows (`jobs.RowPlanner`);
        the plan's draws and geometry wait for `complete`, which a row on the Python path asks for."""
        lo = self.first + b * self.batch_size
        positions = self.positions[lo:lo + slot.size]
        idx = self.indices[lo:lo + slot.size]
        captions = None
        if self.spec.captions is not None and self.on_error == "skip":   # a sample without text: a stand-in's
            idx, captions = self.captioned(idx, positions, slot.errors)
        if slot.labels_np is not None:
            slot.labels_np[:slot.size] = self.labels[idx]
        else:
            slot.objects[:slot.size] = self.labels[idx].tolist()
        # targets are read here and placed in each output by the worker threads (fill)
        slot.extras = {c: (TargetRows(self.targets[c], [self.targets[c].read(self.ds, int(i)) for i in idx])
                           if c in self.targets else captions if c == self.spec.captions and captions is not None
                           else [self.ds.extra(int(i), c) for i in idx])   # the captions read once, by `captioned`
                       for c in (*self.columns, *(c for c in self.targets if c not in self.columns))
                       } if self.columns or self.targets else {}
        if self.kind_extras:
            slot.extras.update(self.kind.extras(idx, positions))   # a clip's video and clip number, say
        if self.spec.captions is not None:   # one caption per sample: of several, this epoch's
            column = self.spec.captions
            slot.extras[column] = captions if captions is not None else choose_captions(
                slot.extras[column], sample_keys(self.seed, self.epoch, idx, tag=TAG_CAPTION), column,
                lambda row: self._describe(int(idx[row]), None), slot.errors)
        bucket = -1
        if self.spec.buckets is not None:   # one bucket per batch: its size, and each row's conditioning
            buckets = self.spec.buckets
            bucket = int(buckets.of[idx[0]])
            slot.shape_rows(*buckets.sizes[bucket])
            if deferred:   # the engine writes each row's crop corner as it plans it (`Engine.run(corners=)`)
                slot.extras.update(buckets.extras(bucket, self.float_sizes[0][idx], self.float_sizes[1][idx], None))
                return BatchPlan(idx, positions, None, None, None, bucket=bucket)  # type: ignore[arg-type]
            keys, u = self._draws(idx, positions)
            slot.extras.update(buckets.extras(bucket, self.float_sizes[0][idx], self.float_sizes[1][idx], u))
        gpu_from = 0
        if self.gpu:
            staging = slot.staging
            if staging is not None:   # `JpegStaging.reset`, inlined: it runs per batch
                staging.used = staging.overflow = 0
            split = self.split
            if split is not None:   # the GPU's rows: as a rule the last batch's answer (`gpu_rows`'s, with no call)
                last, n = split.rows_for, slot.size
                gpu_from = n - (last[2] if last[0] == split.share and last[1] == n else split.gpu_rows(n))
        if deferred:
            return BatchPlan(idx, positions, None, None, None, gpu_from=gpu_from)  # type: ignore[arg-type]
        if bucket < 0:
            keys, u = self._draws(idx, positions)
        sizes = self._sizes(idx)
        geometry = self._geometry(sizes, u, bucket)
        if self.spec.pad:
            slot.extras["sizes"] = geometry.size.astype(np.int64)  # a tensor or an array at hand-out
        return BatchPlan(idx, positions, keys, u, geometry, bucket=bucket, gpu_from=gpu_from)

    def _draws(self, idx: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = (sample_keys(self.seed, self.epoch, positions, tag=TAG_DRAW) if self.spec.key_by_draw
                else sample_keys(self.seed, self.epoch, idx))
        return keys, uniforms(keys, self.draws)

    def complete(self, plan: BatchPlan) -> None:
        """A deferred plan's keys, draws and geometry, as `prepare` makes them (the batch engine's
        refused rows, the GPU's rows that are not JPEGs and those its decoder failed go through `fill`
        with it). Any thread: the draws are set last, so a plan with draws is complete."""
        if plan.u is None:
            keys, u = self._draws(plan.indices, plan.positions)
            plan.geometry = self._geometry(self._sizes(plan.indices), u, plan.bucket)
            plan.keys, plan.u = keys, u

    def _placement(self, geometry: Plan, row: int, idx: int) -> Placement:
        return Placement.of(geometry, row, self.heights[idx], self.widths[idx])

    def fill(self, plan: BatchPlan, row: int, slot: Slot, scratch: dict, times: WorkerTimes) -> None:
        """Row `row` of the batch on the Python path: rendered into the slot, its targets placed; a
        failure raised naming the sample, or under on_error="skip" the row replaced."""
        if plan.u is None:   # a deferred plan (`prepare`): this row is the batch's first on the Python path
            self.complete(plan)
        idx = int(plan.indices[row])
        geo = plan.geometry
        box = _row_box(geo, row)
        try:
            self.render_row(idx, int(plan.positions[row]), int(plan.keys[row]), plan.u[row], box,
                            slot.images_np[row], scratch, times)
            if self.targets:
                at = self._placement(geo, row, idx)
                for c in self.targets:
                    slot.extras[c].place(row, self.ds, idx, at)
        except UserTransformError as exc:  # a bug in the user's code: no data fix, never skipped
            raise self.transform_error(idx, exc) from (exc.__cause__ or exc)
        except OutputError:  # the machine's problem (the shard cache's disk is full), not this sample's
            raise
        except Exception as exc:
            if self.on_error == "raise":
                raise self.sample_error(idx, exc) from exc
            self.replace(plan, row, slot, scratch, times, exc)

    def fill_split(self, plan: BatchPlan, r0: int, r1: int, slot: Slot, scratch: dict,
                   times: WorkerTimes) -> list[tuple[int, BaseException]]:
        """Rows r0..r1 of a batch the GPU shares (the route's GPU columns, without the native engine): the
        rows before `plan.gpu_from` rendered here one at a time (timed for the split), the others left
        for the GPU in one call (`queue_gpu_rows`). Returns the (row, exception) of the rows that failed."""
        if plan.gpu_from <= r0:   # every row the GPU's (decode="gpu": the whole batch, one claim)
            return self.queue_gpu_rows(plan, r0, r1, slot, scratch, times)
        cut = min(r1, plan.gpu_from)
        t0 = time.perf_counter()
        errors = self.fill_rows(plan, range(r0, cut), slot, scratch, times)
        if cut > r0:
            plan.cpu_render_s.append(time.perf_counter() - t0)
        return errors + self.queue_gpu_rows(plan, cut, r1, slot, scratch, times)

    def fill_rows(self, plan: BatchPlan, rows: Iterable[int], slot: Slot, scratch: dict, times: WorkerTimes) -> list:
        """`rows` through the per-sample path (`fill`): the (row, exception) pairs of those that failed, kept
        for the consumer, which raises them in order."""
        errors = []
        for r in rows:
            try:
                self.fill(plan, r, slot, scratch, times)
            except BaseException as exc:
                errors.append((r, exc))
        return errors

    def queue_gpu_rows(self, plan: BatchPlan, r0: int, r1: int, slot: Slot, scratch: dict,
                       times: WorkerTimes, found: tuple | None = None) -> list:
        """Rows r0..r1 for the GPU in one call: the JPEG rows become one `GpuRows` on the plan
        (`jobs.gpu_rows`: each row planned and its crop windows computed by the native planner, or from
        the batch's NumPy plan without one; the bytes gathered into the slot's staging buffer by one native
        call); any other row (not a JPEG, or a shard that fails its check) is rendered here on the Python
        path, timed as the CPU's. Returns the (row, exception) of the rows that failed, as `fill_rows`.
        `found`: the rows' `pixel_spans`, where the caller asked for them (`jobs.gpu_rows`)."""
        if r0 >= r1:
            return []
        t0 = time.perf_counter()
        if self.planner is None and plan.u is None:   # the NumPy path plans from the batch's plan
            self.complete(plan)
        rows, left = gpu_rows(self.ds, plan, r0, r1, slot.staging, (self.out_h, self.out_w), self.heights,
                              self.widths, self.planner, found)
        if rows is not None:
            plan.gpu_rows.append(rows)
        seconds = time.perf_counter() - t0
        times.read += seconds
        times.plan += seconds
        if not left:
            return []
        t1 = time.perf_counter()
        errors = self.fill_rows(plan, left, slot, scratch, times)
        plan.cpu_render_s.append(time.perf_counter() - t1)
        return errors

    def _box(self, s: Any, u: np.ndarray, box: tuple | None) -> tuple[tuple, tuple[int, int]]:
        if box is None:  # sizes known only now (loose files): plan this one sample
            box = _row_box(self.pipe.plan(np.array([s.height]), np.array([s.width]), u[None, :]), 0)
            return box, box[2]
        own = self.spec.pad or self.spec.buckets is not None or getattr(self.kind, "own_size", False)
        return box, (box[2] if own else (self.out_h, self.out_w))

    def render_row(self, idx: int, position: int, key: int, u: np.ndarray, box: tuple | None, dst: np.ndarray,
                   scratch: dict, times: WorkerTimes) -> None:
        """Sample `idx`, at `position` of the epoch, into its row, as its kind renders it: an image
        (`render`) or, from a video pack, the clip that position holds (`clips.ClipKind`)."""
        self.kind.render_row(self, idx, position, key, u, box, dst, scratch, times)

    def render(self, idx: int, key: int, u: np.ndarray, box: tuple | None, dst: np.ndarray, scratch: dict,
               times: WorkerTimes, sample: Any = None) -> None:
        """Read, decode (only the resolution the crop needs) and transform sample `idx` into `dst`."""
        t0 = time.perf_counter()
        s = self.ds.sample(idx) if sample is None else sample
        t1 = time.perf_counter()
        box, size = self._box(s, u, box)
        region, win = self.decode(s, box, size, scratch)
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
            resample_region_into(region, win, dst, box[1], *self.pipe.resampling)
            for op in tail:
                out = run_user_op(op, dst, key)
                if out is not dst:
                    self._check_shape(out, dst, op.name)
                    dst[...] = out
        else:
            mid = np.empty((size[0], size[1], 3), np.uint8)
            resample_region_into(region, win, mid, box[1], *self.pipe.resampling)
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

    def decode(self, s: Any, box: tuple, size: tuple[int, int], scratch: dict) -> tuple[np.ndarray, Resampling]:
        """The source pixels the resampling reads (`r.src` of the image at the decoded scale) and how.

        `box` is the row's (box, flip, size, clip, grid). A JPEG is decoded at the smallest DCT scale
        the box allows and, where the region decoder is installed, only the rectangle the resampling
        reads; its pixels are exactly that rectangle of the whole scaled image, so the batch is the same
        with or without it. An image decoded at full size (always with decode_quality="exact") is
        resampled from the whole region torchvision resamples, giving its pixels; a DCT-scaled one, whose
        pixels are not torchvision's anyway, from the output's share of it (`resampling(trim=)`)."""
        crop, clip, grid = box[0], box[3], box[4]
        if s.encoding == "jpeg":
            h, w = s.height, s.width
            codecs.check_stored_size(s.key, h, w)   # before planning or allocating anything from it
            mh, mw = (h, w) if self.full_size else decode_minimums(crop, size[0], size[1], h, w)
            n = codecs.jpeg_scale_eighths(h, w, mh, mw)
            sh, sw = math.ceil(h * n / 8), math.ceil(w * n / 8)
            r = resampling(crop, sh, sw, h, w, clip, grid, size, trim=n < 8)  # full size: torchvision's grid
            y0, y1, x0, x1 = r.src
            region = codecs.decode_jpeg_region(s.data, s.key, height=h, width=w, scale=n, window=r.src,
                                               out=self._scratch(scratch, (y1 - y0) * (x1 - x0) * 3),
                                               fast=self.fast)
            if region is not None:
                return region, r
            img = codecs.decode_rgb(s.data, "jpeg", s.key, height=h, width=w, min_height=mh, min_width=mw,
                                    out=self._scratch(scratch, sh * sw * 3), fast=self.fast)
        else:
            img = codecs.decode_rgb(s.data, s.encoding, s.key, height=s.height, width=s.width)
            if img.shape[:2] != (s.height, s.width):
                raise ValueError(f"decoded size {img.shape[1]}x{img.shape[0]} differs from the stored size "
                                 f"{s.width}x{s.height}; re-pack the dataset")
        # the whole image was decoded (at some scale, or full size by Pillow): cut the window from it
        r = resampling(crop, img.shape[0], img.shape[1], s.height, s.width, clip, grid, size,
                       trim=img.shape[:2] != (s.height, s.width))
        y0, y1, x0, x1 = r.src
        return img[y0:y1, x0:x1], r

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
            r = self._stand_in(pos, attempt)
            key = sample_keys(self.seed, self.epoch, np.array([r]))
            u = uniforms(key, self.draws)
            geo = self._geometry(self._sizes(np.array([r])), u, plan.bucket)   # in the batch's bucket
            box = _row_box(geo, 0)
            try:
                self.render_row(r, pos, int(key[0]), u[0], box, slot.images_np[row], scratch, times)
                raws = {c: t.read(self.ds, r) for c, t in self.targets.items()}
                caption = None if self.spec.captions is None else self.caption(r)
                at = self._placement(geo, 0, r) if self.targets else None
                placed = {c: t.place(raws[c], self.ds, r, at) for c, t in self.targets.items()}
            except UserTransformError as exc:
                raise self.transform_error(r, exc) from (exc.__cause__ or exc)
            except OutputError:
                raise
            except Exception:
                continue
            if slot.labels_np is not None:
                slot.labels_np[row] = self.labels[r]
            else:
                slot.objects[row] = self.labels[r]
            for c in self.columns:
                if c not in self.targets:
                    slot.extras[c][row] = self.ds.extra(r, c)
            if caption is not None:   # the stand-in's caption this epoch, over the raw value written above
                slot.extras[self.spec.captions][row] = caption
            for c, value in self.kind.extras(np.array([r]), np.array([pos])).items():
                slot.extras[c][row] = value[0]   # the stand-in's own (a clip's video)
            for c, value in placed.items():
                slot.extras[c].raw[row], slot.extras[c][row] = raws[c], value
            if plan.bucket >= 0:   # the stand-in's stored size and crop, in the batch's bucket
                hf, wf = self.float_sizes
                for c, value in self.spec.buckets.extras(plan.bucket, hf[[r]], wf[[r]], u).items():
                    slot.extras[c][row] = value[0]
            key_, shard, srow = self._describe(int(plan.indices[row]), first)
            times.skipped += 1
            times.skipped_keys.append(key_ or "?")
            _log.warning("on_error='skip': sample %r (shard %s, row %d) replaced by index %d: %s: %s",
                         key_, shard, srow, r, type(first).__name__, first)
            return
        raise self.sample_error(int(plan.indices[row]), first,
                                f"; {MAX_REPLACEMENTS} replacement samples failed as well") from first

    def _stand_in(self, pos: int, attempt: int) -> int:
        """on_error="skip": the sample that stands in for position `pos` after `attempt` failures."""
        members = self.spec.members
        return (replacement_index(self.seed, self.epoch, pos, attempt, self.n) if members is None else
                int(members[replacement_index(self.seed, self.epoch, pos, attempt, len(members))]))

    def captioned(self, idx: np.ndarray, positions: np.ndarray, errors: list) -> tuple[np.ndarray, list[str]]:
        """on_error="skip" with `Targets(captions=)`: (the batch's indices, their captions), each sample whose
        caption is not text replaced, before anything of it is read, by a stand-in with text, chosen as
        `replace` chooses one (in the batch's aspect bucket, if any); with none in `MAX_REPLACEMENTS` tries,
        the sample's SampleError goes to `errors`."""
        column, bad = self.spec.captions, []
        captions = choose_captions([self.ds.extra(int(i), column) for i in idx],
                                   sample_keys(self.seed, self.epoch, idx, tag=TAG_CAPTION), column,
                                   lambda row: self._describe(int(idx[row]), None), bad)
        if not bad:
            return idx, captions
        idx, of = idx.copy(), None if self.spec.buckets is None else self.spec.buckets.of
        for row, error in bad:
            for attempt in range(MAX_REPLACEMENTS):
                r = self._stand_in(int(positions[row]), attempt)
                if of is not None and of[r] != of[idx[row]]:
                    continue
                try:
                    text = self.caption(r)
                except ValueError:
                    continue
                _log.warning("on_error='skip': sample %r (shard %s, row %s) holds no text in %r; replaced by index %d",
                             error.key, error.shard, error.row, column, r)
                idx[row], captions[row] = r, text
                break
            else:
                errors.append((row, error))
        return idx, captions

    def caption(self, i: int) -> str:
        """Sample i's caption this epoch (`Targets(captions=)`, drawn as `prepare` draws it); ValueError when its
        value is not text (a stand-in under on_error="skip" is then passed over)."""
        value = self.ds.extra(i, self.spec.captions)
        text = one_caption(value, float(uniforms(sample_keys(self.seed, self.epoch, np.array([i]), tag=TAG_CAPTION),
                                                 1)[0, 0]))
        if text is None:
            raise ValueError(f"its {self.spec.captions!r} value {value!r:.80} is not text")
        return text

    def _describe(self, idx: int, exc: BaseException) -> tuple[str | None, str, int]:
        shard, row = self.ds.location(idx)
        key = getattr(exc, "key", None)
        if key is None and getattr(self.ds, "packed", False):
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
        fix = ("Re-pack to drop the failing samples" if self.on_error == "skip" else
               "Pass workers=stoker.Workers(on_error='skip') to replace failing samples, or re-pack to drop them")
        return SampleError(f"sample {key!r} (shard {shard}, row {row}, index {idx}) failed: "
                           f"{type(exc).__name__}: {exc}{notes}{extra}. {fix}", key=key, shard=shard,
                           row=row, index=idx)


class EpochChain:
    """The plan-and-fill functions of a Run whose batches span epochs one after another (a persistent
    Loader goes on into the next epoch): run batch g is batch g - first of its epoch's Filler. Plans
    carry their Filler (`BatchPlan.filler`), so `fill` (and the device thread's CPU fallback) use the right
    epoch's."""

    def __init__(self, spec: RenderSpec) -> None:
        self.spec = spec  # the same for every epoch (so are its columns and multi-label encoding)
        self.columns = spec.columns
        self.multi_label = spec.multi_label
        self.fillers: list[Filler] = []
        # the native engine plans each row itself (engine.py), and the native planner each GPU row
        # (`jobs.RowPlanner`): `prepare` plans labels only, unless rows on the Python path share the batch
        # with the GPU (a split without the engine: they need the batch's NumPy plan anyway)
        route = spec.route
        self.deferred = route.native or (route.gpu_decode and route.share == 1.0 and route.program is not None)
        self.firsts: list[int] = []  # run batch index of each Filler's first batch, increasing
        self.latest: tuple[int, Filler | None] = (0, None)  # the last one added: (its first batch, it)

    def add(self, filler: Filler, first: int) -> None:
        """Batches from run batch `first` on belong to `filler` (call under the run's lock)."""
        self.fillers.append(filler)
        self.firsts.append(first)
        self.latest = (first, filler)

    def prepare(self, g: int, slot: Slot) -> BatchPlan:
        first, filler = self.latest   # almost every batch is the latest epoch's: no search
        if g < first:
            k = bisect.bisect_right(self.firsts, g) - 1
            first, filler = self.firsts[k], self.fillers[k]
        plan = filler.prepare(g - first, slot, self.deferred)
        plan.filler = filler
        return plan

    def locate(self, g: int) -> tuple[Filler, int]:
        """Run batch g's Filler and its batch index within that Filler's epoch."""
        k = bisect.bisect_right(self.firsts, g) - 1
        filler = self.fillers[k]
        return filler, filler.first // filler.batch_size + g - self.firsts[k]

    @staticmethod
    def fill(plan: BatchPlan, row: int, slot: Slot, scratch: dict, times: WorkerTimes) -> None:
        plan.filler.fill(plan, row, slot, scratch, times)

    @staticmethod
    def fill_split(plan: BatchPlan, r0: int, r1: int, slot: Slot, scratch: dict, times: WorkerTimes
                   ) -> list[tuple[int, BaseException]]:
        if plan.gpu_from <= r0:   # `Filler.fill_split`'s first case, one call fewer (decode="gpu": every batch)
            return plan.filler.queue_gpu_rows(plan, r0, r1, slot, scratch, times)
        return plan.filler.fill_split(plan, r0, r1, slot, scratch, times)


def choose_captions(values: list, keys: np.ndarray, column: str, describe: Any, errors: list) -> list[str]:
    """One caption per row from a text column's values (`one_caption`), drawn from the row's key
    (`TAG_CAPTION` streams: the same per (seed, epoch, sample) at any thread count or process count). A value
    that is not text is a SampleError naming the sample, added to `errors` (the batch raises it when asked for)."""
    draws = uniforms(keys, 1)[:, 0]
    out: list[str] = []
    for row, value in enumerate(values):
        text = one_caption(value, float(draws[row]))
        if text is None:
            key, shard, srow = describe(row)
            what = "no caption (an empty list)" if value == [] or value == "[]" else f"{value!r:.80}"
            errors.append((row, SampleError(f"sample {key!r} (shard {shard}, row {srow}): Targets(captions={column!r}) "
                                            f"needs text, the column holds {what}; pass workers=stoker.Workers(on_error="
                                            f"'skip') to replace such samples, re-pack with text in that column, or "
                                            f"name another column", key=key, shard=shard, row=srow)))
            text = ""
        out.append(text)
    return out


def one_caption(value: Any, draw: float) -> str | None:
    """A text column's value as one caption: a str as it is; of several (a `list<string>` value, or a
    string column's JSON list of strings, as a CSV cell holds them) the one `draw` in [0, 1) picks; None
    when the value is not text (a number, a null, an empty list)."""
    options = value
    if isinstance(value, str) and value.startswith("["):
        try:
            options = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            options = value   # a caption that starts with a bracket
    if isinstance(options, str):
        return options
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return options[min(int(draw * len(options)), len(options) - 1)]
    return None


_COUNT = np.arange(0)


def _counting(n: int) -> np.ndarray:
    """0, 1, ..., n - 1 (int64, read-only): a view of one array shared by every epoch's `Filler`, grown
    to the longest epoch asked for."""
    global _COUNT
    count = _COUNT
    if len(count) < n:
        count = np.arange(n)
        count.flags.writeable = False
        _COUNT = count
    return count[:n]


def _row_box(geometry: Plan | None, row: int) -> tuple | None:
    """One row of a plan as (box, flip, (height, width), clip, grid) in Python numbers (cheaper per sample)."""
    if geometry is None:
        return None
    size = (int(geometry.size[row, 0]), int(geometry.size[row, 1]))
    if geometry.clip is None:
        return geometry.box[row].tolist(), bool(geometry.flip[row]), size, None, None
    return (geometry.box[row].tolist(), bool(geometry.flip[row]), size, geometry.clip[row].tolist(),
            geometry.grid[row].tolist())
