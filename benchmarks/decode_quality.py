"""Each `Workers(decode_quality=...)` against torchvision's own pixels and against each other's speed.

    pip install -e ".[test-torchvision]"
    python benchmarks/decode_quality.py CACHE_DIR --data FOLDER [--sizes 64,128,224] [--images 300]
                                        [--rounds 3] [--threads 2] [--json out.json]

FOLDER is an ImageFolder of real photographs (../shared/corpora/realclasses.py builds one). For each output
size and each quality ("fast", "accurate", "exact"):

- agreement: Resize(size) + CenterCrop(size) (deterministic, so both sides crop the same window) by
  stoker on the packed folder, against torchvision's `transforms.v2.functional` on the same files as
  ImageFolder opens them (Pillow decode, `pil_to_tensor`, `resize(antialias=True)`, `center_crop`):
  the mean absolute difference in levels, the share of values within 1 and within 2 levels, the 99th
  percentile and the largest difference, over `--images` images;
- speed: one epoch of RandomResizedCrop(size) + RandomHorizontalFlip (the training pipeline) per
  quality and round, the order alternating, `--threads` worker threads, batch 64: images/s, and the
  median of the per-round ratios to "accurate".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench_outputs import packed
from stoker import CenterCrop, Loader, RandomHorizontalFlip, RandomResizedCrop, Resize, Workers
from stoker.tools.tvimport import import_torchvision

QUALITIES = ("fast", "accurate", "exact")


def agreement(path: Path, folder: Path, size: int, quality: str, n: int) -> dict[str, float]:
    """stoker's Resize + CenterCrop against torchvision's on the first `n` images of the pack."""
    tv = import_torchvision()
    if tv is None:
        raise SystemExit("torchvision does not import here: pip install -e '.[test-torchvision]'")
    from torchvision.transforms.v2 import functional as F

    diffs = []
    with Loader(path, 16, transforms=[Resize(size), CenterCrop(size)], order="sequential", device="numpy",
                workers=Workers(num_threads=2, decode_quality=quality)) as ld:
        seen = 0
        for x, _ in ld:
            for k in range(len(x)):
                if seen >= n:
                    break
                s = ld.dataset.sample(seen)
                img = Image.open(folder / s.key).convert("RGB") if (folder / s.key).is_file() else None
                if img is None:
                    raise SystemExit(f"{folder / s.key}: the pack's keys must be the files' paths under --data")
                ref = F.center_crop(F.resize(F.pil_to_tensor(img), [size], antialias=True), [size, size])
                diffs.append(np.abs(x[k].astype(np.int16) - ref.numpy().astype(np.int16)).reshape(-1))
                seen += 1
            if seen >= n:
                break
    d = np.concatenate(diffs)
    return {"mean_abs": float(d.mean()), "within_1": float((d <= 1).mean()), "within_2": float((d <= 2).mean()),
            "p99": float(np.percentile(d, 99)), "max": float(d.max()), "images": float(len(diffs))}


def speed(path: Path, size: int, rounds: int, threads: int) -> dict[str, float]:
    loaders = {q: Loader(path, 64, transforms=[RandomResizedCrop(size), RandomHorizontalFlip()], seed=2,
                         workers=Workers(num_threads=threads, decode_quality=q)) for q in QUALITIES}
    rate: dict[str, list[float]] = {q: [] for q in QUALITIES}
    try:
        for q in QUALITIES:   # warm-up
            sum(1 for _ in loaders[q])
        for r in range(rounds):
            for q in (QUALITIES if r % 2 == 0 else QUALITIES[::-1]):
                t0 = time.perf_counter()
                n = sum(len(x) for x, _ in loaders[q])
                rate[q].append(n / (time.perf_counter() - t0))
    finally:
        for ld in loaders.values():
            ld.close()
    out = {f"{q}_images_per_s": statistics.median(rate[q]) for q in QUALITIES}
    out.update({f"{q}_ratio": statistics.median(a / b for a, b in zip(rate[q], rate["accurate"])) for q in QUALITIES})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--sizes", default="64,128,224")
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    path = packed(args.cache, 0, args.data)
    report: dict = {"data": str(args.data), "images": args.images, "threads": args.threads}
    print("| size | quality | mean abs diff | within 1 | within 2 | p99 | max | images/s | ratio to accurate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in (int(v) for v in args.sizes.split(",")):
        fast = speed(path, size, args.rounds, args.threads)
        for q in QUALITIES:
            a = agreement(path, args.data, size, q, args.images)
            report[f"{size}-{q}"] = {**a, "images_per_s": fast[f"{q}_images_per_s"], "ratio": fast[f"{q}_ratio"]}
            print(f"| {size} | {q} | {a['mean_abs']:.2f} | {a['within_1']:.1%} | {a['within_2']:.1%} | {a['p99']:.0f} "
                  f"| {a['max']:.0f} | {fast[f'{q}_images_per_s']:,.0f} | {fast[f'{q}_ratio']:.2f} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
