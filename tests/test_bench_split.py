"""benchmarks/bench_split.py's simulated part: SplitControl driven with synthetic capacities settles within 10%
of G / (G + C), and again after the CPU's capacity halves, in a bounded number of batches (no timing: a
seeded simulated clock)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_benchmark
from stoker.device.gpu_split import SplitControl

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


@pytest.mark.parametrize("seed", [0, 1, 2, 7, 11])
def test_a_gpu_adding_a_tenth_is_split_in_on_the_capacities_prediction(seed: int) -> None:
    """At G / (G + C) = 0.10 the split adds 11%, less than 8 noisy batches can show: the probes' verdict
    is inside the noise, so the capacities decide (the controller used to keep the CPU alone here)."""
    run = bench_split.simulate(0.1, seed=seed, batches=240, noise=0.25)
    assert run.mode == "split" and run.error <= 0.10 and run.error_after <= 0.10, run
    assert run.within >= 0.85 and run.within_after >= 0.85, run


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_a_step_change_is_followed_within_24_batches(ratio: float) -> None:
    """The CPU's capacity halves at batch 120: the change detector restarts the CPU's mean, and the
    mean of 8 batches' shares is within 10% of the new ratio by 24 batches after (sigma 0.25)."""
    for seed in range(3):
        run = bench_split.simulate(ratio, seed=seed, batches=240, noise=0.25)
        assert run.batches_after is not None and run.batches_after <= 24, run
        assert run.within_after >= 0.85 and run.error_after <= 0.10, run


def _interfering(ctrl: SplitControl, gpu_rate: float, cpu_rate: float, batches: int, slow: float, seed: int,
                 noise: float = 0.25, fails: bool = False) -> list[tuple[float, str | None]]:
    """Drive `ctrl` with each side's time jittered (log-normal, sigma `noise`), the CPU rows `slow` times
    slower in a split batch (the two sides sharing the host); `fails`: the GPU decodes none of its rows
    (their CPU fallback on its time). Returns the share each batch was planned at and the probe then."""
    rng = np.random.default_rng(seed)
    planned = []
    for _ in range(batches):
        planned.append((ctrl.share, ctrl.probe))
        n_gpu = ctrl.gpu_rows(256)
        n_cpu = 256 - n_gpu
        jitter_g, jitter_c = np.exp(noise * rng.standard_normal(2) - noise ** 2 / 2)
        gpu_s = n_gpu / gpu_rate * jitter_g
        cpu_s = n_cpu * ctrl.threads / cpu_rate * jitter_c * (slow if n_gpu else 1.0)
        if n_cpu:
            ctrl.observe_cpu(n_cpu, cpu_s)
        if n_gpu:
            ctrl.observe_gpu(0 if fails else n_gpu, gpu_s)
        ctrl.observe_batch(256, max(cpu_s / ctrl.threads, gpu_s if n_gpu else 0.0), split=n_gpu > 0)
        ctrl.batch_done()
    return planned


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_split_that_interferes_goes_back_to_the_cpu_alone(seed: int) -> None:
    """The capacities predict the split (G / (G + C) = 0.2), but beside the GPU the CPU rows take three
    times as long: the split's batches come at 1,000 + 4,000 / 3 img/s against the CPU alone's 4,000,
    slower far beyond the noise, and the CPU alone is kept between probes."""
    ctrl = SplitControl(8)
    planned = _interfering(ctrl, 1000.0, 4000.0, 240, slow=3.0, seed=seed)
    assert ctrl.mode == "cpu" and ctrl.reason.startswith("CPU only: batches came at"), ctrl.reason
    outside = [share for share, probe in planned[40:] if probe != "split"]
    assert outside and max(outside) == 0.0
    # the same capacities without the interference: split, at the ratio
    ctrl = SplitControl(8)
    _interfering(ctrl, 1000.0, 4000.0, 240, slow=1.0, seed=seed)
    assert ctrl.mode == "split" and abs(ctrl.settled - 0.2) <= 0.02, ctrl.reason


@pytest.mark.parametrize("seed", [0, 1])
def test_a_decoder_that_fails_every_image_gets_no_more_than_the_probes(seed: int) -> None:
    """Its rate measures 0 from its first batch: the CPU alone at once, the GPU handed rows only in the
    probe windows of the split (8 batches in 40), each at the floor share."""
    ctrl = SplitControl(8)
    planned = _interfering(ctrl, 3000.0, 4000.0, 400, slow=1.0, seed=seed, fails=True)
    assert ctrl.mode == "cpu" and ctrl.gpu_rate == 0.0
    given = [(k, share, probe) for k, (share, probe) in enumerate(planned) if share > 0]
    assert all(probe == "split" and share == ctrl.floor for k, share, probe in given if k > 1), given
    assert len(given) <= 1 + 8 * 10, given   # the first batch at the starting share; a window every 40
