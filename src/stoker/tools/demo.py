"""`stoker demo`: the main job on built-in data, on any machine.

Generates an ImageNet-like set of JPEGs, packs it, then trains one model for the same number of
steps: on one batch held in memory (synthetic: the model's own speed, the ceiling), fed by PyTorch's
DataLoader + PIL with torchvision's default training transforms, fed by stoker, and on the held batch
while stoker runs beside it with its batches discarded (the interference control: what the running
loader costs the step itself, cores and GIL, which data wait never shows). The headline is
**fed / synthetic** for each loader (the share of the model's speed it keeps), the ratio between the
two loaders, worded by its sign ("1.90x faster", "2.10x slower"), and the control's share.

What keeps the figures honest:

- the model needs its data: on a GPU, ResNet-18 at batch 256 in bf16 and channels_last (torchvision's,
  built without weights, or the same network from `train.resnet18` where torchvision's models do not
  import), so the step is GPU work, not Python; on a CPU host, the small CNN (`train.small_cnn`) at
  batch 64, the model on half of the cores and the loader on the rest;
- the timed window is at least `QUEUE_MULTIPLE` (4) times the largest loader queue (a DataLoader
  queues workers x prefetch_factor batches, stoker a ring of prefetch + 2), after warm-up steps that
  drain the queue filled at start-up, so no loader's figure is a queue filled before the clock started;
  the feeds run epoch after epoch (persistent workers) when the window is longer than the images;
- the device is synchronized only at the window's ends, never per step (the overlap a training loop
  has is kept), and CPU is counted over the whole process tree (DataLoader workers included).

The feeds and the step are the device bench's (`bench_gpu.TrainRun`): batches normalized float in
device memory, the DataLoader's with pin_memory and persistent workers. The table, `demo.json` and a
chart `demo.png` land in the working directory, where the generated images are cached.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._progress import Progress
from .._system import fmt_number, json_safe, ratio_words, usable_cpus

#: timed steps (a floor: raised to QUEUE_MULTIPLE x the largest loader queue)
DEFAULT_STEPS = 20
#: images per step on a CPU host (the small CNN) and on a GPU (ResNet-18)
DEFAULT_BATCH = 64
GPU_BATCH = 256
#: Channels of the small CNN's first layer. On one CPU core its training step takes about 3 ms per image
#: (about 300 images/s): between what DataLoader + PIL and stoker deliver on one core.
MODEL_WIDTH = 16
#: the timed window is at least this many times the largest loader queue
QUEUE_MULTIPLE = 4
#: the interference control within this of the synthetic ceiling reads as "no measurable cost": two
#: windows of the same step on 2 cores differ by about this much (the fresh-clone demo's control came
#: out at 1.08 of synthetic)
CONTROL_NOISE = 0.05
#: DataLoader's default prefetch_factor; stoker's ring is Workers.prefetch (2) + 2 slots
DATALOADER_PREFETCH = 2
STOKER_RING = 4
_CPU_NOTE = ("No GPU here, so the model and the loader share this machine's CPU cores: the model gets "
             "{model} core(s) (torch threads) and the loader the other {loader} (DataLoader worker processes, "
             "or stoker threads), standing in for a GPU that would run the model while the CPU loads. On a "
             "CUDA machine the demo trains ResNet-18 at batch 256 in bf16 on the GPU and both loaders get every core.")


def demo_model(cuda: bool) -> tuple[str, str]:
    """(model spec for `train.load_model`, its name): ResNet-18 on a GPU (torchvision's when its models
    import, else `train.resnet18`, the same network), the small CNN on a CPU host."""
    if not cuda:
        return "stoker.tools.train:small_cnn", f"small CNN (width {MODEL_WIDTH})"
    from ..errors import ConfigError
    from .train import check_model

    try:
        check_model("resnet18")
        return "resnet18", "ResNet-18 (torchvision, no weights)"
    except ConfigError:
        return "stoker.tools.train:resnet18", "ResNet-18 (stoker.tools.train.resnet18: torchvision's models do not import)"


def plan_steps(steps: int, loader_cores: int) -> tuple[int, int, int]:
    """(warm-up steps, timed steps, the largest queue in batches) for loaders on `loader_cores` cores:
    the warm-up drains the queue filled at start-up, the timed window is at least 4x that queue."""
    queue = max(loader_cores * DATALOADER_PREFETCH, STOKER_RING)
    return queue + 2, max(steps, QUEUE_MULTIPLE * queue), queue


@dataclass
class DemoRun:
    """One training run: `steps` timed steps after `warmup_steps`; seconds and data wait over the timed ones."""

    name: str
    description: str
    images_per_s: float
    steps: int
    seconds: float
    wait_s: float
    cpu_percent: float          # the process tree (DataLoader workers included); 100 = one core
    first_batch_s: float        # feed construction to its first batch (start-up, untimed)
    fed_ratio: float | None = None   # images/s over the synthetic run's

    @property
    def compute_s(self) -> float:
        return self.seconds - self.wait_s

    @property
    def data_wait_percent(self) -> float:
        return 100.0 * self.wait_s / self.seconds if self.seconds > 0 else float("nan")

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.seconds / self.steps if self.steps else float("nan")


@dataclass
class DemoResult:
    synthetic: DemoRun
    runs: list[DemoRun]         # DataLoader + PIL, then stoker
    model: str
    images: int
    batch_size: int
    steps: int
    warmup_steps: int
    queue_batches: int
    device: str
    cores: int
    model_threads: int
    loader_cores: int
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    #: the interference control: the held batch while stoker runs beside it, its batches discarded
    control: DemoRun | None = None
    #: the images/s every fed / synthetic is over: the fastest run of the held batch (the synthetic windows,
    #: or the control when the step ran faster beside a running loader), so no ratio reads above 1.00
    ceiling: float = 0.0

    @property
    def speedup(self) -> float | None:
        """stoker's images/s over DataLoader + PIL's (equal to the ratio of their fed / synthetic)."""
        base, fast = self.runs[0].images_per_s, self.runs[-1].images_per_s
        return fast / base if base > 0 else None

    def headline(self) -> str:
        base, fast = self.runs
        line = (f"fed / synthetic: stoker {fmt_number(fast.fed_ratio, '.2f')}, DataLoader + PIL "
                f"{fmt_number(base.fed_ratio, '.2f')} (1.00 = the model's own speed): stoker trained "
                f"{ratio_words(self.speedup)} than DataLoader + PIL")
        if self.control is not None:
            kept = self.control.fed_ratio
            if kept is not None and kept >= 1.0 - CONTROL_NOISE:
                line += (f". Beside a running stoker whose batches were discarded, the model kept all of its speed "
                         f"({fmt_number(kept, '.2f')} of synthetic, no more than {CONTROL_NOISE:.0%} below it: the interference "
                         f"control measured no cost of the loader to the step itself); stoker's gap to 1.00 is "
                         f"waiting for batches")
            else:
                line += (f". Beside a running stoker whose batches were discarded, the model kept "
                         f"{fmt_number(kept, '.2f')} of its speed: the loader's cost to the step itself "
                         f"(the interference control); the rest of stoker's gap to 1.00 is waiting for batches")
        return line

    @property
    def rows(self) -> list[DemoRun]:
        """The table's runs in order: synthetic, the two feeds, the control where it ran."""
        return [self.synthetic, *self.runs, *([self.control] if self.control is not None else [])]

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("synthetic", "runs", "control")}
        out.update(speedup=self.speedup, headline=self.headline(),
                   runs=[{**asdict(r), "data_wait_percent": r.data_wait_percent} for r in self.rows])
        return json_safe(out)


