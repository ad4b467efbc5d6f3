"""The device half of `stoker bench --device cuda`: input pipelines measured where their batches end up
(in GPU memory, normalized), and training throughput fed by each of them.

Two kinds of pipeline; `stoker.tools.bench` runs and times them like every other pipeline (fresh process
each, median of rounds) and this module supplies what runs on the device:

- loader alone, into device memory, bfloat16 NCHW normalized with ImageNet mean/std (`LOADER_DTYPE`; the
  baseline makes float32 and casts it on the device, stoker converts uint8 to it in one pass):
  ``cuda-baseline`` (torchvision ImageFolder + DataLoader(workers, pin_memory, persistent workers),
  torchvision's train transforms incl. ToTensor + Normalize, each batch ``.to(device, non_blocking=True)``),
  ``cuda-stoker`` (stoker.Loader with ``device=``, ``normalize="imagenet"``, CPU decode),
  ``cuda-stoker-gpu`` (the same with ``decode="gpu"``), ``cuda-stoker-auto`` (``decode="auto"``: each batch
  split between the GPU decoder and the CPU threads by measured throughput; its result records the GPU
  share, why, and the GPU path's seconds per phase over the timed rounds, from `LoaderStats`; where no GPU
  decoder works it decodes on the CPU and says why), and ``cuda-<feed>`` for another library's feed added from
  outside the package (`PeerFeed`: the project's benchmarks/bench_dali.py adds NVIDIA DALI's). A round is
  `steps` batches from a stream that runs on across epochs (as the training windows below are), and
  its clock stops after the device is synchronized, so the rate counts images that reached device memory.
- training, per model: ``train-<model>-synthetic`` (one GPU-resident random batch, no input pipeline:
  the model's own speed), ``train-<model>-baseline``, ``train-<model>-stoker``, ``train-<model>-stoker-process``
  (the same Loader with its threads in one worker process, `Workers(processes=1)`),
  ``train-<model>-stoker-interference`` (the control: the model trains on the resident batch while the
  stoker feed runs beside it, one batch per step taken and discarded on another thread; its shortfall
  against synthetic is the loader's cost to the step, with no data wait in it; `stoker.step_controls`),
  ``train-<model>-stoker-gpu`` and a peer's ``train-<model>-<feed>``. Each training row's first figure is fed /
  synthetic.
  One step (`stoker.tools.train.TrainStep`): model and input channels_last, bf16 autocast (on CUDA), cross
  entropy, SGD(lr 0.1, momentum 0.9, weight decay 1e-4), ``zero_grad(set_to_none=True)``. Warm-up steps first
  (cuDNN autotuning, queues filling), then timed windows of a fixed number of steps; the feeds run
  epoch after epoch as a training loop does, and drop the last partial batch (one input shape).

Start-up (construction to first batch) falls in the untimed warm-up, and no feed restarts inside a
timed round: stoker's Loaders are persistent (epochs run into each other), and the baseline's DataLoader has an epoch as
long as ImageNet-1k's (`BASELINE_EPOCH_SAMPLES`, drawn from the bench's images), so its worker restart
comes as rarely as in the training run the bench stands for, not once per pass over a few thousand
images. Each result carries `startup_share`: its start-up time over its timed run; the tables flag any
at or above `STARTUP_SHARE` (1%) with the `--steps` that brings it under.

The project's acceptance targets are judged outside the package, on the JSON this bench writes
(`benchmarks/targets.py`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._system import fmt_number
from ..errors import ConfigError, StokerError
from .results import BenchResult, markdown_table
from .train import TrainStep, check_model, load_model

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_MODELS", "FEEDS", "LOADERS", "FeedUnavailable", "LoaderRun", "PeerFeed", "TrainRun", "add_feed",
           "device_pipelines", "feed_of", "format_tables", "is_device_pipeline", "model_label", "remove_feed",
           "resolve_device"]

_log = logging.getLogger("stoker.bench")

DEFAULT_MODELS = ("resnet50", "resnet18")
DEFAULT_STEPS = 100          # timed training steps per round
DEFAULT_WARMUP_STEPS = 10    # untimed steps before them: cuDNN autotuning, loader queues filling
DEFAULT_IMAGES = 5000
#: the most a pipeline's start-up (construction to first batch) may weigh against its timed run
STARTUP_SHARE = 0.01
#: samples in one epoch of the baseline DataLoader (ImageNet-1k's training set), drawn from the images
BASELINE_EPOCH_SAMPLES = 1_281_167
OUTPUT_SIZE = 224
#: what every loader-alone pipeline hands out: normalized images in the dtype a bf16 training step takes
LOADER_DTYPE = "bfloat16"

#: loader-alone pipeline -> the feed it measures
LOADERS = {"cuda-baseline": "baseline", "cuda-stoker": "stoker", "cuda-stoker-gpu": "stoker-gpu",
           "cuda-stoker-auto": "stoker-auto"}
#: stoker feed -> its DeviceOptions.decode (the loader-alone split feed has no training pipeline)
_DECODES = {"stoker": "cpu", "stoker-process": "cpu", "stoker-gpu": "gpu", "stoker-auto": "auto"}
#: feed -> what delivers the batches
FEEDS = {
    "synthetic": "one GPU-resident random batch (no input pipeline: the model's own speed)",
    "baseline": "ImageFolder + DataLoader(pin_memory, persistent workers) + torchvision train transforms, "
                ".to(device, non_blocking=True)",
    "stoker": "stoker.Loader(workers=Workers(persistent=True), device=DeviceOptions(device, normalize='imagenet')), "
              "CPU decode",
    "stoker-process": "the stoker feed with its threads in one worker process: Workers(persistent=True, processes=1)",
    "stoker-interference": "the control: one resident batch, as synthetic, while the stoker feed runs beside it, a "
                           "batch per step taken and discarded on another thread (the loader's cost to the step)",
    "stoker-gpu": "stoker.Loader(workers=Workers(persistent=True), device=DeviceOptions(device, normalize='imagenet', "
                  "decode='gpu'))",
}
_LOADER_DESCRIPTIONS = {
    "cuda-baseline": "ImageFolder + DataLoader(pin_memory, persistent workers) + RandomResizedCrop(224), flip, "
                     "ToTensor, Normalize; .to(device, non_blocking=True), then bfloat16 on the device",
    "cuda-stoker": "stoker.Loader(device=DeviceOptions(device, normalize='imagenet', dtype=bfloat16)), "
                   "RandomResizedCrop(224) + flip, CPU decode",
    "cuda-stoker-gpu": "stoker.Loader(device=DeviceOptions(device, normalize='imagenet', dtype=bfloat16, decode='gpu')), "
                       "RandomResizedCrop(224) + flip",
    "cuda-stoker-auto": "stoker.Loader(device=DeviceOptions(device, normalize='imagenet', dtype=bfloat16, "
                        "decode='auto')), RandomResizedCrop(224) + flip: each batch split between the GPU decoder "
                        "and the CPU threads by measured throughput, or the CPU alone with the reason",
}


class FeedUnavailable(StokerError):
    """A feed this installation or machine cannot run (stoker's GPU decode, a peer's library); the bench reports
    it as skipped, with why."""


@dataclass(frozen=True)
class PeerFeed:
    """Another library's feed, defined outside the package (`stoker.tools.bench.Peer.feeds`) and measured, while
    added (`add_feed`), as the loader-alone pipeline ``cuda-<name>`` and the training pipelines
    ``train-<model>-<name>``. ``open(root, batch_size, workers, device, drop_last=, channels_last=, dtype=)``: its
    `Feed` over the ImageFolder `root`, images in `dtype` (raises `FeedUnavailable` when it cannot start);
    ``unavailable()``: why it cannot run here, with the fix, or None; ``prepare()``: imports before any clock."""

    training: str   # what delivers the batches (the training pipelines' description)
    loader: str     # the loader-alone pipeline's description
    open: Callable[..., "Feed"]
    unavailable: Callable[[], str | None]
    prepare: Callable[[], None] = lambda: None


_PEER_FEEDS: dict[str, PeerFeed] = {}


def add_feed(name: str, feed: PeerFeed) -> None:
    """Measure `feed` as ``cuda-<name>`` and ``train-<model>-<name>`` beside stoker's feeds (until `remove_feed`)."""
    LOADERS[f"cuda-{name}"] = name
    _LOADER_DESCRIPTIONS[f"cuda-{name}"] = feed.loader
    FEEDS[name] = feed.training
    _PEER_FEEDS[name] = feed


