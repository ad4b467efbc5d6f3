"""Token budgets (NaFlex): each image resized, its aspect kept, so its patch grid fits a number of tokens,
and handed out as a padded sequence of patches with their coordinates and a validity mask.

- `TokenBudget(patch, max_tokens)` is a planned op (`transforms=[stoker.TokenBudget(16, 256), ...]`): each
  image's size is the grid timm's NaFlex computes (`token_grid`: its `get_image_size_for_seq`, the same
  binary search over all images at once, so the same sizes), then the image is resampled to it;
- `PatchKind` is the kind of sample such a Loader reads (`loading.kinds`): each row holds the image's
  patches one under another, uint8 [max_tokens * patch, patch, 3], so a batch is one tensor
  [B, 3, max_tokens * patch, patch] (NCHW view) whose NHWC memory is [B, L, patch * patch * 3] patches
  (`patches(x, patch)` views it so), the rest of each row zero; `extras["patch_coord"]` int64 [B, L, 2]
  (row, column of each patch in its image's grid) and `extras["patch_valid"]` bool [B, L] come with it:
  what timm's NaFlex ViTs take (`patches`, `patch_coord`, `patch_valid`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError
from ..transforms.geometry import PlanState, _check_resampling
from ..transforms.kinds import PLAN
from .stats import WorkerTimes

__all__ = ["PatchKind", "TokenBudget", "patches", "token_grid"]

_EPS = 1e-5


def token_grid(heights: np.ndarray, widths: np.ndarray, patch: tuple[int, int], max_tokens: int,
               max_ratio: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each image's target (height, width): the largest scale (a binary search on the ratio, as timm's
    `get_image_size_for_seq`) whose size, rounded up to whole patches, holds at most `max_tokens` patches.
    The interval halves on every step whatever the outcome, so all images share the loop: the same
    floating-point steps as timm's per image, the same sizes."""
    ph, pw = patch
    h, w = np.asarray(heights, np.float64), np.asarray(widths, np.float64)

    def target(ratio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        th = np.maximum(ph * np.ceil(h * ratio / ph), ph).astype(np.int64)
        tw = np.maximum(pw * np.ceil(w * ratio / pw), pw).astype(np.int64)
        return th, tw

    lb, rb = np.full(len(h), _EPS / 10.0), np.full(len(h), 100.0)
    while (rb[0] - lb[0] if len(h) else 0.0) >= _EPS:
        mid = (lb + rb) / 2.0
        th, tw = target(mid)
        ok = (th // ph) * (tw // pw) <= max_tokens
        lb, rb = np.where(ok, mid, lb), np.where(ok, rb, mid)
    ratio = lb if max_ratio is None else np.minimum(lb, max_ratio)
    if len(h) and ((ratio <= _EPS).any() or (ratio >= 100.0).any()):
        i = int(np.flatnonzero((ratio <= _EPS) | (ratio >= 100.0))[0])
        raise ConfigError(f"TokenBudget: an image of {int(w[i])}x{int(h[i])} cannot be scaled to fit {max_tokens} "
                          f"patches of {pw}x{ph} (timm's search bounds); pack it resized (stoker pack --max-side)")
    return target(ratio)


@dataclass(frozen=True)
class TokenBudget:
    """NaFlex's resize: each image scaled, its aspect kept, to the largest size whose grid of `patch` x
    `patch` pixel patches (an int, or (height, width)) holds at most `max_tokens` patches, sides rounded up
    to whole patches (timm's `ResizeToSequence`; `max_ratio` caps the scale, as its argument does).
    Batches are padded patch sequences (`PatchKind`); `interpolation` and `antialias` as `Resize`'s."""

    patch: Any = 16
    max_tokens: int = 256
    max_ratio: float | None = None
    interpolation: str = "bilinear"
    antialias: bool = True
    draws = 0
    stage = PLAN
    moves_pixels = True

    def __post_init__(self) -> None:
        pair = (self.patch, self.patch) if isinstance(self.patch, (int, np.integer)) else tuple(self.patch)
        if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
                                     for v in pair):
            raise ConfigError(f"TokenBudget: patch must be a positive int or (height, width), got {self.patch!r}")
        object.__setattr__(self, "patch", (int(pair[0]), int(pair[1])))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)) \
                or self.max_tokens < 1:
            raise ConfigError(f"TokenBudget: max_tokens must be at least one patch (an int >= 1), got "
                              f"{self.max_tokens!r}")
        if self.max_ratio is not None and not (isinstance(self.max_ratio, (int, float)) and self.max_ratio > 0):
            raise ConfigError(f"TokenBudget: max_ratio must be None or a positive number, got {self.max_ratio!r}")
        _check_resampling(self)

    def plan(self, state: PlanState, u: np.ndarray) -> None:
        state.lh, state.lw = token_grid(state.lh, state.lw, self.patch, self.max_tokens, self.max_ratio)
        state.resample(self)

    def fixed_size(self, size: Any) -> None:
        return None


