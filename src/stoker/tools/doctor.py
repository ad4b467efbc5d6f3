"""`stoker doctor PATH`: is training on this data input-bound? Measured, without writing training code.

Short runs on the user's data (a packed dataset, an ImageFolder tree or a file list), each over
`steps` batches after one warm-up batch (a few hundred images by default, so it stays quick):

1. the stoker Loader alone: images/s the input pipeline can deliver;
2. the model step on one batch held in memory (`stoker.step_controls`): alone, the synthetic-data
   ceiling (images/s the model can consume), and beside the Loader running with its batches
   discarded, the interference control (the loader's cost to a step that never waits);
3. both together under `stoker.profile`: fed / synthetic, the data-wait share and the verdict, with the fix.

Without a GPU the model and the loader compete for the same cores; unless `threads` is given, the
model then gets half of them (torch threads) and the loader the rest (`split_cores`), as in the
demo: oversubscribed, torch's threads slow down several-fold and the measurement shows scheduling.

The model step is the built-in `small_cnn` (the demo's model, at width 16) unless one is given: an
`nn.Module`, a torchvision model name or a "module:callable" string that returns one (e.g.
"torchvision.models:resnet18"), or any callable `step(images, labels)`. The step is
`stoker.tools.train.TrainStep`, the one the demo and the device bench run.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .._progress import Progress
from .._system import fmt_number, json_safe, usable_cpus
from ..errors import ConfigError
from ..profiling import ProfileReport, profile
from ..step_controls import MIN_VERDICT_STEPS, measure_controls
from .train import TrainStep, load_model, small_cnn

__all__ = ["DoctorReport", "default_device", "format_cores", "run_doctor", "split_cores"]


def default_device(device: str | None = None) -> str:
    """`device` checked and made explicit by `stoker.device.parse_device` and `resolve_device` ("cuda" ->
    "cuda:0", or LOCAL_RANK's GPU); None: the current CUDA GPU when there is one, else the CPU."""
    import torch

    from ..device.stage import parse_device, resolve_device

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(resolve_device(parse_device(device)))


def split_cores(device: str, cores: int) -> tuple[int, int]:
    """(torch threads for the model, cores for the loader). On a GPU machine the loader gets every
    core; on CPU the model gets half of them (at least one) and the loader the rest, so the two do
    not oversubscribe the cores (torch's threads slow down sharply when they do)."""
    import torch

    if device.startswith("cuda"):   # torch sized its pool when imported: no more threads than the cores now
        return min(torch.get_num_threads(), cores), cores
    model = max(1, cores // 2)
    return model, max(1, cores - model)


def _model_from(spec: Any, num_classes: int, device: str) -> tuple[Callable[[Any, Any], None], str]:
    from torch import nn

    if spec is None or spec == "small":
        return TrainStep(small_cnn(num_classes), device), f"built-in small CNN ({num_classes} classes)"
    if isinstance(spec, str):
        spec, name = load_model(spec), spec
    else:
        name = type(spec).__name__
    if isinstance(spec, nn.Module):
        return TrainStep(spec, device), name
    if callable(spec):
        return spec, name
    raise ConfigError(f"model: expected None, 'small', a torchvision model name, 'module:callable', an nn.Module or "
                      f"a step(images, labels) callable, got {type(spec).__name__}")


@dataclass
class DoctorReport:
    """What `run_doctor` measured. Rates in images/s."""

    path: str
    model: str
    device: str
    batch_size: int
    steps: int
    threads: int
    transforms: str
    loader_images_per_s: float      # the loader alone
    step_images_per_s: float        # the model step alone, on a batch held in memory (synthetic)
    profile: ProfileReport          # both together: fed / synthetic, interference, verdict and fixes
    decoder: str = ""               # which CPU JPEG path the loader uses (region decode, or why not)
    gpu_decoder: str = ""           # decode="gpu"/"auto": the backend, the split with the CPU threads and why
    loader_gpu_bytes: int | None = None  # on a GPU: peak bytes the loader alone held in torch's allocator
    loader_batch_bytes: int | None = None  # on a GPU: the peak of LoaderStats.device_peak_bytes (its own tensors)
    route: str = ""                 # how each row became pixels (LoaderStats.route: Loader.route)
    per_sample_python: list[str] = field(default_factory=list)  # LoaderStats.per_sample_python
    gpu_share: float | None = None  # the route splits JPEGs with the GPU: the share the split settled on
    cores: int | None = None        # run pinned to this many cores (stoker doctor --cores), or None
    cpus: list[int] = field(default_factory=list)   # which CPUs, with `cores`

    @property
    def verdict(self) -> str:
        return self.profile.verdict

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("path", "model", "device", "batch_size", "steps", "threads",
                                             "transforms", "loader_images_per_s", "step_images_per_s", "decoder",
                                             "gpu_decoder", "loader_gpu_bytes", "loader_batch_bytes", "route",
                                             "per_sample_python", "gpu_share", "cores", "cpus")}
        return json_safe({**out, "verdict": self.verdict, "fed_ratio": self.profile.fed_ratio,
                          "interference_images_per_s": self.profile.interference_images_per_s,
                          "interference_ratio": self.profile.interference_ratio, "profile": self.profile.as_dict()})

    def format(self) -> str:
        from .cores import cpu_list

        slower = "loader" if self.loader_images_per_s < self.step_images_per_s else "model step"
        pinned = f" at {self.cores} core(s) (CPUs {cpu_list(self.cpus)})" if self.cores is not None else ""
        return "\n".join([
            f"stoker doctor: {self.path}{pinned}",
            f"  setup            batch {self.batch_size}, {self.steps} steps per run, {self.threads} loader thread(s), "
            f"{self.transforms} transforms, model: {self.model} on {self.device}",
            f"  JPEG decode      {self.decoder}",
            f"  route            {self.route}"
            + (f" (the split settled on {self.gpu_share:.0%} of each batch's JPEGs on the GPU)"
               if self.gpu_share is not None else ""),
            f"  Python/sample    {_per_sample(self.per_sample_python)}",
            *([f"  GPU JPEG decode  {self.gpu_decoder}"] if self.gpu_decoder else []),
            f"  loader alone     {self.loader_images_per_s:,.1f} images/s",
            *([f"  loader GPU mem   {self.loader_gpu_bytes / 1e6:,.1f} MB at peak, running alone (batches in flight, "
               f"uploads, conversion, GPU decode; torch's allocator: nvImageCodec's own buffers are not in it)"]
              if self.loader_gpu_bytes is not None else []),
            *([f"  loader batches   {self.loader_batch_bytes / 1e6:,.1f} MB at peak: the device batches it built "
               f"ahead and held (LoaderStats.device_peak_bytes, its own tensors summed)"]
              if self.loader_batch_bytes is not None else []),
            f"  model step alone {fmt_number(self.step_images_per_s, ',.1f')} images/s (synthetic: one batch held in "
            "memory)",
            f"  together         {fmt_number(self.profile.images_per_s, ',.1f')} images/s "
            f"(alone, the {slower} is the slower of the two)",
            "", self.profile.format()])

    __str__ = format


def _batches(loader: Any, n: int) -> Iterable[Any]:
    """The first `n` batches of a fresh epoch (a stoker Loader left part-way would continue its epoch)."""
    if hasattr(loader, "set_epoch") and hasattr(loader, "state_dict") and loader.state_dict().get("sample"):
        loader.set_epoch(loader.epoch + 1)
    return itertools.islice(iter(loader), n)


def run_doctor(path: str | Path, *, batch_size: int = 32, steps: int = MIN_VERDICT_STEPS + 2, threads: int | None = None,
               transforms: str = "train", size: int = 224, model: Any = None, device: str | None = None,
               progress: bool = True, decode: str = "cpu", cores: int | None = None) -> DoctorReport:
    """Measure the loader alone, the model step alone and both together on the data at `path`.

    Reads about `(steps + 1) * batch_size` images per run (one warm-up batch); each run reads a new
    epoch of the dataset (on a smaller dataset, `steps` shrinks to fit; below `MIN_VERDICT_STEPS` the
    report gives no verdict and says how many steps are missing). `transforms`:
    "train" (RandomResizedCrop + flip), "val" (Resize + CenterCrop), at `size` pixels, "buckets"
    (aspect-ratio buckets of size x size pixels + flip: `stoker.AspectBuckets`) or "tokens" (NaFlex:
    `stoker.TokenBudget(16, (size // 16) ** 2)` + flip, rows of patches). `decode`:
    "cpu", "gpu" (JPEGs decoded on a CUDA device) or "auto" (split with the CPU threads by measured
    throughput where a GPU decoder works); the report names the backend, the split and why.
    `cores`: run pinned to that many of this process's CPUs, as a machine with `cores` cores would
    (`tools.cores.pinned`); the loader's threads and the model's follow it.
    """
    if cores is not None:
        from .cores import pinned

        with pinned(cores) as cpus:
            report = run_doctor(path, batch_size=batch_size, steps=steps, threads=threads, transforms=transforms,
                                size=size, model=model, device=device, progress=progress, decode=decode)
        report.cores, report.cpus = cores, cpus
        return report
    import torch

    from ..device.stage import DeviceOptions
    from ..loader.loader import Loader
    from ..buckets import AspectBuckets
    from ..loader.options import Sampling
    from ..loading.tokens import TokenBudget
    from ..transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize

    if transforms not in ("train", "val", "buckets", "tokens"):
        raise ConfigError(f"transforms must be 'train', 'val', 'buckets' or 'tokens', got {transforms!r}")
    if batch_size < 1 or steps < 1:
        raise ConfigError(f"batch_size and steps must be >= 1, got {batch_size} and {steps}")
    ops = [RandomResizedCrop(size), RandomHorizontalFlip()] if transforms == "train" else \
        [RandomHorizontalFlip()] if transforms == "buckets" else \
        [TokenBudget(16, max(1, (size // 16) ** 2)), RandomHorizontalFlip()] if transforms == "tokens" else \
        [Resize(size * 8 // 7), CenterCrop(size)]
    # aspect-ratio buckets of size x size pixels: each batch one bucket (stoker.AspectBuckets)
    sampling = {"sampling": Sampling(buckets=AspectBuckets(area=size * size, multiple=32), drop_last=True, seed=0)} \
        if transforms == "buckets" else {"drop_last": True, "seed": 0}
    device = default_device(device)
    model_threads, loader_cores = split_cores(device, usable_cpus())
    if decode == "gpu" and not device.startswith("cuda"):
        raise ConfigError(f"decode='gpu' needs a CUDA device, got {device}; use decode='cpu' (stoker doctor "
                          f"--decode cpu), or decode='auto', which decodes on the CPU where no GPU decoder works")
    on_device = {"device": DeviceOptions(device, normalize="imagenet", decode=decode)} \
        if device.startswith("cuda") else {}
    loader = Loader(path, batch_size, transforms=ops, **sampling, **on_device, workers=threads or loader_cores)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(model_threads)   # restored below
    try:
        ds = loader.dataset
        if len(loader) < 3:
            raise ConfigError(f"{path}: {len(ds)} images make fewer than 3 batches of {batch_size}; "
                              "pass a smaller --batch-size")
        steps = min(steps, len(loader) - 2)
        labels = ds.labels
        num_classes = int(labels.max()) + 1 if labels.dtype.kind in "iu" and len(labels) and labels.max() >= 0 \
            else 10
        step, model_name = _model_from(model, num_classes, device)
        bar = _bar(2 * (steps + 1) + 3, progress)   # two runs by batch, three control windows

        # 1. the loader alone
        def alone() -> float:
            t0 = None
            for k, _ in enumerate(_batches(loader, steps + 1)):
                if k == 0:
                    t0 = time.perf_counter()   # after the warm-up batch
                bar.update()
            return steps * batch_size / (time.perf_counter() - t0)   # type: ignore[operator]
        loader_rate, loader_gpu = gpu_memory_of(device, alone)
        held = loader.stats.device_peak_bytes if on_device else None   # the loader's own tensors, alone

        # 2. the model step on one batch held in memory: alone (synthetic) and beside the running loader
        first = next(iter(_batches(loader, 1)))[:2]
        controls = measure_controls(step, tuple(first), loader, steps=steps, device=device)
        bar.update(3)
        step_rate = controls.synthetic_images_per_s

        # 3. both together, profiled, judged by fed / synthetic
        prof = profile(loader, warmup=1, sync=device.startswith("cuda"), verbose=False)
        prof.controls = controls
        for k, batch in enumerate(prof):
            if k > steps:   # asking for this batch ended the last measured step
                break
            step(batch[0], batch[1])
            bar.update()
        bar.close()
        report = prof.reports[-1] if prof.reports else prof.report()
    finally:
        torch.set_num_threads(threads_before)
        loader.close()
    return DoctorReport(str(path), model_name, device, batch_size, steps, loader.num_threads, transforms,
                        loader_rate, step_rate, report, _decoder(), _gpu_decode(loader.stats), loader_gpu, held,
                        str(loader.route), list(loader.stats.per_sample_python),
                        loader.stats.gpu_share if loader.route.gpu_decode else None)


def format_cores(reports: list[DoctorReport]) -> str:
    """Doctor runs at several core counts (`stoker doctor --cores 16,8`): one row per count (loader threads,
    rates, verdict, route, the GPU's share where the route splits), then each count's report."""
    head = ("cores", "loader threads", "loader alone (img/s)", "model step alone (img/s)", "together (img/s)",
            "verdict", "route", "GPU share")
    rows = [(str(r.cores), str(r.threads), fmt_number(r.loader_images_per_s, ",.1f"),
             fmt_number(r.step_images_per_s, ",.1f"), fmt_number(r.profile.images_per_s, ",.1f"), r.verdict, r.route,
             "-" if r.gpu_share is None else f"{r.gpu_share:.0%}") for r in reports]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(c) + " |" for c in rows)]
    return "\n\n".join(["\n".join(lines), *(r.format() for r in reports)])


def _gpu_decode(stats: Any) -> str:
    """decode="gpu"/"auto": the backend and how each batch was split with the CPU threads, and why."""
    if not stats.gpu_split:
        return stats.gpu_decoder
    return f"{stats.gpu_decoder or 'none'}; {stats.gpu_share:.0%} of each batch's JPEGs on the GPU: {stats.gpu_split}"


def _per_sample(why: list[str]) -> str:
    """The doctor's line on the Python the loader runs per sample beside the training loop (the route's)."""
    from ..loading.route import PER_SAMPLE_FIX

    if not why:
        return "none in the training process (the route above says which path renders the rows)"
    return (f"yes, holding the training loop's GIL for tens of µs per sample ({'; '.join(why)}); fix: "
            f"{PER_SAMPLE_FIX}")


def _decoder() -> str:
    """The CPU JPEG path: the crop's region only, or whole images (and why, with the fix)."""
    from .. import _libjpeg

    if _libjpeg.region_decoder() is not None:
        return "region + DCT-scaled (only the crop's rectangle is decoded)"
    return (f"whole images, DCT-scaled ({_libjpeg.describe()}; reinstall stoker where a C compiler is "
            "available to build the region decoder)")


def gpu_memory_of(device: str, run: Callable[[], Any]) -> tuple[Any, int | None]:
    """`run()`'s result and, on a CUDA device, the peak bytes allocated through torch's caching allocator
    while it ran, above what was allocated before (the model's weights, say); None elsewhere."""
    if not device.startswith("cuda"):
        return run(), None
    import torch

    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = run()
    return out, max(0, torch.cuda.max_memory_allocated(device) - base)


def _bar(total: int, enabled: bool) -> Progress:
    """A bar on a terminal, `stoker.progress` log lines elsewhere (a log file gets no `\\r` bars)."""
    return Progress("doctor", total, unit="batch", enabled=enabled)