def set_ceiling(result: DemoResult) -> None:
    """Every run's fed / synthetic over the fastest run of the held batch. The step has run faster beside a
    running loader than alone (the control at 1.08 to 1.29 of the synthetic windows in fresh-clone demos on 2
    cores), which made "stoker 1.00 of synthetic" overstate what it kept: the faster of the two is the ceiling."""
    held = [result.synthetic, *([result.control] if result.control is not None else [])]
    result.ceiling = max(r.images_per_s for r in held)
    for run in result.rows:
        run.fed_ratio = run.images_per_s / result.ceiling if result.ceiling > 0 else None


def format_table(result: DemoResult) -> str:
    """The demo's markdown table, the headline and how it was measured."""
    lines = ["| training fed by | images/s | fed / synthetic | data wait | step time (ms) | CPU % |",
             "|---|---|---|---|---|---|"]
    for run in result.rows:
        lines.append(f"| {run.name} | {fmt_number(run.images_per_s, ',.0f')} | {fmt_number(run.fed_ratio, '.2f')} | "
                     f"{fmt_number(run.data_wait_percent, '.0f', '%')} | {fmt_number(run.step_ms, ',.1f')} | "
                     f"{fmt_number(run.cpu_percent, '.0f')} |")
    lines += ["", result.headline() + ".", ""]
    lines += [f"- {run.name}: {run.description}" for run in result.rows]
    lines += ["", f"Same model: {result.model}; same {result.steps} timed steps of {result.batch_size} images after "
              f"{result.warmup_steps} warm-up steps, on {result.device}. The window is {QUEUE_MULTIPLE}x or more the "
              f"largest loader queue ({result.queue_batches} batches), so it measures each loader's sustained rate, "
              "not a queue filled before the clock started; the device is synchronized at the window's ends only. "
              "fed / synthetic: images/s over the same model's on one batch held in device memory, the fastest such "
              "run (the synthetic windows or the control"
              + (", here the control: the step ran faster beside the running loader than alone" if
                 result.control is not None and result.control.images_per_s > result.synthetic.images_per_s else "")
              + "). CPU %: the process and its children (DataLoader workers) over the window, 100 = one core."]
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


