"""User callables in a pipeline: per-sample ops on uint8 HWC numpy arrays, run on the worker threads.

A callable takes the array (and optionally `rng=`, a numpy Generator seeded from the sample's key,
so its randomness is as deterministic as the planned ops') and returns an array of the same kind.
Ops after the first user callable (the pipeline's *tail*) run one at a time on arrays (`apply_tail`):
correct for any order, slower than the fused geometric prefix.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import UserTransformError
from .adapt import TransformError
from .geometry import crop_resize_into, plan_ops
from .kinds import SAMPLE, moves_pixels


@dataclass(frozen=True)
class _UserOp:
    fn: Callable[..., Any]
    wants_rng: bool
    position: int
    draws = 0
    stage = SAMPLE

    @property
    def name(self) -> str:
        name = getattr(self.fn, "name", None)  # an adapt.Adapted names the callable it wraps
        return name if isinstance(name, str) and name else getattr(self.fn, "__name__", type(self.fn).__name__)

    @property
    def moves_pixels(self) -> bool:
        return moves_pixels(self.fn)


def _wants_rng(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "rng" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def run_user_op(op: _UserOp, img: np.ndarray, key: int) -> np.ndarray:
    """Call a user transform; with `rng=` it gets a numpy Generator seeded from the sample's key.
    Whatever goes wrong in it is the transform's own bug: raised as UserTransformError naming it."""
    try:
        if op.wants_rng:
            rng = np.random.Generator(np.random.Philox(key=[key, op.position]))
            out = op.fn(img, rng=rng)
        else:
            out = op.fn(img)
    except TransformError as exc:   # the adapter's own finding (takes or returns no image): already named
        raise UserTransformError(str(exc), transform=op.name) from exc
    except Exception as exc:
        raise UserTransformError(f"transform {op.name} raised {type(exc).__name__}: {exc}",
                                 transform=op.name) from exc
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 3 or out.shape[2] != 3:
        got = type(out).__name__ if not isinstance(out, np.ndarray) else f"{out.dtype} array {out.shape}"
        raise UserTransformError(f"transform {op.name} returned {got}; expected a uint8 HxWx3 numpy array "
                                 f"(modify the input in place and return it, or return a new array)",
                                 transform=op.name)
    return out


def apply_tail(ops: Sequence[Any], offsets: Sequence[int], img: np.ndarray, u: np.ndarray,
               key: int) -> np.ndarray:
    """Run the ops after the first user callable, one at a time on arrays (the general path): user
    callables as they are, planned geometry planned for this one array."""
    for op, off in zip(ops, offsets):
        if isinstance(op, _UserOp):
            img = run_user_op(op, img, key)
            continue
        h, w = img.shape[:2]
        plan = plan_ops([op], [0], np.array([h]), np.array([w]), u[None, off:off + max(op.draws, 1)])
        out = np.empty((int(plan.size[0, 0]), int(plan.size[0, 1]), 3), dtype=np.uint8)
        if out.shape[:2] == (h, w) and plan.box[0].tolist() == [0, 0, h, w]:   # the whole image: a copy or a flip
            out[...] = img[:, ::-1] if plan.flip[0] else img
        else:
            crop_resize_into(np.ascontiguousarray(img), plan.box[0], out, bool(plan.flip[0]), h, w,
                             plan.clip[0], plan.grid[0], plan.interpolation, plan.antialias)
        img = out
    return img
