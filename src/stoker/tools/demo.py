"""`stoker demo`: the main job on built-in data, on any machine.

Generates an ImageNet-like set of JPEGs, packs it, then trains the same small pure-PyTorch CNN
for the same number of steps twice: fed by PyTorch's DataLoader + PIL with torchvision's default
training transforms, and fed by stoker. Each run is measured with `stoker.profile` (images/s,
data wait, verdict); the table, `demo.json` and a chart `demo.png` land in the working directory,
where the generated images are cached. Uses the GPU when CUDA is available.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .._progress import Progress
from .._system import usable_cpus
from ..profiling import ProfileReport

#: The training runs: 30 steps of 64 images (1,920 of the 2,000 images, one pass, no epoch boundary).
DEFAULT_STEPS = 30
DEFAULT_BATCH = 64
#: Channels of the CNN's first layer. On one CPU core its training step takes about 3 ms per image
#: (about 300 images/s): between what DataLoader + PIL and stoker deliver on one core, so the run
#: shows which loader keeps the model busy, not just which decodes faster.
MODEL_WIDTH = 16
_CPU_NOTE = ("No GPU here, so the model and the loader share this machine's CPU cores: the model gets "
             "{model} core(s) (torch threads) and the loader the other {loader} (DataLoader worker processes, "
             "or stoker threads), standing in for a GPU that would run the model while the CPU loads. On a "
             "CUDA machine the demo trains on the GPU and both loaders get every core.")


@dataclass
class DemoRun:
    name: str
    description: str
    report: ProfileReport


@dataclass
class DemoResult:
    runs: list[DemoRun]
    images: int
    batch_size: int
    steps: int
    device: str
    cores: int
    model_threads: int
    loader_cores: int
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        base, fast = self.runs[0].report.images_per_s, self.runs[-1].report.images_per_s
        return fast / base if base > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"images": self.images, "batch_size": self.batch_size, "steps": self.steps, "device": self.device,
                "cores": self.cores, "model_threads": self.model_threads, "loader_cores": self.loader_cores,
                "seconds": self.seconds, "speedup": self.speedup,
                "runs": [{"name": r.name, "description": r.description, **r.report.as_dict()} for r in self.runs]}


def format_table(result: DemoResult) -> str:
    """The demo's markdown table plus a line per run with its verdict."""
    base = result.runs[0].report.images_per_s
    lines = ["| training fed by | images/s | data wait | step time (ms) | speed-up | verdict |",
             "|---|---|---|---|---|---|"]
    for run in result.runs:
        r = run.report
        step_ms = r.wall_s / r.steps * 1000 if r.steps else float("nan")
        lines.append(f"| {run.name} | {r.images_per_s:,.0f} | {r.data_wait_percent:.0f}% | {step_ms:,.0f} | "
                     f"{r.images_per_s / base:.2f}x | {r.verdict} |")
    lines.append("")
    for run in result.runs:
        lines.append(f"- {run.name}: {run.description}")
        lines.append(f"  verdict: {run.report.reason}" + (f"; fix: {run.report.fixes[0]}" if run.report.input_bound
                                                             and run.report.fixes else ""))
    lines += ["", f"Same model (small CNN, width {MODEL_WIDTH}), same {result.steps} steps of {result.batch_size} "
              f"images after one warm-up step, model on {result.device}; images/s and data wait from "
              "`stoker.profile`; a step is the wait for its batch plus the model's forward, backward and update."]
    if not result.device.startswith("cuda"):
        lines.append(_CPU_NOTE.format(model=result.model_threads, loader=result.loader_cores))
    return "\n".join(lines)


def _generate(out: Path, images: int, cores: int, progress: bool) -> Path:
    """`synth.cached_imagenet_like` with a progress bar that counts the files as they appear."""
    from .synth import cached_imagenet_like

    name = f"imagenet-like-n{images}-c10-s0"
    if (out / f"{name}.complete").exists():
        return out / name
    done = threading.Event()

    def count() -> int:
        root = out / name
        try:
            return sum(len(os.listdir(d)) for d in root.iterdir() if d.is_dir())
        except OSError:
            return 0

    bar = Progress("generate", images, enabled=progress)

    def watch() -> None:
        while not done.wait(0.5):
            bar.update(count() - bar.done)

    watcher = threading.Thread(target=watch, name="stoker-demo-progress", daemon=True)
    watcher.start()
    try:
        root = cached_imagenet_like(out, images, workers=cores)
    finally:
        done.set()
        watcher.join(timeout=2.0)
        bar.update(count() - bar.done)
        bar.close()
    return root


def _train(name: str, loader: Iterable[Any], steps: int, device: str, progress: bool) -> ProfileReport:
    """`steps` training steps (after one warm-up step) of a fresh small CNN fed by `loader`, profiled."""
    import torch

    from .train import TrainStep, small_cnn
    from ..profiling import profile

    torch.manual_seed(0)   # the same initial model for both runs
    step = TrainStep(small_cnn(10, MODEL_WIDTH), device)
    prof = profile(loader, warmup=1, sync=device.startswith("cuda"), verbose=False)
    with Progress(f"train: {name}", steps + 1, unit="step", enabled=progress) as bar:
        for k, (images, labels) in enumerate(prof):
            if k > steps:   # asking for this batch ended the last measured step
                break
            step(images, labels)
            bar.update()
            if prof.images_per_s > 0:
                bar.set_postfix(images_per_s=f"{prof.images_per_s:.0f}")
    return prof.reports[-1] if prof.reports else prof.report()


