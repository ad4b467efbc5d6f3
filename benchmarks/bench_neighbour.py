"""The noisy-neighbour bench: what a loader costs the training thread's own Python.

    python benchmarks/bench_neighbour.py [--data PHOTOS] [--images 1000] [--workers 2] [--rounds 3]
                                         [--batch-size 32] [--python-us 300] [--processes 1] [--out DIR] [--json]

stoker's worker threads live in the training process. What they run under the GIL (per-sample
dispatch, crop planning) competes with the training loop's Python: kernel dispatch, the optimizer
step, logging. A DataLoader's workers are processes; only the batches' hand-off runs in the
training process. This bench measures both sides in one run:

- **step inflation**: a fixed, dispatch-bound "training step" (`dispatch_step`: a few hundred small
  torch ops on tiny tensors, as kernel launches are for the host) timed on the main thread with no
  loader, with stoker's Loader at 1..N threads (in this process, and in worker processes:
  `Workers(processes=P)`, "stoker-process", P from `--processes`, default 1, at most one per thread)
  and with a DataLoader + PIL at 1..N worker processes
  feeding it; per configuration the step's median and p90 (ms), the inflation of each over the
  no-loader step, and the loader's images/s. Configurations alternate within each round, so slow
  drifts of a shared machine fall on all of them.
- **GIL time per sample**: a probe thread runs pure-Python work in a loop; its time blocked waiting for
  the GIL while a loader runs (Linux's scheduler account, less the same in alternated windows with the
  loader idle) is the share of the GIL the loader held, and that share of the windows' wall time over
  their samples is µs per sample (`gil_share`; checked against a load holding the GIL for known times).

The arrangement of the training loop: `next(loader)`, then `steps_per_batch` timed steps, and again.
The steps take a small share of each batch's time (the share is reported), so the loader runs at
full speed and every step overlaps its work, as the host side of a GPU training loop does (the
GPU runs the kernels; the host only dispatches them).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stoker._system import usable_cpus
from stoker.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the sibling scripts, however this one is loaded
from bench_calls import CALLS_BATCH, CALLS_THREADS, python_calls  # noqa: E402 (benchmarks/bench_calls.py)

__all__ = ["GilShare", "NeighbourResult", "NeighbourRow", "dispatch_step", "format_neighbour", "gil_share",
           "run_neighbour"]

STEP_OPS = 300          # small torch ops per step
#: the loaders measured: stoker's threads here, the same threads in a worker process, a DataLoader
FEEDS = ("stoker", "stoker-process", "dataloader")
PROBE_CHUNK = 2000      # pure-Python loop iterations the probe counts as one unit (about 50 µs)


# ----------------------------------------------------------------------------- the training thread's step

def make_step(ops: int = STEP_OPS) -> Callable[[], None]:
    """A dispatch-bound step: `ops` in-place ops on 16-element tensors, each almost all host-side
    dispatch (microseconds of Python and C++ under the GIL, nanoseconds of arithmetic)."""
    import torch

    x, y = torch.zeros(16), torch.full((16,), 0.5)

    def step() -> None:
        for _ in range(ops // 3):
            x.add_(y)
            x.mul_(0.5)
            x.sub_(y)
    return step


def dispatch_step(ops: int = STEP_OPS) -> float:
    """Seconds one `ops`-op dispatch-bound step takes on the calling thread (for a quick look)."""
    step = make_step(ops)
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


# ----------------------------------------------------------------------------- the GIL probe

def _spin(n: int) -> int:
    k = 0
    for i in range(n):   # pure bytecode: runs only while this thread holds the GIL
        k += i & 7
    return k


_Reading = tuple[int, float, "float | None", "int | None"]


class _Probe:
    """A thread doing pure-Python work in units of `PROBE_CHUNK` iterations, counting them.

    Where Linux shows its scheduler times (/proc/self/task/TID/schedstat: time on a CPU, time waiting
    for one), the probe's time blocked, neither running nor runnable, is its time waiting for the GIL,
    whatever other processes do to the CPUs; elsewhere its lost progress stands in for it."""

    def __init__(self) -> None:
        self.units = 0
        self._tid: int | None = None
        self._started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stoker-gil-probe", daemon=True)

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        self._started.set()
        while not self._stop.is_set():
            _spin(PROBE_CHUNK)
            self.units += 1

    def reading(self) -> _Reading:
        """(units, wall s, blocked s, times scheduled in; the last two None where the scheduler's
        account is not readable)."""
        wall = time.perf_counter()
        try:
            with open(f"/proc/self/task/{self._tid}/schedstat") as f:
                on_cpu, waiting, slices = (int(v) for v in f.read().split()[:3])
        except (OSError, ValueError):
            return self.units, wall, None, None
        return self.units, wall, wall - (on_cpu + waiting) / 1e9, slices

    def __enter__(self) -> "_Probe":
        self._thread.start()
        self._started.wait(5.0)
        time.sleep(0.02)   # the probe is running
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


@dataclass
class GilShare:
    """What `gil_share` measured: `share` of the GIL the load held (0..1; a little below 0 where noise
    outweighs it, beside `share_alone`, the probe's own blocked share), `us_per_unit` of GIL time per
    unit of the load's work (µs per sample for a loader), the load's own rate while the probe ran
    (`units_per_s`), and how (`method`: "blocked", the probe's time blocked in the scheduler's account;
    "progress", its lost progress, which CPU contention inflates)."""

    share: float
    us_per_unit: float
    units_per_s: float
    method: str
    share_alone: float   # the same measure with the load idle (subtracted; near 0 on a quiet machine)
    # times the probe was scheduled back in per unit, over its rate alone: about the GIL hand-offs per
    # sample (each costs a thread wake-up, which a busy machine lengthens); NaN without the account
    switches_per_unit: float = float("nan")


def _share(start: _Reading, end: _Reading) -> tuple[float, float | None, float | None]:
    """(probe units/s, blocked share, times scheduled in per second; None where unknown) between two readings."""
    wall = end[1] - start[1]
    blocked = None if start[2] is None or end[2] is None else (end[2] - start[2]) / wall
    slices = None if start[3] is None or end[3] is None else (end[3] - start[3]) / wall
    return (end[0] - start[0]) / wall, blocked, slices


def gil_share(run_load: Callable[[Callable[[], None], float], int], seconds: float = 1.0, rounds: int = 3,
              switch_interval: float | None = None) -> GilShare:
    """The share of the GIL a load holds, measured by a probe thread that always wants it.

    `run_load(mark, seconds)` sets the load up on the calling thread, calls `mark()` where the measured
    part begins (after start-up), runs the load for about `seconds` (on this thread, or waiting for its
    own threads) and returns the units of work done since `mark()` (samples). Windows with the load
    alternate with windows where the calling thread only sleeps, `rounds` of each (medians). The
    probe's time blocked (`_Probe`) is the time others held the GIL; lost CPU time to other processes
    is not counted. Without the scheduler's times, the probe's lost progress stands in.

    `switch_interval` (seconds; None: Python's, 5 ms by default) is how long a thread waiting for the GIL
    lets the probe run before asking for it (`sys.setswitchinterval`, restored after). Shorter, a loader
    runs nearer its own speed beside the probe, but on a busy machine the probe then spends more of its
    wait runnable rather than blocked, which this account does not count: a known 2 ms hold read about
    half its share at 0.5 ms, within 10% at 5 ms (tests/test_bench_neighbour.py checks the default)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(before if switch_interval is None else switch_interval)
    try:
        return _gil_share(run_load, seconds, rounds)
    finally:
        sys.setswitchinterval(before)


def _gil_share(run_load: Callable[[Callable[[], None], float], int], seconds: float, rounds: int) -> GilShare:
    alone: list[tuple[float, float | None, float | None]] = []
    loaded: list[tuple[float, float | None, float | None]] = []
    wall, units = 0.0, 0
    for _ in range(rounds):
        with _Probe() as probe:
            r0 = probe.reading()
            time.sleep(seconds)
            alone.append(_share(r0, probe.reading()))
        with _Probe() as probe:
            marks: list[_Reading] = []
            done = run_load(lambda: marks.append(probe.reading()), seconds)
            r1 = probe.reading()
            if not marks:
                raise ConfigError("gil_share: run_load(mark, seconds) returned without calling mark() where its "
                                  "measured part begins")
            loaded.append(_share(marks[0], r1))
        wall, units = wall + r1[1] - marks[0][1], units + done
    switches = float("nan")
    if all(x[1] is not None and x[2] is not None for x in alone + loaded):
        method = "blocked"
        base = statistics.median(x[1] for x in alone)  # type: ignore[misc]
        share = statistics.median(x[1] for x in loaded) - base  # type: ignore[misc]
        extra = statistics.median(x[2] for x in loaded) - statistics.median(x[2] for x in alone)  # type: ignore[misc]
        switches = max(0.0, extra) * wall / units if units else float("nan")
    else:
        method, base = "progress", 0.0
        share = 1.0 - statistics.median(x[0] for x in loaded) / statistics.median(x[0] for x in alone)
    share = min(1.0, share)   # not clamped at 0: a negative share is noise, and says how much
    return GilShare(share, share * wall / units * 1e6 if units else float("nan"), units / wall, method, base,
                    switches)


# ----------------------------------------------------------------------------- the feeds

class PythonWork:
    """A user transform that runs `us` µs of pure Python per sample (under the GIL) and returns the image
    unchanged: the per-sample Python a video clip's frame loop or a user's own transform brings."""

    def __init__(self, us: float) -> None:
        self.us = us

    def __call__(self, img: np.ndarray) -> np.ndarray:
        end = time.perf_counter() + self.us / 1e6
        while time.perf_counter() < end:
            pass
        return img


def _stoker_feed(packed: Path, batch_size: int, threads: int, seed: int, processes: int = 0, python_us: float = 0.0
                 ) -> tuple[Iterator[Any], Callable[[], None]]:
    from stoker.loader.loader import Loader
    from stoker.loader.options import Workers
    from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop, adapt

    ops: list[Any] = [RandomResizedCrop(224), RandomHorizontalFlip()]
    if python_us:
        ops.append(adapt(PythonWork(python_us), input="numpy", random="none"))
    loader = Loader(str(packed), batch_size, transforms=ops, seed=seed,
                    workers=Workers(num_threads=threads, processes=processes))
    it = iter(loader)

    def close() -> None:
        it.close()
        loader.close()
    return it, close


def _dataloader_feed(root: Path, batch_size: int, workers: int, seed: int) -> tuple[Iterator[Any], Callable[[], None]]:
    from stoker.tools.baseline import baseline_loader

    it = iter(baseline_loader(root, batch_size, workers=workers, train=True, shuffle=True, seed=seed))

    def close() -> None:
        shutdown = getattr(it, "_shutdown_workers", None)   # the worker processes, now rather than at collection
        if shutdown is not None:
            shutdown()
    return it, close


def _open_feed(name: str, threads: int, data: "_Data", batch_size: int, seed: int
               ) -> tuple[Iterator[Any], Callable[[], None]]:
    if name in ("stoker", "stoker-process"):   # the threads in this process, or in worker processes (at most
        # one per thread: Workers' num_threads counts all of theirs)
        processes = min(data.processes, threads) if name == "stoker-process" else 0
        return _stoker_feed(data.packed, batch_size, threads, seed, processes=processes, python_us=data.python_us)
    return _dataloader_feed(data.root, batch_size, threads, seed)


@dataclass
class _Data:
    root: Path     # ImageFolder (the DataLoader's)
    packed: Path   # the same images packed (stoker's)
    images: int
    python_us: float = 0.0   # µs of pure Python per sample in stoker's transforms (PythonWork)
    processes: int = 1   # the "stoker-process" feed's worker processes (at most one per thread)


# ----------------------------------------------------------------------------- results

@dataclass
class NeighbourRow:
    """One configuration: the step's times beside it and the loader's rate."""

    name: str                 # "none", "stoker-1", "stoker-process-1", "dataloader-2", ...
    feed: str                 # "none", "stoker", "stoker-process" (Workers(processes=1)), "dataloader"
    threads: int              # stoker's threads or the DataLoader's worker processes (0: no loader)
    step_median_ms: float = float("nan")
    step_p90_ms: float = float("nan")
    inflation_median_pct: float = float("nan")   # vs the no-loader step
    inflation_p90_pct: float = float("nan")
    images_per_s: float = float("nan")   # what the loop received (0 for no loader)
    step_share: float = float("nan")     # share of the loop's time spent in steps (the rest waits in next())
    steps: int = 0
    step_ms: list[float] = field(default_factory=list, repr=False)


@dataclass
class NeighbourResult:
    rows: list[NeighbourRow]
    gil: dict[str, dict[str, float]]   # feed name -> GilShare as a dict
    batch_size: int
    rounds: int
    steps_per_batch: int
    batches: int
    step_ops: int
    data: dict[str, Any]
    machine: dict[str, Any]
    python_us: float = 0.0   # µs of pure Python per sample added to stoker's transforms
    #: Python calls per batch run by stoker's threads (threads -> calls; `bench_calls.python_calls`), and
    #: "batch_size": the batch they were counted at
    calls: dict[str, float] = field(default_factory=dict)
    processes: int = 1   # the "stoker-process" feed's Workers(processes=...) (at most one per thread)

    def get(self, name: str) -> NeighbourRow | None:
        return next((r for r in self.rows if r.name == name), None)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for row in out["rows"]:
            row.pop("step_ms")
        return out


# ----------------------------------------------------------------------------- the run

def _window(step: Callable[[], None], feed: Iterator[Any] | None, batches: int, steps_per_batch: int,
            times: list[float]) -> tuple[int, float, float]:
    """`batches` times: take a batch (none without a feed), then `steps_per_batch` timed steps.
    Returns (images received, wall seconds, seconds in steps)."""
    images, in_steps = 0, 0.0
    t0 = time.perf_counter()
    for _ in range(batches):
        if feed is not None:
            batch = next(feed)
            images += len(batch[1])
            del batch
        for _ in range(steps_per_batch):
            t = time.perf_counter()
            step()
            dt = time.perf_counter() - t
            times.append(dt)
            in_steps += dt
    return images, time.perf_counter() - t0, in_steps


def _measure_gil(feed_name: str, data: _Data, batch_size: int, seconds: float, rounds: int, seed: int) -> GilShare:
    """The GIL share of one feed at 1 thread/worker: the loop only drains batches beside the probe (a fresh
    pass per window, started before the window; a window ends early where the pass does)."""
    def drain(mark: Callable[[], None], secs: float) -> int:
        feed, close = _open_feed(feed_name, 1, data, batch_size, seed)
        try:
            next(feed)   # start-up is not the steady state
            mark()
            n, end = 0, time.perf_counter() + secs
            for batch in feed:
                n += len(batch[1])
                if time.perf_counter() >= end:
                    break
            return n
        finally:
            close()
    return gil_share(drain, seconds, rounds)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _plan_rows(max_threads: int) -> list[NeighbourRow]:
    rows = [NeighbourRow("none", "none", 0)]
    for feed in FEEDS:
        rows += [NeighbourRow(f"{feed}-{n}", feed, n) for n in range(1, max_threads + 1)]
    return rows


def _fill(rows: list[NeighbourRow], counts: dict[str, list[float]]) -> None:
    base = rows[0]
    for row in rows:
        row.step_median_ms = statistics.median(row.step_ms) * 1e3
        row.step_p90_ms = _percentile(row.step_ms, 90) * 1e3
        row.steps = len(row.step_ms)
        images, wall, in_steps = counts[row.name]
        row.images_per_s = images / wall
        row.step_share = in_steps / wall
    for row in rows:
        row.inflation_median_pct = (row.step_median_ms / base.step_median_ms - 1.0) * 100.0
        row.inflation_p90_pct = (row.step_p90_ms / base.step_p90_ms - 1.0) * 100.0


def _check(images: int, batch_size: int, max_threads: int, rounds: int, batches: int, steps_per_batch: int,
           gil_seconds: float) -> None:
    if min(batch_size, max_threads, rounds, batches, steps_per_batch) < 1 or gil_seconds < 0:
        raise ConfigError(f"run_neighbour: expected batch_size, workers, rounds, batches and steps_per_batch >= 1 "
                          f"and gil_seconds >= 0, got {batch_size}, {max_threads}, {rounds}, {batches}, "
                          f"{steps_per_batch}, {gil_seconds}")
    if images < (batches + 1) * batch_size:
        raise ConfigError(f"run_neighbour: {images} images is less than the {batches + 1} batches of {batch_size} "
                          f"one measured window takes (one warm-up batch first); use more images (images=, "
                          f"--images, or a larger data folder), a smaller batch_size (--batch-size), or fewer "
                          f"batches (batches=)")


def run_neighbour(data_dir: Path | None = None, *, images: int | None = None, batch_size: int = 32,
                  workers: int | None = 2, rounds: int = 3, batches: int = 12, steps_per_batch: int = 10,
                  step_ops: int = STEP_OPS, gil_seconds: float = 2.0, out_dir: Path | None = None, seed: int = 0,
                  progress: bool = False, python_us: float = 0.0,
                  calls_threads: tuple[int, ...] | None = None, processes: int = 1) -> NeighbourResult:
    """The noisy-neighbour bench: a dispatch-bound step's inflation beside each loader, and the GIL time per
    sample of stoker (threads here, and in a worker process) and of a DataLoader at 1 thread/worker
    (module docstring).

    `data_dir`: an ImageFolder tree of JPEGs (None: `images` generated ImageNet-like JPEGs, default 1,000).
    `workers`: the largest thread/worker count measured (1..workers; None: all usable cores). Each of
    `rounds` rounds runs every configuration once, for `batches` batches of `batch_size` after one warm-up
    batch, `steps_per_batch` timed steps of `step_ops` ops after each batch. `gil_seconds`: each GIL window
    (0 skips the GIL measurement). `out_dir` receives neighbour.json and neighbour.md. `python_us`: µs of
    pure Python per sample added to stoker's transforms (`PythonWork`, as a user transform or a clip's frame
    loop brings; the DataLoader's transforms stay torchvision's). `calls_threads`: the thread counts at which
    the Python calls per batch of stoker's threads are counted (`bench_calls.python_calls`; None: its
    `CALLS_THREADS`; () skips it).
    `processes`: the worker processes of the "stoker-process" feed (`Workers(processes=)`, at most one
    per thread). Raises ConfigError for bad arguments.
    """
    from stoker._progress import Progress
    from stoker.tools.baseline import list_image_folder
    from stoker.tools.bench import _data_stats, _pack_once, machine_info
    from stoker.tools.synth import cached_imagenet_like

    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"run_neighbour: processes (--processes) is the stoker-process feed's worker processes, "
                          f">= 1; got {processes!r}")
    if not python_us >= 0:
        raise ConfigError(f"run_neighbour: python_us (--python-us) is µs of Python per sample, >= 0; got {python_us}")
    max_threads = workers or usable_cpus()
    calls_threads = CALLS_THREADS if calls_threads is None else calls_threads
    rows = _plan_rows(max_threads)
    with tempfile.TemporaryDirectory(prefix="stoker-neighbour-") as tmp, \
            Progress("bench", rounds * len(rows) + 2, unit="window", enabled=progress) as bar:
        work = Path(out_dir) if out_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        generated = data_dir is None
        root = cached_imagenet_like(work / "data", images or 1000, seed=seed, workers=max_threads) if generated \
            else Path(data_dir)  # type: ignore[arg-type]
        samples, _ = list_image_folder(root)
        _check(len(samples), batch_size, max_threads, rounds, batches, steps_per_batch, gil_seconds)
        bar.stage("packing the images once")
        data = _Data(root, work / "packed-neighbour", len(samples), python_us, processes)
        _pack_once(root, data.packed, max_threads)
        step = make_step(step_ops)
        for _ in range(20):   # warm the dispatcher and the caches
            step()
        counts = {row.name: [0, 0.0, 0.0] for row in rows}
        for r in range(rounds):
            for row in rows:
                bar.stage(f"round {r + 1}/{rounds}: {row.name}")
                feed, close = (None, lambda: None) if row.feed == "none" else \
                    _open_feed(row.feed, row.threads, data, batch_size, seed + r)
                try:
                    if feed is not None:
                        next(feed)   # worker start-up is not the steady state
                    got = _window(step, feed, batches, steps_per_batch, row.step_ms)
                finally:
                    close()
                counts[row.name] = [a + b for a, b in zip(counts[row.name], got)]
                bar.update()
        _fill(rows, counts)
        gil: dict[str, dict[str, float]] = {}
        if gil_seconds > 0:
            for feed_name in FEEDS:
                bar.stage(f"GIL share of {feed_name} at 1 thread/worker")
                gil[feed_name] = asdict(_measure_gil(feed_name, data, batch_size, gil_seconds, rounds, seed))
                bar.update()
        calls: dict[str, float] = {}
        calls_batch = CALLS_BATCH if len(samples) >= 3 * CALLS_BATCH else batch_size
        for n in calls_threads:
            bar.stage(f"Python calls per batch of {calls_batch} at {n} threads")
            calls[str(n)] = python_calls(data.packed, calls_batch, n, seed=seed)
        calls["batch_size"] = calls_batch
        result = NeighbourResult(rows, gil, batch_size, rounds, steps_per_batch, batches, step_ops,
                                 _data_stats(root, samples, generated), machine_info(), python_us, calls,
                                 processes)
        if out_dir is not None:
            (work / "neighbour.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
            (work / "neighbour.md").write_text(format_neighbour(result) + "\n")
    return result


def format_neighbour(result: NeighbourResult) -> str:
    """The result as markdown: the step table, the GIL time per sample, the data and how to read them."""
    from stoker._system import fmt_number
    from stoker.tools.results import NOTE

    lines = ["| configuration | step median (ms) | step p90 (ms) | inflation median | inflation p90 | images/s | "
             "step share |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result.rows:
        none = r.feed == "none"
        lines.append(f"| {r.name} | {r.step_median_ms:.3f} | {r.step_p90_ms:.3f} | "
                     f"{'-' if none else f'{r.inflation_median_pct:+.1f}%'} | "
                     f"{'-' if none else f'{r.inflation_p90_pct:+.1f}%'} | "
                     f"{'-' if none else fmt_number(r.images_per_s, ',.0f')} | {r.step_share:.0%} |")
    if result.gil:
        lines += ["", "| GIL held, 1 thread/worker | share of the GIL | µs per sample | hand-offs per sample | "
                      "images/s beside the probe | probe blocked alone |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, g in result.gil.items():
            lines.append(f"| {name} | {g['share']:.2%} | {fmt_number(g['us_per_unit'], '.1f')} | "
                         f"{fmt_number(g['switches_per_unit'], '.1f')} | {fmt_number(g['units_per_s'], ',.0f')} | "
                         f"{g['share_alone']:.2%} |")
    if result.calls:
        per = int(result.calls.get("batch_size", result.batch_size))
        lines += ["", f"| stoker threads | Python calls per batch of {per} (loader's threads) |", "| ---: | ---: |"]
        lines += [f"| {n} | {c:,.0f} |" for n, c in result.calls.items() if n != "batch_size"]
    d, m = result.data, result.machine
    lines += ["",
              f"Step: {result.step_ops} in-place ops on 16-element tensors (dispatch-bound, as a GPU step is for the "
              f"host), timed one by one on the main thread; {result.steps_per_batch} steps after each of "
              f"{result.batches} batches per window (after one warm-up batch), {result.rounds} round(s), the "
              "configurations alternating within each round. Inflation: over the no-loader step. images/s: what "
              "the loop received; step share: the loop's time in steps (the rest waits in next()).",
              "stoker: Loader, RandomResizedCrop(224) + RandomHorizontalFlip on N threads in this process; "
              "stoker-process: the same N threads in "
              + ("one worker process (Workers(processes=1))" if result.processes == 1 else
                 f"min(N, {result.processes}) worker processes (Workers(processes={result.processes}), at most one "
                 "per thread)") + ", batches in shared memory. " + (f"Both add a user transform of {result.python_us:g} µs of pure Python per sample "
                            "(PythonWork). " if result.python_us else "") +
              "dataloader: torch DataLoader + PIL + torchvision's transforms (ToTensor, Normalize) on N worker "
              "processes.",
              "Python calls per batch: the calls (Python functions, and C functions called from Python) the "
              "loader's own threads make per batch in the steady state, counted with threading.setprofile "
              "(stoker, default Workers at that many threads; the GIL they take beside the training loop).",
              "GIL: a probe thread that always wants the GIL runs beside the loader (the loop only drains batches); "
              "its time blocked (Linux's scheduler account: neither on a CPU nor waiting for one) less its blocked "
              "time in windows without the loader (last column: the noise floor) is the loader's share of the GIL; that share of the windows' wall time over the "
              "samples delivered is µs per sample: the Python the loader runs under the lock plus each hand-off of "
              "the lock (a thread wake-up, longer on a busy machine; hand-offs per sample: the probe's extra times "
              "scheduled in). The probe slows stoker's threads (they wait for the lock it holds). Method: "
              f"{next(iter(result.gil.values()))['method'] if result.gil else '-'}.",
              f"Data: {d['images']} {'generated ImageNet-like ' if d['generated'] else ''}JPEGs, mean "
              f"{d['mean_width']}x{d['mean_height']} px, {d['mean_file_kb']} KB; batch {result.batch_size}.",
              f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, load average {m['load_1m']} at the start; "
              f"Python {m['python']}, torch {m.get('torch', '-')}, Pillow {m['pillow']}.", NOTE]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help="an ImageFolder of JPEGs (default: generate ImageNet-like)")
    p.add_argument("--images", type=int, default=None, help="images to generate (default 1000)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="measure 1..N threads/workers (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--python-us", type=float, default=0.0,
                   help="add a user transform of this many µs of pure Python per sample to stoker's feeds")
    p.add_argument("--processes", type=int, default=1,
                   help="the worker processes of the stoker-process feed (Workers(processes=N), at most one per thread)")
    p.add_argument("--out", type=Path, default=None, help="keep the data and write neighbour.json/.md here")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    result = run_neighbour(args.data, images=args.images, batch_size=args.batch_size, workers=args.workers,
                           rounds=args.rounds, out_dir=args.out, progress=True, python_us=args.python_us,
                           processes=args.processes)
    print(json.dumps(result.to_json(), indent=1) if args.json else format_neighbour(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