@dataclass(frozen=True)
class PatchKind:
    """Each row is an image cut into patches (module docstring): [max_tokens * ph, pw, 3], the patches in
    raster order, one under another, zero after the image's own."""

    budget: TokenBudget
    #: each dataset row's grid (patches high, patches wide), int64 [n, 2], from its stored size
    grids: np.ndarray = field(compare=False, repr=False)
    name: ClassVar[str] = "patches"
    frames: ClassVar[int] = 0
    per_item: ClassVar[int] = 1
    plans_batch: ClassVar[bool] = True
    per_row_python: ClassVar[str | None] = "token budgets: each image is resized and cut into patches per row"
    own_size: ClassVar[bool] = True   # each row rendered at its own planned size first (`Filler._box`)
    cpu_only: ClassVar[str | None] = "token budgets: the rows are patch sequences, cut on the CPU"

    @property
    def options(self) -> TokenBudget:
        return self.budget

    @property
    def row_size(self) -> tuple[int, int]:
        """(height, width) of a row: the patches one under another."""
        ph, pw = self.budget.patch
        return self.budget.max_tokens * ph, pw

    def extras(self, indices: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        grid = self.grids[np.asarray(indices, np.int64)]
        k = np.arange(self.budget.max_tokens)[None, :]
        nh, nw = grid[:, :1], grid[:, 1:]
        valid = k < nh * nw
        coord = np.zeros((len(grid), self.budget.max_tokens, 2), np.int64)
        coord[:, :, 0] = np.where(valid, k // nw, 0)
        coord[:, :, 1] = np.where(valid, k % nw, 0)
        return {"patch_coord": coord, "patch_valid": valid}

    def render_row(self, filler: Any, idx: int, position: int, key: int, u: np.ndarray, box: tuple | None,
                   dst: np.ndarray, scratch: dict, times: WorkerTimes) -> None:
        (th, tw), (ph, pw) = box[2], self.budget.patch
        buf = scratch.get("patches")
        if buf is None or buf.size < th * tw * 3:
            buf = scratch["patches"] = np.empty(max(th * tw * 3, 1 << 16), np.uint8)
        image = buf[:th * tw * 3].reshape(th, tw, 3)
        filler.render(idx, key, u, box, image, scratch, times)
        nh, nw = th // ph, tw // pw
        n = nh * nw
        dst[:n * ph] = image.reshape(nh, ph, nw, pw, 3).transpose(0, 2, 1, 3, 4).reshape(n * ph, pw, 3)
        dst[n * ph:] = 0

    def state(self) -> dict[str, str]:
        return {"tokens": repr(self.budget)}


def patches(images: Any, patch: int | tuple[int, int]) -> Any:
    """A token-budget batch ([B, C, L * ph, pw], as the Loader hands it out) as patch sequences
    [B, L, ph * pw * C], each patch's pixels in (row, column, channel) order: timm's `patchify_image`
    layout. A view where the batch's memory is NHWC (uint8 batches, channels_last), else a copy."""
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    b, c, lh, w = images.shape
    if w != pw or lh % ph:
        raise ConfigError(f"patches: a batch of {lh}x{w} rows is not patches of {ph}x{pw}; pass the TokenBudget's patch")
    return images.permute(0, 2, 3, 1).reshape(b, lh // ph, ph * pw * c)


def grids_of(heights: np.ndarray, widths: np.ndarray, budget: TokenBudget) -> np.ndarray:
    """Each stored size's grid (patches high, patches wide) under `budget`, int64 [n, 2]."""
    th, tw = token_grid(heights, widths, budget.patch, budget.max_tokens, budget.max_ratio)
    grid = np.empty((len(th), 2), np.int64)
    grid[:, 0], grid[:, 1] = th // budget.patch[0], tw // budget.patch[1]
    return grid

