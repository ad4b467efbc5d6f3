"""Random video clips through stoker's clip decode and the common DataLoader scripts.

    python benchmarks/bench_video.py CACHE_DIR [--data VIDEOS|PACKED] [--videos 16] [--clips 48] [--rounds 3]
                                     [--threads 2] [--keyframes 1] [--json out.json]

Clips of 16 frames, stride 4, RandomResizedCrop 224 + flip into uint8 ``[16, 224, 224, 3]``, the same
clips (frames and crop planned once by :func:`stoker.loading.clips.plan_clip`) for every pipeline, on two
packs of the same videos: stored as they are (``keep``) and re-encoded with a keyframe every
``keyframes`` seconds (``kf``, ``stoker pack --video-keyframes``). Pipelines, alternating within each
round so that the machine's load falls on all of them alike:

- ``stoker pool=N``: :func:`~stoker.loading.clips.decode_clip_into` + :func:`~stoker.loading.clips.finish_clip`
  per clip on a pool of N threads into preallocated rows (the work a Loader thread runs per clip), FFmpeg's
  own threading off; ``pool=1`` shows how the pool scales;
- ``stoker pool=1 ffmpeg FRAME xN``: one clip at a time, FFmpeg's frame threads instead of the pool;
- ``stoker pool=N ffmpeg FRAME x2`` / ``AUTO``: both at once (do FFmpeg's threads help or fight the pool);
- ``DataLoader+PyAV``: N worker processes, each opening the file with PyAV, decoding from the first frame
  to the clip's last, cropping and resizing with torch's antialiased bilinear (the common script, as
  `stoker demo --video`'s baseline runs it: `stoker.tools.demo_video`);
- ``DataLoader+decord``: the same with decord's ``VideoReader.get_batch``, where decord imports.

Reported per pipeline: clips/s and CPU ms per clip (every thread, plus the DataLoader workers'
processes) of the best round, their product (cores busy: on a shared machine, the share each pipeline
got), and frames decoded per frame delivered (the waste; decord does not say). The stoker figure is
the decode path on threads, without the Loader around it; `stoker demo --video` trains through the
Loader. Results: docs/video.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stoker._progress import Progress
from stoker.errors import ConfigError, StokerError
from stoker.loading.clips import Clips, PyAVDecoder, decode_clip_into, finish_clip, plan_clip
from stoker.tools.demo_video import crop_resize_flip, pyav_from_start

__all__ = ["SIZE", "SPEC", "VideoBenchResult", "format_video_table", "run_video_bench"]

SPEC = Clips(frames=16, stride=4)
SIZE = 224
BASELINE = "DataLoader+PyAV"


@dataclass
class VideoBenchResult:
    """What one run measured. ``best``: ``"<pipeline> [<pack>]"`` -> the best
    round's ``clips_per_s``, ``cpu_ms_per_clip`` and ``waste`` (frames decoded per frame delivered, NaN
    where the decoder does not say); ``rounds``: every round; ``bytes``: each pack's video bytes."""

    settings: dict[str, Any]
    best: dict[str, dict[str, float]] = field(default_factory=dict)
    rounds: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    loader_startup_s: float = float("nan")
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=float).replace("NaN", "null"))


