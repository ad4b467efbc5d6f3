"""`stoker.profile`: how long a training loop waits for data, and what to do about it.

    for images, labels in stoker.profile(loader):     # a stoker.Loader, a torch DataLoader, any iterable
        step(images, labels)

Per step it measures the time blocked in `next()` (data wait) and the time from receiving a
batch to asking for the next one (the step: forward, backward, update, logging). At the end of the
pass (and every `every` steps) it prints a `ProfileReport`: data-wait % of wall time, images/s,
the loader's per-stage times (stoker Loaders), CPU use and a verdict with the fix that applies.

The verdict, and why its thresholds are where they are:

- **input-bound** when the loop waits for data for at least `INPUT_BOUND_WAIT` (10%) of its wall
  time: an infinitely fast loader would then make training at least 1 / (1 - 0.10) = 1.11x
  faster, more than run-to-run noise of a shared machine (a few %), so the loader is worth fixing.
- **compute-bound** below that: the loader keeps up; speed comes from the model step.

Data wait misses what a loader costs a step that never waits for it (its threads take the cores and
the GIL the step needs). Given the training `step`, the profiler also times it on one batch held in
memory, alone (the synthetic-data ceiling) and beside the loader running with its batches discarded
(the interference control, `stoker.step_controls`), and judges by **fed / synthetic**: input-bound
when training keeps less than 1 - 0.10 = 90% of the model's own speed, the same 1.11x as above.

No verdict from fewer than `MIN_VERDICT_STEPS` (10) measured steps (`step_controls` says why); the
report says how many more are needed. A figure that was not measured reads "not measured", never NaN.

Data wait counts only the steps after the first `warmup` (default 1): the first batch pays for
starting the loader (threads, worker processes, file opens) once, and is reported on its own.
With batches on a CUDA device (or `sync=True`), the GPU is synchronized before and after each
`next()`, so queued GPU work counts as step time, not as data wait; without profiling, no
synchronization is added to the loop.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, TextIO

from ._system import json_safe, usable_cpus
from .errors import ConfigError
from .step_controls import (MIN_VERDICT_STEPS, StepControls, _batch_size, _first_tensor, measure_controls,
                            resident_copy)
# the verdict's names, re-exported: `stoker.profiling` is where users and tools look for them
from .verdict import (COMPUTE_BOUND, CPU_SATURATED, INPUT_BOUND, INPUT_BOUND_WAIT, OVERSIZED,  # noqa: F401
                      READ_HEAVY, UNDECIDED, _is_data_loader, _is_stoker_loader, _packed, diagnose)

__all__ = ["COMPUTE_BOUND", "INPUT_BOUND", "INPUT_BOUND_WAIT", "MIN_VERDICT_STEPS", "UNDECIDED", "ProfileReport",
           "Profiler", "profile"]

#: the most steps a control window times (the fed pass may be far longer; the controls need not be)
CONTROL_STEPS_MAX = 50


@dataclass
class ProfileReport:
    """What `profile` measured over the steps after warm-up. Times in seconds, rates in images/s."""

    steps: int                          # steps measured (after warm-up)
    images: int                         # images in those steps (0 when batch sizes are unknown)
    wall_s: float                       # data wait + step time over the measured steps
    wait_s: float                       # blocked in next()
    compute_s: float                    # from receiving a batch to asking for the next one
    images_per_s: float
    steps_per_s: float
    data_wait_fraction: float           # wait_s / wall_s
    median_wait_ms: float
    median_step_ms: float
    first_batch_s: float                # from the first next() to the first batch (loader start-up)
    warmup_steps: int
    synchronized: bool                  # CUDA-synchronized around next()
    device: str                         # where batches live: "cpu", "cuda:0", ...
    loader: str                         # what was profiled, e.g. "stoker.Loader (packed, 2 threads)"
    cpu_percent: float                  # this process + its children (DataLoader workers); 100 = one core
    cpu_cores: int                      # cores this process may use
    system_cpu_percent: float           # all cores of the machine, busy %, any process
    stages: dict[str, float] | None     # stoker Loaders: per-image ms per stage and wait seconds
    verdict: str                        # INPUT_BOUND, COMPUTE_BOUND, or UNDECIDED (too few steps)
    reason: str                         # the measurement behind the verdict, in a sentence
    fixes: list[str] = field(default_factory=list)  # what to do, most effective first
    notes: list[str] = field(default_factory=list)
    synthetic_images_per_s: float | None = None     # the step on a resident batch (given a step)
    interference_images_per_s: float | None = None  # ... while the loader runs, batches discarded
    control_note: str = ""              # why a control was not measured

    @property
    def data_wait_percent(self) -> float:
        return self.data_wait_fraction * 100.0

    @property
    def fed_ratio(self) -> float | None:
        """fed / synthetic: the share of the model's own speed that training fed by the loader keeps."""
        return _ratio(self.images_per_s, self.synthetic_images_per_s)

    @property
    def interference_ratio(self) -> float | None:
        """interference control / synthetic: the step's speed beside the running loader, never waiting."""
        return _ratio(self.interference_images_per_s, self.synthetic_images_per_s)

    @property
    def input_bound(self) -> bool:
        return self.verdict == INPUT_BOUND

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN becomes None)."""
        out = asdict(self)
        out.update(data_wait_percent=self.data_wait_percent, fed_ratio=self.fed_ratio,
                   interference_ratio=self.interference_ratio, min_verdict_steps=MIN_VERDICT_STEPS)
        return json_safe(out)

    def format(self) -> str:
        """The report as text: figures, verdict, fixes. A figure not measured reads "not measured"."""
        lines = [f"stoker profile: {self.loader}, batches on {self.device}"
                 + (" (CUDA-synchronized)" if self.synchronized else ""),
                 f"  steps            {self.steps} measured after {self.warmup_steps} warm-up "
                 f"(first batch {_fmt(self.first_batch_s, '.2f', ' s')})",
                 f"  throughput       {_fmt(self.images_per_s, ',.1f', ' images/s')}, "
                 f"{_fmt(self.steps_per_s, '.2f', ' steps/s')}",
                 f"  data wait        {_fmt(self.data_wait_percent, '.1f', '%')} of wall time "
                 f"({self.wait_s:.2f} of {self.wall_s:.2f} s; median {_fmt(self.median_wait_ms, '.1f', ' ms')}/step)",
                 f"  step (compute)   median {_fmt(self.median_step_ms, '.1f', ' ms')}",
                 f"  CPU              {_fmt(self.cpu_percent, '.0f', '%')} of one core (this process and its "
                 f"workers; {self.cpu_cores} usable cores), machine {_fmt(self.system_cpu_percent, '.0f', '%')} busy"]
        lines += self._control_lines()
        if self.stages:
            s = self.stages
            if _finite(s.get("samples")) and s["samples"] > 0:
                lines.append(f"  loader stages    per image: read {_fmt(s['read_ms'], '.2f', ' ms')}, decode "
                             f"{_fmt(s['decode_ms'], '.2f', ' ms')}, augment {_fmt(s['augment_ms'], '.2f', ' ms')} "
                             f"(thread time); workers waited for a free slot {s['worker_wait_s']:.2f} s")
            else:
                lines.append("  loader stages    not measured: the loader made the measured batches ahead, during "
                             "warm-up (profile more steps)")
            if _finite(s.get("device_ms")) and s["device_ms"] > 0:
                lines.append(f"  device stage     {s['device_ms']:.3f} ms per image on its thread (upload, convert, GPU "
                             f"decode); the copy itself overlaps your step on its own stream")
        lines.append(f"  verdict          {self.verdict.upper()}: {self.reason}")
        lines += [f"  fix              {fix}" if i == 0 else f"                   {fix}"
                  for i, fix in enumerate(self.fixes)]
        lines += [f"  note             {n}" for n in self.notes]
        return "\n".join(lines)

    def _control_lines(self) -> list[str]:
        if self.synthetic_images_per_s is None:
            return []
        lines = [f"  synthetic        {_fmt(self.synthetic_images_per_s, ',.1f', ' images/s')}: the same step on one "
                 "batch held in memory (the model's own speed)",
                 f"  fed / synthetic  {_fmt(self.fed_ratio, '.2f')}: training fed by the loader keeps "
                 f"{_fmt(self.fed_ratio, '.0%')} of the model's speed"]
        if self.interference_images_per_s is not None:
            lines.append(f"  interference     {_fmt(self.interference_ratio, '.2f')} of synthetic "
                         f"({_fmt(self.interference_images_per_s, ',.1f', ' images/s')}): the step on the held batch "
                         "while the loader runs, its batches discarded; below 1.00 is the loader's cost to the step")
        else:
            lines.append(f"  interference     not measured: {self.control_note or 'no loader to run'}")
        return lines

    __str__ = format


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """`value` formatted, or "not measured" (never "nan") when there is no finite figure."""
    return f"{value:{spec}}{suffix}" if _finite(value) else "not measured"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if _finite(num) and _finite(den) and den > 0 else None   # type: ignore[operator]


# ----------------------------------------------------------------------------- what is being profiled

def _describe(obj: Any) -> str:
    if _is_stoker_loader(obj):
        kind = "packed" if _packed(obj) else "loose files"
        return f"stoker.Loader ({kind}, {obj.num_threads} thread(s), prefetch {obj.prefetch})"
    if _is_data_loader(obj):
        return f"torch DataLoader (num_workers={obj.num_workers}, batch_size={obj.batch_size})"
    return type(obj).__name__


def cpu_seconds() -> float:
    """CPU time (user + system) of this process, its reaped children and its live ones."""
    import psutil

    try:
        import resource  # POSIX only: imported here so that Windows can import stoker
    except ImportError:
        t = psutil.Process().cpu_times()   # Windows: no reaped-children figure; live children are below
        total = t.user + t.system
    else:
        own = resource.getrusage(resource.RUSAGE_SELF)
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _system_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    import psutil

    t = psutil.cpu_times()
    total = sum(t)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


# ----------------------------------------------------------------------------- the profiler

class Profiler:
    """Iterates `iterable`, timing each `next()` against the rest of the step. Made by `profile()`."""

    def __init__(self, iterable: Iterable[Any], *, every: int | None = None, warmup: int = 1,
                 sync: bool | None = None, file: TextIO | None = None, verbose: bool = True,
                 step: Callable[..., Any] | None = None) -> None:
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ConfigError(f"profile(every=) must be a positive number of steps or None, got {every!r}")
        if not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"profile(warmup=) must be a number of steps >= 0, got {warmup!r}")
        self.iterable, self.every, self.warmup, self.sync = iterable, every, warmup, sync
        if step is not None and not callable(step):
            raise ConfigError(f"profile(step=) must be your training step, called as step(images, labels), got "
                              f"{type(step).__name__}")
        self.file, self.verbose, self.step = file, verbose, step
        #: the step's controls (synthetic, interference), measured after the pass when `step` is given
        self.controls: StepControls | None = None
        self.reports: list[ProfileReport] = []
        self._reset()

    def _reset(self) -> None:
        self._waits: list[float] = []
        self._steps: list[float] = []
        self._sizes: list[int] = []
        self._first_batch = math.nan
        self._seen = 0
        self._device = "cpu"
        self._synced = False
        self._stats0: dict[str, float] | None = None
        self._cpu0 = (0.0, 0.0, (0.0, 0.0))
        self._resident: Any = None

    # -- iteration --
    def __iter__(self) -> Iterator[Any]:
        self._reset()
        it = iter(self.iterable)
        done_at = None   # when the previous batch was handed to the loop
        failed = False
        try:
            while True:
                if done_at is not None:
                    now = self._clock()   # the step is over (its GPU work too, when synchronizing)
                    if self._seen > self.warmup:
                        self._steps.append(now - done_at)
                        if self.every and len(self._steps) % self.every == 0:
                            self._emit(self.report())
                if self._seen == self.warmup:   # the next batch is the first one measured
                    self._mark_start()
                start = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                if not self._seen:
                    self._decide_sync(batch)
                    if self.step is not None:
                        self._resident = resident_copy(batch)   # the controls' batch, kept from the ring
                got = self._clock()
                self._seen += 1
                if self._seen == 1:
                    self._first_batch = got - start
                if self._seen > self.warmup:
                    self._waits.append(got - start)
                    self._sizes.append(_batch_size(batch))
                done_at = time.perf_counter()
                yield batch
        except GeneratorExit:   # the loop broke out: what it measured still counts
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if it is not self.iterable and hasattr(it, "close"):
                it.close()   # a loop that breaks out stops the loader's threads now
            if not failed and self.step is not None and self._resident is not None and self.controls is None:
                self._run_controls()
            if self._steps and not (self.reports and self.reports[-1].steps == len(self._steps)
                                    and (self.controls is None or self.reports[-1].synthetic_images_per_s is not None)):
                self._emit(self.report())

    def _run_controls(self) -> None:
        """The step on the kept batch, alone and beside the loader (`step_controls`), after the pass."""
        n = len(self._steps)
        if n < MIN_VERDICT_STEPS:
            return   # no verdict either way: the report says how many steps are missing
        device = self._device if self._synced else None
        self.controls = measure_controls(self.step, self._resident, self.iterable,   # type: ignore[arg-type]
                                         steps=min(n, CONTROL_STEPS_MAX), device=device)
        self._resident = None

    def _decide_sync(self, batch: Any) -> None:
        t = _first_tensor(batch)
        if t is not None:
            self._device = str(t.device)
        torch = sys.modules.get("torch")
        cuda_ready = torch is not None and torch.cuda.is_available()
        on_gpu = t is not None and t.is_cuda
        self._synced = bool(cuda_ready and (on_gpu if self.sync is None else self.sync))

    def _clock(self) -> float:
        if self._synced:
            # the batches' GPU (torch.cuda.synchronize() alone waits for the current one, which under a
            # training loop on cuda:1 with device 0 current is not where the step runs)
            on = self._device if self._device.startswith("cuda") else None
            sys.modules["torch"].cuda.synchronize(on)
        return time.perf_counter()

    def _mark_start(self) -> None:
        self._stats0 = self._loader_stats()
        self._cpu0 = (time.perf_counter(), cpu_seconds(), _system_busy())

    def _loader_stats(self) -> dict[str, float] | None:
        if not _is_stoker_loader(self.iterable):
            return None
        st = self.iterable.stats
        return {k: float(getattr(st, k, 0.0)) for k in ("samples", "read_s", "decode_s", "augment_s",
                                                        "worker_wait_s", "consumer_wait_s", "device_s")}

    def _emit(self, report: ProfileReport) -> None:
        self.reports.append(report)
        if self.verbose:
            print(report.format(), file=self.file or sys.stderr, flush=True)

    @property
    def images_per_s(self) -> float:
        """Images/s over the steps measured so far (NaN before the first)."""
        n = len(self._steps)
        wall = sum(self._waits[:n]) + sum(self._steps)
        images = sum(self._sizes[:n])
        return images / wall if wall > 0 and images else math.nan

    # -- the report --
    def report(self) -> ProfileReport:
        """The report over the steps measured so far (after warm-up)."""
        n = len(self._steps)   # measured steps: each has its wait and its step time
        waits, steps = self._waits[:n], self._steps[:n]
        wait_s, compute_s = sum(waits), sum(steps)
        wall = wait_s + compute_s
        images = sum(self._sizes[:n])
        t0, cpu0, (busy0, total0) = self._cpu0
        elapsed = time.perf_counter() - t0 if t0 else math.nan
        cpu = (cpu_seconds() - cpu0) / elapsed * 100 if t0 and elapsed > 0 else math.nan
        busy1, total1 = _system_busy()
        system = (busy1 - busy0) / (total1 - total0) * 100 if t0 and total1 > total0 else math.nan
        stages = self._stage_times()
        frac = wait_s / wall if wall > 0 else math.nan
        report = ProfileReport(
            steps=n, images=images, wall_s=wall, wait_s=wait_s, compute_s=compute_s,
            images_per_s=images / wall if wall > 0 and images else math.nan,
            steps_per_s=n / wall if wall > 0 else math.nan, data_wait_fraction=frac,
            median_wait_ms=statistics.median(waits) * 1000 if waits else math.nan,
            median_step_ms=statistics.median(steps) * 1000 if steps else math.nan,
            first_batch_s=self._first_batch, warmup_steps=self.warmup, synchronized=self._synced,
            device=self._device, loader=_describe(self.iterable), cpu_percent=cpu, cpu_cores=usable_cpus(),
            system_cpu_percent=system, stages=stages, verdict=COMPUTE_BOUND, reason="")
        c = self.controls
        if c is not None:
            report.synthetic_images_per_s = c.synthetic_images_per_s
            report.interference_images_per_s = c.interference_images_per_s
            report.control_note = c.why_no_interference
        diagnose(report, self.iterable)
        return report

    def _stage_times(self) -> dict[str, float] | None:
        now, start = self._loader_stats(), self._stats0
        if now is None or start is None:
            return None
        d = {k: now[k] - start[k] for k in now}
        per = 1000.0 / d["samples"] if d["samples"] > 0 else math.nan
        return {"read_ms": d["read_s"] * per, "decode_ms": d["decode_s"] * per, "augment_ms": d["augment_s"] * per,
                "worker_wait_s": d["worker_wait_s"], "consumer_wait_s": d["consumer_wait_s"],
                "device_ms": d["device_s"] * per, "samples": d["samples"]}


def profile(iterable: Iterable[Any], *, every: int | None = None, warmup: int = 1, sync: bool | None = None,
            file: TextIO | None = None, verbose: bool = True, step: Callable[..., Any] | None = None) -> Profiler:
    """Wrap a batch iterable to measure data wait vs step time inside your own training loop.

        prof = stoker.profile(loader)
        for images, labels in prof:
            step(images, labels)
        prof.reports[-1].verdict        # "input-bound" or "compute-bound"

    `every`: also report every N measured steps. `warmup`: first steps left out of the figures
    (loader start-up). `sync`: CUDA-synchronize around `next()`; default: when batches are CUDA
    tensors (set True when you move CPU batches to the GPU yourself and want queued GPU work
    counted as step time). Reports print to `file` (default stderr) unless `verbose=False`; all
    of them are kept in `.reports`, and `.report()` gives one for the steps so far.

    `step`: your training step, called as `step(*batch)`. Given, the pass ends with the step's controls
    (`stoker.step_controls`): the step on a copy of the first batch held in memory, alone (synthetic) and
    beside the loader running again with its batches discarded (interference), each over as many steps
    as were measured (at most 50); the final report then judges by fed / synthetic.
    """
    return Profiler(iterable, every=every, warmup=warmup, sync=sync, file=file, verbose=verbose, step=step)