def _train(feed: str, name: str, description: str, model: str, paths: tuple[Path, Path], batch_size: int,
           steps: tuple[int, int], loader_cores: int, device: str, progress: bool) -> DemoRun:
    """`warmup` untimed steps, then one timed window of `timed` steps (device synchronized at its ends)."""
    from ..profiling import cpu_seconds
    from .bench_gpu import TrainRun, autotuned_convolutions

    warmup, timed = steps
    root, packed = paths
    # cudnn.benchmark on for the run only, as a training script sets it (and the device bench does)
    with autotuned_convolutions(), Progress(f"train: {name}", warmup + timed, unit="step", enabled=progress) as bar:
        run = TrainRun(f"train-demo-{feed}", model, root=str(root), packed=str(packed), batch_size=batch_size,
                       workers=loader_cores, device=device)
        try:
            run.run(warmup)
            bar.update(warmup)
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            seconds, wait = run.run(timed)
            cpu = (cpu_seconds() - cpu0) / (time.perf_counter() - wall0) * 100.0
            bar.update(timed)
        finally:
            run.close()
    return DemoRun(name, description, timed * batch_size / seconds, timed, seconds, wait, cpu, run.first_batch_s)


def run_demo(out: str | Path = "stoker-demo", *, images: int = 2000, batch_size: int | None = None,
             steps: int = DEFAULT_STEPS, device: str | None = None, progress: bool = True) -> DemoResult:
    """Generate, pack, train (synthetic, DataLoader + PIL, stoker, the interference control, synthetic
    again: the faster synthetic window is the ceiling), print and write the comparison.

    Writes `demo.md`, `demo.json` and (with matplotlib) `demo.png` in `out`. `batch_size`: default 256 on
    a GPU, 64 on the CPU. `steps` is raised to 4x the largest loader queue. On CPU, torch's thread count is
    set for the training runs (see `doctor.split_cores`) and restored afterwards.
    """
    import torch

    from ..packing import PackOptions, pack
    from .doctor import default_device, split_cores

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cores = usable_cpus()
    device = default_device(device)
    cuda = device.startswith("cuda")
    batch_size = batch_size or (GPU_BATCH if cuda else DEFAULT_BATCH)
    started = time.perf_counter()
    model_threads, loader_cores = split_cores(device, cores)
    warmup, steps, queue = plan_steps(steps, loader_cores)
    model, model_name = demo_model(cuda)

    print(f"[1/6] generating {images:,} ImageNet-like JPEGs (cached in {out})", flush=True)
    root = _generate(out, images, cores, progress)
    print("[2/6] packing them into Arrow shards", flush=True)
    packed = out / "packed"
    summary = pack(root, packed, options=PackOptions(workers=cores), overwrite=True, progress=progress)
    print(f"      {summary.format().splitlines()[0]}", flush=True)

    where = device if cuda else f"cpu: {model_threads} core(s) for the model, {loader_cores} for the loader"
    dtype = "bf16 autocast, channels_last" if cuda else "float32, channels_last"
    runs: list[DemoRun] = []
    threads_before = torch.get_num_threads()
    torch.set_num_threads(model_threads)
    feeds = _feeds(loader_cores)
    try:
        # the synthetic ceiling first and again last, the faster kept: a cold start (allocator, caches, clocks)
        # in the first window would otherwise flatter the feeds (fed / synthetic above 1)
        for k, (feed, name, description) in enumerate([*feeds, feeds[0]], start=3):
            print(f"[{min(k, 6)}/6] {model_name}, {warmup} warm-up + {steps} timed steps of {batch_size} ({dtype}; "
                  f"{where}): {name}{' again' if k == 7 else ''}", flush=True)
            runs.append(_train(feed, name, description, model, (root, packed), batch_size, (warmup, steps),
                               loader_cores, device, progress))
    finally:
        torch.set_num_threads(threads_before)
    synthetic = max(runs.pop(0), runs.pop(), key=lambda r: r.images_per_s)
    control = runs.pop()
    result = DemoResult(synthetic, runs, model_name, images, batch_size, steps, warmup, queue, device, cores,
                        model_threads, loader_cores, control=control)
    set_ceiling(result)
    result.seconds = time.perf_counter() - started
    _write(result, out)
    print("\n" + format_table(result))
    print(f"\nstoker trained {ratio_words(result.speedup)} than DataLoader + PIL. demo finished in "
          f"{result.seconds:.0f} s; results in {', '.join(result.files)}", flush=True)
    return result


