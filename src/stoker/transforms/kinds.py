"""What a transform declares about itself: where it runs, and whether boxes and masks can follow it.

An op is known by two class attributes, never by a list of classes, so a new op is one class:

- `stage`, where it runs:
    - `"plan"`: geometry planned per batch from the stored image sizes and fused with decode; it has
      `draws` (uniform draws per sample), `plan(state, u)` (updates a `geometry.PlanState` from its
      draws `u` [n, draws]) and `fixed_size(size)` (its output size when it does not depend on the image);
    - `"sample"`: a callable on one uint8 HWC numpy array, on the worker threads, taking `rng=` (a
      Generator seeded from the sample's key) when it draws;
    - `"batch"`: on a whole `[B, 3, H, W]` batch, on the device thread (or the CPU batch):
      `params(rng, n, h, w)` then `apply(x, params)`; `takes` says which batches it accepts
      ("uint8", "float": normalized, "any") and `gives` the dtype it leaves (None: unchanged);
      `mixes_labels = True` for the one op that mixes labels too (a Mixup, run last).
- `engine_args()`, declared by a planned op's own class (not inherited: a subclass that plans otherwise
  must declare its own): its row of the native batch engine's program, (opcode, parameters), as
  csrc/engine.c plans it; an op without one is planned in NumPy and its batches take the Python path.
- `moves_pixels`: False for an op that changes pixel values only (colour, blur, normalize, erasing in
  place), so boxes and masks stay valid; True for one that moves them (the default for anything that
  does not say). Planned geometry moves pixels and targets follow it through the plan; any other op
  that moves pixels refuses boxes and masks (`Pipeline.pixel_movers`).

Anything without a `stage` is a user callable: adapted (`adapt.py`) and run per sample.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError

PLAN, SAMPLE, BATCH = "plan", "sample", "batch"
STAGES = (PLAN, SAMPLE, BATCH)
#: the dtypes a batch op may take or give
BATCH_DTYPES = ("uint8", "float", "any")
#: csrc/engine.c's opcodes and its program's row width (opcode, draw offset, up to 8 parameters)
ENGINE_RRC, ENGINE_RESIZE, ENGINE_CENTER, ENGINE_FLIP, ENGINE_COVER = 1, 2, 3, 4, 5
ENGINE_WIDTH = 10


def engine_program(ops: Sequence[Any], offsets: Sequence[int]) -> np.ndarray | None:
    """The planned ops as the native engine's program (float64 [ops, ENGINE_WIDTH]: opcode, draw offset,
    parameters), or None when one of them declares no engine row (`engine_args` on its own class)."""
    rows = []
    for op, off in zip(ops, offsets):
        declared = type(op).__dict__.get("engine_args")
        if declared is None:
            return None
        code, args = declared(op)
        rows.append([float(code), float(off), *map(float, args)] + [0.0] * (ENGINE_WIDTH - 2 - len(args)))
    return np.array(rows, np.float64).reshape(-1, ENGINE_WIDTH)


def stage_of(op: Any) -> str | None:
    """The stage `op` declares, or None for an undeclared callable."""
    stage = getattr(op, "stage", None)
    if stage is None or isinstance(op, type):
        return None
    if stage not in STAGES:
        raise ConfigError(f"transform {op!r} declares stage={stage!r}; a stoker op declares one of {STAGES} "
                          f"(see docs/transforms.md, 'Writing your own op')")
    return stage


def moves_pixels(op: Any) -> bool:
    """Whether `op` moves pixels (so boxes and masks cannot follow it unless it is planned geometry).
    Undeclared ops are taken to move them."""
    return bool(getattr(op, "moves_pixels", True))
