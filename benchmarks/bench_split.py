"""Where decode="auto"'s split settles, against the capacities' ratio, and how many batches it takes.

    python benchmarks/bench_split.py [--only simulated loader] [--batches 240] [--seeds 5] [--noise 0.25]
                                     [--rates R R R] [--images 256] [--json out.json]

`SplitControl` (`stoker.device.gpu_split`) gives the GPU the share G / (G + C) of each batch's JPEG
rows, G and C being the two sides' measured images/s, so both finish together. Two checks, each against
that target (met when the settled share is within 10% of the capacities' ratio):

1. **Simulated.** The controller alone, driven as the device thread drives it (`observe_cpu`,
   `observe_gpu`, `observe_batch`, `batch_done`) with a simulated clock: the CPU threads render at C
   img/s, the GPU decodes at G img/s, each side's time per batch jittered (log-normal, mean 1, sigma
   `--noise`), the probe windows on (the CPU alone is timed every 40 batches, as in a Loader). For
   several ratios G / (G + C): the settled share (`SplitControl.settled`, its mean over the last
   half of the run), the batches until it stays within 10% of the ratio, and the same after a step
   change: the CPU's capacity halved mid-run (another process taking half the cores), against the
   new ratio. No timing: deterministic per seed, and the figures are the same on any machine.
2. **Loader.** A real `stoker.Loader(..., device=DeviceOptions("cpu", decode="auto",
   gpu_decoder=FixedRateDecoder(images_per_s=R)))` on generated JPEGs, for several stand-in rates R
   (`tests/gpu_standin.py`: each call blocks for images / R seconds, GIL released, as a hardware
   decoder's call does; by default the rates that would give the GPU 1/4, 1/2 and 3/4 of the capacity,
   from the CPU threads' rate measured first). Each side's capacity is measured alone (gpu_share=1: the stand-in and the
   device side's resample; gpu_share=0: the worker threads), and the automatic split run for a few
   epochs on one Loader: where it settled against G / (G + C) of those capacities, and against the
   rates the controller measured beside each other (the two sides share this host's cores, so each is
   slower beside the other than alone). About a minute on 2 cores; absolute rates are the machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoker.device.gpu_split import SplitControl

TARGET = 0.10   # the settled share within this fraction of the capacities' ratio
RATIOS = (0.1, 0.25, 0.5, 0.75, 0.9)   # G / (G + C) of the simulated runs
CPU_RATE = 4000.0   # img/s of the simulated CPU threads (only the ratio matters)
LOADER_RATIOS = (0.25, 0.5, 0.75)   # the stand-in's rate against the CPU's capacity alone, by default


# ----------------------------------------------------------------------------- 1. simulated

def drive(ctrl: SplitControl, gpu_rate: float, cpu_rate: float, batches: int, rng: np.random.Generator,
          batch: int = 256, noise: float = 0.25) -> list[float]:
    """`batches` batches through `ctrl` as the device thread reports them (`gpu_pipeline._account`): the
    GPU's rows take n_gpu / gpu_rate seconds, the CPU's n_cpu * threads / cpu_rate thread-seconds, each
    times its own log-normal jitter (mean 1); the batch as long as its slower side. Returns `settled`
    after each batch."""
    settled = []
    for _ in range(batches):
        n_gpu = ctrl.gpu_rows(batch)
        n_cpu = batch - n_gpu
        jitter_g, jitter_c = np.exp(noise * rng.standard_normal(2) - noise ** 2 / 2)
        gpu_s = n_gpu / gpu_rate * jitter_g
        cpu_s = n_cpu * ctrl.threads / cpu_rate * jitter_c
        if n_cpu:
            ctrl.observe_cpu(n_cpu, cpu_s)
        if n_gpu:
            ctrl.observe_gpu(n_gpu, gpu_s)
        ctrl.observe_batch(batch, max(cpu_s / ctrl.threads, gpu_s if n_gpu else 0.0), split=n_gpu > 0)
        ctrl.batch_done()
        settled.append(ctrl.settled)
    return settled


WINDOW = 8   # batches of the moving mean that decides when the share has settled


def settle_batches(settled: list[float], want: float, within: float = TARGET, window: int = WINDOW) -> int | None:
    """Batches until the share has settled: the mean of the last `window` batches' shares stays within
    `within` of `want` from there to the end (counted at the window's last batch), or None when it
    never does. Each batch's share moves with the noise of its measurements; the mean is what the
    throughput sees."""
    means = np.convolve(settled, np.ones(window) / window, mode="valid")
    off = np.flatnonzero(np.abs(means - want) > within * want)
    if len(off) == 0:
        return window
    return None if off[-1] == len(means) - 1 else int(off[-1]) + window + 1


def within_share(settled: list[float], want: float, within: float = TARGET) -> float:
    """The share of batches whose own share was within `within` of `want`."""
    return float(np.mean(np.abs(np.asarray(settled) - want) <= within * want))


@dataclass
class Simulated:
    """One simulated run: a ratio, and a step change of the CPU's capacity halfway."""

    ratio: float            # G / (G + C) before the step
    settled: float          # mean settled share over the second quarter of the run (before the step)
    batches: int | None     # batches until it settled within TARGET of `ratio` (`settle_batches`)
    within: float           # share of the second quarter's batches, each within TARGET of `ratio`
    ratio_after: float      # G / (G + C / 2): the CPU's capacity halved
    settled_after: float    # mean settled share over the last quarter
    batches_after: int | None   # batches after the step until it settled within TARGET of `ratio_after`
    within_after: float
    mode: str               # "split" or "cpu" at the end

    @property
    def error(self) -> float:
        return abs(self.settled - self.ratio) / self.ratio

    @property
    def error_after(self) -> float:
        return abs(self.settled_after - self.ratio_after) / self.ratio_after


def simulate(ratio: float, seed: int = 0, batches: int = 240, noise: float = 0.25, threads: int = 8) -> Simulated:
    """The controller (default settings) on a CPU of CPU_RATE img/s and a GPU giving `ratio`; after
    `batches` / 2 batches the CPU's capacity halves."""
    rng = np.random.default_rng(seed)
    gpu = CPU_RATE * ratio / (1 - ratio)
    ctrl = SplitControl(threads)
    half = batches // 2
    before = drive(ctrl, gpu, CPU_RATE, half, rng, noise=noise)
    after = drive(ctrl, gpu, CPU_RATE / 2, batches - half, rng, noise=noise)
    ratio_after = gpu / (gpu + CPU_RATE / 2)
    tail = after[len(after) // 2:]
    return Simulated(ratio, float(np.mean(before[half // 2:])), settle_batches(before, ratio),
                     within_share(before[half // 2:], ratio), ratio_after, float(np.mean(tail)),
                     settle_batches(after, ratio_after), within_share(tail, ratio_after), ctrl.mode)


def simulated(seeds: int, batches: int, noise: float) -> list[dict[str, Any]]:
    """Each ratio over `seeds` seeds: the worst error and the most batches to settle among them."""
    out = []
    for ratio in RATIOS:
        runs = [simulate(ratio, seed, batches, noise) for seed in range(seeds)]
        worst = max(runs, key=lambda r: max(r.error, r.error_after))

        def most(field: str) -> int | None:
            counts = [getattr(r, field) for r in runs]
            return None if None in counts else max(counts)
        out.append({"ratio": ratio, "settled": statistics.fmean(r.settled for r in runs),
                    "worst_error": max(r.error for r in runs), "batches": most("batches"),
                    "within": min(r.within for r in runs),
                    "ratio_after": worst.ratio_after, "settled_after": statistics.fmean(r.settled_after for r in runs),
                    "worst_error_after": max(r.error_after for r in runs), "batches_after": most("batches_after"),
                    "within_after": min(r.within_after for r in runs),
                    "modes": sorted({r.mode for r in runs}), "runs": [asdict(r) for r in runs]})
    return out


# ----------------------------------------------------------------------------- 2. a real Loader

def make_dataset(root: Path, n: int) -> Path:
    """`n` generated JPEGs of about 110 x 130 px, packed (bench_gpu_pipeline's data)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu_pipeline import make_dataset as generated

    return generated(root, n)


def _epochs(packed: Path, batch: int, threads: int, rate: float, share: float | None, epochs: int,
            kept: bool = False) -> tuple[float, Any, list[float]]:
    """images/s of the last of `epochs` epochs on one Loader (from its third batch on), the Loader, and the
    settled share after each batch of that epoch. `kept`: the automatic split without its probe windows
    (it never tries the CPU alone), so the balance is measured alone."""
    import stoker
    from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gpu_standin import FixedRateDecoder   # tests/gpu_standin.py: the tests' stand-in decoder

    loader = stoker.Loader(packed, batch, transforms=[RandomResizedCrop(64), RandomHorizontalFlip()], seed=0,
                           device=stoker.DeviceOptions("cpu", decode="auto", gpu_share=share,
                                                       gpu_decoder=FixedRateDecoder(images_per_s=rate)),
                           workers=stoker.Workers(num_threads=threads))
    if kept:
        loader._passes._split = SplitControl(threads, None, probe_every=1 << 30, warmup=1 << 30)
    try:
        for _ in range(epochs - 1):
            for _ in loader:
                pass
        stamps, shares = [], []
        for _ in loader:
            stamps.append(time.perf_counter())
            shares.append(loader.stats.gpu_share)
    finally:
        loader.close()
    return (len(stamps) - 3) * batch / (stamps[-1] - stamps[2]), loader, shares


def loader_runs(rates: list[float] | None, images: int, batch: int, threads: int, epochs: int
                ) -> list[dict[str, Any]]:
    """Per stand-in rate (None: the rates that would give the GPU LOADER_RATIOS of the CPU threads'
    capacity measured alone): each side alone, the automatic split, where it settled against both ratios."""
    with tempfile.TemporaryDirectory(prefix="stoker-bench-split-") as tmp:
        packed = make_dataset(Path(tmp), images)
        cpu, _, _ = _epochs(packed, batch, threads, 1e9, 0.0, 2)   # the CPU threads alone
        out = []
        for rate in rates or [round(cpu * r / (1 - r)) for r in LOADER_RATIOS]:
            gpu, _, _ = _epochs(packed, batch, threads, rate, 1.0, 2)   # the stand-in (and device side) alone
            auto, loader, _ = _epochs(packed, batch, threads, rate, None, epochs)
            kept, held, shares = _epochs(packed, batch, threads, rate, None, epochs, kept=True)
            ctrl = held._passes._split   # the controller's own view: both sides' rates beside each other
            ratio = gpu / (gpu + cpu)
            beside = ctrl.gpu_rate / (ctrl.gpu_rate + ctrl.cpu_rate) if ctrl.gpu_rate and ctrl.cpu_rate else None
            settled = statistics.fmean(shares)
            out.append({"stand_in_img_per_s": rate, "gpu_alone": gpu, "cpu_alone": cpu, "ratio": ratio,
                        "auto_settled": loader.stats.gpu_share, "auto_mode": loader._passes._split.mode,
                        "auto_img_per_s": auto, "reason": loader.stats.gpu_split,
                        "settled": settled, "error": abs(settled - ratio) / ratio, "kept_img_per_s": kept,
                        "beside_gpu": ctrl.gpu_rate, "beside_cpu": ctrl.cpu_rate, "beside_ratio": beside,
                        "error_beside": None if beside is None else abs(settled - beside) / beside,
                        "batches": ctrl.batches})
    return out


# ----------------------------------------------------------------------------- report

def _count(n: int | None) -> str:
    return "never" if n is None else str(n)


def report(sim: list[dict[str, Any]] | None, real: list[dict[str, Any]] | None, seeds: int, noise: float) -> str:
    lines = []
    if sim is not None:
        lines += [f"Simulated: the controller's settled share against G / (G + C), {seeds} seed(s), each side's "
                  f"time per batch jittered (log-normal, sigma {noise}); the CPU's capacity halved halfway.", "",
                  "| G / (G + C) | settled | worst error | batches to settle | batches within 10% | after the "
                  "step: ratio | settled | worst error | batches to settle | batches within 10% | mode |",
                  "|" + "---|" * 11]
        for r in sim:
            lines.append(f"| {r['ratio']:.2f} | {r['settled']:.3f} | {r['worst_error']:.1%} | {_count(r['batches'])} "
                         f"| {r['within']:.0%} | {r['ratio_after']:.2f} | {r['settled_after']:.3f} "
                         f"| {r['worst_error_after']:.1%} | {_count(r['batches_after'])} | {r['within_after']:.0%} "
                         f"| {', '.join(r['modes'])} |")
        lines.append("")
    if real is not None:
        lines += ["Loader: decode='auto' with the fixed-rate stand-in (img/s). Capacities alone: gpu_share=1 and "
                  "gpu_share=0. The balance: the split without probe windows, its mean settled share over the last "
                  "epoch against G / (G + C) of the capacities alone and of its own rates beside each other. Auto: "
                  "the default controller (probe windows on), where it settled and which way it kept.", "",
                  "| stand-in | GPU alone | CPU alone | G / (G + C) | settled | error | beside: GPU | CPU "
                  "| G / (G + C) | error | img/s | auto: settled | way | img/s |", "|" + "---|" * 14]
        for r in real:
            beside = "-" if r["beside_ratio"] is None else f"{r['beside_ratio']:.3f}"
            error = "-" if r["error_beside"] is None else f"{r['error_beside']:.1%}"
            lines.append(f"| {r['stand_in_img_per_s']:,.0f} | {r['gpu_alone']:,.0f} | {r['cpu_alone']:,.0f} "
                         f"| {r['ratio']:.3f} | {r['settled']:.3f} | {r['error']:.1%} | {r['beside_gpu'] or 0:,.0f} "
                         f"| {r['beside_cpu'] or 0:,.0f} | {beside} | {error} | {r['kept_img_per_s']:,.0f} "
                         f"| {r['auto_settled']:.3f} | {r['auto_mode']} | {r['auto_img_per_s']:,.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=("simulated", "loader"), default=("simulated", "loader"))
    ap.add_argument("--batches", type=int, default=240, help="simulated batches per run (the step at half)")
    ap.add_argument("--seeds", type=int, default=5, help="simulated runs per ratio")
    ap.add_argument("--noise", type=float, default=0.25, help="sigma of the simulated log-normal jitter")
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help="the stand-in decoder's images/s in the Loader runs (default: those giving 1/4, 1/2 and "
                    "3/4 of the capacity, from the CPU threads' rate measured alone)")
    ap.add_argument("--images", type=int, default=256, help="generated JPEGs of the Loader runs")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="the Loader's worker threads")
    ap.add_argument("--epochs", type=int, default=6, help="epochs of the automatic split on one Loader")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args(argv)
    sim = simulated(args.seeds, args.batches, args.noise) if "simulated" in args.only else None
    if "loader" in args.only:
        import torch
        torch.set_num_threads(1)   # the device side's small resample ops; a thread pool stalls them on few cores
    real = loader_runs(args.rates, args.images, args.batch, args.threads, args.epochs) if "loader" in args.only \
        else None
    print(report(sim, real, args.seeds, args.noise))
    if args.json is not None:
        args.json.write_text(json.dumps({"simulated": sim, "loader": real}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