def prepare(cache: Path, data: Path | None, videos: int, keyframes: float,
            threads: int) -> dict[str, tuple[Path, list[Path]]]:
    """Both packs (``keep``: the videos as they are; ``kf<keyframes>``: re-encoded) and each pack's videos
    as loose files (what the DataLoader baselines open), cached under ``cache`` for the next run.
    ``data``: a folder of videos, a packed dataset (measured as it is; its videos are re-encoded for the
    second pack), or None: ``videos`` generated Kinetics-like videos."""
    import stoker
    from stoker.packing import PackOptions, pack
    from stoker.shards import MANIFEST_NAME
    from stoker.tools.synth_video import VideoStyle, make_kinetics_like

    if data is None:
        data = cache / f"kinetics-{videos}"
        if not data.exists():
            make_kinetics_like(data, max(1, videos // 4), classes=4, style=VideoStyle())
    data = Path(data)
    tag = data.name if data.parent == cache else \
        f"{data.name}-{hashlib.sha1(str(data.resolve()).encode()).hexdigest()[:8]}"   # two folders, two caches
    kf = f"kf{keyframes:g}"
    given = (data / MANIFEST_NAME).is_file()
    keep, files = (data if given else cache / f"packed-{tag}-keep"), cache / f"packed-{tag}-keep-files"
    if not given:
        pack(data, keep, options=PackOptions(workers=threads), resume=keep.exists(), progress=False)
    out: dict[str, tuple[Path, list[Path]]] = {}
    with stoker.open_dataset(keep) as ds:
        out["keep"] = (keep, _loose(ds, files))
    reencoded = cache / f"packed-{tag}-{kf}"
    # a given pack's videos, written out just above, are the source of its re-encode
    pack(files if given else data, reencoded, options=PackOptions(workers=threads, video_keyframes=keyframes),
         resume=reencoded.exists(), progress=False)
    with stoker.open_dataset(reencoded) as ds:
        out[kf] = (reencoded, _loose(ds, cache / f"packed-{tag}-{kf}-files"))
    return out


def _loose(ds: Any, dest: Path) -> list[Path]:
    """The pack's videos written out as files (once), in sample order."""
    paths = [dest / f"{i:06d}{Path(ds.sample(i).key).suffix or '.mp4'}" for i in range(len(ds))]
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(paths):
            (tmp / p.name).write_bytes(bytes(ds.sample(i).data))
        tmp.rename(dest)
    return paths


def _plans(ds: Any, clips: int, epoch: int, pipe: Any) -> list[tuple[int, Any]]:
    from stoker.video import VIDEO_INDEX_COLUMN, VideoIndex
    out = []
    for j in range(clips):
        i = j % len(ds)
        index = VideoIndex.from_json(ds.extra(i, VIDEO_INDEX_COLUMN))
        out.append((i, plan_clip(index, SPEC, pipe, seed=0, epoch=epoch, sample=i, clip=j // len(ds))))
    return out


def run_stoker(ds: Any, work: list[tuple[int, Any]], pipe: Any, pool_size: int,
               decoder: PyAVDecoder) -> dict[str, float]:
    """The clips on a pool of ``pool_size`` threads, into a ring of preallocated rows."""
    from stoker.video import VIDEO_INDEX_COLUMN, VideoIndex
    indexes = {i: VideoIndex.from_json(ds.extra(i, VIDEO_INDEX_COLUMN)) for i, _ in work}
    rows = np.empty((pool_size * 2, SPEC.frames, SIZE, SIZE, 3), np.uint8)   # stands in for a slot ring

    def one(job: tuple[int, tuple[int, Any]]) -> tuple[int, int]:
        k, (i, plan) = job
        s = ds.sample(i)
        dst = rows[k % len(rows)]
        st = decode_clip_into(s.data, indexes[i], plan.frames, dst, plan.box, plan.flip, key=s.key, decoder=decoder)
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
        i, plan = self.work[j]
        frames = plan.frames.tolist()
        if self.reader == "pyav":
            import av
            with av.open(str(self.paths[i])) as container:
                clip, decoded = pyav_from_start(container, frames)
        else:
            import decord
            vr = decord.VideoReader(str(self.paths[i]), num_threads=1)
            clip, decoded = vr.get_batch(frames).asnumpy(), -1
        box = tuple(int(round(v)) for v in plan.box)
        return crop_resize_flip(clip, box, SIZE, bool(plan.flip)), decoded


def run_dataloader(paths: list[Path], work: list[tuple[int, Any]], reader: str, workers: int) -> dict[str, float]:
    from torch.utils.data import DataLoader
    loader = DataLoader(_ClipSet(paths, work, reader), batch_size=4, num_workers=workers, timeout=600)

    def go() -> list[tuple[int, int]]:
        return [(int(d), SPEC.frames) for _, decoded in loader for d in decoded]
    return _timed(go, len(work))


def loader_startup(workers: int) -> float:
    """Seconds a DataLoader with this many workers takes to deliver trivial batches: the start-up cost
    inside each DataLoader figure (paid once per epoch in training)."""
    from torch.utils.data import DataLoader
    started = time.perf_counter()
    for _ in DataLoader(list(range(2 * workers)), batch_size=1, num_workers=workers, timeout=60):
        pass
    return time.perf_counter() - started


def _timed(fn: Callable[[], list[tuple[int, int]]], clips: int) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    child = os.times()   # the DataLoader's workers, once they exit and are reaped (0 on Windows)
    counts = fn()
    child_after = os.times()
    cpu = time.process_time() - cpu + (child_after.children_user + child_after.children_system
                                       - child.children_user - child.children_system)
    wall = time.perf_counter() - wall
    known = all(d >= 0 for d, _ in counts)
    waste = sum(d for d, _ in counts) / sum(n for _, n in counts) if known else float("nan")
    return {"clips_per_s": clips / wall, "cpu_ms_per_clip": 1000 * cpu / clips, "waste": waste}


def _pipelines(threads: int, ffmpeg: bool) -> list[tuple[str, int, PyAVDecoder | None]]:
    """(label, pool threads or DataLoader workers, the stoker decoder or None for a DataLoader)."""
    out: list[tuple[str, int, PyAVDecoder | None]] = [(f"stoker pool={threads}", threads, PyAVDecoder())]
    if ffmpeg:
        out += [("stoker pool=1", 1, PyAVDecoder()),
                (f"stoker pool=1 ffmpeg FRAME x{threads}", 1, PyAVDecoder(threads=threads, thread_type="FRAME")),
                (f"stoker pool={threads} ffmpeg FRAME x2", threads, PyAVDecoder(threads=2, thread_type="FRAME")),
                (f"stoker pool={threads} ffmpeg AUTO", threads, PyAVDecoder(threads=0, thread_type="AUTO"))]
    out = list({label: (label, n, d) for label, n, d in out}.values())   # threads=1: pool=1 once
    return out + [(f"{BASELINE} workers={threads}", threads, None)]


def run_video_bench(data: Path | None = None, *, cache: Path, videos: int = 8, clips: int = 24, rounds: int = 2,
                    threads: int = 2, keyframes: float = 1.0, ffmpeg: bool = True, decord: bool = True,
                    progress: bool = False) -> VideoBenchResult:
    """Measure random clips through each pipeline on both packs, ``rounds`` rounds of ``clips`` clips
    (best round kept). ``data``: a folder of videos (anything ``stoker pack`` reads) or a packed dataset
    of videos (measured as it is, and re-encoded for the second pack); None generates ``videos``
    Kinetics-like ones (10 s, 25 fps, 256x340, H.264, a keyframe every 10 s). ``cache``
    keeps the videos, packs and loose copies for the next run. ``ffmpeg``: also run the FFmpeg threading
    variants; ``decord``: the decord DataLoader where decord imports."""
    import stoker
    from stoker.transforms import Pipeline, RandomHorizontalFlip, RandomResizedCrop

    for name, value in (("videos", videos), ("clips", clips), ("rounds", rounds), ("threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected a positive integer")
    if not keyframes > 0:
        raise ConfigError(f"keyframes={keyframes!r}: expected seconds between keyframes of the re-encode, > 0")
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline([RandomResizedCrop(SIZE), RandomHorizontalFlip()])
    result = VideoBenchResult(settings={"frames": SPEC.frames, "stride": SPEC.stride, "size": SIZE, "clips": clips,
                                        "rounds": rounds, "threads": threads, "keyframes": keyframes,
                                        "data": str(data) if data else f"generated: {videos} videos"})
    runs = _pipelines(threads, ffmpeg)
    if decord:
        try:
            import decord as _decord  # noqa: F401
            runs.append((f"DataLoader+decord workers={threads}", threads, None))
        except ImportError:
            result.skipped["DataLoader+decord"] = "decord does not import (pip install decord)"
    with Progress("bench_video", rounds * 2 * len(runs), unit="run", enabled=progress) as bar:
        bar.stage("preparing the videos and their two packs (cached for the next run)")
        packs = prepare(cache, data, videos, keyframes, threads)
        datasets = {name: stoker.open_dataset(path) for name, (path, _) in packs.items()}
        try:
            loose = {name: files for name, (_, files) in packs.items()}
            result.bytes = {name: int(np.sum(ds.sizes)) for name, ds in datasets.items()}
            for r in range(rounds):
                for name, ds in datasets.items():
                    work = _plans(ds, clips, r, pipe)
                    for label, n, decoder in runs:
                        if decoder is not None:
                            m = run_stoker(ds, work, pipe, n, decoder)
                        else:
                            m = run_dataloader(loose[name], work, "decord" if "decord" in label else "pyav", n)
                        result.rounds.setdefault(f"{label} [{name}]", []).append(m)
                        bar.update()
        finally:
            for ds in datasets.values():
                ds.close()
    result.best = {k: max(v, key=lambda x: x["clips_per_s"]) for k, v in result.rounds.items()}
    result.loader_startup_s = min(loader_startup(threads) for _ in range(2))
    return result


def format_video_table(result: VideoBenchResult) -> str:
    """A markdown table: each pipeline's best round, ratios against the PyAV DataLoader on the stored videos."""
    s = result.settings
    packs = list(result.bytes)
    base = next(v for k, v in result.best.items() if k.startswith(BASELINE) and k.endswith(f"[{packs[0]}]"))
    lines = [f"clips of {s['frames']} frames, stride {s['stride']}, {s['size']}x{s['size']}, {s['clips']} clips per "
             f"round, best of {s['rounds']} rounds, {s['threads']} threads/workers; data: {s['data']}; "
             f"{packs[0]}: the videos as stored ({result.bytes[packs[0]] / 1e6:.1f} MB), {packs[1]}: re-encoded "
             f"with a keyframe every {s['keyframes']:g} s ({result.bytes[packs[1]] / 1e6:.1f} MB); each DataLoader "
             f"figure includes starting its workers ({result.loader_startup_s:.2f} s for trivial batches)", "",
             f"| pipeline | clips/s | CPU ms / clip | cores busy | frames decoded / delivered | clips/s vs {BASELINE} "
             f"[{packs[0]}] | CPU / clip vs {BASELINE} [{packs[0]}] |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, v in result.best.items():
        waste = "n/a" if v["waste"] != v["waste"] else f"{v['waste']:.2f}"
        cores = v["clips_per_s"] * v["cpu_ms_per_clip"] / 1000   # CPU seconds per second: the share it got
        lines.append(f"| {k} | {v['clips_per_s']:.2f} | {v['cpu_ms_per_clip']:.0f} | {cores:.2f} | {waste} | "
                     f"{v['clips_per_s'] / base['clips_per_s']:.2f}x | "
                     f"{base['cpu_ms_per_clip'] / v['cpu_ms_per_clip']:.2f}x |")
    lines += [f"| {k} | skipped: {why} | | | | | |" for k, why in result.skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_video.py", description=__doc__.split("\n\n")[0])
    p.add_argument("cache", type=Path, help="keeps the generated videos, packs and loose copies")
    p.add_argument("--data", type=Path, default=None,
                   help="a folder of videos or a packed dataset of them (default: generate Kinetics-like)")
    p.add_argument("--videos", type=int, default=16, help="videos to generate (default 16)")
    p.add_argument("--clips", type=int, default=48, help="clips per round and pack (default 48)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the best kept (default 3)")
    p.add_argument("--threads", type=int, default=2, help="stoker's pool threads and the DataLoaders' workers")
    p.add_argument("--keyframes", type=float, default=1.0, help="keyframe interval of the re-encode, seconds")
    p.add_argument("--json", type=Path, default=None, help="also write the result as JSON to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    args = p.parse_args(argv)
    try:
        result = run_video_bench(args.data, cache=args.cache, videos=args.videos, clips=args.clips,
                                 rounds=args.rounds, threads=args.threads, keyframes=args.keyframes,
                                 progress=not args.quiet)
    except StokerError as exc:
        p.error(str(exc))
    print(format_video_table(result))
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
