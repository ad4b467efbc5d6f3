"""Epoch order, rank slices and per-sample random streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stoker.errors import ConfigError
from stoker.order import (ShardRandom, epoch_order, num_batches, rank_indices, replacement_index, sample_keys,
                          shard_window_order,
                          samples_per_rank, uniforms)


@pytest.mark.parametrize("order", ["random", "sequential", "shard_random", "shard_window"])
def test_epoch_order_is_a_permutation(order: str) -> None:
    perm = epoch_order(1000, seed=3, epoch=1, order=order, shard_rows=[300, 300, 400])
    assert perm.dtype == np.int64
    assert np.array_equal(np.sort(perm), np.arange(1000))


def test_random_order_depends_on_seed_and_epoch_only() -> None:
    a = epoch_order(500, seed=1, epoch=0)
    assert np.array_equal(a, epoch_order(500, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_order(500, seed=1, epoch=1))
    assert not np.array_equal(a, epoch_order(500, seed=2, epoch=0))
    assert not np.array_equal(a, np.arange(500))
    assert np.array_equal(epoch_order(500, seed=1, epoch=0, order="sequential"), np.arange(500))


def test_random_order_looks_uniform() -> None:
    # Where sample 0 lands over many epochs: roughly uniform over 10 bins of 100 positions.
    counts = np.zeros(10)
    for e in range(2000):
        counts[int(np.argmax(epoch_order(1000, seed=0, epoch=e) == 0)) // 100] += 1
    chi2 = ((counts - 200) ** 2 / 200).sum()
    assert chi2 < 30  # 9 dof; p < 1e-3 above 27.9


def test_shard_random_reads_each_block_once_per_window() -> None:
    rows = [130, 70, 200]
    cfg = ShardRandom(block=16, window=4)
    perm = epoch_order(400, seed=5, epoch=2, order="shard_random", shard_rows=rows, shard_random=cfg)
    starts = np.cumsum([0, *rows])[:-1]
    shard_of = np.searchsorted(starts, perm, side="right") - 1
    block_of = shard_of * 10_000 + (perm - starts[shard_of]) // cfg.block
    # Walk the order window by window: a block never reappears once its window has passed.
    seen_done: set[int] = set()
    pos = 0
    while pos < len(perm):
        blocks = set()
        while pos < len(perm) and (len(blocks) < cfg.window or block_of[pos] in blocks):
            blocks.add(int(block_of[pos]))
            pos += 1
        assert not blocks & seen_done
        seen_done |= blocks
    assert not np.array_equal(perm, np.arange(400))
    assert not np.array_equal(perm, epoch_order(400, seed=5, epoch=3, order="shard_random", shard_rows=rows,
                                                shard_random=cfg))


def test_shard_random_rejects_wrong_row_counts() -> None:
    with pytest.raises(ConfigError, match="sum to 10"):
        epoch_order(11, seed=0, epoch=0, order="shard_random", shard_rows=[5, 5])
    with pytest.raises(ConfigError):
        ShardRandom(block=0)
    with pytest.raises(ConfigError, match="order must be"):
        epoch_order(3, seed=0, epoch=0, order="shuffled")


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 300), world=st.integers(1, 8), drop_last=st.booleans(), contiguous=st.booleans())
def test_rank_slices_cover_the_epoch(n: int, world: int, drop_last: bool, contiguous: bool) -> None:
    perm = epoch_order(n, seed=n, epoch=world)
    parts = [rank_indices(perm, r, world, drop_last=drop_last, contiguous=contiguous) for r in range(world)]
    per = samples_per_rank(n, world, drop_last)
    assert all(len(p) == per for p in parts)
    allidx = np.concatenate(parts)
    uniq = np.unique(allidx)
    if drop_last:
        assert len(uniq) == len(allidx) and n - len(allidx) <= world - 1  # disjoint; drops < world
    else:
        if n >= world:
            assert len(uniq) == n  # every sample seen
            assert len(allidx) - n <= world - 1  # at most world-1 repeats
        else:
            assert len(uniq) == n


def test_rank_slice_matches_distributed_sampler_rule() -> None:
    perm = np.arange(10)
    # torch DistributedSampler(shuffle=False, num_replicas=4): pad with the first 2, then stride.
    assert rank_indices(perm, 0, 4, drop_last=False).tolist() == [0, 4, 8]
    assert rank_indices(perm, 1, 4, drop_last=False).tolist() == [1, 5, 9]
    assert rank_indices(perm, 2, 4, drop_last=False).tolist() == [2, 6, 0]
    assert rank_indices(perm, 3, 4, drop_last=True).tolist() == [3, 7]
    with pytest.raises(ConfigError):
        rank_indices(perm, 4, 4, drop_last=False)


def test_num_batches() -> None:
    assert num_batches(10, 4, False) == 3
    assert num_batches(10, 4, True) == 2
    assert num_batches(8, 4, True) == 2


def test_uniforms_are_per_sample_and_independent_of_the_batch() -> None:
    keys = sample_keys(7, 3, np.arange(1000))
    u = uniforms(keys, 5)
    assert u.shape == (1000, 5) and u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    # A sample's stream is the same whatever else is in its batch, and offsets are stream slices.
    assert np.array_equal(uniforms(keys[[42, 7]], 5), u[[42, 7]])
    assert np.array_equal(uniforms(keys, 2, offset=3), u[:, 3:5])
    # Neighbouring counters and neighbouring samples are uncorrelated.
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.1
    assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.1
    assert not np.array_equal(sample_keys(7, 4, np.arange(10)), keys[:10])


def test_replacement_index_is_deterministic_and_in_range() -> None:
    picks = [replacement_index(1, 2, pos, att, 50) for pos in range(100) for att in range(3)]
    assert picks == [replacement_index(1, 2, pos, att, 50) for pos in range(100) for att in range(3)]
    assert all(0 <= p < 50 for p in picks)
    assert len(set(picks)) > 30


# ---- shard_window: the order for shards fetched from object storage ------------------------------

def _shard_of(indices: np.ndarray, rows: list[int]) -> np.ndarray:
    return np.searchsorted(np.cumsum(rows), indices, side="right")


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_window_ranks_are_disjoint_balanced_and_cover_the_epoch(world: int, drop_last: bool) -> None:
    rows = [100] * 15 + [37]
    n = sum(rows)
    parts = [shard_window_order(rows, seed=4, epoch=1, rank=r, world_size=world, drop_last=drop_last)
             for r in range(world)]
    per = samples_per_rank(n, world, drop_last)
    assert all(len(p) == per for p in parts)
    together = np.concatenate(parts)
    if drop_last:
        assert len(np.unique(together)) == len(together)  # nothing read twice
    else:
        assert set(together.tolist()) == set(range(n))  # nothing lost
        assert len(together) - len(np.unique(together)) == per * world - n  # only the padding repeats


def test_shard_window_rank_reads_about_its_share_of_shards() -> None:
    rows = [64] * 40
    for epoch in range(3):
        touched = [set(_shard_of(shard_window_order(rows, seed=0, epoch=epoch, rank=r, world_size=2), rows).tolist())
                   for r in range(2)]
        assert all(len(t) <= 21 for t in touched)  # 20 of 40, plus at most one shared at the cut
        assert len(touched[0] & touched[1]) <= 1
    # different epochs give a rank different shards
    a = set(_shard_of(shard_window_order(rows, seed=0, epoch=0, rank=0, world_size=2), rows).tolist())
    b = set(_shard_of(shard_window_order(rows, seed=0, epoch=1, rank=0, world_size=2), rows).tolist())
    assert a != b


def test_shard_window_mixes_within_windows_only() -> None:
    rows = [50] * 12
    window = 3
    order = shard_window_order(rows, seed=9, epoch=0, window=window)
    shards = _shard_of(order, rows)
    # walking the order, each run of 150 samples comes from exactly `window` shards, then those never return
    runs = [set(shards[i:i + 150].tolist()) for i in range(0, 600, 150)]
    assert all(len(r) == window for r in runs)
    assert set().union(*runs) == set(range(12)) and sum(len(r) for r in runs) == 12
    # within a window, samples of its shards are interleaved, not one shard after another
    assert len(np.unique(shards[:10])) > 1
    assert not np.array_equal(order, shard_window_order(rows, seed=9, epoch=1, window=window))
    assert np.array_equal(order, shard_window_order(rows, seed=9, epoch=0, window=window))
    assert np.array_equal(epoch_order(600, seed=9, epoch=0, order="shard_window", shard_rows=rows),
                          shard_window_order(rows, seed=9, epoch=0))  # the single-rank order, window 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 5), st.integers(1, 4),
       st.booleans(), st.integers(0, 3))
def test_shard_window_counting_rule_holds(rows: list[int], world: int, window: int, drop_last: bool,
                                          epoch: int) -> None:
    n = sum(rows)
    parts = [shard_window_order(rows, seed=1, epoch=epoch, rank=r, world_size=world, drop_last=drop_last,
                                window=window) for r in range(world)]
    assert [len(p) for p in parts] == [samples_per_rank(n, world, drop_last)] * world
    together = np.concatenate(parts)
    assert ((together >= 0) & (together < max(n, 1))).all()
    if not drop_last and n:
        assert set(together.tolist()) == set(range(n))


def test_shard_window_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="window"):
        shard_window_order([10], seed=0, epoch=0, window=0)
    with pytest.raises(ConfigError, match="rank"):
        shard_window_order([10], seed=0, epoch=0, rank=2, world_size=2)


@given(st.lists(st.floats(0, 10), min_size=1, max_size=40), st.integers(0, 2**31), st.integers(0, 50))
def test_weighted_draws_never_pick_zero_weights_and_repeat_exactly(weights, seed, epoch):
    from stoker.order import make_pool

    assume(sum(weights) > 0)
    pool = make_pool(len(weights), weights=weights)
    draws = pool.draw(seed, epoch)
    assert len(draws) == len(weights) and ((draws >= 0) & (draws < len(weights))).all()
    assert all(weights[i] > 0 for i in draws)
    assert np.array_equal(draws, make_pool(len(weights), weights=weights).draw(seed, epoch))
