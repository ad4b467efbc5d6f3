"""benchmarks/bench_split.py's simulated part: SplitControl driven with synthetic capacities settles within 10%
of G / (G + C), and again after the CPU's capacity halves, in a bounded number of batches (no timing: a
seeded simulated clock)."""

from __future__ import annotations

import pytest

from conftest import load_benchmark

bench_split = load_benchmark("bench_split")


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_split_settles_within_10_percent_of_the_capacities_ratio(ratio: float, seed: int) -> None:
    run = bench_split.simulate(ratio, seed=seed, batches=240, noise=0.1)
    assert run.mode == "split"
    assert run.error <= 0.10 and run.error_after <= 0.10, run
    # the mean of 8 batches' shares within 10% from batch 64 on, and within 40 batches of the step
    assert run.batches is not None and run.batches <= 64, run
    assert run.batches_after is not None and run.batches_after <= 40, run


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.9])
def test_noisier_measurements_still_settle_on_the_ratio_on_average(ratio: float) -> None:
    """Each side's time jittered by 25% (log-normal): a batch's share scatters, the mean stays within 10%."""
    for seed in range(3):
        run = bench_split.simulate(ratio, seed=seed, batches=240, noise=0.25)
        assert run.error <= 0.10 and run.error_after <= 0.10, run


def test_without_noise_the_share_is_the_ratio_from_the_first_batches() -> None:
    for ratio in (0.25, 0.5, 0.75, 0.9):
        run = bench_split.simulate(ratio, noise=0.0)
        assert run.error < 0.01 and run.error_after < 0.01 and run.batches == run.batches_after == 8, run
    assert bench_split.settle_batches([0.5] * 3 + [0.1] * 20, 0.1) == 11   # 8 batches of 0.1 from the 4th on
    assert bench_split.settle_batches([0.1] * 20 + [0.5], 0.1) is None


def test_the_report_has_a_row_per_ratio() -> None:
    sim = bench_split.simulated(seeds=1, batches=80, noise=0.1)
    text = bench_split.report(sim, None, 1, 0.1)
    assert [r["ratio"] for r in sim] == list(bench_split.RATIOS)
    assert all(f"| {r:.2f} |" in text for r in bench_split.RATIOS)