def remove_feed(name: str) -> None:
    for table in (LOADERS, _LOADER_DESCRIPTIONS):
        table.pop(f"cuda-{name}", None)
    FEEDS.pop(name, None)
    _PEER_FEEDS.pop(name, None)


# ----------------------------------------------------------------------------- names and checks

def model_label(spec: str) -> str:
    """'resnet50' -> 'resnet50'; 'pkg.nets:make_net' -> 'make_net' (the name in pipeline names)."""
    return spec.partition(":")[2] if ":" in spec else spec


def is_device_pipeline(name: str) -> bool:
    return name in LOADERS or name.startswith("train-")


def feed_of(name: str) -> str:
    """The feed a device pipeline measures: 'cuda-stoker' -> 'stoker', 'train-resnet50-stoker-gpu' -> 'stoker-gpu'."""
    if name in LOADERS:
        return LOADERS[name]
    for feed in sorted(FEEDS, key=len, reverse=True):   # "stoker-gpu" before "stoker"
        if name.endswith("-" + feed):
            return feed
    raise ConfigError(f"unknown device pipeline {name!r}")


def uses_packed(name: str) -> bool:
    """Whether the pipeline reads the packed copy (so the bench packs before timing)."""
    return is_device_pipeline(name) and feed_of(name).startswith("stoker")


