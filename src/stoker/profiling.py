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
from typing import Any, Iterable, Iterator, TextIO

from ._system import fmt_number, json_safe, usable_cpus
from .errors import ConfigError

__all__ = ["COMPUTE_BOUND", "INPUT_BOUND", "INPUT_BOUND_WAIT", "ProfileReport", "Profiler", "profile"]

INPUT_BOUND = "input-bound"
COMPUTE_BOUND = "compute-bound"
#: Data-wait fraction of wall time at and above which a loop is input-bound (see the module docstring).
INPUT_BOUND_WAIT = 0.10
#: CPU use (fraction of the usable cores) at and above which the CPUs count as saturated:
#: more loader threads cannot help then, a cheaper decode or another decoder (the GPU) can.
CPU_SATURATED = 0.85
#: Share of the loader's worker time spent reading bytes above which storage is the slow stage.
READ_HEAVY = 0.25
#: Stored images whose mean longer side exceeds this multiple of the output side are worth shrinking
#: once at pack time (decode cost grows with the pixels decoded).
OVERSIZED = 2.5


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
    verdict: str                        # INPUT_BOUND or COMPUTE_BOUND
    reason: str                         # the measurement behind the verdict, in a sentence
    fixes: list[str] = field(default_factory=list)  # what to do, most effective first
    notes: list[str] = field(default_factory=list)

    @property
    def data_wait_percent(self) -> float:
        return self.data_wait_fraction * 100.0

    @property
    def input_bound(self) -> bool:
        return self.verdict == INPUT_BOUND

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN becomes None)."""
        out = asdict(self)
        out["data_wait_percent"] = self.data_wait_percent
        return json_safe(out)

    def format(self) -> str:
        """The report as text: figures, verdict, fixes."""
        lines = [f"stoker profile: {self.loader}, batches on {self.device}"
                 + (" (CUDA-synchronized)" if self.synchronized else ""),
                 f"  steps            {self.steps} measured after {self.warmup_steps} warm-up "
                 f"(first batch {fmt_number(self.first_batch_s, '.2f')} s)",
                 f"  throughput       {fmt_number(self.images_per_s, ',.1f')} images/s, "
                 f"{fmt_number(self.steps_per_s, '.2f')} steps/s",
                 f"  data wait        {fmt_number(self.data_wait_percent, '.1f')}% of wall time "
                 f"({self.wait_s:.2f} of {self.wall_s:.2f} s; median {fmt_number(self.median_wait_ms, '.1f')} ms/step)",
                 f"  step (compute)   median {fmt_number(self.median_step_ms, '.1f')} ms",
                 f"  CPU              {fmt_number(self.cpu_percent, '.0f')}% of one core (this process and its "
                 f"workers; {self.cpu_cores} usable cores), machine {fmt_number(self.system_cpu_percent, '.0f')}% busy"]
        if self.stages:
            s = self.stages
            lines.append(f"  loader stages    per image: read {s['read_ms']:.2f} ms, decode {s['decode_ms']:.2f} ms, "
                         f"augment {s['augment_ms']:.2f} ms (thread time); workers waited for a free slot "
                         f"{s['worker_wait_s']:.2f} s")
            if s.get("device_ms"):
                lines.append(f"  device stage     {s['device_ms']:.3f} ms per image on its thread (upload, convert, GPU "
                             f"decode); the copy itself overlaps your step on its own stream")
        lines.append(f"  verdict          {self.verdict.upper()}: {self.reason}")
        lines += [f"  fix              {fix}" if i == 0 else f"                   {fix}"
                  for i, fix in enumerate(self.fixes)]
        lines += [f"  note             {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = format


# ----------------------------------------------------------------------------- what is being profiled

def _is_stoker_loader(obj: Any) -> bool:
    stats = getattr(obj, "stats", None)
    return all(hasattr(stats, a) for a in ("read_s", "decode_s", "augment_s", "consumer_wait_s")) \
        and hasattr(obj, "dataset") and hasattr(obj, "num_threads")


def _is_data_loader(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.utils.data.DataLoader)


def _describe(obj: Any) -> str:
    if _is_stoker_loader(obj):
        kind = "packed" if _packed(obj) else "loose files"
        return f"stoker.Loader ({kind}, {obj.num_threads} thread(s), prefetch {obj.prefetch})"
    if _is_data_loader(obj):
        return f"torch DataLoader (num_workers={obj.num_workers}, batch_size={obj.batch_size})"
    return type(obj).__name__


def _packed(loader: Any) -> bool:
    return loader.dataset.packed


def _first_tensor(batch: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def _batch_size(batch: Any) -> int:
    t = _first_tensor(batch)
    if t is not None and t.dim() > 0:
        return int(t.shape[0])
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    try:
        return len(first)
    except TypeError:
        return 0


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
                 sync: bool | None = None, file: TextIO | None = None, verbose: bool = True) -> None:
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ConfigError(f"profile(every=) must be a positive number of steps or None, got {every!r}")
        if not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"profile(warmup=) must be a number of steps >= 0, got {warmup!r}")
        self.iterable, self.every, self.warmup, self.sync = iterable, every, warmup, sync
        self.file, self.verbose = file, verbose
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

    # -- iteration --
    def __iter__(self) -> Iterator[Any]:
        self._reset()
        it = iter(self.iterable)
        done_at = None   # when the previous batch was handed to the loop
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
                got = self._clock()
                self._seen += 1
                if self._seen == 1:
                    self._first_batch = got - start
                if self._seen > self.warmup:
                    self._waits.append(got - start)
                    self._sizes.append(_batch_size(batch))
                done_at = time.perf_counter()
                yield batch
        finally:
            if it is not self.iterable and hasattr(it, "close"):
                it.close()   # a loop that breaks out stops the loader's threads now
            if self._steps and not (self.reports and self.reports[-1].steps == len(self._steps)):
                self._emit(self.report())

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
            file: TextIO | None = None, verbose: bool = True) -> Profiler:
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
    """
    return Profiler(iterable, every=every, warmup=warmup, sync=sync, file=file, verbose=verbose)


