"""How each row of a batch becomes pixels: one frozen `Route`, decided once when the Loader is made.

One fold (`decide`) over what the transforms declare (`transforms.kinds`: an engine row per planned
op, or none), what the dataset can do (stored sizes, mapped JPEG bytes, the JPEG share of a probe),
the device options (decode, gpu_share), the placement (threads or worker processes) and a GPU
decoder probe gives:

- `cpu`: "native" (the batch engine's pool renders each batch's JPEG rows: csrc/engine.c, `engine.py`)
  or "python" (every row through `render.Filler.fill`, on every worker thread);
- `gpu`: "none" or "columns" (a share of each batch's JPEG rows decoded on the GPU, handed over as
  columns: `jobs.GpuRows`, `device/gpu_pipeline.py`);
- `share`: the GPU's share, fixed, or None (measured per batch: `device.gpu_split.SplitControl`);
- `processes`: 0 (worker threads here) or the worker processes the rows are rendered in;
- `stage`: what the device stage does with a finished batch;
- `program`: the engine's program, for its pool (the native path) and for the native planner of the
  GPU columns' rows (`jobs.RowPlanner`); None where neither uses it (the native path is off, or an op
  declares no engine row: the GPU's rows are then planned in NumPy);
- `python`: what runs Python per sample in the training process, and why (empty on the native path
  or in worker processes); `reasons`: why the route is what it is, as short lines.

So a row takes one of three paths (native, Python, GPU columns); rows the engine refuses (not a JPEG,
damaged, a size it does not serve) and the GPU's failures take the Python path. `repr(loader)`,
`LoaderStats.route` and `stoker doctor` print this value; nothing after it asks again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import native
from ..dataset import Dataset
from ..errors import ConfigError
from ..transforms.kinds import engine_program

ENV = "STOKER_ENGINE"
#: the least share of JPEG rows (of a probe of up to `PROBE` rows spread over the dataset) for the native
#: path: below it most rows would be refused by the engine and rendered in Python anyway
MIN_JPEG_SHARE = 0.9
PROBE = 1024
NATIVE, PYTHON = "native", "python"
NO_GPU, COLUMNS = "none", "columns"
#: what to do when `Route.python` names something (stoker doctor prints it)
PER_SAMPLE_FIX = ("move per-sample colour and policy ops to the batched GPU ops (stoker.transforms.gpu, run by the "
                  "device thread on whole batches), or run the worker threads in child processes, whose GILs are "
                  "not the training loop's: workers=stoker.Workers(processes=1), or processes=N (N > 1) where one "
                  "process's Python per sample cannot keep up (the same batches, bit for bit)")


@dataclass(frozen=True)
class Route:
    """How a Loader's rows become pixels (module docstring)."""

    cpu: str = PYTHON
    gpu: str = NO_GPU
    share: float | None = 0.0   # the GPU's share of each batch's JPEG rows; None: measured per batch
    processes: int = 0
    stage: str = "none"
    program: np.ndarray | None = field(default=None, compare=False, repr=False)
    python: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def native(self) -> bool:
        return self.cpu == NATIVE

    @property
    def gpu_decode(self) -> bool:
        return self.gpu == COLUMNS

    @property
    def cpu_only(self) -> str:
        """Why decode="auto" left the GPU no rows ("CPU only: ..."), or ""."""
        return next((r for r in self.reasons if r.startswith("CPU only")), "")

    def __str__(self) -> str:
        where = ("on threads" if not self.processes else "in a worker process" if self.processes == 1 else
                 f"in {self.processes} worker processes")
        gpu = self.gpu if not self.gpu_decode else (
            f"columns, share {'measured' if self.share is None else f'{self.share:g}'}")
        return f"cpu {self.cpu} {where}; gpu {gpu}; device stage {self.stage}"

    def lines(self) -> list[str]:
        """The route and its reasons, one per line (stoker doctor, the Loader's log)."""
        return [str(self), *(f"  why: {r}" for r in self.reasons),
                *(f"  Python per sample: {p}" for p in self.python)]


def engine_enabled() -> bool:
    """Whether the native engine may be used: the extension is on, found a libjpeg-turbo, and
    STOKER_ENGINE does not turn it off."""
    return (native.engine_available()
            and os.environ.get(ENV, "").strip().lower() not in ("0", "off", "false", "no"))