def device_pipelines(models: Sequence[str], *, check: bool = True) -> dict[str, tuple[str, str | None]]:
    """Every device pipeline for these model specs, in run order: name -> (what it is, its ratio's reference).
    `check`: load each model's module now (`check_model`), so a bad spec fails before anything runs."""
    if not models:
        raise ConfigError("models: expected at least one (a torchvision name such as resnet50, or 'module:callable')")
    out: dict[str, tuple[str, str | None]] = {
        name: (_LOADER_DESCRIPTIONS[name], None if name == "cuda-baseline" else "cuda-baseline") for name in LOADERS}
    seen: dict[str, str] = {}
    for spec in models:
        if check:
            check_model(spec)
        label = model_label(spec)
        if label in seen:
            raise ConfigError(f"models {seen[label]!r} and {spec!r} both name pipelines train-{label}-*; "
                              "give each model once")
        seen[label] = spec
        for feed, what in FEEDS.items():
            out[f"train-{label}-{feed}"] = (f"{spec} training step fed by {what}",
                                            None if feed == "synthetic" else f"train-{label}-synthetic")
    return out


def resolve_device(device: str) -> "torch.device":
    """'cuda', 'cuda:1' or 'cpu' -> torch.device (`stoker.device.parse_device`); ConfigError naming the fix when
    the device is not one this machine has."""
    from ..device.stage import parse_device, resolve_device as gpu_of

    try:
        return gpu_of(parse_device(device))
    except ConfigError as exc:
        raise ConfigError(f"bench --device {device}: {exc}; or leave --device out for the CPU benchmark") from exc


def unavailable(name: str, device: str) -> str | None:
    """Why device pipeline `name` cannot run here (with the fix), or None when it may."""
    if feed_of(name) == "stoker-gpu" and not str(device).startswith("cuda"):
        return f"decode='gpu' needs a CUDA device; this run is on {device} (run with --device cuda)"
    peer = _PEER_FEEDS.get(feed_of(name))
    return peer.unavailable() if peer is not None else None


def device_info(device: "torch.device") -> dict[str, Any]:
    """GPU model and memory, CUDA, cuDNN and torchvision versions, for the record next to the timings."""
    import torch

    info: dict[str, Any] = {"device": str(device)}
    from .tvimport import import_torchvision

    tv = import_torchvision()   # also one built for another torch (its transforms and models)
    info["torchvision"] = None if tv is None else tv.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1), cuda_version=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), gpus=torch.cuda.device_count())
    return info


# ----------------------------------------------------------------------------- on the device

