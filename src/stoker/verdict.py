"""The verdict of `stoker.profile` and `stoker doctor`: input-bound, compute-bound, or none yet, with
the fixes that apply; judged from a `ProfileReport`'s figures (the thresholds' reasons are in
`stoker.profiling`'s docstring).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from ._system import fmt_number
from .step_controls import MIN_VERDICT_STEPS

#: what the functions below judge: a `stoker.profiling.ProfileReport` (not imported: profiling imports this)
ProfileReport = Any

__all__ = ["COMPUTE_BOUND", "INPUT_BOUND", "INPUT_BOUND_WAIT", "UNDECIDED", "diagnose"]

INPUT_BOUND = "input-bound"
COMPUTE_BOUND = "compute-bound"
#: the verdict of a run with fewer than MIN_VERDICT_STEPS measured steps: none
UNDECIDED = "undecided"
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


def _is_stoker_loader(obj: Any) -> bool:
    stats = getattr(obj, "stats", None)
    return all(hasattr(stats, a) for a in ("read_s", "decode_s", "augment_s", "consumer_wait_s")) \
        and hasattr(obj, "dataset") and hasattr(obj, "num_threads")


def _is_data_loader(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.utils.data.DataLoader)


def _packed(loader: Any) -> bool:
    return type(loader.dataset).__name__ in ("PackedDataset", "CachedDataset")


def diagnose(report: ProfileReport, iterable: Any = None) -> ProfileReport:
    """Fill `report.verdict`, `.reason` and `.fixes` from its figures (and what `iterable` is): by fed /
    synthetic where the step's controls were measured, else by data wait; none below MIN_VERDICT_STEPS."""
    report.fixes = []
    torch = sys.modules.get("torch")
    gpu = report.device.startswith("cuda")
    if not gpu and not (torch is not None and torch.cuda.is_available()):
        report.notes.append("no GPU: the model step and the loader share the same CPU cores, so the loader's "
                            "CPU time also slows the step")
    if report.steps < MIN_VERDICT_STEPS:
        return _too_few_steps(report)
    frac = report.data_wait_fraction
    if not math.isfinite(frac):   # steps without any measurable time: nothing to judge
        report.verdict, report.reason = UNDECIDED, "the measured steps took no measurable time"
        return report
    cpu_use = report.cpu_percent / (100.0 * report.cpu_cores) if math.isfinite(report.cpu_percent) else math.nan
    saturated = math.isfinite(cpu_use) and cpu_use >= CPU_SATURATED
    fed = report.fed_ratio
    if fed is not None:
        lost = fed < 1.0 - INPUT_BOUND_WAIT
        report.reason = (f"training fed by the loader keeps {fed:.0%} of the model's speed on a batch held in memory "
                         f"(fed / synthetic {fed:.2f}, {'under' if lost else 'at or above'} "
                         f"{1 - INPUT_BOUND_WAIT:.2f}){_split(report)}")
    else:
        lost = frac >= INPUT_BOUND_WAIT
        gain = 1.0 / max(1.0 - frac, 1e-9)
        report.reason = (f"the loop waits for data {frac:.0%} of the time (threshold {INPUT_BOUND_WAIT:.0%}); a loader "
                         f"that kept up would make training up to {gain:.2f}x faster" if lost else
                         f"the loop waits for data only {frac:.0%} of the time (under {INPUT_BOUND_WAIT:.0%}): the "
                         f"loader keeps up, at most {gain:.2f}x to gain from it")
        report.notes.append("judged by data wait alone, which misses the loader's cost to a step that never waits "
                            "(its threads take the step's cores); pass your step, `stoker.profile(loader, "
                            "step=step)`, to judge by fed / synthetic")
    if lost:
        report.verdict = INPUT_BOUND
        report.fixes = _interference_fixes(report, iterable) + \
            (_input_fixes(report, iterable, saturated) if fed is None or frac >= INPUT_BOUND_WAIT / 2 else [])
        if not report.fixes:
            report.fixes = _input_fixes(report, iterable, saturated)
    else:
        report.verdict = COMPUTE_BOUND
        report.fixes = ["speed up the step itself: mixed precision (torch.autocast), channels_last, "
                        "torch.compile, a larger batch" + ("" if gpu else ", or a GPU")]
    return report


