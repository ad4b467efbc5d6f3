"""Judge a `stoker bench --device cuda` run against the project's acceptance targets.

    stoker bench --device cuda --images 5000 --workers 16 --out bench-results
    python benchmarks/targets.py bench-results/bench.json [more/bench.json ...]

Reads the JSON the bench wrote (several: their pipelines together, a later file's pipeline replacing
an earlier one of the same name, as a rerun with more --steps does) and prints each target with the figure it is judged on and "met",
"NOT met" or "not measured" (a pipeline it needs was skipped or not asked for), and the start-up share
of the pipelines behind it: start-up (construction to first batch, the untimed warm-up) over the timed
run, i.e. what a run as short as this one would add on top of the rate's time. It is reported, not a
gate: a gate at 1% made a 1.2 s baseline start-up need minutes of reruns, and otherwise read "not
measured". The verdicts come from the run's numbers only. Exit status: 0 when every target is met, 1 when one is not met or not
measured, 2 when the file is not a device bench result.

The targets live here, not in the installed package: they are this project's goals for its own
benchmark, not something a user's training run is judged by.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: model label -> share of its synthetic-data training speed a stoker feed must keep
TRAIN_TARGETS: dict[str, float] = {"resnet50": 0.97, "resnet18": 0.90}
#: the faster stoker loader pipeline over cuda-baseline, and its images/s into device memory
LOADER_SPEEDUP_TARGET = 3.0
LOADER_RATE_TARGET = 15_000.0
#: a start-up (construction to first batch) of this share of its timed run or more is pointed out below
#: the verdicts: a run as short as the bench's would spend that much more time than its rate says
STARTUP_SHARE = 0.01


@dataclass
class Target:
    """One target and whether this run's figures meet it."""

    goal: str                      # what is promised, in words
    threshold: float
    unit: str                      # "of synthetic", "x cuda-baseline", "images/s"
    measured: float | None = None  # None: the pipelines it needs did not run
    pipeline: str | None = None    # where the measured figure comes from
    met: bool | None = None
    startup: dict[str, float] | None = None  # start-up share of each pipeline the figure is computed from

    @property
    def verdict(self) -> str:
        return "not measured" if self.met is None else ("met" if self.met else "NOT met")


def startup_shares(pipelines: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, float]:
    """Start-up over timed run of each of `names` that reports one, in the order of `names`."""
    shares = {p.get("name"): p.get("startup_share") for p in pipelines}
    return {n: float(shares[n]) for n in names if isinstance(shares.get(n), (int, float))}


def _rate(pipelines: Sequence[Mapping[str, Any]], name: str) -> float | None:
    """images/s of pipeline `name` when it ran and measured a positive rate, else None."""
    p = next((p for p in pipelines if p.get("name") == name), None)
    if p is None or p.get("skipped") is not None:
        return None
    rate = p.get("images_per_s")
    return float(rate) if isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0 else None


def _best(pipelines: Sequence[Mapping[str, Any]], names: Sequence[str]) -> tuple[str, float] | None:
    rates = [(n, r) for n in names if (r := _rate(pipelines, n)) is not None]
    return max(rates, key=lambda nr: nr[1]) if rates else None


def check_targets(pipelines: Sequence[Mapping[str, Any]],
                  train_targets: Mapping[str, float] | None = None) -> list[Target]:
    """The targets for the pipelines present in `pipelines` (the "pipelines" list of bench.json), each
    judged on the best of stoker's decode paths (CPU, GPU, and the two split: decode="auto")."""
    train_targets = TRAIN_TARGETS if train_targets is None else train_targets
    names = {p.get("name") for p in pipelines}
    out: list[Target] = []
    stoker_loaders = [n for n in ("cuda-stoker", "cuda-stoker-gpu", "cuda-stoker-auto") if n in names]
    if stoker_loaders:
        speedup = Target(f"loader alone, faster stoker decode path >= {LOADER_SPEEDUP_TARGET:g}x cuda-baseline",
                         LOADER_SPEEDUP_TARGET, "x cuda-baseline")
        rate = Target(f"loader alone, faster stoker decode path >= {LOADER_RATE_TARGET:,.0f} images/s into "
                      "device memory", LOADER_RATE_TARGET, "images/s")
        best = _best(pipelines, stoker_loaders)
        base = _rate(pipelines, "cuda-baseline")
        if best is not None:
            rate.pipeline, rate.measured = best
            rate.met = rate.measured >= LOADER_RATE_TARGET
            rate.startup = startup_shares(pipelines, [best[0]])
            if base is not None:
                speedup.pipeline, speedup.measured = best[0], best[1] / base
                speedup.met = speedup.measured >= LOADER_SPEEDUP_TARGET
                speedup.startup = startup_shares(pipelines, [best[0], "cuda-baseline"])
        out += [speedup, rate]
    for label, threshold in train_targets.items():
        feeds = [n for n in (f"train-{label}-stoker", f"train-{label}-stoker-gpu") if n in names]
        if not feeds:
            continue
        target = Target(f"{label} fed by stoker keeps >= {threshold:.0%} of its synthetic-data training speed",
                        threshold, "of synthetic")
        best = _best(pipelines, feeds)
        synthetic = _rate(pipelines, f"train-{label}-synthetic")
        if best is not None and synthetic is not None:
            target.pipeline, target.measured = best[0], best[1] / synthetic
            target.met = target.measured >= threshold
            target.startup = startup_shares(pipelines, [best[0], f"train-{label}-synthetic"])
        out.append(target)
    return out


def format_targets(targets: Sequence[Target]) -> str:
    """The targets as a markdown table."""
    lines = ["| target | measured | from | verdict | start-up share of the run |", "|---|---|---|---|---|"]
    for t in targets:
        measured = "-" if t.measured is None else (f"{t.measured:,.0f} {t.unit}" if t.unit == "images/s" else
                                                  f"{t.measured:.1%} {t.unit}" if t.unit == "of synthetic" else
                                                  f"{t.measured:.2f}{t.unit}")
        startup = ", ".join(f"{n} {v:.1%}" for n, v in (t.startup or {}).items()) or "-"
        lines.append(f"| {t.goal} | {measured} | {t.pipeline or '-'} | {t.verdict} | {startup} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Judge a `stoker bench --device cuda` result against the "
                                     "project's targets.")
    parser.add_argument("results", type=Path, nargs="+",
                        help="bench.json written by `stoker bench --device cuda --out DIR` (one or more)")
    args = parser.parse_args(argv)
    by_name: dict[str, Mapping[str, Any]] = {}
    for result in args.results:
        try:
            by_name.update((p["name"], p) for p in json.loads(result.read_text())["pipelines"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"targets: {result}: expected the bench.json of `stoker bench --device cuda` ({exc})",
                  file=sys.stderr)
            return 2
    pipelines = list(by_name.values())
    targets = check_targets(pipelines)
    if not targets:
        print(f"targets: {' '.join(map(str, args.results))} has no stoker device pipelines (cuda-stoker, "
              "train-<model>-stoker); run `stoker bench --device cuda`", file=sys.stderr)
        return 2
    print(format_targets(targets))
    long_startups = sorted({n for t in targets for n, v in (t.startup or {}).items() if v >= STARTUP_SHARE})
    if long_startups:
        print(f"\nstart-up is {STARTUP_SHARE:.0%} or more of the timed run of {', '.join(long_startups)}: the rates "
              "leave it out (untimed warm-up); a run as short as this one would take that much longer")
    return 0 if all(t.met for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