def synchronize(device: "torch.device") -> None:
    """Wait for every queued kernel and copy on `device` (nothing to wait for on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare(device: str, feed: str = "") -> None:
    """Do before any clock starts what a training script has done already: import torch (and torchvision
    when installed, what a peer's feed imports) and create the CUDA context."""
    import torch

    # one that fails to import is left to the feed that needs it, which says so with the fix
    from .tvimport import import_torchvision

    import_torchvision()
    if feed in _PEER_FEEDS:
        with contextlib.suppress(Exception):
            _PEER_FEEDS[feed].prepare()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.empty(1, device=dev)
        synchronize(dev)


def reset_peak_memory(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: str) -> int:
    """Peak bytes held by tensors on `device` since `reset_peak_memory` (0 on the CPU)."""
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if torch.device(device).type == "cuda" else 0


@contextlib.contextmanager
def autotuned_convolutions() -> Iterator[None]:
    """cudnn.benchmark on, as a training script sets it, for the measurement only (restored after):
    the bench is the user here; the library never sets it."""
    import torch

    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


@dataclass
class Feed:
    """Batches `(images, labels)` already on the device, an epoch per `epoch()` call."""

    epoch: Callable[[], Iterator[tuple[Any, Any]]]
    close: Callable[[], None]
    version: str
    discarded: Callable[[], int] | None = None   # the interference control: loader batches taken and dropped
    split: Callable[[], dict[str, Any]] | None = None   # decode="gpu"/"auto": the loader's `split_state` now
    route: str = ""   # stoker's feeds: how each row becomes pixels (`Loader.route`, as text)


def split_state(stats: Any) -> dict[str, Any]:
    """A Loader's GPU split as the bench records it (`LoaderStats`): the share of each batch's JPEGs the
    GPU decodes, why, and the GPU path's seconds per phase so far."""
    return {"gpu_share": stats.gpu_share, "gpu_split": stats.gpu_split, "gpu_phases": dict(stats.gpu_phases)}


def split_fields(name: str, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The result's fields for pipeline `name`'s timed rounds (`split_state` at their start and end): the
    split at their end, the phases' seconds in them; logged on `stoker.bench` (in the step's log of a
    GPU session)."""
    phases = {k: round(v - before["gpu_phases"].get(k, 0.0), 6) for k, v in after["gpu_phases"].items()}
    out = {**after, "gpu_phases": phases}
    _log.info("%s", _split_line(name, out))
    return out


def _torch_version() -> str:
    import torch

    from .tvimport import import_torchvision

    tv = import_torchvision()
    return f"torch {torch.__version__}" + ("" if tv is None else f", torchvision {tv.__version__}")


def _baseline_feed(root: str, batch_size: int, workers: int, device: "torch.device", drop_last: bool,
                   dtype: "torch.dtype") -> Feed:
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from .baseline import _FolderDataset, _torchvision, baseline_transform, list_image_folder

    transform, _ = baseline_transform(True)
    if _torchvision() is not None:
        from torchvision.datasets import ImageFolder
        dataset: Any = ImageFolder(root, transform=transform)
    else:   # the exact re-implementation, as the CPU bench uses
        dataset = _FolderDataset(list_image_folder(Path(root))[0], transform)
    # one DataLoader epoch as long as ImageNet-1k's (permutations of the images back to back): its
    # workers restart as rarely as in a real training run, not after every pass over the bench's images
    sampler = RandomSampler(dataset, num_samples=max(len(dataset), BASELINE_EPOCH_SAMPLES),
                            generator=torch.Generator().manual_seed(0))
    loader: Any = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                             pin_memory=device.type == "cuda", persistent_workers=True, drop_last=drop_last)
    per_pass = max(1, len(dataset) // batch_size)
    it: Any = None

    def epoch() -> Iterator[tuple[Any, Any]]:
        """One pass's worth of batches from the running DataLoader epoch."""
        nonlocal it
        for _ in range(per_pass):
            batch = next(it, None) if it is not None else None
            if batch is None:   # the long epoch ended (or none started yet): the DataLoader restarts
                it = iter(loader)
                batch = next(it)
            images, labels = batch
            # torchvision's transforms make float32; a float32 batch is not copied again (.to is a no-op)
            yield images.to(device, non_blocking=True).to(dtype), labels.to(device, non_blocking=True)

    def close() -> None:
        nonlocal loader, it
        it = loader = None   # the persistent workers stop with the DataLoader's iterator
    return Feed(epoch, close, _torch_version())


def _stoker_loader(packed: str, batch_size: int, **options: Any) -> Any:
    """stoker.Loader with the bench's transforms: RandomResizedCrop(224) + RandomHorizontalFlip, shuffled."""
    from ..loader.loader import Loader
    from ..transforms import RandomHorizontalFlip, RandomResizedCrop

    return Loader(packed, batch_size, transforms=[RandomResizedCrop(OUTPUT_SIZE), RandomHorizontalFlip()],
                  seed=0, **options)


def _stoker_feed(feed: str, packed: str, batch_size: int, workers: int, device: "torch.device",
                 drop_last: bool, channels_last: bool, dtype: "torch.dtype") -> Feed:
    from .. import __version__
    from ..device.stage import DeviceOptions
    from ..loader.options import Workers

    process = feed == "stoker-process"
    try:
        on_device = DeviceOptions(device, normalize="imagenet", dtype=dtype,
                                  memory_format="channels_last" if channels_last else None, decode=_DECODES[feed])
        # persistent: epochs run straight into each other (as the baseline's persistent workers do), so
        # no round or training window after the first pays the pipeline's start-up again
        loader = _stoker_loader(packed, batch_size, drop_last=drop_last, device=on_device,
                                workers=Workers(num_threads=workers, persistent=True, processes=int(process)))
    except ConfigError as exc:   # e.g. decode="gpu" without a GPU JPEG decoder installed
        raise FeedUnavailable(str(exc)) from exc
    started = False

    def epoch() -> Iterator[tuple[Any, Any]]:
        nonlocal started
        it = None
        while True:
            try:
                if it is None:
                    it = iter(loader)
                batch = next(it)
            except StopIteration:
                return
            except ConfigError as exc:   # a GPU decoder is made on first use; once batches flowed, errors are errors
                if started:
                    raise
                loader.close()
                raise FeedUnavailable(str(exc)) from exc
            started = True
            yield batch[0], batch[1]
    extra = {"stoker-gpu": ", decode='gpu'", "stoker-auto": ", decode='auto'", "stoker-process": ", processes=1"}
    split = (lambda: split_state(loader.stats)) if _DECODES[feed] != "cpu" else None
    return Feed(epoch, loader.close, f"stoker {__version__}{extra.get(feed, '')}", split=split,
                route=str(loader.route))


def _interference_feed(packed: str, batch_size: int, workers: int, device: "torch.device", dtype: "torch.dtype") -> Feed:
    """The control: the synthetic batch, one per step, while the stoker feed runs on a `Drain` thread that
    takes one of its batches per step and drops it (it starts before the first batch is handed out)."""
    from ..step_controls import Drain

    loader = _stoker_feed("stoker", packed, batch_size, workers, device, drop_last=True, channels_last=True,
                          dtype=dtype)
    resident = _synthetic_feed(batch_size, device)

    class _Stream:   # what the drain iterates: the feed's epochs back to back
        def __iter__(self) -> Iterator[tuple[Any, Any]]:
            return _forever(loader, batch_size)
    drain = Drain(_Stream())
    try:
        drain.start()
    except BaseException:
        loader.close()
        raise

    def epoch() -> Iterator[tuple[Any, Any]]:
        for batch in resident.epoch():
            drain.permit()
            yield batch

    def close() -> None:
        try:
            drain.stop()
        finally:
            loader.close()
    return Feed(epoch, close, loader.version + ", interference control", lambda: drain.taken)


def _synthetic_feed(batch_size: int, device: "torch.device") -> Feed:
    import torch

    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, OUTPUT_SIZE, OUTPUT_SIZE, generator=g).to(device)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch_size,), generator=g).to(device)

    def epoch() -> Iterator[tuple[Any, Any]]:
        while True:
            yield images, labels
    return Feed(epoch, lambda: None, f"torch {torch.__version__}")