# ----------------------------------------------------------------------------- the verdict

def diagnose(report: ProfileReport, iterable: Any = None) -> ProfileReport:
    """Fill `report.verdict`, `.reason` and `.fixes` from its figures (and what `iterable` is)."""
    frac = report.data_wait_fraction
    if not math.isfinite(frac):
        report.verdict, report.reason = COMPUTE_BOUND, "no steps measured yet"
        return report
    gain = 1.0 / max(1.0 - frac, 1e-9)
    cpu_use = report.cpu_percent / (100.0 * report.cpu_cores) if math.isfinite(report.cpu_percent) else math.nan
    saturated = math.isfinite(cpu_use) and cpu_use >= CPU_SATURATED
    gpu = report.device.startswith("cuda")
    if frac >= INPUT_BOUND_WAIT:
        report.verdict = INPUT_BOUND
        report.reason = (f"the loop waits for data {frac:.0%} of the time (threshold {INPUT_BOUND_WAIT:.0%}); "
                         f"a loader that kept up would make training up to {gain:.2f}x faster")
        report.fixes = _input_fixes(report, iterable, saturated)
    else:
        report.verdict = COMPUTE_BOUND
        report.reason = (f"the loop waits for data only {frac:.0%} of the time (under {INPUT_BOUND_WAIT:.0%}): "
                         f"the loader keeps up, at most {gain:.2f}x to gain from it")
        report.fixes = ["speed up the step itself: mixed precision (torch.autocast), channels_last, "
                        "torch.compile, a larger batch" + ("" if gpu else ", or a GPU")]
    torch = sys.modules.get("torch")
    if not gpu and not (torch is not None and torch.cuda.is_available()):
        report.notes.append("no GPU: the model step and the loader share the same CPU cores, so the loader's "
                            "CPU time also slows the step")
    return report


