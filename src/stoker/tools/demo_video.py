"""`stoker demo --video`: training on video clips, fed by the common script and by stoker.

Generates Kinetics-like videos (`synth_video`: class-dependent motion, H.264), packs them, then trains
the same tiny 3D CNN for the same number of steps, alternating between two feeds for `rounds` rounds:

- the baseline: a torch DataLoader whose worker processes open each video with PyAV, decode from its
  first frame up to a random clip's last frame, keep the clip's frames, and crop, resize and flip them
  with torchvision's RandomResizedCrop sampling (one plan per clip) and antialiased bilinear resize;
- stoker: `Loader(pack, sampling=Sampling(clips=Clips(...)))`, the same clip length, stride and
  transforms, decoded on threads from the keyframe before each clip straight into pinned
  `[B, T, H, W, 3]` slots.

Each run is measured with `stoker.profile` (clips/s, data-wait share); the best round of each feed is
compared. On a machine without a GPU the model and the loader split the CPU cores (`doctor.split_cores`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from .._system import usable_cpus
from ..profiling import ProfileReport



@dataclass(frozen=True)
class VideoDemoSetup:
    """What the demo generates and trains on. The default: 32 videos of 4 classes shaped like Kinetics'
    (10 s at 25 fps, 256 x 340, H.264 with x264's default keyframe interval, 10 s), clips of 16 frames
    4 apart at 112 x 112, 10 steps of 8 clips per run, two rounds of each feed: about a minute on 2 cores."""

    videos: int = 32
    classes: int = 4
    seconds: float = 10.0
    fps: int = 25
    frame_size: tuple[int, int] = (256, 340)   # (height, width) of the generated videos, pixels
    keyframe_seconds: float = 10.0
    frames: int = 16
    stride: int = 4
    size: int = 112   # RandomResizedCrop's output, pixels
    batch_size: int = 8
    steps: int = 10
    rounds: int = 2


@dataclass
class VideoDemoResult:
    """Per feed, the profile of each round (baseline first); `speedup` compares the best rounds."""

    runs: dict[str, list[ProfileReport]]
    setup: VideoDemoSetup
    device: str
    model_threads: int
    loader_cores: int
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)

    def best(self, name: str) -> ProfileReport:
        return max(self.runs[name], key=lambda r: r.images_per_s)

    @property
    def speedup(self) -> float:
        base, fast = (self.best(n).images_per_s for n in self.runs)
        return fast / base if base > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.setup), "device": self.device, "model_threads": self.model_threads,
                "loader_cores": self.loader_cores, "seconds": self.seconds, "speedup": self.speedup,
                "runs": {n: [r.as_dict() for r in rs] for n, rs in self.runs.items()}}


def format_table(result: VideoDemoResult) -> str:
    """The markdown table (best round of each feed) and what was compared."""
    names = list(result.runs)
    base = result.best(names[0]).images_per_s
    lines = ["| training fed by | clips/s | data wait | step time (ms) | speed-up |", "|---|---|---|---|---|"]
    for name in names:
        r = result.best(name)
        step_ms = r.wall_s / r.steps * 1000 if r.steps else float("nan")
        lines.append(f"| {name} | {r.images_per_s:,.1f} | {r.data_wait_percent:.0f}% | {step_ms:,.0f} | "
                     f"{r.images_per_s / base:.2f}x |")
    d = result.setup
    lines += ["", f"A tiny 3D CNN, {d.steps} steps of {d.batch_size} clips ({d.frames} frames {d.stride} apart, "
              f"RandomResizedCrop({d.size}) + flip, one plan per clip) after one warm-up step, on {result.device}; "
              f"best of {d.rounds} alternating round(s) per feed; {result.loader_cores} loader core(s) "
              f"(DataLoader worker processes, or stoker threads), the model on {result.model_threads} thread(s)."]
    return "\n".join(lines)


def video_cnn(num_classes: int, width: int = 8) -> Any:
    """A tiny 3D CNN on clips `[B, T, 3, H, W]`: a (1, 4, 4) stride-(1, 4, 4) stem, one stride-2 3x3x3
    conv, global pooling, a linear head."""
    from torch import nn

    class Clips3d(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv3d(3, width, (1, 4, 4), stride=(1, 4, 4)), nn.BatchNorm3d(width), nn.ReLU(inplace=True),
                nn.Conv3d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm3d(2 * width), nn.ReLU(inplace=True),
                nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))

        def forward(self, x: Any) -> Any:
            return self.body(x.transpose(1, 2))   # [B, T, C, H, W] -> Conv3d's [B, C, T, H, W]

    return Clips3d()


def crop_resize_flip(clip: np.ndarray, box: tuple[int, int, int, int], size: int, flip: bool) -> Any:
    """The baseline's per-clip transform: the (top, left, height, width) box of every frame of `clip`
    (uint8 [T, H, W, 3]) resized to size x size with torch's antialiased bilinear (what
    torchvision's tensor transforms run), mirrored when `flip`; uint8 [T, 3, size, size]."""
    import torch

    top, left, h, w = box
    x = torch.from_numpy(np.ascontiguousarray(clip[:, top:top + h, left:left + w])).permute(0, 3, 1, 2).float()
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    if flip:
        x = x.flip(-1)
    return x.round_().clamp_(0, 255).to(torch.uint8)


def pyav_from_start(container: Any, frames: list[int]) -> tuple[np.ndarray, int]:
    """The common script, on a video opened with `av.open`: decode from the first frame, keep the
    clip's `frames`, stop after the last one. Returns the clip (uint8 [T, H, W, 3]) and the
    frames decoded."""
    wanted, last, kept, n = set(frames), max(frames), {}, -1
    for n, frame in enumerate(container.decode(video=0)):
        if n in wanted:
            kept[n] = frame.to_ndarray(format="rgb24")
        if n >= last:
            break
    return np.stack([kept[f] for f in frames]), n + 1


class PyAVClips:
    """The baseline's map-style dataset, as a training script commonly writes it: per item, open the
    video with PyAV, decode from the start up to a random clip's last frame, keep the clip's frames,
    then RandomResizedCrop (torchvision's sampling, one box per clip, antialiased bilinear) and a flip.
    Returns (uint8 [frames, 3, size, size], label)."""

    def __init__(self, items: list[tuple[Path, int]], frames: int, stride: int, size: int) -> None:
        self.items, self.frames, self.stride, self.size = items, frames, stride, size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import av
        import torch

        from .baseline import _TVRandomResizedCrop

        path, label = self.items[i]
        span = (self.frames - 1) * self.stride + 1
        with av.open(str(path)) as container:
            total = container.streams.video[0].frames
            start = int(torch.randint(0, max(1, total - span + 1), (1,)).item())
            wanted = [min(start + k * self.stride, max(total - 1, 0)) for k in range(self.frames)]
            clip, _ = pyav_from_start(container, wanted)
        box = _TVRandomResizedCrop(self.size).get_params(clip.shape[2], clip.shape[1])
        return crop_resize_flip(clip, box, self.size, torch.rand(1).item() < 0.5), label


def _epochs(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (a run of fixed steps may span several)."""
    while True:
        yield from loader


def _train(loader: Iterable[Any], steps: int, classes: int, device: str) -> ProfileReport:
    """`steps` training steps (after one warm-up step) of a fresh tiny 3D CNN fed by `loader`, profiled."""
    import torch

    from .train import TrainStep
    from ..profiling import profile

    torch.manual_seed(0)   # the same initial model for every run
    step = TrainStep(video_cnn(classes), device)
    batches = _epochs(loader)
    prof = profile(batches, warmup=1, sync=device.startswith("cuda"), verbose=False)
    try:
        for k, (clips, labels, *_) in enumerate(prof):
            if k > steps:   # asking for this batch ended the last measured step
                break
            step(clips, labels)
    finally:
        batches.close()
    return prof.reports[-1] if prof.reports else prof.report()


def run_video_demo(out: str | Path = "stoker-demo-video", setup: VideoDemoSetup = VideoDemoSetup(), *,
                   device: str | None = None) -> VideoDemoResult:
    """Generate and pack `setup.videos` videos (cached in `out`), then train alternately fed by the PyAV
    DataLoader and by stoker, `setup.rounds` times each; print the comparison and write `demo-video.md`
    and `demo-video.json` in `out`."""
    import torch
    from torch.utils.data import DataLoader

    from .doctor import default_device, split_cores
    from .synth_video import VideoStyle, make_kinetics_like
    from ..loading.clips import Clips
    from ..device.stage import DeviceOptions
    from ..loader.loader import Loader
    from ..loader.options import Sampling
    from ..packing import PackOptions, pack
    from ..transforms import RandomHorizontalFlip, RandomResizedCrop
    from ..video import require_av

    require_av()
    out = Path(out)
    started = time.perf_counter()
    device = default_device(device)
    cuda = device.startswith("cuda")
    model_threads, loader_cores = split_cores(device, usable_cpus())
    d = setup
    per_class = max(1, d.videos // d.classes)
    style = VideoStyle(seconds=d.seconds, fps=d.fps, size=d.frame_size, keyframe_seconds=d.keyframe_seconds)
    src = out / (f"videos-{per_class * d.classes}-c{d.classes}-{d.seconds:g}s-{d.fps}fps-"
                 f"{d.frame_size[0]}x{d.frame_size[1]}-k{d.keyframe_seconds:g}")
    print(f"[1/3] generating {per_class * d.classes} Kinetics-like videos ({d.seconds:g} s, {d.fps} fps, "
          f"{d.frame_size[0]}x{d.frame_size[1]}, H.264, a keyframe every {d.keyframe_seconds:g} s) in {out}",
          flush=True)
    if not (src / "complete").exists():   # generated once, reused by later runs
        make_kinetics_like(src, per_class, classes=d.classes, style=style)
        (src / "complete").write_text("")
    print("[2/3] packing them (byte-for-byte, with a frame index)", flush=True)
    packed = out / "packed"
    pack(src, packed, options=PackOptions(workers=loader_cores), overwrite=True, progress=False)
    items = sorted((p, int(p.parent.name.rsplit("_", 1)[1])) for p in src.rglob("*.mp4"))

    where = device if cuda else f"cpu: {model_threads} core(s) for the model, {loader_cores} for the loader"
    print(f"[3/3] training a tiny 3D CNN, {d.steps} steps of {d.batch_size} clips per run, alternating feeds "
          f"({where})", flush=True)
    base_name = f"baseline (DataLoader + PyAV, {loader_cores} worker(s))"
    fast_name = f"stoker (Loader with clips, {loader_cores} thread(s))"
    runs: dict[str, list[ProfileReport]] = {base_name: [], fast_name: []}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(model_threads)
    # on a GPU the loader's device stage copies uint8 clips on its own stream and normalizes there
    on_device = {"device": DeviceOptions(device, normalize="imagenet")} if cuda else {}
    try:
        for r in range(d.rounds):
            base = DataLoader(PyAVClips(items, d.frames, d.stride, d.size), batch_size=d.batch_size, shuffle=True,
                              num_workers=loader_cores, persistent_workers=True, pin_memory=cuda, drop_last=True)
            runs[base_name].append(_train(base, d.steps, d.classes, device))
            del base
            with Loader(packed, d.batch_size, sampling=Sampling(clips=Clips(frames=d.frames, stride=d.stride)),
                        transforms=[RandomResizedCrop(d.size), RandomHorizontalFlip()], seed=r, drop_last=True,
                        workers=loader_cores, **on_device) as loader:
                runs[fast_name].append(_train(loader, d.steps, d.classes, device))
            print(f"      round {r + 1}/{d.rounds}: " + ", ".join(
                f"{n.split(' (')[0]} {rs[-1].images_per_s:.1f} clips/s, data wait {rs[-1].data_wait_percent:.0f}%"
                for n, rs in runs.items()), flush=True)
    finally:
        torch.set_num_threads(threads_before)
    result = VideoDemoResult(runs, d, device, model_threads, loader_cores)
    result.seconds = time.perf_counter() - started
    (out / "demo-video.md").write_text(format_table(result) + "\n")
    (out / "demo-video.json").write_text(json.dumps(result.as_dict(), indent=1) + "\n")
    result.files = [str(out / "demo-video.md"), str(out / "demo-video.json")]
    print("\n" + format_table(result))
    print(f"\nstoker trained {result.speedup:.2f}x faster on clips. demo finished in {result.seconds:.0f} s; "
          f"results in {', '.join(result.files)}", flush=True)
    return result