def run_demo(out: str | Path = "stoker-demo", *, images: int = 2000, batch_size: int = DEFAULT_BATCH,
             steps: int = DEFAULT_STEPS, device: str | None = None, progress: bool = True) -> DemoResult:
    """Generate, pack, train twice (DataLoader + PIL, then stoker), print and write the comparison.

    Writes `demo.md`, `demo.json` and (with matplotlib) `demo.png` in `out`. `steps` is capped so
    that both runs stay within one pass over the images. On CPU, torch's thread count is set for
    the training runs (see `doctor.split_cores`) and restored afterwards.
    """
    import torch

    from .doctor import default_device, split_cores
    from ..packing import PackOptions, pack

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cores = usable_cpus()
    device = default_device(device)
    cuda = device.startswith("cuda")
    started = time.perf_counter()
    steps = max(1, min(steps, images // batch_size - 1))   # steps + 1 batches: one pass, no epoch boundary
    model_threads, loader_cores = split_cores(device, cores)

    print(f"[1/4] generating {images:,} ImageNet-like JPEGs (cached in {out})", flush=True)
    root = _generate(out, images, cores, progress)
    print("[2/4] packing them into Arrow shards", flush=True)
    packed = out / "packed"
    summary = pack(root, packed, options=PackOptions(workers=cores), overwrite=True, progress=progress)
    print(f"      {summary.format().splitlines()[0]}", flush=True)

    where = device if cuda else f"cpu: {model_threads} core(s) for the model, {loader_cores} for the loader"
    threads_before = torch.get_num_threads()
    torch.set_num_threads(model_threads)
    try:
        runs = _race(root, packed, batch_size, steps, device, loader_cores, where, progress)
    finally:
        torch.set_num_threads(threads_before)

    result = DemoResult(runs, images, batch_size, steps, device, cores, model_threads, loader_cores)
    result.seconds = time.perf_counter() - started
    _write(result, out)
    print("\n" + format_table(result))
    print(f"\nstoker trained {result.speedup:.2f}x faster. demo finished in {result.seconds:.0f} s; "
          f"results in {', '.join(result.files)}", flush=True)
    return result


def _race(root: Path, packed: Path, batch_size: int, steps: int, device: str, loader_cores: int, where: str,
          progress: bool) -> list[DemoRun]:
    from .baseline import baseline_loader
    from ..device.stage import DeviceOptions
    from ..loader.loader import Loader
    from ..transforms import RandomHorizontalFlip, RandomResizedCrop

    print(f"[3/4] training a small CNN for {steps} steps of {batch_size} fed by DataLoader + PIL ({where})",
          flush=True)
    base = baseline_loader(root, batch_size, workers=loader_cores, train=True, pin_memory=device.startswith("cuda"))
    baseline = DemoRun("baseline (DataLoader + PIL)",
                       f"torch DataLoader, {loader_cores} worker process(es), PIL decode, torchvision's "
                       "RandomResizedCrop(224), flip, ToTensor, Normalize (float32, on the CPU)",
                       _train("baseline", base, steps, device, progress))
    del base
    print("[4/4] the same training fed by stoker.Loader on the pack", flush=True)
    cuda = device.startswith("cuda")
    # on a GPU the loader's device stage copies uint8 batches on its own stream and normalizes there
    on_device = {"device": DeviceOptions(device, normalize="imagenet")} if cuda else {}
    with Loader(packed, batch_size, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()],
                seed=0, **on_device, workers=loader_cores) as loader:
        how = ("copied as uint8 on the loader's copy stream and normalized on the GPU, a batch ahead" if cuda
               else f"converted to float and normalized by the training step on {device}")
        fast = DemoRun("stoker", f"stoker.Loader, {loader_cores} thread(s), the same transforms; uint8 batches, "
                       f"{how}", _train("stoker", loader, steps, device, progress))
    return [baseline, fast]


def _write(result: DemoResult, out: Path) -> None:
    from .charts import demo_chart

    (out / "demo.md").write_text(format_table(result) + "\n")
    result.files = [str(out / "demo.md"), str(out / "demo.json")]
    cuda = result.device.startswith("cuda")
    note = "" if cuda else (f"CPU only: the model ran on {result.model_threads} core(s), the loader on "
                            f"{result.loader_cores} (no GPU on this machine)")
    if demo_chart([("baseline\n(DataLoader + PIL)", result.runs[0].report),
                   ("stoker\n(Loader)", result.runs[1].report)], out / "demo.png", note=note,
                  title=f"Training a small CNN: {result.steps} steps of {result.batch_size} images "
                        f"on {result.device}"):
        result.files.append(str(out / "demo.png"))
    (out / "demo.json").write_text(json.dumps(result.as_dict(), indent=1) + "\n")