def open_feed(feed: str, *, root: str, packed: str, batch_size: int, workers: int, device: "torch.device",
              training: bool, dtype: "torch.dtype | None" = None) -> Feed:
    """The batches a pipeline measures. `training`: drop the last partial batch (one input shape, as
    training loaders do) and hand stoker's and peers' batches out channels_last (the model's layout).
    `dtype`: the images' floating dtype (default float32), the same for every feed but the synthetic one."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if feed == "synthetic":
        return _synthetic_feed(batch_size, device)
    if feed == "baseline":
        return _baseline_feed(root, batch_size, workers, device, drop_last=training, dtype=dtype)
    if feed == "stoker-interference":
        return _interference_feed(packed, batch_size, workers, device, dtype)
    if feed in _DECODES:
        return _stoker_feed(feed, packed, batch_size, workers, device, drop_last=training, channels_last=training,
                            dtype=dtype)
    if feed in _PEER_FEEDS:
        return _PEER_FEEDS[feed].open(root, batch_size, workers, device, drop_last=training, channels_last=training,
                                      dtype=dtype)
    raise ConfigError(f"unknown feed {feed!r}; expected one of {', '.join(dict.fromkeys([*FEEDS, *_DECODES]))}")


def _forever(feed: Feed, batch_size: int) -> Iterator[tuple[Any, Any]]:
    """Epoch after epoch, as a training loop's `for epoch ...: for batch in loader:` does."""
    while True:
        got = False
        for batch in feed.epoch():
            got = True
            yield batch
        if not got:
            raise ConfigError(f"the feed gave no full batch of {batch_size}; use more images or a smaller batch")


