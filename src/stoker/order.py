"""The order of an epoch and the random numbers of each sample.

Everything here is a pure function of integers (seed, epoch, sample index, rank, world size), so a
batch's content never depends on thread count, prefetch depth or scheduling:

- `epoch_order`: a permutation of the dataset from `(seed, epoch)`; `"random"` is a full shuffle,
  `"sequential"` keeps dataset order, `"shard_random"` is a quasi-random order that reads each
  contiguous block of a shard exactly once per epoch (for datasets larger than the page cache).
- `shard_window_order`: the order for data fetched shard by shard (object storage): shards are
  shuffled, the epoch is cut into one contiguous run of shards per rank, and samples are shuffled
  within windows of a few consecutive shards; a rank reads (and downloads) about 1/world_size of
  the shards, and every rank gets the same number of samples.
- `rank_indices`: the slice of an epoch's order one distributed rank reads, padded or trimmed so every
  rank gets the same number of samples (the `DistributedSampler` rule).
- `Pool`: which samples an epoch draws from: all of them, a subset (`indices=`), or weighted draws
  with replacement (`weights=`, the `WeightedRandomSampler` rule), each a pure function too.
- `unseen_positions`, `layout_positions`: elastic resume. An epoch's progress over all ranks is the
  part of its global order no rank has read (as `to_ranges`, in a Loader's state); any world size
  splits that remainder over its ranks by the `rank_indices` rule.
- `uniforms`: per-sample uniform floats in [0, 1) from a counter-based hash of
  `(seed, epoch, sample index, counter)`, vectorised in numpy.

The hash is SplitMix64's finalizer, not numpy's bit generators, so orders stay the same across numpy
versions.
"""

from __future__ import annotations

import functools

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError

ORDERS = ("random", "sequential", "shard_random", "shard_window")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_MASK64 = (1 << 64) - 1
# Domain tags keep the streams of different uses apart.
_TAG_ORDER, _TAG_BLOCK, _TAG_SAMPLE, _TAG_REPLACE, _TAG_WEIGHTED = 1, 2, 3, 4, 5
#: the tag of per-draw random streams (weighted sampling: one sample drawn twice gets two crops)
TAG_DRAW = 6
#: the tag of per-sample random streams (`sample_keys`' default)
TAG_SAMPLE = _TAG_SAMPLE
_TAG_SHARD = 7
#: the tag of per-clip random streams (stoker.video.clip_key: where a clip lies in time, its one plan)
TAG_CLIP = 8
#: the tag of per-sample caption choices (`Targets(captions=)`: which of a sample's captions an epoch hands out)
TAG_CAPTION = 9


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over a uint64 array (wrapping arithmetic); returns a new array."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z ^= z >> _S30  # in place: the same values, fewer arrays made (once per batch, on [rows, draws])
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def _u64(value: int) -> np.ndarray:
    return np.array([int(value) & _MASK64], dtype=np.uint64)


@functools.lru_cache(maxsize=64)
def stream_key(seed: int, epoch: int, tag: int) -> np.ndarray:
    """One uint64 (as a read-only length-1 array) naming the stream of `(seed, epoch, tag)`. Cached:
    every batch of an epoch asks for the same one (ten NumPy calls saved per batch)."""
    key = mix64(mix64(mix64(_u64(seed)) ^ _u64(epoch)) ^ _u64(tag))
    key.flags.writeable = False
    return key


def sample_keys(seed: int, epoch: int, indices: np.ndarray, *, tag: int = _TAG_SAMPLE) -> np.ndarray:
    """uint64 key per sample index: the root of that sample's random stream in this epoch."""
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64)
    return mix64(stream_key(seed, epoch, tag) ^ idx)


def uniforms(keys: np.ndarray, count: int, offset: int = 0) -> np.ndarray:
    """float64 [len(keys), count] uniform in [0, 1): draws `offset .. offset+count-1` of each key's stream."""
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1, 1)
    bits = mix64(keys ^ _counters(offset, count))
    bits >>= _S11
    return bits.astype(np.float64) * (1.0 / 9007199254740992.0)


@functools.lru_cache(maxsize=64)
def _counters(offset: int, count: int) -> np.ndarray:
    """uint64 [1, count]: draw counters `offset + 1 ..` times the stream multiplier (read-only, cached:
    the same for every batch)."""
    counters = np.arange(offset + 1, offset + count + 1, dtype=np.uint64).reshape(1, -1) * _M2
    counters.flags.writeable = False
    return counters


