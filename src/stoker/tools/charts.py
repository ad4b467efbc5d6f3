"""PNG charts for `stoker bench` and `stoker demo` (matplotlib, optional: `pip install matplotlib`).

Each function returns False, drawing nothing, when matplotlib is not installed. Charts are written
with the Agg backend: files only, never a window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .bench_gpu import FEEDS, LOADERS, feed_of
from .results import BenchResult

_COLOURS = {"stoker": "#d2691e", "baseline": "#4c72b0", "other": "#8c8c8c", "wait": "#c44e52",
            "compute": "#55a868"}


def _pyplot() -> Any | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _colour(name: str) -> str:
    if name.startswith("stoker"):
        return _COLOURS["stoker"]
    if name.startswith("baseline"):
        return _COLOURS["baseline"]
    return _COLOURS["other"]


# pipelines measured on other data than the loaders (overhead: one thread over 16x16 raw images, tens of
# thousands of images/s): a bar of theirs would set the axis and shrink the loaders to slivers
_NOT_A_LOADER = ("ceiling", "overhead")


def bench_bars(result: BenchResult) -> tuple[list[Any], list[str]]:
    """The pipelines `bench_chart` draws as bars (the loaders, compared on the same images) and the
    lines it writes under the chart for the others (the overhead figure, in µs per sample)."""
    bars = [p for p in result.pipelines if p.skipped is None and p.name not in _NOT_A_LOADER]
    overhead = result.ran("overhead")
    notes = [] if overhead is None or not overhead.images_per_s > 0 else [
        f"not drawn: overhead (1 thread, 16x16 raw images) {1e6 / overhead.images_per_s:.1f} µs of Python "
        "work per sample"]
    return bars, notes


def bench_chart(result: BenchResult, path: Path) -> bool:
    """Images/s per pipeline as horizontal bars, the decode ceiling as a dashed reference line."""
    plt = _pyplot()
    if plt is None:
        return False
    from matplotlib.patches import Patch

    ran, notes = bench_bars(result)
    ceiling = result.ran("ceiling")
    fig, ax = plt.subplots(figsize=(8, 2.4 + 0.5 * max(len(ran), 1)))
    names = [p.name for p in ran][::-1]
    rates = [p.images_per_s for p in ran][::-1]
    ax.barh(names, rates, color=[_colour(n) for n in names])
    top = max(rates + ([ceiling.images_per_s] if ceiling is not None else []) + [1.0])
    for y, (p, rate) in enumerate(zip(ran[::-1], rates)):
        label = f"{rate:,.0f}" + (f"  ({p.ratio:.2f}x {p.ratio_to})" if p.ratio is not None else "")
        ax.text(rate + top * 0.01, y, label, va="center", fontsize=8,   # on white: readable over the ceiling
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0, "alpha": 0.85})
    handles = [Patch(color=_COLOURS["baseline"], label="DataLoader + PIL (baseline)"),
               Patch(color=_COLOURS["stoker"], label="stoker.Loader")]
    if any(_colour(n) == _COLOURS["other"] for n in names):
        handles.append(Patch(color=_COLOURS["other"], label="other loaders"))
    if ceiling is not None:
        handles.append(ax.axvline(ceiling.images_per_s, color="black", linestyle="--", linewidth=1.2,
                                  label=f"decode ceiling: full JPEG decode only ({ceiling.images_per_s:,.0f})"))
    ax.set_xlim(0, top * 1.3)
    ax.set_xlabel(f"throughput, images/s (median of {result.rounds} round(s); higher is better)")
    ax.set_ylabel("pipeline")
    ax.set_title(f"stoker bench: {result.images:,} images, batch {result.batch_size}, "
                 f"{result.workers} CPU cores per pipeline" + "".join(f"\n{line}" for line in notes), fontsize=10)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=8,
              frameon=False)   # below the axes: never over a bar
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def device_bench_chart(result: BenchResult, path: Path, *, rate_line: float | None = None,
                       share_lines: Mapping[str, float] | None = None) -> bool:
    """The device bench in two panels: the loaders alone (images/s into device memory) and, per model,
    training images/s as a share of the same model on synthetic data. `rate_line` (images/s) and
    `share_lines` (model label -> share of synthetic speed) draw dashed reference lines, e.g. a goal."""
    plt = _pyplot()
    if plt is None:
        return False
    share_lines = share_lines or {}

    loaders = [p for p in result.pipelines if p.name in LOADERS and p.skipped is None]
    training = [p for p in result.pipelines
                if p.name.startswith("train-") and p.skipped is None and p.ratio is not None]
    panels = [k for k, rows in (("loaders", loaders), ("training", training)) if rows] or ["loaders"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "loaders":
            names = [p.name for p in loaders]
            rates = [p.images_per_s for p in loaders]
            ax.bar(names, rates, color=[_colour(n.removeprefix("cuda-")) for n in names])
            for x, p in enumerate(loaders):
                text = f"{p.images_per_s:,.0f}" + (f"\n{p.ratio:.2f}x baseline" if p.ratio is not None else "")
                ax.text(x, p.images_per_s, text, ha="center", va="bottom", fontsize=8)
            top = max(rates + [1.0])
            if rate_line is not None:
                ax.axhline(rate_line, color="black", linestyle="--", linewidth=1, label=f"{rate_line:,.0f} images/s")
                top = max(top, rate_line)
                ax.legend(loc="upper left", fontsize=8)
            ax.set_ylim(0, top * 1.25)
            ax.set_ylabel(f"images/s into {result.device} memory (higher is better)")
            ax.set_title(f"loader alone (median of {result.rounds} epoch(s))", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            continue
        models = list(dict.fromkeys(p.name.rsplit("-" + feed_of(p.name), 1)[0].removeprefix("train-")
                                    for p in training))
        feeds = [f for f in FEEDS if f != "synthetic"]
        width = 0.8 / len(feeds)
        top = max([p.ratio for p in training if p.ratio is not None] + [1.0])
        for k, feed in enumerate(feeds):
            xs, shares = [], []
            for i, model in enumerate(models):
                p = result.get(f"train-{model}-{feed}")
                if p is not None and p.skipped is None and p.ratio is not None:
                    xs.append(i + (k - (len(feeds) - 1) / 2) * width)
                    shares.append(p.ratio)
            if not shares:
                continue
            bars = ax.bar(xs, shares, width, color=_colour(feed), hatch="//" if feed == "stoker-gpu" else None,
                          edgecolor="white", label=f"fed by {feed}")
            for bar, share in zip(bars, shares):
                ax.text(bar.get_x() + bar.get_width() / 2, share, f"{share:.0%}", ha="center", va="bottom", fontsize=8)
        for i, model in enumerate(models):
            if model in share_lines:
                ax.hlines(share_lines[model], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1)
                ax.text(i + 0.45, share_lines[model], f"{share_lines[model]:.0%}", fontsize=7, ha="right",
                        va="bottom")
        ax.axhline(1.0, color="#55a868", linewidth=1, label="synthetic data (the model's own speed)")
        ax.set_xticks(range(len(models)), models)
        ax.set_xlim(-0.5, len(models) - 0.5)
        ax.set_ylim(0, top * 1.25)
        ax.set_ylabel("training images/s / synthetic-data images/s")
        ax.set_title(f"training (median of {result.rounds} window(s) of {result.steps} steps)", fontsize=10)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8, frameon=False)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"stoker bench on {result.device}: {result.images:,} images, batch {result.batch_size}, "
                 f"{result.workers} CPU cores per pipeline", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def demo_chart(named: Sequence[tuple[str, Any]], path: Path, *, title: str, note: str = "") -> bool:
    """Two panels for the demo's training runs, `(name, run)` pairs (the synthetic run first; a run has
    `images_per_s`, `steps`, `wait_s`, `compute_s`, `data_wait_percent`): training throughput (images/s,
    each fed run labelled with its share of the synthetic run's) and the mean step split into data
    wait and model step (ms)."""
    plt = _pyplot()
    if plt is None:
        return False
    names = [n for n, _ in named]
    runs = [r for _, r in named]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    rates = [r.images_per_s for r in runs]
    left.bar(names, rates, color=[_colour(n) for n in names])
    for x, rate in enumerate(rates):
        text = f"{rate:,.0f}" + (f"\n{rate / rates[0]:.2f} of synthetic" if x and rates[0] > 0 else "")
        left.text(x, rate, text, ha="center", va="bottom", fontsize=9)
    left.set_ylim(0, max(rates + [1.0]) * 1.25)
    left.set_ylabel("training throughput, images/s (higher is better)")
    left.set_title("images/s while training", fontsize=10)
    left.grid(axis="y", alpha=0.3)

    wait = [r.wait_s / max(r.steps, 1) * 1000 for r in runs]
    compute = [r.compute_s / max(r.steps, 1) * 1000 for r in runs]
    right.bar(names, compute, color=_COLOURS["compute"], label="model step (forward, backward, update)")
    right.bar(names, wait, bottom=compute, color=_COLOURS["wait"], label="waiting for the next batch")
    for x, r in enumerate(runs):
        right.text(x, compute[x] + wait[x], f"{r.data_wait_percent:.0f}% waiting", ha="center", va="bottom",
                   fontsize=9)
    right.set_ylim(0, max([c + w for c, w in zip(compute, wait)] + [1.0]) * 1.3)
    right.set_ylabel("time per training step, ms (lower is better)")
    right.set_title("where each step's time goes", fontsize=10)
    right.legend(loc="upper right", fontsize=8)
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    if note:
        fig.text(0.5, 0.01, note, ha="center", fontsize=8, style="italic")
    fig.tight_layout(rect=(0, 0.05 if note else 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
