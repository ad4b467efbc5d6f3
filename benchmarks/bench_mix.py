"""What a Mix and a pack function cost, as ratios measured in one run, alternating.

    python benchmarks/bench_mix.py WORKDIR [--images 600] [--rounds 3]

1. Loading: one epoch of `Loader(Mix({"a": half_a, "b": half_b}))` against `Loader(whole)` (the same
   images packed as one dataset), same transforms, threads and batch size: images/s of each, and the
   mix's over the single pack's.
2. Packing: `pack(..., PackOptions(map=fn))` with a function that returns the sample untouched (no
   decode: a plain JPEG keeps its bytes), and with one that reads and sets the pixels (a flip),
   against the same pack without a function.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import stoker
from stoker.tools.synth import make_imagenet_like


def untouched(sample):
    return sample


def flipped(sample):
    return sample.replace(image=sample.image[:, ::-1])


def _epoch(source, workers: int) -> float:
    loader = stoker.Loader(source, 64, transforms=[stoker.RandomResizedCrop(160), stoker.RandomHorizontalFlip()],
                           workers=workers, seed=1)
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in loader)
    seconds = time.perf_counter() - t0
    loader.close()
    return n / seconds


def _pack(src: Path, out: Path, fn) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    summary = stoker.pack(src, out, options=stoker.PackOptions(workers=2, map=fn), progress=False)
    return summary.packed / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    root = args.workdir
    imgs = root / "imgs"
    if not imgs.exists():
        make_imagenet_like(imgs, args.images, classes=4, seed=0, workers=2)
    classes = sorted(p.name for p in imgs.iterdir())
    for name, picked in (("a", classes[:2]), ("b", classes[2:])):   # two halves, by class
        if not (root / name).exists():
            (root / f"{name}-imgs").mkdir(exist_ok=True)
            for c in picked:
                if not (root / f"{name}-imgs" / c).exists():
                    (root / f"{name}-imgs" / c).symlink_to((imgs / c).resolve())
            stoker.pack(root / f"{name}-imgs", root / name, progress=False)
    if not (root / "whole").exists():
        stoker.pack(imgs, root / "whole", progress=False)
    mix = stoker.Mix({"a": str(root / "a"), "b": str(root / "b")})
    load = {"single": [], "mix": []}
    packs = {"no map": [], "map untouched": [], "map flips pixels": []}
    for _ in range(args.rounds):
        load["single"].append(_epoch(root / "whole", args.workers))
        load["mix"].append(_epoch(mix, args.workers))
        packs["no map"].append(_pack(imgs, root / "out", None))
        packs["map untouched"].append(_pack(imgs, root / "out", untouched))
        packs["map flips pixels"].append(_pack(imgs, root / "out", flipped))
    for title, runs, base in (("load", load, "single"), ("pack", packs, "no map")):
        ref = statistics.median(runs[base])
        for name, rates in runs.items():
            med = statistics.median(rates)
            print(f"{title:5s} {name:18s} {med:8.0f} images/s (median of {len(rates)}), x{med / ref:.2f} {base}")


if __name__ == "__main__":
    main()
