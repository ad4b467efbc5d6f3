"""Pipeline: the transforms compiled into a planned geometric prefix, a per-array tail and the batch ops.

`transforms=` may be one transform, a list or a Compose-like object, with stoker's ops, torchvision's
(translated to stoker's) and any callable on arrays, PIL images or tensors (`adapt.as_ops`). Batched
ops (`transforms.gpu`: Normalize, RandomErasing, ...) and a `Mixup` at the end run on whole batches,
on the device when the Loader has one (`batch`, a `gpu.BatchAugment`, or None)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError
from .geometry import (GEOMETRIC, CenterCrop, Plan, RandomResizedCrop, Resize, Size, crop_resize_into,
                       plan_ops)
from .adapt import as_ops
from .gpu import BatchAugment
from .mixing import Mixup
from .user import _UserOp, _wants_rng, apply_tail


class Pipeline:
    """A compiled list of transforms: the planned geometric prefix and the per-array tail."""

    def __init__(self, transforms: Sequence[Any] | Any | None) -> None:
        per_sample, batch_ops = as_ops(transforms)
        mixes = [k for k, op in enumerate(batch_ops) if isinstance(op, Mixup)]
        if mixes and mixes != [len(batch_ops) - 1]:
            raise ConfigError("a Mixup must be the last transform (it mixes whole, finished batches), and there can "
                              "be only one")
        self.batch = None if not batch_ops else BatchAugment([op for op in batch_ops if not isinstance(op, Mixup)],
                                                             mix=batch_ops[-1] if mixes else None)
        ops: list[Any] = []
        for pos, t in enumerate(per_sample):
            if isinstance(t, GEOMETRIC):
                ops.append(t)
            elif callable(t):
                ops.append(_UserOp(t, _wants_rng(t), pos))
            else:
                raise ConfigError(f"transform #{pos} is {t!r}: expected a stoker transform or a callable on a "
                                  f"uint8 HWC numpy array")
        first_user = next((k for k, op in enumerate(ops) if isinstance(op, _UserOp)), len(ops))
        self.ops = ops
        self.prefix = ops[:first_user]
        self.tail = ops[first_user:]
        self.tail_geometric = any(isinstance(op, GEOMETRIC) for op in self.tail)
        offsets, total = [], 0
        for op in ops:
            offsets.append(total)
            total += op.draws
        self.offsets = offsets
        self.draws = total
        resizes = [op for op in self.prefix if isinstance(op, (RandomResizedCrop, Resize))]
        #: (interpolation, antialias) of the planned prefix's resampling: its last resize's, as `plan_ops`
        self.resampling = (resizes[-1].interpolation, resizes[-1].antialias) if resizes else ("bilinear", True)

    @property
    def fixed_size(self) -> Size | None:
        """Output (height, width) when it does not depend on the image size, else None."""
        size: Size | None = None
        for op in self.ops:
            if isinstance(op, RandomResizedCrop | CenterCrop):
                size = op.size
            elif isinstance(op, Resize):
                size = op.size if not isinstance(op.size, int) else None
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