def decide(spec: Any, ds: Dataset, *, decode: str, gpu_share: float | None, processes: int, stage: str,
           decoder: Callable[[], str | None]) -> Route:
    """The route of `spec` (a `render.RenderSpec`) over `ds`. `decode`: "cpu" (also without a device
    stage), "gpu" or "auto"; `decoder()`: None where a GPU JPEG decoder works here, else why not (asked
    only when the GPU could take rows). decode="gpu" where the GPU cannot take the rows is a ConfigError
    naming the fix; decode="auto" then stays on the CPU and says why."""
    gpu, share, gpu_why = NO_GPU, 0.0, ""
    if decode in ("gpu", "auto"):
        blocked = _gpu_blocker(spec, processes) or decoder()
        if blocked is None:
            gpu = COLUMNS
            share = gpu_share if gpu_share is not None else 1.0 if decode == "gpu" else None
            gpu_why = "the GPU decodes " + ("every JPEG row" if share == 1.0 else "a measured share of each "
                                            "batch's JPEG rows" if share is None else f"{share:.0%} of each batch's JPEG rows")
        elif decode == "gpu":
            raise ConfigError(f"decode='gpu': {blocked}; use DeviceOptions(decode='cpu'), or decode='auto' to "
                              f"use the GPU only where it can help")
        else:
            gpu_why = f"CPU only: {blocked}"
    every_row_gpu = gpu == COLUMNS and share == 1.0
    cpu_why = ["every JPEG row is the GPU's (the others are few: the Python path)"] if every_row_gpu else \
        _cpu_blockers(spec, ds)
    # the engine's program: for its pool (the native CPU path), and for the native planner of the GPU's rows
    # (`jobs.RowPlanner`), which needs only the extension, not the engine's libjpeg-turbo
    gpu_plans = gpu == COLUMNS and native.plans_rows()
    program = None if cpu_why and not gpu_plans else engine_program(spec.pipeline.prefix, spec.pipeline.offsets)
    cpu = NATIVE if program is not None and not cpu_why else PYTHON
    reasons = ["the native engine renders each batch's JPEG rows" if cpu == NATIVE
               else f"Python renders the CPU's rows: {cpu_why[0]}", *([gpu_why] if gpu_why else [])]
    python: list[str] = []
    if processes:
        reasons.append(f"Workers(processes={processes}): rows rendered in worker processes, not this one")
    elif cpu == PYTHON and not every_row_gpu:
        python = cpu_why
    return Route(cpu, gpu, share, processes, stage, program, tuple(python), tuple(reasons))


def _cpu_blockers(spec: Any, ds: Dataset) -> list[str]:
    """What keeps the native engine from rendering `spec`'s rows (each item names the cause); [] where it can."""
    pipe = spec.pipeline
    why = [f"{getattr(op, 'name', type(op).__name__)}: a per-sample op after the planned crop" for op in pipe.tail]
    why += [f"{type(t).__name__} targets ({t.column}): placed per sample" for t in spec.target_kinds()]
    if spec.kind.per_row_python:   # video clips: PyAV's frame loop
        why.append(spec.kind.per_row_python)
    if spec.pad:
        why.append("pad=True: each image is placed at its own size")
    if pipe.resampling[0] != "bilinear":
        why.append(f"interpolation={pipe.resampling[0]!r}: only bilinear resampling is native")
    if engine_program(pipe.prefix, pipe.offsets) is None:
        names = [type(op).__name__ for op in pipe.prefix if "engine_args" not in type(op).__dict__]
        why.append(f"{', '.join(names)}: planned per batch in NumPy, not by the engine")
    if not native.ON:
        why.append("the native path is off (STOKER_NATIVE=off, or the extension was not compiled)")
    elif not engine_enabled():
        why.append("the engine is off (STOKER_ENGINE=off, or no libjpeg-turbo was found for it)")
    if why:
        return why
    if spec.heights is None or not ds.maps_jpegs:
        return [f"the data is not a packed dataset of JPEGs or raw pixels on local disk ({type(ds).__name__})"]
    share = jpeg_share(ds)
    if share < MIN_JPEG_SHARE:
        return [f"{share:.0%} of a probe of its rows are JPEGs or raw pixels (the engine takes packs of at least "
                f"{MIN_JPEG_SHARE:.0%}); the others are PNG, WebP, ... decoded per sample"]
    return []


def jpeg_share(ds: Dataset) -> float:
    """The share of the rows the engine reads (JPEGs, stored raw pixels) in up to `PROBE` rows spread evenly
    over `ds` (a shard that fails its check: 0)."""
    n = len(ds)
    idx = np.unique(np.linspace(0, n - 1, min(n, PROBE)).astype(np.int64))
    try:
        _, spans, _ = ds.pixel_spans(idx)
    except Exception:  # noqa: BLE001 - a shard that fails its check: the per-sample path reports it
        return 0.0
    return float(np.count_nonzero(spans[:, 0] >= 0)) / max(len(idx), 1)


def _gpu_blocker(spec: Any, processes: int) -> str | None:
    """Why the GPU cannot take `spec`'s JPEG rows as columns (None: it can)."""
    pipe = spec.pipeline
    tail = ", ".join(getattr(op, "name", type(op).__name__) for op in pipe.tail)
    if processes:
        return f"Workers(processes={processes}) renders in its worker processes"
    if tail:
        return f"{tail} run on numpy arrays, after the decode"
    if tuple(pipe.resampling) != ("bilinear", True):
        return (f"the transforms resize with {pipe.resampling[0]!r} (antialias={pipe.resampling[1]}); the GPU "
                f"path resizes with antialiased bilinear only")
    if spec.pad:
        return "pad=True places each image at its own size"
    if getattr(spec, "buckets", None) is not None:
        return "aspect buckets: each batch is its bucket's size, and the GPU path decodes one output size"
    if spec.kind.cpu_only:
        return spec.kind.cpu_only
    if spec.target_kinds():
        return "boxes= and masks= are placed per row on the CPU"
    if spec.heights is None:
        return ("the GPU's crops are planned per batch from the stored image sizes of a packed dataset; pack the "
                "data first (stoker pack SRC OUT)")
    return None
