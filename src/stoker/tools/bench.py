"""`stoker bench`: the same images through the baselines, stoker and the decode ceiling, side by side.

Pipelines (each limited to `workers` CPU cores; one epoch over every image is one round):

- ``baseline``: torch DataLoader (``workers`` processes) over an ImageFolder dataset, PIL decode,
  torchvision's default training transforms (RandomResizedCrop 224, RandomHorizontalFlip,
  ToTensor, Normalize); real torchvision when installed, else the exact re-implementation in
  `stoker.tools.baseline`.
- ``baseline-val``: the same with Resize 256 + CenterCrop 224 + ToTensor + Normalize.
- ``stoker-train`` / ``stoker-val``: stoker.Loader on the packed copy, the same transforms.
- ``ceiling``: libjpeg-turbo (simplejpeg) full decode of every image on ``workers`` threads, nothing else.
- ``stoker-train-fast``: stoker-train with ``decode_quality="fast"`` (fast IDCT, plain upsampling).
- ``stoker-train-float``: stoker-train handing out what the baseline hands out, float32 normalized NCHW
  batches on the CPU (``device="cpu"``, ``normalize="imagenet"``; the conversion goes through per-channel tables).
- ``stoker-train-raw256`` / ``stoker-train-jpeg256``: the recipes of storing smaller images: the same
  images packed with ``--encoding raw --max-side 256`` (no decode at load time) or ``--max-side 256``
  (smaller JPEGs), then stoker-train; the table prints each pipeline's bytes on disk beside its speed.
- ``stoker-buckets`` (not run by default): aspect-ratio buckets of 224 x 224 pixels + flip, each batch one
  bucket (``stoker.AspectBuckets``), its ratio to stoker-train; benchmarks/bench_buckets.py compares more.
- ``stoker-tokens`` (not run by default): NaFlex token budgets of 196 patches of 16 + flip
  (``stoker.TokenBudget``); benchmarks/bench_naflex.py compares it with timm's.
- ``overhead``: stoker.Loader on ONE thread over tiny (16 x 16) raw-stored images, so decode and resize
  cost nothing: what is left is the per-sample Python work, reported in µs per sample.

Other libraries' loaders (NVIDIA DALI, TurboLoader) are not part of the package: the project's benchmarks/
scripts define them as a `Peer` and run this bench with it added (`peer_added`), their pipelines beside these.

Each pipeline runs one warm-up round, then `rounds` timed rounds (median images/s), by default in
a fresh Python process pinned to `workers` CPUs, so peak memory and CPU use are its own. Packing
happens once, before any timing. Ratios between pipelines of one run are the figures that count:
absolute images/s on a shared machine are noise.

With ``device="cuda"`` (``stoker bench --device cuda``) the pipelines are the device set of
`stoker.tools.bench_gpu` instead: the loaders alone into GPU memory, normalized (``cuda-baseline``,
``cuda-stoker``, ``cuda-stoker-gpu``, ``cuda-stoker-auto``, and a peer's ``cuda-<feed>``), and training
throughput of each model fed by each of them
against the same model on GPU-resident synthetic data (``train-<model>-<feed>``). Naming device
pipelines with ``device="cpu"`` runs them on the CPU (how the tests exercise them).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._progress import Progress
from .._system import cpu_ids, fmt_number, usable_cpus
from ..errors import ConfigError, StokerError
from ..profiling import cpu_seconds
from . import bench_gpu
from .baseline import baseline_loader, list_image_folder
from .results import NOTE, BenchResult, PipelineResult, markdown_table

__all__ = ["MOVED", "NOTE", "PIPELINES", "BenchResult", "Peer", "PipelineResult", "format_cores", "format_table",
           "machine_info", "peer_added", "run_bench"]

#: name -> (what it is, the pipeline its ratio is taken against)
PIPELINES: dict[str, tuple[str, str | None]] = {
    "baseline": ("DataLoader + PIL + RandomResizedCrop(224), flip, ToTensor, Normalize", None),
    "baseline-val": ("DataLoader + PIL + Resize(256), CenterCrop(224), ToTensor, Normalize", None),
    "stoker-train": ("stoker.Loader, RandomResizedCrop(224) + RandomHorizontalFlip", "baseline"),
    "stoker-val": ("stoker.Loader, Resize(256) + CenterCrop(224)", "baseline-val"),
    "ceiling": ("simplejpeg full decode of every image, nothing else", "baseline"),
    "stoker-train-fast": ("stoker-train with decode_quality='fast'", "baseline"),
    "stoker-train-process": ("stoker-train with its threads in one worker process, batches in shared memory "
                             "(Workers(processes=1, persistent=True): the process started once)", "baseline"),
    "stoker-train-float": ("stoker-train delivering float32 normalized NCHW on the CPU like the baseline "
                           "(device='cpu', normalize='imagenet')", "baseline"),
    "stoker-train-raw256": ("stoker-train on a pack with --encoding raw --max-side 256", "baseline"),
    "stoker-buckets": ("stoker.Loader, aspect-ratio buckets of 224x224 pixels (AspectBuckets(area=224*224, "
                       "multiple=32)) + flip: each batch one bucket", "stoker-train"),
    "stoker-tokens": ("stoker.Loader, NaFlex token budgets (TokenBudget(16, 196)) + flip: rows of patches",
                      "stoker-train"),
    "stoker-train-jpeg256": ("stoker-train on a pack with --max-side 256 (JPEG)", "baseline"),
    "overhead": ("stoker.Loader, 1 thread, 16x16 raw images: per-sample Python work only", None),
    "baseline-randaug": ("DataLoader + PIL + RandomResizedCrop(224), flip, RandAugment(2, 9), ToTensor, Normalize",
                         None),
    "stoker-randaug": ("stoker.Loader, RandomResizedCrop(224) + flip + RandAugment(2, 9) on the worker threads",
                       "baseline-randaug"),
    "baseline-deit": ("DataLoader + PIL + the randaug recipe + RandomErasing(0.25) in the workers, Mixup/CutMix "
                      "(0.8/1.0, smoothing 0.1) in the main process", None),
    "stoker-deit": ("stoker.Loader, crop + flip + RandAugment(2, 9) on the threads; Normalize, RandomErasing(0.25), "
                    "Mixup/CutMix batched on the device thread (device='cpu')", "baseline-deit"),
}
DEFAULT_PIPELINES = ("baseline", "baseline-val", "stoker-train", "stoker-val", "ceiling", "stoker-train-fast", "stoker-train-float", "stoker-train-raw256", "stoker-train-jpeg256", "overhead")
#: `stoker bench --recipe`: the pipelines each recipe runs by default (the ceiling is the same for all)
RECIPE_PIPELINES = {"basic": DEFAULT_PIPELINES, "randaug": ("baseline-randaug", "stoker-randaug", "ceiling"),
                    "deit": ("baseline-deit", "stoker-deit", "ceiling")}
#: pipeline -> the PackOptions of its own packed copy (the recipes of storing smaller images)
RECIPES: dict[str, dict[str, Any]] = {"stoker-train-raw256": {"encoding": "raw", "max_side": 256},
                                      "stoker-train-jpeg256": {"max_side": 256}}
#: pipelines that run from the project's benchmarks/ scripts, not from the package: name pattern -> script
MOVED = {"dali": "bench_dali.py", "dali-val": "bench_dali.py", "dali-float": "bench_dali.py", "cuda-dali": "bench_dali.py",
         "train-*-dali": "bench_dali.py", "turbo-tbl": "bench_turbo.py", "calls": "bench_calls.py",
         "datago": "bench_datago.py", "spdl": "bench_spdl.py"}
OVERHEAD_SAMPLES = 20_000  # tiny raw images in the overhead pipeline's dataset
OVERHEAD_SIDE = 16
_CHILD_TIMEOUT_S = 3600.0


# ----------------------------------------------------------------------------- machine and process

def machine_info() -> dict[str, Any]:
    """CPU model, usable cores, memory, OS and library versions, for the record next to timings."""
    import psutil
    from PIL import Image
    import simplejpeg

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": model or "unknown", "usable_cores": usable_cpus(), "logical_cores": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "os": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "pillow": getattr(Image, "__version__", "?"), "simplejpeg": simplejpeg.__version__,
            # Other work on the machine while measuring (1-minute load average; 0 where unknown).
            "load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0}
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        pass
    return info


class _MemorySampler:
    """Peak RSS of this process plus its children, sampled on a background thread."""

    def __init__(self, interval_s: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, name="stoker-bench-rss", daemon=True)

    def _sample(self) -> None:
        import psutil

        total = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    def __enter__(self) -> "_MemorySampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sample()


# ----------------------------------------------------------------------------- pipelines

@dataclass
class _Spec:
    """What one measurement needs; JSON-serializable so it can cross into a child process."""

    pipeline: str
    root: str             # ImageFolder tree (baselines, peers)
    packed: str           # packed copy of the same images (stoker, ceiling)
    batch_size: int
    workers: int
    rounds: int
    device: str = "cpu"   # device pipelines only, like the fields below
    model: str = ""       # training: the model spec
    steps: int = 0        # training: timed steps per round
    warmup_steps: int = 0
    script: str = ""      # a peer's pipeline: the file that defines the peer (`Peer.script`)


class _Runner:
    """One constructed pipeline: `epoch()` yields the size of each batch; `close()` frees it."""

    def __init__(self, epoch: Callable[[], Iterator[int]], close: Callable[[], None] = lambda: None,
                 version: str = "", split: Callable[[], dict[str, Any]] | None = None, route: str = "") -> None:
        self.epoch, self.close, self.version = epoch, close, version
        self.split = split   # stoker's GPU decode loaders: `bench_gpu.split_state` now
        self.route = route   # stoker's loaders: `Loader.route`, as text


@dataclass(frozen=True, eq=False)   # each peer is itself (compared and hashed by identity)
class Peer:
    """Another library's loader measured beside stoker's, defined outside the package: each of the project's
    benchmarks/ scripts (NVIDIA DALI, TurboLoader) defines one as ``PEER`` and runs this bench with it added
    (`peer_added`).

    ``script``: that file (each pipeline's fresh process loads it); ``unavailable()``: why the library cannot
    run here, with the fix, or None; ``version()``: which library and version does the work. CPU bench:
    ``pipelines`` (name -> (what it is, the pipeline its ratio is to)), each opened by ``open(spec)`` as
    ``(epoch, close)``, `epoch()` yielding its batch sizes; ``modules``: imported before the clock starts;
    ``prepare(images, work, workers)``: what its pipelines read, made once before any timing (default: the
    ImageFolder). Device bench: ``feeds`` (name -> `bench_gpu.PeerFeed`), measured as ``cuda-<name>`` and
    ``train-<model>-<name>``. ``note``: a line for the table, when any of its pipelines ran."""

    script: str
    unavailable: Callable[[], str | None]
    version: Callable[[], str]
    pipelines: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    open: Callable[[Any], tuple[Callable[[], Iterator[int]], Callable[[], None]]] | None = None
    modules: tuple[str, ...] = ()
    prepare: Callable[[Path, Path, int], Path] | None = None
    feeds: dict[str, bench_gpu.PeerFeed] = field(default_factory=dict)
    note: str = ""


_PEERS: list[Peer] = []


@contextlib.contextmanager
def peer_added(peer: Peer) -> Iterator[Peer]:
    """`run_bench` (and `stoker bench`) with `peer`'s pipelines and feeds beside stoker's, until the block ends."""
    taken = [n for n in peer.pipelines if n in PIPELINES] + [n for n in peer.feeds if n in bench_gpu.FEEDS]
    if taken:
        raise ConfigError(f"bench peer {peer.script}: {', '.join(taken)} name pipelines or feeds the bench has")
    PIPELINES.update(peer.pipelines)
    _PEERS.append(peer)
    try:
        for name, feed in peer.feeds.items():
            bench_gpu.add_feed(name, feed)
        yield peer
    finally:
        for name in peer.feeds:
            bench_gpu.remove_feed(name)
        _PEERS.remove(peer)
        for name in peer.pipelines:
            PIPELINES.pop(name, None)


def _peer_of(name: str) -> Peer | None:
    """The added peer that measures pipeline `name`, or None (one of stoker's own)."""
    for peer in _PEERS:
        if name in peer.pipelines:
            return peer
        if peer.feeds and bench_gpu.is_device_pipeline(name):
            with contextlib.suppress(ConfigError):
                if bench_gpu.feed_of(name) in peer.feeds:
                    return peer
    return None


def _load_peer(script: str) -> Peer:
    """The ``PEER`` a benchmarks/ script defines, the script imported from its file (a pipeline's process)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    if spec is None or spec.loader is None:
        raise StokerError(f"bench peer {script}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # what pickles and dataclasses look up
    spec.loader.exec_module(module)
    return module.PEER


def _moved_to(name: str) -> str | None:
    return next((script for pattern, script in MOVED.items() if fnmatch.fnmatchcase(name, pattern)), None)


def _check_moved(names: Sequence[str], device: str) -> None:
    """A pipeline that runs from a benchmarks/ script now: say which command runs it (unless its peer is added)."""
    for name in names:
        script = _moved_to(name)
        if script is None or _peer_of(name) is not None:
            continue
        if name == "calls":   # the GPU half's count too, on the CPU with the stand-in decoder
            how = "[--data DIR] [--workers N] [--decode gpu | --decode auto --gpu-share 0.5]"
        else:
            dev = device if device != "cpu" else "cuda" if name.startswith(("cuda-", "train-")) else ""
            how = (f"--pipelines {','.join(n for n in names if _moved_to(n) == script)}"
                   f"{f' --device {dev}' if dev else ''} (with stoker bench's other options)")
        raise ConfigError(f"run_bench: {name} is not a pipeline of stoker bench; from a checkout of the project "
                          f"run python benchmarks/{script} {how}")


def _baseline_runner(spec: _Spec, train: bool) -> _Runner:
    loader = baseline_loader(spec.root, spec.batch_size, workers=spec.workers, train=train, shuffle=True, seed=0)

    def epoch() -> Iterator[int]:
        for _, labels in loader:
            yield len(labels)
    return _Runner(epoch)


def _recipe_of(name: str) -> str:
    return name.split("-", 1)[1]


def _baseline_recipe_runner(spec: _Spec) -> _Runner:
    from .baseline_recipes import deit_mixup, recipe_transform

    recipe = _recipe_of(spec.pipeline)
    transform, _ = recipe_transform(recipe)
    loader = baseline_loader(spec.root, spec.batch_size, workers=spec.workers, shuffle=True, seed=0,
                             transform=transform)
    mix = deit_mixup(len(list_image_folder(Path(spec.root))[1])) if recipe == "deit" else None

    def epoch() -> Iterator[int]:
        for b, (images, labels) in enumerate(loader):
            if mix is not None:
                images, labels = mix(images, labels, epoch=0, batch=b)
            yield len(labels)
    return _Runner(epoch)


def _stoker_recipe_runner(spec: _Spec) -> _Runner:
    from ..loader.loader import Loader
    from ..loader.options import Workers
    from ..transforms import Normalize, RandAugment, RandomErasing, RandomHorizontalFlip, RandomResizedCrop
    from .baseline_recipes import deit_mixup

    ops: list[Any] = [RandomResizedCrop(224), RandomHorizontalFlip(), RandAugment()]
    device = None
    if _recipe_of(spec.pipeline) == "deit":
        # the batch ops on the loader's device thread (here the CPU), beside the workers and the consumer
        ops += [Normalize("imagenet"), RandomErasing(p=0.25), deit_mixup(len(list_image_folder(Path(spec.root))[1]))]
        device = "cpu"
    loader = Loader(spec.packed, spec.batch_size, transforms=ops, seed=0, device=device, workers=spec.workers)

    def epoch() -> Iterator[int]:
        for batch in loader:
            yield int(batch[0].shape[0])
    return _Runner(epoch, loader.close, route=str(loader.route))


def _stoker_runner(spec: _Spec, train: bool) -> _Runner:
    from ..device.stage import DeviceOptions
    from ..loader.loader import Loader
    from ..buckets import AspectBuckets
    from ..loader.options import Sampling, Workers
    from ..loading.tokens import TokenBudget
    from ..transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize

    sampling = None
    if spec.pipeline == "overhead":
        ops: list = [RandomResizedCrop(OVERHEAD_SIDE), RandomHorizontalFlip()]
    elif spec.pipeline == "stoker-tokens":
        ops = [TokenBudget(16, 196), RandomHorizontalFlip()]
    elif spec.pipeline == "stoker-buckets":
        ops = [RandomHorizontalFlip()]
        sampling = Sampling(buckets=AspectBuckets(area=224 * 224, multiple=32), seed=0)
    elif train:
        ops = [RandomResizedCrop(224), RandomHorizontalFlip()]
    else:
        ops = [Resize(256), CenterCrop(224)]
    device = DeviceOptions(device="cpu", normalize="imagenet") if spec.pipeline == "stoker-train-float" else None
    process = spec.pipeline == "stoker-train-process"   # one worker process, started once
    workers = Workers(num_threads=spec.workers, **({"decode_quality": "fast"} if spec.pipeline == "stoker-train-fast"
                                                   else {}), processes=int(process), persistent=process)
    loader = Loader(spec.packed, spec.batch_size, transforms=ops, device=device, workers=workers,
                    **({"sampling": sampling} if sampling is not None else {"seed": 0}))

    def epoch() -> Iterator[int]:
        for batch in loader:
            yield int(batch[0].shape[0])
    return _Runner(epoch, loader.close, route=str(loader.route))


def _ceiling_runner(spec: _Spec) -> _Runner:
    import simplejpeg

    from .. import codecs
    from ..reader import open_dataset

    dataset = open_dataset(spec.packed)
    pool = ThreadPoolExecutor(max_workers=spec.workers, thread_name_prefix="stoker-bench-decode")
    rng = np.random.default_rng(0)

    def decode(indices: np.ndarray) -> int:
        for i in indices:   # simplejpeg releases the GIL while it decodes
            s = dataset.sample(int(i))
            if s.encoding == "jpeg":
                simplejpeg.decode_jpeg(s.data, colorspace="RGB")
            else:   # a non-JPEG source image that packing re-encoded or stored raw
                codecs.decode_rgb(s.data, s.encoding, s.key, height=s.height, width=s.width)
        return len(indices)

    def epoch() -> Iterator[int]:
        order = rng.permutation(len(dataset))
        futures = [pool.submit(decode, order[k:k + 8]) for k in range(0, len(order), 8)]
        done = 0
        try:
            for fut in futures:
                done += fut.result(timeout=_CHILD_TIMEOUT_S)
                while done >= spec.batch_size:
                    done -= spec.batch_size
                    yield spec.batch_size
            if done:
                yield done
        finally:
            for fut in futures:
                fut.cancel()

    def close() -> None:
        pool.shutdown(wait=True, cancel_futures=True)
        dataset.close()
    return _Runner(epoch, close)


def _make_runner(spec: _Spec) -> _Runner:
    name = spec.pipeline
    if name in ("baseline", "baseline-val"):
        return _baseline_runner(spec, train=name == "baseline")
    if name in ("baseline-randaug", "baseline-deit"):
        return _baseline_recipe_runner(spec)
    if name in ("stoker-randaug", "stoker-deit"):
        return _stoker_recipe_runner(spec)
    if name.startswith("stoker-") or name == "overhead":
        return _stoker_runner(spec, train=name != "stoker-val")
    if name == "ceiling":
        return _ceiling_runner(spec)
    peer = _peer_of(name)
    if peer is not None and peer.open is not None and name in peer.pipelines:
        return _Runner(*peer.open(spec))
    if bench_gpu.is_device_pipeline(name):
        run = bench_gpu.loader_epochs(name, root=spec.root, packed=spec.packed, batch_size=spec.batch_size,
                                      workers=spec.workers, device=spec.device, steps=spec.steps)
        return _Runner(run.epoch, run.close, run.version, run.split, run.route)
    raise ConfigError(f"unknown pipeline {name!r}; expected one of {', '.join(PIPELINES)}")


def _unavailable(name: str, device: str = "cpu") -> str | None:
    """Why pipeline `name` cannot run here (with the fix), or None when it can."""
    if bench_gpu.is_device_pipeline(name):
        return bench_gpu.unavailable(name, device)
    peer = _peer_of(name)
    return peer.unavailable() if peer is not None else None


def _preimport(name: str, device: str = "cpu") -> None:
    """Import what the pipeline needs before the clock starts: a training script has torch loaded
    already, so module import time is not part of time-to-first-batch (nor is CUDA context creation)."""
    import importlib

    if bench_gpu.is_device_pipeline(name):
        bench_gpu.prepare(device, bench_gpu.feed_of(name))
        importlib.import_module("stoker.loader")
        return
    peer = _peer_of(name)
    modules = {"baseline": ["torch.utils.data", "PIL.Image"], "baseline-val": ["torch.utils.data", "PIL.Image"],
               "ceiling": ["simplejpeg", "stoker.reader"], **({name: list(peer.modules)} if peer else {})}
    stoker = ["torch", "stoker.loader"]
    for module in modules.get(name, stoker if name.startswith("stoker-") or name == "overhead" else []):
        importlib.import_module(module)


def _version(name: str) -> str:
    """Which library (and version) does the work in pipeline `name`."""
    import importlib

    if bench_gpu.is_device_pipeline(name):   # the device pipelines report their versions themselves
        return ""
    if name.startswith("stoker-") or name == "overhead":
        from .. import codecs
        from .._libjpeg import describe

        mod = importlib.import_module("stoker")
        region = "region decode" if codecs.region_decode_available() else describe()
        return f"stoker {getattr(mod, '__version__', '?')}, {region}"
    peer = _peer_of(name)
    if peer is not None:
        return peer.version()
    module = "torch" if name.startswith("baseline") else {"ceiling": "simplejpeg"}[name]
    return f"{module} {getattr(importlib.import_module(module), '__version__', '?')}"


def _measure(spec: _Spec) -> dict[str, Any]:
    """Measure one pipeline; a device pipeline whose feed cannot run here (GPU decode, a peer's) comes back as
    `{"skipped": why}` instead of failing the whole bench."""
    if not bench_gpu.is_device_pipeline(spec.pipeline):
        return _measure_rounds(spec)
    _preimport(spec.pipeline, spec.device)
    bench_gpu.reset_peak_memory(spec.device)
    try:
        out = _measure_training(spec) if spec.pipeline.startswith("train-") else _measure_rounds(spec)
    except bench_gpu.FeedUnavailable as exc:
        return {"skipped": str(exc)}
    return {**out, "peak_device_bytes": bench_gpu.peak_memory(spec.device)}


def _measure_rounds(spec: _Spec) -> dict[str, Any]:
    """Construct, warm up (first-batch time), then time `rounds` epochs; CPU and peak RSS alongside."""
    _preimport(spec.pipeline, spec.device)
    with _MemorySampler() as memory:
        start = time.perf_counter()
        runner = _make_runner(spec)
        try:
            first = math.nan
            for _ in runner.epoch():
                if math.isnan(first):
                    first = time.perf_counter() - start
            rates, images, timed = [], 0, 0.0
            split = runner.split() if runner.split is not None else None
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            for _ in range(spec.rounds):
                t = time.perf_counter()
                images = sum(runner.epoch())
                seconds = time.perf_counter() - t
                timed += seconds
                rates.append(images / seconds)
            cpu_s = cpu_seconds() - cpu0
            cpu = cpu_s / (time.perf_counter() - wall0) * 100.0
            if split is not None:   # the split at the end, the GPU path's phases in the timed rounds
                split = bench_gpu.split_fields(spec.pipeline, split, runner.split())
        finally:
            runner.close()
    return {**(split or {}), "images_per_s": statistics.median(rates), "rounds": rates, "cpu_percent": cpu,
            "cpu_ms_per_image": cpu_s * 1000.0 / (images * spec.rounds),
            "peak_rss_bytes": memory.peak, "first_batch_s": first, "images": images,
            "startup_share": bench_gpu.startup_share(first, timed), "version": runner.version or _version(spec.pipeline),
            "route": runner.route}


def _measure_training(spec: _Spec) -> dict[str, Any]:
    """A model training on one feed: `warmup_steps` untimed steps, then `rounds` timed windows of
    `steps` steps (median images/s); the share of each window spent waiting in next(), CPU and
    peak RSS alongside."""
    with bench_gpu.autotuned_convolutions(), _MemorySampler() as memory:
        run = bench_gpu.TrainRun(spec.pipeline, spec.model, root=spec.root, packed=spec.packed,
                                 batch_size=spec.batch_size, workers=spec.workers, device=spec.device)
        try:
            if spec.warmup_steps:
                run.run(spec.warmup_steps)
            rates, waits, timed = [], [], 0.0
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            for _ in range(spec.rounds):
                seconds, wait = run.run(spec.steps)
                timed += seconds
                rates.append(spec.steps * spec.batch_size / seconds)
                waits.append(wait / seconds)
            cpu_s = cpu_seconds() - cpu0
            cpu = cpu_s / (time.perf_counter() - wall0) * 100.0
        finally:
            run.close()
    images = spec.steps * spec.batch_size
    return {"images_per_s": statistics.median(rates), "rounds": rates, "cpu_percent": cpu,
            "cpu_ms_per_image": cpu_s * 1000.0 / (images * spec.rounds), "peak_rss_bytes": memory.peak,
            "first_batch_s": run.first_batch_s, "images": images, "version": run.version,
            "startup_share": bench_gpu.startup_share(run.first_batch_s, timed),
            "data_wait": statistics.median(waits)}


_RESULT_MARK = "STOKER-BENCH-RESULT "
#: set (to 1) in the environment: each pipeline's process logs stoker's info lines (its timers among them)
#: and the bench passes them on to its own stderr, each line prefixed with the pipeline's name
CHILD_LOGS_ENV = "STOKER_BENCH_CHILD_LOGS"


def _measure_isolated(spec: _Spec) -> dict[str, Any]:
    """`_measure` in a fresh Python process pinned to `spec.workers` CPUs (its children inherit)."""
    cmd = [sys.executable, "-m", "stoker.tools.bench", "--child", json.dumps(asdict(spec))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise StokerError(f"bench pipeline {spec.pipeline!r} ran longer than {_CHILD_TIMEOUT_S:.0f} s; "
                          "use fewer images or rounds") from None
    if os.environ.get(CHILD_LOGS_ENV, "0") not in ("", "0"):
        for line in proc.stderr.splitlines():
            print(f"[{spec.pipeline}] {line}", file=sys.stderr, flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        raise StokerError(f"bench pipeline {spec.pipeline!r} failed (exit {proc.returncode}); its output "
                          f"ended with:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len(_RESULT_MARK):])


def _child_main(argv: Sequence[str]) -> int:
    spec = _Spec(**json.loads(argv[1]))
    peer = peer_added(_load_peer(spec.script)) if spec.script else contextlib.nullcontext()
    if os.environ.get(CHILD_LOGS_ENV, "0") not in ("", "0"):
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("stoker").setLevel(logging.INFO)
    cpus = cpu_ids()
    if hasattr(os, "sched_setaffinity") and len(cpus) > spec.workers:
        os.sched_setaffinity(0, cpus[:spec.workers])   # this child only: the same cores for every pipeline
    with peer:
        print(_RESULT_MARK + json.dumps(_measure(spec)), flush=True)
    return 0


# ----------------------------------------------------------------------------- the run

def _data_stats(root: Path, samples: list[tuple[str, int]], generated: bool) -> dict[str, Any]:
    from PIL import Image

    sizes = np.array([os.path.getsize(p) for p, _ in samples], np.int64)
    step = max(1, len(samples) // 500)   # header reads only; a sample is enough for the mean
    dims = []
    for path, _ in samples[::step]:
        with Image.open(path) as im:
            dims.append(im.size)
    w, h = np.array(dims, np.float64).T
    return {"root": str(root), "generated": generated, "images": len(samples),
            "mean_width": round(float(w.mean())), "mean_height": round(float(h.mean())),
            "mean_file_kb": round(float(sizes.mean()) / 1000, 1), "total_mb": round(float(sizes.sum()) / 1e6, 1)}


def _pack_once(root: Path, out: Path, workers: int, **options: Any) -> float:
    """Pack `root` into `out` (replacing what is there); returns seconds. Not part of any timing."""
    from ..packing import PackOptions, pack

    start = time.perf_counter()
    pack(root, out, options=PackOptions(workers=workers, **options), progress=False, overwrite=True)
    return time.perf_counter() - start


def _tiny_raw_dataset(out: Path, n: int = OVERHEAD_SAMPLES, side: int = OVERHEAD_SIDE) -> Path:
    """`n` raw-stored side x side images (nothing to decode or resize): the overhead pipeline's data."""
    from ..shards import Manifest, ShardWriter, write_manifest

    if (out / "stoker.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (8, side, side, 3), dtype=np.uint8)
    writer = ShardWriter(out, 0, label_type="int64")
    for i in range(n):
        writer.add(f"tiny/{i:06d}", pixels[i % 8].tobytes(), "raw", side, side, i % 10)
    write_manifest(out, Manifest(num_samples=n, shards=[writer.finish()], classes=None, label_type="int64"))
    return out


def _disk_bytes(path: Path) -> int:
    """Bytes of the files under `path` (what a pipeline reads its images from)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _check_args(images: int, batch_size: int, workers: int, rounds: int, pipelines: Sequence[str],
                catalog: dict[str, tuple[str, str | None]] = PIPELINES) -> None:
    for name, value in (("images", images), ("batch_size", batch_size), ("workers", workers), ("rounds", rounds)):
        if value < 1:
            raise ConfigError(f"run_bench: expected {name} >= 1, got {value}")
    unknown = [p for p in pipelines if p not in catalog]
    if unknown or not pipelines:
        raise ConfigError(f"run_bench: unknown pipelines {unknown or '(none given)'}; expected some of "
                          f"{', '.join(catalog)}")


@dataclass(frozen=True)
class _BenchPlan:
    """What one run measures, defaults resolved: the CPU bench, or the device bench of `bench_gpu`."""

    catalog: dict[str, tuple[str, str | None]]   # name -> (description, ratio reference)
    pipelines: tuple[str, ...]
    images: int
    device_run: bool = False
    device: str = "cpu"
    models: tuple[str, ...] = ()
    steps: int = 0
    warmup_steps: int = 0


def _plan(images: int | None, batch_size: int, workers: int, rounds: int, pipelines: Sequence[str] | None,
          device: str, models: Sequence[str] | None, steps: int | None, warmup_steps: int | None,
          recipe: str = "basic") -> _BenchPlan:
    named = tuple(pipelines) if pipelines is not None else None
    _check_moved(named or (), device)
    if recipe not in RECIPE_PIPELINES:
        raise ConfigError(f"run_bench: recipe must be one of {', '.join(RECIPE_PIPELINES)}, got {recipe!r}")
    if recipe != "basic":
        if device != "cpu" or named is not None:
            raise ConfigError(f"run_bench: recipe={recipe!r} picks the CPU bench's pipelines for that recipe; leave "
                              f"out device and pipelines (or name the pipelines yourself, without a recipe)")
        named = RECIPE_PIPELINES[recipe]
    if device == "cpu" and not any(bench_gpu.is_device_pipeline(p) for p in named or ()):
        if models is not None or steps is not None or warmup_steps is not None:
            raise ConfigError("run_bench: models, steps and warmup_steps belong to the device bench's training "
                              "pipelines; add device='cuda' (stoker bench --device cuda)")
        plan = _BenchPlan(PIPELINES, DEFAULT_PIPELINES if named is None else named, images or 2000)
        _check_args(plan.images, batch_size, workers, rounds, plan.pipelines)
        return plan
    dev = str(bench_gpu.resolve_device(device))
    cpu_named = [p for p in named or () if p in PIPELINES]
    if cpu_named:
        raise ConfigError(f"run_bench: {', '.join(cpu_named)} belong to the CPU bench; with device {dev!r} choose "
                          "among the device pipelines (or leave the device out for the CPU bench)")
    # Models given are checked now; the default ones only when their pipelines run (the loader-alone
    # pipelines need no torchvision).
    chosen_models = tuple(bench_gpu.DEFAULT_MODELS if models is None else models)
    catalog = bench_gpu.device_pipelines(chosen_models, check=models is not None)
    plan = _BenchPlan(catalog, tuple(catalog) if named is None else named, images or bench_gpu.DEFAULT_IMAGES, True,
                 dev, chosen_models, bench_gpu.DEFAULT_STEPS if steps is None else steps,
                 bench_gpu.DEFAULT_WARMUP_STEPS if warmup_steps is None else warmup_steps)
    _check_args(plan.images, batch_size, workers, rounds, plan.pipelines, catalog)
    if plan.steps < 1 or plan.warmup_steps < 0:
        raise ConfigError(f"run_bench: expected steps >= 1 and warmup_steps >= 0, got {plan.steps} and "
                          f"{plan.warmup_steps}")
    for model in {_model_of(p, chosen_models) for p in plan.pipelines} - {""}:
        bench_gpu.check_model(model)
    return plan


def run_bench(data_dir: Path | None = None, *, images: int | None = None, batch_size: int = 256,
              workers: int | None = 2, rounds: int = 3, pipelines: Sequence[str] | None = None,
              out_dir: Path | None = None, isolate: bool = True, seed: int = 0,
              packed: Path | None = None, device: str = "cpu", models: Sequence[str] | None = None,
              steps: int | None = None, warmup_steps: int | None = None, recipe: str = "basic",
              progress: bool = False, cores: int | None = None) -> BenchResult:
    """Run the same images through each pipeline and measure images/s, CPU %, peak RSS, first batch.

    `data_dir`: an ImageFolder tree of JPEGs; None generates `images` ImageNet-like JPEGs (cached
    under `out_dir/data`; default 2,000, or 5,000 for the device bench). `workers`: CPU cores every
    pipeline gets (None: all usable). With `isolate`, each pipeline runs in a fresh process pinned
    to `workers` cores. `out_dir` (None: a temporary folder) receives the packed copy and bench.json /
    bench.md (and bench.png with matplotlib). `packed`: an existing pack of `data_dir` to use
    instead of packing it again. `pipelines`: None runs the default set (the CPU bench's, or with a
    CUDA `device` the device bench's). `recipe` ("basic", "randaug", "deit"; see `baseline_recipes`) runs
    that recipe's baseline and stoker pipelines side by side, plus the decode ceiling.

    `device` ("cuda", "cuda:N"): the device bench of `stoker.tools.bench_gpu`, loaders into device memory and
    training of `models` (torchvision names or "module:callable"; default resnet50, resnet18) for
    `steps` timed steps per round (default 100) after `warmup_steps` (default 10). Naming device
    pipelines with device "cpu" runs them on the CPU.
    `progress`: say what is being measured (a bar on a terminal, log lines on `stoker.progress` elsewhere).
    `cores`: run the whole bench (generation, packing, every pipeline's process) pinned to that many of this
    process's CPUs, as a machine with `cores` cores would (`tools.cores.pinned`); `workers` then defaults
    to `cores`, and the files in `out_dir` are named bench-cores{N}.json/.md/.png.
    Raises ConfigError for bad arguments (and for a CUDA device this machine lacks, or `cores` beyond the
    CPUs this process may use), StokerError when a pipeline fails.
    """
    from .synth import cached_imagenet_like

    if cores is not None and workers is not None and workers > cores:
        raise ConfigError.spelled(f"{{workers}} is more than the {cores} core(s) of {{cores}}: each pipeline may use "
                                  f"at most the cores the bench runs on; leave {{no_workers}} out (it follows "
                                  f"{{cores}}) or give at most {cores}",
                                  {"workers": (f"workers={workers}", f"--workers {workers}"),
                                   "cores": (f"cores={cores}", f"--cores {cores}"),
                                   "no_workers": ("workers", "--workers")})
    workers = workers or cores or usable_cpus()
    plan = _plan(images, batch_size, workers, rounds, pipelines, device, models, steps, warmup_steps, recipe)
    with _pinned(cores) as cpus, tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp, \
            Progress("bench", len(plan.pipelines), unit="pipeline", enabled=progress) as bar:
        work = Path(out_dir) if out_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        generated = data_dir is None
        if generated:
            bar.stage(f"generating {plan.images:,} images (cached for the next run)")
        root = cached_imagenet_like(work / "data", plan.images, seed=seed, workers=workers) if generated \
            else Path(data_dir)  # type: ignore[arg-type]
        samples, _ = list_image_folder(root)
        machine = machine_info()
        if plan.device_run:
            machine.update(bench_gpu.device_info(bench_gpu.resolve_device(plan.device)))
            if len(samples) < batch_size and any(p.startswith("train-") and not p.endswith("-synthetic")
                                                 for p in plan.pipelines):
                raise ConfigError(f"{root}: {len(samples)} images is less than one batch of {batch_size}; the "
                                  "training pipelines drop the last partial batch. Use more images or a smaller "
                                  "batch size")
        from .baseline_recipes import recipe_transform

        result = BenchResult([], len(samples), batch_size, workers, rounds, _data_stats(root, samples, generated),
                             recipe_transform(recipe)[1], machine, device=plan.device, models=list(plan.models),
                             steps=plan.steps, warmup_steps=plan.warmup_steps, cores=cores, cpus=cpus)
        if packed is None:
            packed = work / "packed"
            if any(_reads_packed(p) for p in plan.pipelines):
                bar.stage("packing the images once")
                result.pack_seconds = _pack_once(root, packed, workers)
        sources = {name: work / f"packed-{name.rsplit('-', 1)[1]}" for name in RECIPES if name in plan.pipelines}
        for name, path in sources.items():   # the recipes' own packs, also before any timing
            _pack_once(root, path, workers, **RECIPES[name])
        peers = list(dict.fromkeys(p for p in map(_peer_of, plan.pipelines) if p is not None))
        for peer in peers:   # what a peer's pipelines read (its own copy of the images), also untimed
            if peer.prepare is not None and peer.unavailable() is None:
                made = peer.prepare(root, work, workers)
                sources.update((n, made) for n in plan.pipelines if n in peer.pipelines)
        result.notes += [peer.note for peer in peers if peer.note]
        if "overhead" in plan.pipelines:
            sources["overhead"] = _tiny_raw_dataset(work / "overhead-tiny-raw")
        for name in plan.pipelines:
            description, ratio_to = plan.catalog[name]
            entry = PipelineResult(name, description, ratio_to=ratio_to, skipped=_unavailable(name, plan.device))
            source = sources.get(name, packed if _reads_packed(name) else root)
            if entry.skipped is None:
                bar.stage(f"measuring {name}, {rounds} round(s)")
                peer = _peer_of(name)
                spec = _Spec(name, str(root), str(source), batch_size, 1 if name == "overhead" else workers,
                             rounds, plan.device, _model_of(name, plan.models), plan.steps, plan.warmup_steps,
                             peer.script if peer is not None else "")
                for key, value in (_measure_isolated(spec) if isolate else _measure(spec)).items():
                    setattr(entry, key, value)
                if not plan.device_run:
                    entry.disk_bytes = _disk_bytes(Path(source))
            result.pipelines.append(entry)
            bar.update()
        _fill_ratios(result)
        if out_dir is not None:
            _write_outputs(result, work, "bench" if cores is None else f"bench-cores{cores}")
    return result


def _pinned(cores: int | None) -> contextlib.AbstractContextManager[list[int]]:
    """This process pinned to `cores` of its CPUs for the block (`tools.cores.pinned`); None: left as it is."""
    from .cores import pinned

    return contextlib.nullcontext([]) if cores is None else pinned(cores)


def _model_of(name: str, models: Sequence[str]) -> str:
    """The model spec a training pipeline trains ("" for any other pipeline)."""
    if not name.startswith("train-"):
        return ""
    return next(m for m in models if name == f"train-{bench_gpu.model_label(m)}-{bench_gpu.feed_of(name)}")


def _reads_packed(name: str) -> bool:
    """Whether pipeline `name` reads the packed copy (so it is packed once, before any timing)."""
    return (name.startswith("stoker-") and name not in RECIPES) or name == "ceiling" or bench_gpu.uses_packed(name)


def _fill_ratios(result: BenchResult) -> None:
    for p in result.pipelines:
        ref = result.get(p.ratio_to) if p.ratio_to else None
        ok = p.skipped is None and ref is not None and ref.skipped is None
        p.ratio = p.images_per_s / ref.images_per_s if ok else None   # type: ignore[union-attr]


def _write_outputs(result: BenchResult, out: Path, stem: str = "bench") -> None:
    """bench.json, bench.md and, with matplotlib, bench.png in `out` (`stem` for another name)."""
    from .charts import bench_chart, device_bench_chart

    chart = device_bench_chart if _is_device_result(result) else bench_chart
    if not chart(result, out / f"{stem}.png"):
        result.notes.append("No chart: matplotlib is not installed (pip install matplotlib).")
    (out / f"{stem}.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
    (out / f"{stem}.md").write_text(format_table(result) + "\n")


def _is_device_result(result: BenchResult) -> bool:
    return any(bench_gpu.is_device_pipeline(p.name) for p in result.pipelines)


def _described(p: PipelineResult) -> str:
    """A pipeline's line under the table: what it is, which library did the work, and stoker's route."""
    return (f"- {p.name}: {p.description}" + (f" ({p.version})" if p.version else "")
            + (f"; route: {p.route}" if p.route else ""))


def _cores_heading(result: BenchResult) -> list[str]:
    """`stoker bench --cores N`: the section's heading, the cores the run was pinned to."""
    from .cores import cpu_list

    if result.cores is None:
        return []
    return [f"## {result.cores} core(s) (CPUs {cpu_list(result.cpus)})", ""]


def format_cores(results: Sequence[BenchResult]) -> str:
    """Runs of one bench at several core counts (`stoker bench --cores 16,8`): images/s of each pipeline
    at each count, one row per count, then each count's own section (`format_table`)."""
    names = list(dict.fromkeys(p.name for r in results for p in r.pipelines))
    rows = []
    for r in results:
        shares = [f"{p.name} {p.gpu_share:.0%}" for p in r.pipelines if p.ran and p.gpu_split]
        cells = [fmt_number(p.images_per_s, ",.0f") if (p := r.ran(n)) is not None else "-" for n in names]
        rows.append("| " + " | ".join([str(r.cores), *cells, ", ".join(shares) or "-"]) + " |")
    lines = ["Images/s at each core count (each row a run pinned to that many cores; GPU share: of each batch's "
             "JPEGs, where the route splits them between the CPU threads and the GPU):", "",
             "| cores | " + " | ".join(names) + " | GPU share |", "|" + "---|" * (len(names) + 2), *rows, ""]
    return "\n".join([*lines, *(format_table(r) + "\n" for r in results)])


def format_table(result: BenchResult) -> str:
    """The result as a markdown table, with the data, the machine and how to read it."""
    if _is_device_result(result):
        return "\n".join([*_cores_heading(result), _format_device(result)])
    ceiling = result.ran("ceiling")

    def cells(p: PipelineResult) -> list[str]:
        ratio = f"{p.ratio:.2f}x {p.ratio_to}" if p.ratio is not None else "-"
        vs_ceiling = p.images_per_s / ceiling.images_per_s if ceiling is not None and p is not ceiling else None
        if p.name == "overhead":   # one thread, nothing to decode: not comparable with the others
            ratio, vs_ceiling = "-", None
        return [fmt_number(p.images_per_s, ",.0f"), ratio, fmt_number(vs_ceiling, ".2f", "x"),
                fmt_number(p.cpu_percent, ".0f"), fmt_number(p.cpu_ms_per_image, ".2f"),
                f"{p.peak_rss_bytes / 1e6:,.0f}", fmt_number(p.first_batch_s, ".2f"),
                f"{p.disk_bytes / 1e6:,.1f}" if p.disk_bytes else "-"]
    lines = _cores_heading(result) + markdown_table(
        ("pipeline", "images/s", "ratio", "vs ceiling", "CPU %", "CPU ms/image", "peak RSS (MB)", "first batch (s)",
         "disk (MB)"), [(p, cells(p)) for p in result.pipelines])
    overhead = result.ran("overhead")
    if overhead is not None:
        lines += ["", f"Per-sample overhead: {1e6 / overhead.images_per_s:.1f} µs per sample on one thread "
                      f"({OVERHEAD_SIDE}x{OVERHEAD_SIDE} raw images: no decode, a trivial resize; target <= 30 µs)."]
    d, m = result.data, result.machine
    lines += [*map(_described, result.pipelines), "",
              f"Data: {d['images']} {'generated ImageNet-like ' if d['generated'] else ''}JPEGs, mean "
              f"{d['mean_width']}x{d['mean_height']} px, {d['mean_file_kb']} KB; batch {result.batch_size}; "
              f"{result.workers} CPU cores per pipeline; median of {result.rounds} round(s) after one warm-up; "
              f"packing ({fmt_number(result.pack_seconds, '.1f')} s) done once before any timing.",
              f"Baseline transforms: {result.baseline_transforms}. The baselines also convert to float and "
              "normalize on the CPU (torchvision's defaults); stoker hands out uint8 and normalizes on the GPU.",
              f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['memory_gb']} GB, load average "
              f"{m['load_1m']} at the start; Python {m['python']}, "
              f"torch {m.get('torch', '-')}, Pillow {m['pillow']}, simplejpeg {m['simplejpeg']}.",
              "Disk: bytes of the files each pipeline reads (the ImageFolder for the baselines, the packed copy for "
              "stoker; the recipes' own packs).",
              "CPU %: process + children over the timed rounds (100 = one core); CPU ms/image is the same CPU "
              "time per image, which other load on the machine disturbs less than images/s. Peak RSS: process + "
              "children (forked workers' shared pages count once per process).",
              NOTE, *result.notes]
    return "\n".join(lines)


def _format_device(result: BenchResult) -> str:
    """The device bench: loader-alone and training tables, the data, device and machine."""
    d, m = result.data, result.machine
    steps_per_epoch = result.images // result.batch_size
    gpu = (f"{m['gpu']}, {m['gpu_memory_gb']} GB; CUDA {m['cuda_version']}, cuDNN {m['cudnn']}" if m.get("gpu")
           else result.device)
    lines = [*bench_gpu.format_tables(result), *map(_described, result.pipelines),
             "",
             f"Data: {d['images']} {'generated ImageNet-like ' if d['generated'] else ''}JPEGs, mean "
             f"{d['mean_width']}x{d['mean_height']} px, {d['mean_file_kb']} KB; batch {result.batch_size}; "
             f"{result.workers} CPU cores per pipeline, each pipeline in its own process; packing "
             f"({fmt_number(result.pack_seconds, '.1f')} s) done once before any timing.",
             f"Loaders alone: median of {result.rounds} round(s) of {result.steps} batches after one warm-up round; "
             "a round ends when the device is synchronized. Training: median of "
             f"{result.rounds} window(s) of {result.steps} steps after {result.warmup_steps} warm-up step(s); the "
             f"training feeds drop the last partial batch ({steps_per_epoch} steps per pass over the images). "
             "No feed restarts inside the measurement: stoker's Loaders are persistent (epochs run into each other), "
             f"the baseline DataLoader's epoch is {bench_gpu.BASELINE_EPOCH_SAMPLES:,} samples (ImageNet-1k's); start-up falls in "
             "the warm-up.",
             f"Baseline transforms: {result.baseline_transforms}. Every loader delivers float32 NCHW batches "
             "normalized with ImageNet mean/std in device memory (stoker: channels_last for training); the "
             "baseline converts and normalizes on the CPU, stoker copies uint8 and normalizes on the device.",
             f"Device: {gpu}; torch {m.get('torch', '-')}, torchvision {m.get('torchvision') or 'not installed'}.",
             f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['memory_gb']} GB, load average "
             f"{m['load_1m']} at the start; Python {m['python']}, Pillow {m['pillow']}, simplejpeg {m['simplejpeg']}.",
             "fed / synthetic: training images/s over the same model's on one GPU-resident batch (no input "
             "pipeline): the share of the model's speed a feed keeps. stoker-interference is the control: the model on "
             "that resident batch while the stoker feed runs beside it, its batches discarded; its shortfall is the "
             "loader's cost to the step, which data wait does not show. "
             "Data wait: share of the timed steps the training loop spent in next() (host side). Peak device: "
             "torch.cuda.max_memory_allocated of the pipeline's process. CPU %: process + children (100 = one core).",
             NOTE, *result.notes]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[1:]))
    sys.exit("usage: stoker bench (this module's command line is internal)")
