"""Aspect-ratio buckets: every batch from one bucket, a (height, width) of about the same area.

SDXL-style training (and most diffusion trainers since) batches images of similar shape together
instead of cropping every image square:

- `AspectBuckets` lists the buckets: sides multiples of `multiple`, area at most `area`, aspect up to
  `max_ratio` either way (or an explicit list of sizes);
- `assign` puts each sample in the bucket nearest its stored aspect (the pack knows every size: no decode);
- `bucket_batches` lays an epoch out: the epoch's order grouped by bucket (its order kept), cut into
  batches, a bucket's partial batch completed with its own first samples (`drop_last=False`) or dropped,
  the batches shuffled by (seed, epoch), then as many as divide over the ranks (completed with the first
  batches, or cut with `drop_last=True`); rank r reads batches r, r + W, ...
- each image is resized to cover its bucket and cropped to it (`transforms.CoverCrop`, by the native
  engine); the batch hands out each sample's stored size and the crop's top-left (`extras`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError

#: a sample "fits" a bucket whose aspect is within this factor of its own: the cover crop keeps at least
#: half of it. Samples fitting no bucket still go to the nearest; a bucket list that fits no sample is refused.
FIT = 2.0
#: the extras each batch of a bucketed Loader hands out
EXTRAS = ("original_size", "crop_top_left")


@dataclass(frozen=True)
class AspectBuckets:
    """Aspect-ratio buckets for `stoker.Sampling(buckets=...)`: (height, width) sizes whose sides are
    multiples of `multiple`, of at most `area` pixels, with an aspect ratio of at most `max_ratio` either
    way (for each width the tallest height that fits, each with its transpose, and the square); or
    `sizes`, an explicit list of (height, width). Each image is resized to cover its bucket and
    cropped to it at a random place (`crop="random"`) or the centre (`"center"`)."""

    area: int = 1024 * 1024
    multiple: int = 64
    max_ratio: float = 4.0
    crop: str = "random"
    sizes: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"AspectBuckets: {msg}")

        for name in ("area", "multiple"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise bad(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_ratio, (int, float)) or not math.isfinite(self.max_ratio) or self.max_ratio < 1:
            raise bad(f"max_ratio must be a number >= 1, got {self.max_ratio!r}")
        if self.crop not in ("random", "center"):
            raise bad(f"crop must be 'random' or 'center', got {self.crop!r}")
        if self.sizes is not None:
            object.__setattr__(self, "sizes", _sizes(self.sizes))
        elif self.multiple * self.multiple > self.area:
            raise bad(f"area={self.area} holds no bucket of sides that are multiples of {self.multiple}; "
                      f"raise area= or lower multiple=")

    @classmethod
    def of(cls, value: Any) -> "AspectBuckets":
        """`Sampling(buckets=)`: an AspectBuckets, or a list of (height, width)."""
        if isinstance(value, AspectBuckets):
            return value
        if isinstance(value, (list, tuple)):
            return cls(sizes=tuple(value))
        raise ConfigError(f"buckets= takes a stoker.AspectBuckets or a list of (height, width), got {value!r:.80}")

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        """The buckets' (height, width), widest last."""
        if self.sizes is not None:
            return self.sizes
        m = self.multiple
        side = math.isqrt(self.area) // m * m
        found = {(side, side)} if side else set()
        for w in range(m, self.area // m + 1, m):   # each width, the tallest height that fits, and its transpose
            h = self.area // w // m * m
            if h >= m and max(h / w, w / h) <= self.max_ratio:
                found.update(((h, w), (w, h)))
        if not found:
            raise ConfigError(f"AspectBuckets: no bucket of area <= {self.area}, sides multiples of {self.multiple} "
                              f"and aspect within {self.max_ratio}; raise max_ratio= or area=")
        return tuple(sorted(found, key=lambda s: s[1] / s[0]))


def _sizes(sizes: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for s in sizes:
        try:
            h, w = (int(v) for v in s)
            ok = all(float(v) == int(v) for v in s)
        except (TypeError, ValueError):
            ok = False
        if not ok or h < 1 or w < 1:
            raise ConfigError(f"AspectBuckets(sizes=): each bucket is a (height, width) of positive ints, got {s!r}")
        if (h, w) not in out:
            out.append((h, w))
    if not out:
        raise ConfigError("AspectBuckets(sizes=) is empty: give at least one (height, width)")
    return tuple(sorted(out, key=lambda s: s[1] / s[0]))


def assign(heights: np.ndarray, widths: np.ndarray, sizes: Sequence[tuple[int, int]], keys: Any = None) -> np.ndarray:
    """The bucket (index into `sizes`, int32) nearest each sample's aspect (log width/height; ties to the
    first). A stored size that is not positive is a ConfigError naming the sample (`keys(i)`: its key); a
    bucket list that fits no sample (`FIT`) is refused."""
    h, w = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    bad = np.flatnonzero((h < 1) | (w < 1))
    if len(bad):
        i = int(bad[0])
        name = keys(i) if keys is not None else f"index {i}"
        raise ConfigError(f"sample {name} has the stored size {w[i]}x{h[i]}, which no bucket can take; re-pack it "
                          f"(stoker pack) or leave it out with Sampling(indices=)")
    mine = np.log(w.astype(np.float64)) - np.log(h.astype(np.float64))
    theirs = np.array([math.log(bw / bh) for bh, bw in sizes])   # increasing (sizes sorted by aspect)
    at = np.clip(np.searchsorted(theirs, mine), 1, max(len(theirs) - 1, 1))
    lo = np.maximum(at - 1, 0)
    hi = np.minimum(at, len(theirs) - 1)
    nearest = np.where(np.abs(mine - theirs[lo]) <= np.abs(theirs[hi] - mine), lo, hi).astype(np.int32)
    if len(mine) and not (np.abs(mine - theirs[nearest]) <= math.log(FIT)).any():
        raise ConfigError(f"the buckets {list(sizes)} fit none of the {len(mine)} samples (aspects "
                          f"{math.exp(mine.min()):.2f} to {math.exp(mine.max()):.2f} width/height; a bucket fits "
                          f"within a factor of {FIT:g}): give buckets of the data's shapes, or AspectBuckets()")
    return nearest


def bucket_batches(order: np.ndarray, bucket_of: np.ndarray, batch_size: int, drop_last: bool, world_size: int,
                   shuffle: np.ndarray | None) -> np.ndarray:
    """An epoch's batches, int64 [G, batch_size] of dataset indices (module docstring): `order` is the
    epoch's order (dataset indices), `shuffle` a permutation source for the batches (called with their
    count), or None to keep them in bucket order. G is a multiple of `world_size`."""
    of = bucket_of[order]
    parts = []
    for k in np.unique(of).tolist():
        idx = order[of == k]
        n = len(idx) // batch_size if drop_last else -(-len(idx) // batch_size)
        if n:
            parts.append(np.resize(idx, n * batch_size).reshape(n, batch_size))   # completed with its own first
    batches = np.concatenate(parts) if parts else np.empty((0, batch_size), np.int64)
    if shuffle is not None and len(batches):
        batches = batches[shuffle(len(batches))]
    return balance(batches, world_size, drop_last)


def balance(batches: np.ndarray, world_size: int, drop_last: bool) -> np.ndarray:
    """`batches` cut (drop_last) or completed with their first ones to a multiple of `world_size`."""
    g = len(batches)
    if g % world_size == 0:
        return batches
    if drop_last or g == 0:
        return batches[:g - g % world_size]
    return np.resize(batches, (g + world_size - g % world_size, batches.shape[1]))