def _hash_order(keys: np.ndarray) -> np.ndarray:
    return np.argsort(keys, kind="stable")


@dataclass(frozen=True)
class ShardRandom:
    """Parameters of the `"shard_random"` order: blocks of `block` consecutive rows (never across a
    shard boundary) are visited in random order, `window` blocks at a time, and samples are shuffled
    within each window. Each block is read once per epoch; about `block * window` samples are live."""

    block: int = 64
    window: int = 32

    def __post_init__(self) -> None:
        if self.block < 1 or self.window < 1:
            raise ConfigError(f"ShardRandom needs block >= 1 and window >= 1, got block={self.block}, "
                              f"window={self.window}")


def _shard_random(n: int, shard_rows: Sequence[int], seed: int, epoch: int, cfg: ShardRandom) -> np.ndarray:
    starts = np.cumsum([0, *shard_rows])[:-1]
    if int(sum(shard_rows)) != n:
        raise ConfigError(f"shard row counts sum to {int(sum(shard_rows))}, the dataset has {n} samples")
    # Block id of each sample: blocks restart at every shard start.
    shard_of = np.repeat(np.arange(len(shard_rows)), shard_rows)
    row_in_shard = np.arange(n) - np.repeat(starts, shard_rows)
    blocks_per_shard = -(-np.asarray(shard_rows, dtype=np.int64) // cfg.block)
    block_base = np.cumsum([0, *blocks_per_shard])[:-1]
    block_of = block_base[shard_of] + row_in_shard // cfg.block if n else np.zeros(0, np.int64)
    n_blocks = int(blocks_per_shard.sum())
    block_rank = np.empty(n_blocks, dtype=np.int64)
    block_rank[_hash_order(sample_keys(seed, epoch, np.arange(n_blocks), tag=_TAG_BLOCK))] = np.arange(n_blocks)
    window_of = block_rank[block_of] // cfg.window
    within = sample_keys(seed, epoch, np.arange(n), tag=_TAG_ORDER)
    return np.lexsort((within, window_of)).astype(np.int64)


def epoch_order(n: int, *, seed: int, epoch: int, order: str = "random",
                shard_rows: Sequence[int] | None = None, shard_random: ShardRandom | None = None) -> np.ndarray:
    """int64 [n]: the dataset indices of epoch `epoch` in the order they are read.

    `shard_rows` (rows per shard, in dataset order) is used by `"shard_random"` and `"shard_window"`
    (the single-rank order of `shard_window_order`); without it the dataset counts as one shard."""
    if order not in ORDERS:
        raise ConfigError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "sequential":
        return np.arange(n, dtype=np.int64)
    if order == "random":
        return _hash_order(sample_keys(seed, epoch, np.arange(n), tag=_TAG_ORDER)).astype(np.int64)
    rows = list(shard_rows) if shard_rows else [n]
    if int(sum(rows)) != n:
        raise ConfigError(f"shard row counts sum to {int(sum(rows))}, the dataset has {n} samples")
    if order == "shard_window":
        return shard_window_order(rows, seed=seed, epoch=epoch)
    return _shard_random(n, rows, seed, epoch, shard_random or ShardRandom())


def shard_window_order(shard_rows: Sequence[int], *, seed: int, epoch: int, rank: int = 0, world_size: int = 1,
                       drop_last: bool = False, window: int = 4) -> np.ndarray:
    """int64: the dataset indices `rank` reads in `epoch` under the shard-aware order.

    1. Shards are shuffled from `(seed, epoch)`; their rows, in that shard order, make one sequence.
    2. The sequence is cut into `world_size` equal contiguous parts, one per rank (padded with
       repeats of its own last samples, or trimmed, by the `rank_indices` counting rule), so a rank
       touches only its ~1/world_size of the shards plus at most the two it shares with neighbours.
    3. Within a rank's part, samples are shuffled inside windows of `window` consecutive shards:
       a batch mixes up to `window` shards, and only about that many must be local at once.
    A pure function of its arguments: the same for any thread count, and resumable at any position."""
    if window < 1:
        raise ConfigError(f"window must be >= 1 shards, got {window!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
    rows = np.asarray(shard_rows, dtype=np.int64)
    n = int(rows.sum())
    starts = np.cumsum(np.concatenate([[0], rows]))[:-1]
    shard_perm = _hash_order(sample_keys(seed, epoch, np.arange(len(rows)), tag=_TAG_SHARD))
    seq = np.concatenate([np.arange(starts[s], starts[s] + rows[s]) for s in shard_perm]) if n else \
        np.zeros(0, np.int64)
    slot_of = np.repeat(np.arange(len(rows)), rows[shard_perm])  # the shard's place in the shuffled order
    per = samples_per_rank(n, world_size, drop_last)
    total = per * world_size
    if total > n and n:  # pad with repeats from the end: samples of the shards the last rank reads anyway
        extra = np.resize(np.arange(n - 1, -1, -1), total - n)
        seq, slot_of = np.concatenate([seq, seq[extra]]), np.concatenate([slot_of, slot_of[extra]])
    lo, hi = rank * per, (rank + 1) * per
    mine, slots = seq[lo:hi], slot_of[lo:hi]
    if not len(mine):
        return mine.astype(np.int64)
    window_of = (slots - slots[0]) // window
    within = sample_keys(seed, epoch, np.arange(lo, hi), tag=_TAG_ORDER)
    return mine[np.lexsort((within, window_of))].astype(np.int64)


def samples_per_rank(n: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank reads per epoch: floor(n / world) with drop_last, else ceil (padding repeats)."""
    return n // world_size if drop_last else -(-n // world_size)


def rank_indices(order: np.ndarray, rank: int, world_size: int, *, drop_last: bool,
                 contiguous: bool = False) -> np.ndarray:
    """The part of an epoch's order that `rank` reads; every rank gets the same count.

    Like torch's DistributedSampler: without drop_last the order is padded by repeating its first
    (at most world_size - 1) entries; with drop_last its tail (at most world_size - 1) is dropped.
    Ranks take every world_size-th entry (`contiguous=False`) or one contiguous chunk each."""
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
    n = len(order)
    per = samples_per_rank(n, world_size, drop_last)
    total = per * world_size
    if total > n:
        reps = -(-total // n) if n else 0
        order = np.tile(order, reps)[:total] if n else order
    else:
        order = order[:total]
    if contiguous:
        return order[rank * per:(rank + 1) * per]
    return order[rank:total:world_size]


def num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches in an epoch of `samples` samples; a partial last batch counts unless drop_last."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def replacement_index(seed: int, epoch: int, position: int, attempt: int, n: int) -> int:
    """The sample that stands in for the one at `position` of the epoch after `attempt` failures
    (on_error="skip"): a pure function of its arguments, so it does not depend on scheduling."""
    key = sample_keys(seed, epoch, np.array([position]), tag=_TAG_REPLACE)
    return int(mix64(key ^ _u64(attempt + 1))[0] % np.uint64(n))


@dataclass(frozen=True)
class Pool:
    """The samples an epoch is made of. `indices` (None: the whole dataset) is the subset an epoch
    permutes; with `cdf` (weights), an epoch is instead `size` draws with replacement, each picking
    sample i with probability weight[i] / sum(weights); with `plan`, `size` draws of the plan's own.
    `fingerprint` names the choice in a saved loader state (None for the whole dataset)."""

    size: int
    indices: np.ndarray | None = None
    cdf: np.ndarray | None = None
    fingerprint: str | None = None
    plan: Any = None   # draws of its own (`draw(seed, epoch)`): a Mix (stoker.mix.MixPlan)

    @property
    def weighted(self) -> bool:
        """Whether an epoch is drawn (with repeats possible) rather than a permutation."""
        return self.cdf is not None or self.plan is not None

    def members(self) -> np.ndarray | None:
        """Dataset indices a stand-in for a failed sample may come from (None: any)."""
        return self.indices

    def draw(self, seed: int, epoch: int) -> np.ndarray:
        """The weighted epoch: `size` dataset indices, by inverse CDF over uniforms of `(seed, epoch, draw)`
        (or the plan's own draws)."""
        if self.plan is not None:
            return self.plan.draw(seed, epoch)
        assert self.cdf is not None
        u = uniforms(sample_keys(seed, epoch, np.arange(self.size), tag=_TAG_WEIGHTED), 1)[:, 0]
        picks = np.minimum(np.searchsorted(self.cdf, u * self.cdf[-1], side="right"), len(self.cdf) - 1)
        return picks if self.indices is None else self.indices[picks]


def make_pool(n: int, indices: Any = None, weights: Any = None) -> Pool:
    """Check `indices` (dataset indices, like `torch.utils.data.Subset`) and `weights` (one per dataset
    sample, or per entry of `indices`; like `WeightedRandomSampler(weights, len(weights))`)."""
    if indices is None and weights is None:
        return Pool(n)
    digest = hashlib.sha256()
    idx = None
    if indices is not None:
        idx = np.asarray(indices)
        if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
            raise ConfigError(f"indices must be a non-empty 1-D sequence of ints (dataset indices), got {indices!r:.100}")
        idx = idx.astype(np.int64)
        bad = idx[(idx < 0) | (idx >= n)]
        if bad.size:
            raise ConfigError(f"indices hold {bad.size} value(s) outside the dataset's 0..{n - 1}, e.g. {int(bad[0])}")
        digest.update(b"indices" + idx.tobytes())
    size = n if idx is None else len(idx)
    cdf = None
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) != size:
            what = "entry of indices" if idx is not None else "dataset sample"
            raise ConfigError(f"weights must hold one number per {what} ({size}), got shape {w.shape}")
        if not np.isfinite(w).all() or (w < 0).any() or not w.max() > 0:
            bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
            found = f"weights[{bad[0]}] = {w[bad[0]]}" if bad.size else "all are 0"
            raise ConfigError(f"weights must be finite and >= 0, with a positive sum; {found}")
        with np.errstate(over="ignore"):
            cdf = np.cumsum(w)
        if not 1e-200 < cdf[-1] < np.inf:  # a sum that overflows (or nearly underflows): same proportions,
            cdf = np.cumsum(w / w.max())     # scaled to at most one per sample
        digest.update(b"weights" + w.tobytes())
    return Pool(size, idx, cdf, digest.hexdigest()[:16])


# ---- elastic resume: an epoch's progress over all ranks, whatever their number -------------------

def layout_positions(queue: np.ndarray, rank: int, world_size: int, *, drop_last: bool, contiguous: bool,
                     batch_size: int) -> np.ndarray:
    """The entries of `queue` (positions in an epoch's global order) that `rank` reads, in order: the
    `rank_indices` rule, then, with drop_last, trimmed to whole batches (the same count on every rank)."""
    mine = rank_indices(queue, rank, world_size, drop_last=drop_last, contiguous=contiguous)
    return mine[:len(mine) // batch_size * batch_size] if drop_last else mine


def unseen_positions(queue: np.ndarray, sample: int, world_size: int, *, drop_last: bool,
                     contiguous: bool) -> np.ndarray:
    """The entries of `queue` no rank has read once every rank of `world_size` read its first `sample`
    (ranks step together: each rank's checkpoint is at the same count), in queue order, each once.
    A pure function: O(len(queue)), whatever the world size."""
    n = len(queue)
    per = samples_per_rank(n, world_size, drop_last)
    total = per * world_size
    padded = np.resize(queue, total) if total > n and n else queue[:total]   # the rank_indices padding
    sample = min(int(sample), per)
    if contiguous:
        seen = padded[(np.arange(world_size)[:, None] * per + np.arange(sample)[None, :]).ravel()]
    else:
        seen = padded[:sample * world_size]
    return queue[~np.isin(queue, seen)]


def to_ranges(positions: np.ndarray) -> list[list[int]]:
    """Increasing runs of consecutive positions as [start, stop) pairs: a compact, JSON-able queue."""
    p = np.asarray(positions, dtype=np.int64)
    if not len(p):
        return []
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    starts, stops = np.r_[p[:1], p[breaks]], np.r_[p[breaks - 1] + 1, p[-1:] + 1]
    return [[int(a), int(b)] for a, b in zip(starts, stops)]


def from_ranges(ranges: Sequence[Sequence[int]], size: int) -> np.ndarray:
    """The positions of `to_ranges`' pairs; refuses pairs outside an epoch of `size` entries, or not
    increasing and disjoint (a position listed twice would be read twice)."""
    parts = []
    last = 0
    for pair in ranges:
        if len(pair) != 2 or not last <= int(pair[0]) <= int(pair[1]) <= size:
            raise ConfigError(f"saved loader state: range {list(pair)!r} is not within the epoch's {size} samples, "
                              f"after the ranges before it")
        parts.append(np.arange(int(pair[0]), int(pair[1]), dtype=np.int64))
        last = int(pair[1])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
