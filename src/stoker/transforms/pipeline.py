"""Pipeline: the transforms compiled into a planned geometric prefix, a per-array tail and the batch ops.

`transforms=` may be one transform, a list or a Compose-like object, with stoker's ops, torchvision's
(translated to stoker's) and any callable on arrays, PIL images or tensors (`adapt.as_ops`). Batched
ops (`transforms.gpu`: Normalize, RandomErasing, ...) and a `Mixup` at the end run on whole batches,
on the device when the Loader has one (`batch`, a `batch_ops.BatchAugment`, or None). Which is which comes
from what each op declares (`kinds.py`)."""

from __future__ import annotations

import copy

from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError
from .geometry import Plan, Size, crop_resize_into, plan_ops
from .adapt import as_ops
from .batch_ops import BatchAugment
from .kinds import PLAN, moves_pixels, stage_of
from .user import _UserOp, _wants_rng, apply_tail


class Pipeline:
    """A compiled list of transforms: the planned geometric prefix and the per-array tail."""

    def __init__(self, transforms: Sequence[Any] | Any | None) -> None:
        per_sample, batch_ops = as_ops(transforms)
        mixes = [k for k, op in enumerate(batch_ops) if getattr(op, "mixes_labels", False)]
        if mixes and mixes != [len(batch_ops) - 1]:
            raise ConfigError("a Mixup must be the last transform (it mixes whole, finished batches), and there can "
                              "be only one")
        self.batch = None if not batch_ops else BatchAugment(batch_ops[:-1] if mixes else batch_ops,
                                                             mix=batch_ops[-1] if mixes else None)
        ops: list[Any] = []
        for pos, t in enumerate(per_sample):
            if stage_of(t) == PLAN:
                ops.append(t)
            elif callable(t):
                ops.append(_UserOp(t, _wants_rng(t), pos))
            else:
                raise ConfigError(f"transform #{pos} is {t!r}: expected a stoker transform or a callable on a "
                                  f"uint8 HWC numpy array")
        self._layout(ops)

    def _layout(self, ops: list[Any]) -> None:
        """The compiled ops laid out: the planned prefix, the tail, each op's draw offset, the resampling."""
        first_user = next((k for k, op in enumerate(ops) if isinstance(op, _UserOp)), len(ops))
        self.ops = ops
        self.prefix = ops[:first_user]
        self.tail = ops[first_user:]
        self.tail_geometric = any(stage_of(op) == PLAN for op in self.tail)
        offsets, total = [], 0
        for op in ops:
            offsets.append(total)
            total += op.draws
        self.offsets = offsets
        self.draws = total
        # a planned op that resamples declares its filter (`interpolation`, `antialias`)
        resizes = [op for op in self.prefix if hasattr(op, "interpolation")]
        #: (interpolation, antialias) of the planned prefix's resampling: its last resize's, as `plan_ops`
        self.resampling = (resizes[-1].interpolation, resizes[-1].antialias) if resizes else ("bilinear", True)

    def prepended(self, op: Any) -> "Pipeline":
        """This pipeline with the planned op `op` first (a copy): an aspect bucket's `CoverCrop`."""
        new = copy.copy(self)
        new._layout([op, *self.ops])
        return new

    def with_mix(self, mix: Any) -> "Pipeline":
        """This pipeline with its batch Mixup replaced by `mix` (a copy: the pipeline itself is not changed)."""
        new = copy.copy(self)
        new.batch = BatchAugment(self.batch.ops, mix=mix, seed=self.batch.seed)
        return new

    @property
    def fixed_size(self) -> Size | None:
        """Output (height, width) when it does not depend on the image size, else None."""
        size: Size | None = None
        for op in self.ops:
            if stage_of(op) == PLAN:
                size = op.fixed_size(size)
        return size

    def output_size(self, height: int, width: int) -> Size:
        """Output (height, width) for a source of this size (user callables keep the shape)."""
        fixed = self.fixed_size
        if fixed is not None:
            return fixed
        plan = plan_ops(self.ops, self.offsets, np.array([height]), np.array([width]),
                        np.zeros((1, max(self.draws, 1))))
        return int(plan.size[0, 0]), int(plan.size[0, 1])

    def apply(self, img: np.ndarray, u: np.ndarray | None = None, key: int = 0) -> np.ndarray:
        """Run the whole pipeline on one uint8 HWC array (a preview; the Loader does the same per
        sample). `u`: the sample's draws [self.draws] (default: all 0.5); `key`: seeds `rng=`."""
        u = np.full(max(self.draws, 1), 0.5) if u is None else np.asarray(u, dtype=np.float64)
        h, w = img.shape[:2]
        p = self.plan(np.array([h]), np.array([w]), u[None, :])
        out = np.empty((int(p.size[0, 0]), int(p.size[0, 1]), 3), np.uint8)
        crop_resize_into(np.ascontiguousarray(img), p.box[0], out, bool(p.flip[0]), h, w, p.clip[0], p.grid[0],
                         p.interpolation, p.antialias)
        return apply_tail(self.tail, self.offsets[len(self.prefix):], out, u, key)

    def plan(self, heights: np.ndarray, widths: np.ndarray, u: np.ndarray) -> Plan:
        """Plan the geometric prefix for a batch: sizes are source sizes, `u` the draws [n, self.draws]."""
        return plan_ops(self.prefix, self.offsets, heights, widths, u)

    @property
    def normalizes(self) -> bool:
        """Whether a batch op turns the uint8 batch into normalized floats (a Normalize: `gives = "float"`)."""
        return self.batch is not None and any(getattr(op, "gives", None) == "float" for op in self.batch.ops)

    def pixel_movers(self) -> list[str]:
        """The ops that move pixels where boxes and masks cannot follow: after the planned prefix (a
        user callable ends it) or among the batch ops, unless they declare `moves_pixels = False`."""
        movers = [getattr(op, "name", type(op).__name__) for op in self.tail if moves_pixels(op)]
        if self.batch is not None:
            ops = [*self.batch.ops, *([self.batch.mix] if self.batch.mix is not None else [])]
            movers += [type(op).__name__ for op in ops if moves_pixels(op)]
        return movers

    def check_targets(self, columns: Sequence[str]) -> None:
        """Refuse target columns (boxes, masks) when an op would move pixels without them."""
        movers = self.pixel_movers() if columns else []
        if movers:
            raise ConfigError(f"boxes/masks {tuple(columns)} follow stoker's planned crop, resize and flip, but "
                              f"{', '.join(movers)} would move pixels without them; use colour ops only after the "
                              f"geometry (ColorJitter, GaussianBlur, RandomGrayscale, Normalize, RandomErasing), or declare "
                              f"`moves_pixels = False` on your own op's class if it changes pixel values only")
