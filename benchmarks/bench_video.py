"""Random video clips (16 frames, stride 4, RandomResizedCrop 224 + flip) on 2 cores: stoker's clip decode
on a thread pool (with and without FFmpeg's own frame threads) against a DataLoader whose workers decode
with PyAV from the start of the file to the clip (the common script) and one whose workers use decord, in
the same run, on the videos as stored and re-encoded with short keyframe intervals. The engine is
`stoker.tools.bench_video` (`stoker bench --video`); this script keeps the longer settings used for the
figures in docs/video.md. The stoker figure is the decode path on threads (what a Loader worker runs per
clip), without the Loader around it; `stoker demo --video` trains through the Loader.

    python benchmarks/bench_video.py CACHE_DIR [--data VIDEOS] [--videos 16] [--clips 48] [--rounds 3]
                                     [--threads 2] [--keyframes 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stoker.tools.bench_video import format_video_table, run_video_bench


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", type=Path, help="keeps the generated videos, packs and loose copies")
    p.add_argument("--data", type=Path, default=None, help="a folder of videos (default: generate Kinetics-like)")
    p.add_argument("--videos", type=int, default=16)
    p.add_argument("--clips", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keyframes", type=float, default=1.0, help="keyframe interval of the re-encode, seconds")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = run_video_bench(args.data, cache=args.cache, videos=args.videos, clips=args.clips, rounds=args.rounds,
                             threads=args.threads, keyframes=args.keyframes, progress=True)
    print(format_video_table(result))
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