def _input_fixes(report: ProfileReport, iterable: Any, saturated: bool) -> list[str]:
    fixes: list[str] = []
    cores = report.cpu_cores
    bursty = (math.isfinite(report.median_wait_ms) and math.isfinite(report.median_step_ms)
              and report.median_wait_ms < 0.1 * report.median_step_ms)
    if _is_stoker_loader(iterable):
        loader = iterable
        if not _packed(loader):
            fixes.append("pack the dataset once (`stoker pack SRC OUT`) and load the pack: no file opens or "
                         "header parsing per sample, crops planned per batch")
        st = report.stages or {}
        work = sum(st.get(k, 0.0) for k in ("read_ms", "decode_ms", "augment_ms"))
        if work > 0 and st.get("read_ms", 0.0) / work >= READ_HEAVY:
            fixes.append(f"reading takes {st['read_ms'] / work:.0%} of the loader's time: stage the dataset to "
                         "local disk or RAM (copy the shards to local NVMe or /dev/shm)")
        side = _oversized(loader)
        if side:
            fixes.append(f"the stored images are large for the output: re-pack with `--max-side {side}` "
                         "(decode cost grows with the pixels decoded)")
        if bursty:
            fixes.append(f"waits come in bursts (median wait {report.median_wait_ms:.1f} ms per step): a bigger "
                         f"prefetch, e.g. `workers=stoker.Workers(prefetch={max(4, loader.prefetch * 2)})`")
        if loader.num_threads < cores and not saturated:
            fixes.append(f"more threads: `workers={cores}` (now {loader.num_threads}; {cores} usable cores)")
        if saturated:
            fixes.append("the CPU cores are saturated: more threads cannot help; decode on the GPU "
                         "(`Loader(..., device=DeviceOptions('cuda', decode='gpu'))`, nvJPEG) or use a machine "
                         "with more CPU cores per GPU")
    else:
        fixes.append("switch to stoker: pack the dataset once (`stoker pack SRC OUT`) and load it with "
                     "`stoker.Loader` (reduced-scale JPEG decode on threads, uint8 batches)")
        workers = getattr(iterable, "num_workers", None)
        if workers is not None and workers < cores and not saturated:
            fixes.append(f"more worker processes: `num_workers={cores}` (now {workers})")
        if bursty:
            fixes.append("waits come in bursts: a bigger prefetch (`prefetch_factor=4` for a DataLoader)")
        if saturated:
            fixes.append("the CPU cores are saturated: decode on the GPU (pack, then `stoker.Loader(..., "
                         "device=DeviceOptions('cuda', decode='gpu'))`, nvJPEG), shrink the images once "
                         "(`stoker pack --max-side 512`), or use more CPU cores per GPU")
    busy = report.system_cpu_percent
    if math.isfinite(busy) and busy >= 100 * CPU_SATURATED and not saturated:   # starved by other processes
        fixes.append(f"the machine is {busy:.0f}% busy while this process uses "
                     f"{fmt_number(report.cpu_percent, '.0f')}% of its {cores} core(s) (100% = one core): "
                     "other processes take the CPU the loader needs; run where the cores are free (or give "
                     "the job its own cores), then profile again")
    if not fixes:   # none of the figures points anywhere: never leave the verdict bare
        fixes.append(f"no single stage stands out: try `num_threads={cores}` with a bigger `prefetch`, shrink the "
                     "images once (`stoker pack --max-side`), or decode on the GPU "
                     "(`DeviceOptions('cuda', decode='gpu')`)")
    return fixes


def _oversized(loader: Any) -> int | None:
    """A `--max-side` to suggest when the stored images are much larger than the loader's output."""
    ds = loader.dataset
    heights, widths = getattr(ds, "heights", None), getattr(ds, "widths", None)
    if heights is None or widths is None or len(heights) == 0:
        return None
    import numpy as np

    longer = float(np.maximum(np.asarray(heights), np.asarray(widths)).mean())
    out = max(loader.output_size)
    if longer <= OVERSIZED * out:
        return None
    return int(math.ceil(2 * out / 32) * 32)