@dataclass
class LoaderRun:
    """A loader-alone pipeline, opened (`loader_epochs`)."""

    epoch: Callable[[], Iterator[int]]
    close: Callable[[], None]
    version: str
    split: Callable[[], dict[str, Any]] | None = None   # stoker's GPU decode feeds: `split_state` now
    route: str = ""   # stoker's feeds: `Loader.route`, as text


def loader_epochs(name: str, *, root: str, packed: str, batch_size: int, workers: int, device: str,
                  steps: int) -> LoaderRun:
    """A loader-alone pipeline: each `epoch()` (a round) yields the sizes of the next `steps` batches of
    a stream that runs on across epochs, each once it is queued for device memory, and returns after
    synchronizing the device, so a round timed around it counts images that reached device memory and
    no round after the first pays the pipeline's start-up."""
    import torch

    if steps < 1:
        raise ConfigError(f"steps must be at least 1 (batches per timed round), got {steps}")
    dev = resolve_device(device)
    feed = open_feed(LOADERS[name], root=root, packed=packed, batch_size=batch_size, workers=workers, device=dev,
                     training=False, dtype=getattr(torch, LOADER_DTYPE))
    stream = _forever(feed, batch_size)
    started = False

    def epoch() -> Iterator[int]:
        nonlocal started
        for _ in range(steps):
            images, _labels = next(stream)
            if not started:   # the first batch (time to first batch) counts once it is in device memory
                synchronize(dev)
                started = True
            yield int(images.shape[0])
        synchronize(dev)

    def close() -> None:
        stream.close()
        feed.close()
    return LoaderRun(epoch, close, feed.version, feed.split, feed.route)


def startup_share(first_batch_s: float, timed_s: float) -> float:
    """A pipeline's start-up (construction to first batch) over its timed run's seconds."""
    return first_batch_s / timed_s if timed_s > 0 else math.nan


def steps_for_startup(steps: int, share: float) -> int:
    """The timed steps per round that bring a start-up measured at `share` of a run of `steps` steps per
    round under STARTUP_SHARE."""
    return max(steps, math.ceil(steps * share / STARTUP_SHARE * 1.1))


# ----------------------------------------------------------------------------- training

class TrainRun:
    """A model training on one feed. Construction builds the model and the feed and takes the first batch
    (`first_batch_s`: feed construction to first batch, cold); `run(steps)` trains and times."""

    def __init__(self, name: str, model: str, *, root: str, packed: str, batch_size: int, workers: int,
                 device: str) -> None:
        import torch

        self.device = resolve_device(device)
        with torch.random.fork_rng(devices=[]):   # the same initial weights every run; the caller's RNG untouched
            torch.manual_seed(0)
            # the device bench's recipe: channels_last, bf16 autocast on CUDA (the CPU runs float32), SGD(0.1, wd 1e-4)
            self.step = TrainStep(load_model(model), self.device, lr=0.1, weight_decay=1e-4, channels_last=True,
                                  autocast=self.device.type == "cuda")
        self.batch_size = batch_size
        start = time.perf_counter()
        self.feed = open_feed(feed_of(name), root=root, packed=packed, batch_size=batch_size, workers=workers,
                              device=self.device, training=True)
        self._stream = _forever(self.feed, batch_size)
        try:
            self._pending: Any = next(self._stream)
        except BaseException:
            self.close()
            raise
        self.first_batch_s = time.perf_counter() - start
        self.version = self.feed.version

    def run(self, steps: int) -> tuple[float, float]:
        """Train `steps` steps; returns (seconds, seconds spent waiting for batches in next()), with the
        device synchronized before the clock starts and before it stops."""
        synchronize(self.device)
        wait = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            if self._pending is not None:
                batch, self._pending = self._pending, None
            else:
                batch = next(self._stream)
            wait += time.perf_counter() - t
            self.step(*batch)
        synchronize(self.device)
        return time.perf_counter() - start, wait

    def close(self) -> None:
        self._pending = None
        self._stream.close()
        self.feed.close()