def _too_few_steps(report: ProfileReport) -> ProfileReport:
    more = MIN_VERDICT_STEPS - report.steps
    per_step = report.images // report.steps if report.steps else 0
    images = f" ({more * per_step:,} more images at {per_step} per batch)" if per_step else ""
    report.verdict = UNDECIDED
    report.reason = (f"{report.steps} step(s) measured after {report.warmup_steps} warm-up; a verdict needs at least "
                     f"{MIN_VERDICT_STEPS}: {more} more{images}")
    report.fixes = [f"profile a pass of at least {MIN_VERDICT_STEPS + report.warmup_steps} batches: more images or a "
                    "smaller batch_size (`stoker doctor PATH --steps N` for the doctor)"]
    return report


def _split(report: ProfileReport) -> str:
    """Where the lost speed went: the interference control's share and the data wait's."""
    ratio = report.interference_ratio
    if ratio is None:
        return f"; data wait {report.data_wait_fraction:.0%} of wall time"
    return (f"; beside the running loader, never waiting, the step keeps {ratio:.0%} (interference control), and "
            f"the fed loop waits for data {report.data_wait_fraction:.0%} of its time")


def _interference_fixes(report: ProfileReport, iterable: Any) -> list[str]:
    ratio = report.interference_ratio
    if ratio is None or ratio >= 1.0 - INPUT_BOUND_WAIT:
        return []
    torch = sys.modules.get("torch")
    if not report.device.startswith("cuda") and not (torch is not None and torch.cuda.is_available()):
        how = ("without a GPU the model and the loader share these cores; train on a GPU, or give the loader "
               "fewer threads")
    elif _is_stoker_loader(iterable):
        how = ("run its threads in their own process (`workers=stoker.Workers(processes=1)`), decode on the GPU "
               "(`DeviceOptions('cuda', decode='gpu')`), or give it fewer threads")
    else:
        how = ("give the workers fewer cores than the step needs (`num_workers=`), or switch to stoker's process "
               "mode (`stoker.Loader(..., workers=stoker.Workers(processes=1))`)")
    return [f"the running loader slows the step itself by {1 - ratio:.0%} although the step never waits for it "
            f"(interference control): its CPU work competes with the step's; {how}"]


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
                     "the job its own cores), then profile again" + _pool_fix(iterable))
    if not fixes:   # none of the figures points anywhere: never leave the verdict bare
        fixes.append(f"no single stage stands out: try `num_threads={cores}` with a bigger `prefetch`, shrink the "
                     "images once (`stoker pack --max-side`), or decode on the GPU "
                     "(`DeviceOptions('cuda', decode='gpu')`)")
    return fixes


def _pool_fix(iterable: Any) -> str:
    """What to say of the engine pool when other processes take the cores: a pool below the training
    process's priority yields to every other job (`Workers(nice=)`); one that may grow keeps its share with
    more threads (`Workers(max_threads=)`), and says how far it grew."""
    workers = getattr(iterable, "workers", None)
    if not _is_stoker_loader(iterable) or workers is None:
        return ""
    from .loading.engine import pool_nice

    said = []
    nice = pool_nice(workers.nice)
    if nice != 0:
        said.append(f"the loader's threads run at nice {nice}, below every other job: "
                    f"workers=stoker.Workers(nice=0) keeps their share")
    stats, threads = getattr(iterable, "stats", None), iterable.num_threads
    peak = getattr(stats, "pool_threads_peak", 0)
    if peak > threads:
        said.append(f"the loader's pool already ran up to {peak} threads (num_threads={threads}) to keep its "
                    f"share beside them")
    elif stats is not None and getattr(stats, "engine", False) and workers.max_threads is not None \
            and workers.max_threads <= threads:
        said.append(f"the loader's pool may not grow (max_threads={workers.max_threads}): "
                    f"workers=stoker.Workers(max_threads=None) lets it start more threads to keep its share")
    return "".join("; " + s for s in said)


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
