"""What `stoker bench` measured: one `PipelineResult` per pipeline inside one `BenchResult`.

The CPU bench (`bench`), the device bench (`bench_gpu`) and the charts (`charts`) all read and write
these types; this module imports none of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .._system import json_safe

__all__ = ["NOTE", "BenchResult", "PipelineResult", "markdown_table"]

NOTE = ("Ratios between pipelines of this one run are the figures that count; absolute images/s on a "
        "shared machine are noise.")


@dataclass
class PipelineResult:
    """One pipeline's measurement. Rates in images/s, memory in bytes, times in seconds."""

    name: str
    description: str
    images_per_s: float = math.nan            # median of the timed rounds
    rounds: list[float] = field(default_factory=list)
    cpu_percent: float = math.nan             # process + children over the timed rounds; 100 = one core
    cpu_ms_per_image: float = math.nan        # CPU time per image over the timed rounds (less load-sensitive)
    peak_rss_bytes: int = 0                   # process + children, sampled every 20 ms
    first_batch_s: float = math.nan           # construction to first batch, cold (warm-up round)
    images: int = 0                           # images per round
    startup_share: float = math.nan           # first_batch_s over the seconds of all timed rounds
    ratio: float | None = None                # images/s over that of `ratio_to`
    ratio_to: str | None = None
    skipped: str | None = None                # why it did not run
    version: str = ""                         # of the library doing the work, e.g. "nvidia.dali 2.4.0"
    peak_device_bytes: int = 0                # device pipelines: torch.cuda.max_memory_allocated (0 on CPU)
    data_wait: float = math.nan               # training: share of the timed steps spent waiting in next()
    disk_bytes: int = 0                       # CPU bench: bytes of the files the pipeline reads its images from
    # stoker's GPU decode loaders (decode="gpu"/"auto"), from LoaderStats: the share of each batch's JPEGs
    # the GPU decoded at the end, why (or why the CPU alone), the GPU path's seconds per phase in the timed rounds
    gpu_share: float = math.nan
    gpu_split: str = ""
    gpu_phases: dict[str, float] = field(default_factory=dict)
    route: str = ""                           # stoker's loaders: how each row became pixels (Loader.route)

    @property
    def ran(self) -> bool:
        """Whether it ran and produced a rate (not skipped, not NaN)."""
        return self.skipped is None and math.isfinite(self.images_per_s)


@dataclass
class BenchResult:
    """Everything one `run_bench` call measured, plus what it ran on."""

    pipelines: list[PipelineResult]
    images: int
    batch_size: int
    workers: int
    rounds: int
    data: dict[str, Any]                      # where the images came from, their statistics
    baseline_transforms: str                  # "torchvision X.Y" or the re-implementation
    machine: dict[str, Any]
    pack_seconds: float = math.nan
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"                       # where the device pipelines ran ("cpu" for the CPU bench)
    models: list[str] = field(default_factory=list)   # training pipelines' model specs
    steps: int = 0                            # timed training steps per round
    warmup_steps: int = 0                     # untimed training steps before them
    cores: int | None = None                  # run pinned to this many cores (stoker bench --cores), or None
    cpus: list[int] = field(default_factory=list)  # which CPUs, with `cores`

    def get(self, name: str) -> PipelineResult | None:
        """The pipeline called `name`, or None when this run did not include it."""
        return next((p for p in self.pipelines if p.name == name), None)

    def ran(self, name: str) -> PipelineResult | None:
        """The pipeline called `name` when it ran and produced a rate, else None."""
        p = self.get(name)
        return p if p is not None and p.ran else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN becomes null)."""
        return json_safe({**asdict(self), "note": NOTE})


def markdown_table(columns: Sequence[str], rows: Sequence[tuple[PipelineResult, list[str]]]) -> list[str]:
    """Markdown lines of a table of `(pipeline, cells)` rows, the pipeline's name first; a skipped
    pipeline's row says why instead of its cells. Ends with an empty line."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for p, cells in rows:
        shown = [f"skipped: {p.skipped}"] + [""] * (len(columns) - 2) if p.skipped is not None else cells
        lines.append("| " + " | ".join([p.name, *shown]) + " |")
    return [*lines, ""]