# ----------------------------------------------------------------------------- the table

def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f}" if n else "-"


def _loader_cells(p: Any) -> list[str]:
    ratio = f"{p.ratio:.2f}x {p.ratio_to}" if p.ratio is not None else "-"
    return [fmt_number(p.images_per_s, ",.0f"), ratio, fmt_number(p.cpu_percent, ".0f"),
            fmt_number(p.cpu_ms_per_image, ".2f"), _mb(p.peak_rss_bytes), _mb(p.peak_device_bytes),
            fmt_number(p.first_batch_s, ".2f")]


def _training_cells(p: Any, result: BenchResult) -> list[str]:
    base = result.ran(p.name.rsplit("-" + feed_of(p.name), 1)[0] + "-baseline")
    vs_base = p.images_per_s / base.images_per_s if base is not None and \
        feed_of(p.name) not in ("synthetic", "baseline", "stoker-interference") else None
    return [fmt_number(p.ratio, ".2f"), fmt_number(p.images_per_s, ",.0f"), fmt_number(vs_base, ".2f", "x"),
            fmt_number(p.data_wait, ".1%"), fmt_number(p.cpu_percent, ".0f"), _mb(p.peak_rss_bytes),
            _mb(p.peak_device_bytes), fmt_number(p.first_batch_s, ".2f")]


def format_tables(result: BenchResult) -> list[str]:
    """Markdown lines: the loader-alone table and the training table (no footer)."""
    loaders = [p for p in result.pipelines if p.name in LOADERS]
    training = [p for p in result.pipelines if p.name.startswith("train-")]
    lines: list[str] = []
    if loaders:
        lines += [f"Loader alone: batches in {result.device} memory, {LOADER_DTYPE} NCHW, normalized (ImageNet mean/std), "
                  f"{result.steps} batches of {result.batch_size} per round.", "",
                  *markdown_table(("pipeline", "images/s", "ratio", "CPU %", "CPU ms/image", "peak RSS (MB)",
                           "peak device (MB)", "first batch (s)"), [(p, _loader_cells(p)) for p in loaders])]
        splits = [_split_line(p.name, vars(p)) for p in loaders if p.ran and p.gpu_split]
        lines += ["", *splits, ""] if splits else []
    if training:
        lines += [f"Training on {result.device}: images/s over {result.steps} steps of {result.batch_size} per round "
                  f"after {result.warmup_steps} warm-up step(s).", "",
                  *markdown_table(("pipeline", "fed / synthetic", "images/s", "vs baseline feed", "data wait", "CPU %",
                           "peak RSS (MB)", "peak device (MB)", "first batch (s)"),
                          [(p, _training_cells(p, result)) for p in training])]
    late = [p for p in loaders + training if p.ran and p.startup_share >= STARTUP_SHARE]
    if late:   # NaN compares False: only shares that were measured are flagged
        lines += ["", *(f"Start-up of {p.name} ({p.first_batch_s:.2f} s) is {p.startup_share:.1%} of its timed run, "
                        f"over {STARTUP_SHARE:.0%}: rerun with --steps {steps_for_startup(result.steps, p.startup_share)}."
                        for p in late)]
    return lines


def _split_line(name: str, split: dict[str, Any]) -> str:
    """Where a GPU decode loader's time went: its split, why, and the GPU path's seconds per phase."""
    spent = {k: v for k, v in split["gpu_phases"].items() if v > 0}
    phases = (", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in spent.items()) if spent
              else "none (no batch went through the GPU decode path)")
    return (f"{name}: {split['gpu_share']:.0%} of each batch's JPEGs on the GPU ({split['gpu_split']}); seconds "
            f"per phase over the timed rounds: {phases}.")