def _feeds(loader_cores: int) -> list[tuple[str, str, str]]:
    return [("synthetic", "synthetic (one batch in memory)",
             "no loader: one random batch held in device memory, the model's own speed (the ceiling)"),
            ("baseline", "DataLoader + PIL",
             f"torch DataLoader, {loader_cores} persistent worker process(es), pin_memory on a GPU, PIL decode, "
             "torchvision's RandomResizedCrop(224), flip, ToTensor, Normalize (float32, on the CPU), then copied"),
            ("stoker", "stoker",
             f"stoker.Loader on the pack, {loader_cores} thread(s), the same transforms; on a GPU, uint8 copied on "
             "the loader's own stream and normalized there, a batch ahead; on the CPU, normalized by its threads"),
            ("stoker-interference", "stoker running, batches discarded (control)",
             "the interference control: the synthetic batch, while the stoker feed runs beside it and a thread "
             "takes one of its batches per step and drops it; its share of synthetic is the loader's cost to the "
             "step itself, whatever data wait says")]


def _write(result: DemoResult, out: Path) -> None:
    from .charts import demo_chart

    (out / "demo.md").write_text(format_table(result) + "\n")
    result.files = [str(out / "demo.md"), str(out / "demo.json")]
    cuda = result.device.startswith("cuda")
    note = "" if cuda else (f"CPU only: the model ran on {result.model_threads} core(s), the loader on "
                            f"{result.loader_cores} (no GPU on this machine)")
    named = [("synthetic\n(one batch held)", result.synthetic), ("baseline\n(DataLoader + PIL)", result.runs[0]),
             ("stoker\n(Loader)", result.runs[1])]
    if result.control is not None:
        named.append(("control: stoker\nrunning, batches\ndiscarded", result.control))
    if demo_chart(named, out / "demo.png", note=note,
                  title=f"Training {result.model}: {result.steps} steps of {result.batch_size} images on "
                        f"{result.device}"):
        result.files.append(str(out / "demo.png"))
    (out / "demo.json").write_text(json.dumps(result.as_dict(), indent=1) + "\n")
