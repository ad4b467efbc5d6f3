"""Random video clips (16 frames, stride 4, RandomResizedCrop 224 + flip) on 2 cores: stoker's clip decode
on a thread pool against a DataLoader whose workers decode with PyAV from the start of the file to the
clip (the common script) and a DataLoader whose workers use decord, in the same run, alternating.

    python benchmarks/bench_video.py CACHE_DIR [--videos 16] [--clips 48] [--rounds 3] [--threads 2]
                                     [--json out.json]

CACHE_DIR keeps the generated Kinetics-like videos (10 s, 25 fps, 256 x 340, H.264 with a keyframe every
10 s: x264's default interval) and their packs: byte-for-byte, and re-encoded with a keyframe every second
(`stoker pack --video-keyframes 1`). Every pipeline decodes the same clips (frames and crop planned once by
stoker.clips.plan_clip) into uint8 [16, 224, 224, 3]. Reported per pipeline: clips/s, CPU ms per clip (all
threads, plus the DataLoader workers' own CPU time), frames decoded per frame delivered (the waste), best
round of `--rounds`. The stoker figure is the decode path on threads (what a Loader worker runs per
clip), without the Loader around it (`stoker demo --video` trains through the Loader: docs/video.md).
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

import stoker
from stoker.clips import Clips, decode_clip_into, finish_clip, plan_clip
from stoker.packing import PackOptions, pack
from stoker.tools.synth_video import VideoStyle, make_kinetics_like
from stoker.transforms import Pipeline, RandomHorizontalFlip, RandomResizedCrop
from stoker.video import VIDEO_INDEX_COLUMN, VideoIndex

SPEC = Clips(frames=16, stride=4)
SIZE = 224


def prepare(cache: Path, videos: int) -> dict[str, Path]:
    """The generated videos, their two packs, and the re-encoded videos as loose files (for the baselines)."""
    src = cache / f"kinetics-{videos}"
    if not src.exists():
        make_kinetics_like(src, max(1, videos // 4), classes=4, style=VideoStyle())
    out = {"src": src}
    for name, options in (("keep", PackOptions()), ("kf1", PackOptions(video_keyframes=1.0))):
        dest = cache / f"packed-{videos}-{name}"
        pack(src, dest, options=options, resume=dest.exists(), progress=False)
        out[name] = dest
    loose = cache / f"kinetics-{videos}-kf1"
    if not loose.exists():
        with stoker.open_dataset(out["kf1"]) as ds:
            for i in range(len(ds)):
                s = ds.sample(i)
                (loose / s.key).parent.mkdir(parents=True, exist_ok=True)
                (loose / s.key).write_bytes(bytes(s.data))
    out["src-kf1"] = loose
    return out


def plans(ds: Any, clips: int, epoch: int, pipe: Pipeline) -> list[tuple[int, Any]]:
    out = []
    for j in range(clips):
        i = j % len(ds)
        index = VideoIndex.from_json(ds.extra(i, VIDEO_INDEX_COLUMN))
        out.append((i, plan_clip(index, SPEC, pipe, seed=0, epoch=epoch, sample=i, clip=j // len(ds))))
    return out


def run_stoker(ds: Any, work: list[tuple[int, Any]], pipe: Pipeline, pool_size: int, **decode: Any) -> dict[str, float]:
    indexes = {i: VideoIndex.from_json(ds.extra(i, VIDEO_INDEX_COLUMN)) for i, _ in work}
    rows = np.empty((pool_size * 2, SPEC.frames, SIZE, SIZE, 3), np.uint8)   # stands in for a slot ring

    def one(job: tuple[int, tuple[int, Any]]) -> tuple[int, int]:
        k, (i, plan) = job
        s = ds.sample(i)
        dst = rows[k % len(rows)]
        st = decode_clip_into(s.data, indexes[i], plan.frames, dst, plan.box, plan.flip, key=s.key, **decode)
        finish_clip(pipe, plan, dst)
        return st.decoded, st.delivered

    with ThreadPoolExecutor(pool_size) as pool:
        return _timed(lambda: list(pool.map(one, enumerate(work))), len(work))


class _ClipSet:
    """A map-style dataset of clips for the DataLoader baselines: decode, then RandomResizedCrop's box
    resized with torch's antialiased bilinear (what torchvision's tensor transforms run)."""

    def __init__(self, paths: list[Path], work: list[tuple[int, Any]], reader: str) -> None:
        self.paths, self.work, self.reader = paths, work, reader

    def __len__(self) -> int:
        return len(self.work)

    def __getitem__(self, j: int) -> tuple[Any, int]:
        import torch
        i, plan = self.work[j]
        frames = plan.frames.tolist()
        if self.reader == "pyav":
            clip, decoded = _pyav_from_start(self.paths[i], frames)
        else:
            import decord
            vr = decord.VideoReader(str(self.paths[i]), num_threads=1)
            clip, decoded = vr.get_batch(frames).asnumpy(), -1
        top, left, h, w = (int(round(v)) for v in plan.box)
        x = torch.from_numpy(np.ascontiguousarray(clip[:, top:top + h, left:left + w])).permute(0, 3, 1, 2).float()
        x = torch.nn.functional.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
        if plan.flip:
            x = x.flip(-1)
        return x.round().clamp(0, 255).to(torch.uint8), decoded


def _pyav_from_start(path: Path, frames: list[int]) -> tuple[np.ndarray, int]:
    """The common script: open the file, decode from the first frame, keep the clip's frames, stop after
    the last one."""
    import av
    wanted, last, kept, n = set(frames), max(frames), {}, -1
    with av.open(str(path)) as container:
        for n, frame in enumerate(container.decode(video=0)):
            if n in wanted:
                kept[n] = frame.to_ndarray(format="rgb24")
            if n >= last:
                break
    return np.stack([kept[f] for f in frames]), n + 1


def run_dataloader(paths: list[Path], work: list[tuple[int, Any]], reader: str, threads: int) -> dict[str, float]:
    from torch.utils.data import DataLoader
    loader = DataLoader(_ClipSet(paths, work, reader), batch_size=4, num_workers=threads)

    def go() -> list[tuple[int, int]]:
        out = []
        for _, decoded in loader:
            out.extend((int(d), SPEC.frames) for d in decoded)
        return out
    return _timed(go, len(work))


def loader_startup(workers: int) -> float:
    """Seconds a DataLoader with this many workers takes to deliver 2 trivial batches: the start-up
    cost inside each DataLoader figure (it is paid once per epoch in training)."""
    from torch.utils.data import DataLoader
    started = time.perf_counter()
    for _ in DataLoader(list(range(2 * workers)), batch_size=1, num_workers=workers):
        pass
    return time.perf_counter() - started


def _timed(fn: Callable[[], list[tuple[int, int]]], clips: int) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    counts = fn()
    child_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - cpu + (child_after.ru_utime + child_after.ru_stime - child.ru_utime - child.ru_stime)
    wall = time.perf_counter() - wall
    decoded = sum(d for d, _ in counts)
    waste = decoded / sum(n for _, n in counts) if decoded >= 0 and all(d >= 0 for d, _ in counts) else float("nan")
    return {"clips_per_s": clips / wall, "cpu_ms_per_clip": 1000 * cpu / clips, "waste": waste}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", type=Path)
    p.add_argument("--videos", type=int, default=16)
    p.add_argument("--clips", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    data = prepare(args.cache, args.videos)
    pipe = Pipeline([RandomResizedCrop(SIZE), RandomHorizontalFlip()])
    try:
        import decord  # noqa: F401
        have_decord = True
    except ImportError:
        have_decord = False
    results: dict[str, list[dict[str, float]]] = {}
    sizes = {}
    for name in ("keep", "kf1"):
        with stoker.open_dataset(data[name]) as ds:
            sizes[name] = int(np.sum(ds.sizes))
    for r in range(args.rounds):
        for name, loose in (("keep", data["src"]), ("kf1", data["src-kf1"])):
            with stoker.open_dataset(data[name]) as ds:
                work = plans(ds, args.clips, r, pipe)
                paths = [loose / ds.sample(i).key for i in range(len(ds))]
                runs: list[tuple[str, Callable[[], dict[str, float]]]] = [
                    (f"stoker threads={args.threads}", lambda: run_stoker(ds, work, pipe, args.threads)),
                    ("stoker threads=1", lambda: run_stoker(ds, work, pipe, 1)),
                    (f"stoker threads={args.threads} ffmpeg FRAME x2",
                     lambda: run_stoker(ds, work, pipe, args.threads, threads=2, thread_type="FRAME")),
                    (f"stoker threads={args.threads} ffmpeg AUTO",
                     lambda: run_stoker(ds, work, pipe, args.threads, threads=0, thread_type="AUTO")),
                    (f"DataLoader+PyAV workers={args.threads}",
                     lambda: run_dataloader(paths, work, "pyav", args.threads)),
                ]
                if have_decord:
                    runs.append((f"DataLoader+decord workers={args.threads}",
                                 lambda: run_dataloader(paths, work, "decord", args.threads)))
                for label, fn in runs:
                    results.setdefault(f"{label} [{name}]", []).append(fn())
                    print(f"round {r} {label} [{name}]: {results[f'{label} [{name}]'][-1]}", file=sys.stderr)
    best = {k: max(v, key=lambda x: x["clips_per_s"]) for k, v in results.items()}
    startup = min(loader_startup(args.threads) for _ in range(3))
    print(f"\nclips of {SPEC.frames} frames, stride {SPEC.stride}, {SIZE}x{SIZE}; {args.videos} videos 10 s 25 fps "
          f"256x340 H.264; best of {args.rounds} rounds; keep: stored as generated (keyframe every 10 s, "
          f"{sizes['keep'] / 1e6:.1f} MB), kf1: re-encoded, keyframe every 1 s ({sizes['kf1'] / 1e6:.1f} MB); each DataLoader figure includes starting its workers once "
          f"({startup:.2f} s for trivial batches)\n")
    print("| pipeline | clips/s | CPU ms / clip | frames decoded / delivered | clips/s vs DataLoader+PyAV [keep] "
          "| CPU / clip vs DataLoader+PyAV [keep] |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = best[f"DataLoader+PyAV workers={args.threads} [keep]"]
    for k, v in best.items():
        waste = "n/a" if v["waste"] != v["waste"] else f"{v['waste']:.2f}"   # decord does not say
        print(f"| {k} | {v['clips_per_s']:.2f} | {v['cpu_ms_per_clip']:.0f} | {waste} | "
              f"{v['clips_per_s'] / base['clips_per_s']:.2f}x | {base['cpu_ms_per_clip'] / v['cpu_ms_per_clip']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"best": best, "rounds": results, "bytes": sizes,
                                         "loader_startup_s": startup}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
