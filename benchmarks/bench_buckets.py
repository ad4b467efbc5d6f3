"""Aspect-ratio buckets against the fixed-size pipeline on the same pack, same run, alternating.

    python benchmarks/bench_buckets.py CACHE_DIR [--data FOLDER] [--images 1000] [--rounds 5]
                                                [--batch-size 64] [--threads 2] [--size 224] [--json out.json]

CACHE_DIR keeps the generated ImageNet-like JPEGs (`stoker.tools.synth`), or with --data an image folder of
your own (real photographs: ../shared/corpora/realclasses.py builds one), and the packed copy. Two Loaders:

- `fixed`: RandomResizedCrop(size) + RandomHorizontalFlip, every batch size x size (a crop of 8% to 100%
  of the image: on average about half of it decoded, by the region decoder);
- `center`: Resize(size) + CenterCrop(size) + RandomHorizontalFlip, every batch size x size from the whole
  image, as a bucket's crop is (the baseline of equal decode work);
- `buckets`: Sampling(buckets=AspectBuckets(area=size * size, multiple=32)) + RandomHorizontalFlip, each
  batch one bucket of at most size * size pixels (equal output pixels per batch, within the buckets' rounding).

- `datago` (with --data, where `pip install datago` has installed it: Photoroom's Rust loader, the peer
  with aspect buckets): the same JPEG files read, decoded and resized to its aspect buckets of the same
  area (`crop_and_resize`, `default_image_size=size`, `downsampling_ratio=32`, aspects 1/4 to 4), one
  sample at a time as it hands them out (it batches nothing); skipped, saying why, where it is missing.

Each round is one whole epoch of each, the order alternating (forward, then reversed; one warm-up epoch of
each first). The report gives each pipeline's median images/s and output megapixels/s, the medians of the
per-round ratios buckets/fixed, and the Python calls per batch run by the Loader's own threads in this
process (`threading.setprofile` on every thread the Loader started: what a training loop beside it pays in
GIL), over one more epoch of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stoker import (AspectBuckets, CenterCrop, Loader, RandomHorizontalFlip, RandomResizedCrop, Resize, Sampling,
                    Workers)
from bench_outputs import packed   # the same packs as the output bench (run from benchmarks/ or as a script)


def _loader(kind: str, path: Path, args: argparse.Namespace) -> Loader:
    workers = Workers(num_threads=args.threads, prefetch=2)
    if kind == "fixed":
        return Loader(path, args.batch_size, transforms=[RandomResizedCrop(args.size), RandomHorizontalFlip()],
                      workers=workers, seed=1)
    if kind == "center":
        return Loader(path, args.batch_size, transforms=[Resize(args.size), CenterCrop(args.size),
                                                         RandomHorizontalFlip()], workers=workers, seed=1)
    buckets = AspectBuckets(area=args.size * args.size, multiple=32)
    return Loader(path, args.batch_size, transforms=[RandomHorizontalFlip()], workers=workers,
                  sampling=Sampling(buckets=buckets, seed=1))


def _epoch(loader: Loader) -> tuple[int, float, float]:
    """(images, output pixels, seconds) of one epoch; each batch's first pixel read, then dropped."""
    images = pixels = 0
    t0 = time.perf_counter()
    for batch in loader:
        x = batch[0]
        int(x[0, 0, 0, 0])
        images += x.shape[0]
        pixels += x.shape[0] * x.shape[2] * x.shape[3]
        del batch, x
    return images, pixels, time.perf_counter() - t0


def _datago_epoch(folder: Path, n: int, size: int) -> tuple[int, float, float]:
    """(images, output pixels, seconds) of `n` samples from datago over the image files of `folder`."""
    from datago import DatagoClient

    config = {"source_type": "file",
              "source_config": {"root_path": str(folder), "random_sampling": True, "rank": 0, "world_size": 1},
              "image_config": {"crop_and_resize": True, "default_image_size": size, "downsampling_ratio": 32,
                               "min_aspect_ratio": 0.25, "max_aspect_ratio": 4.0, "pre_encode_images": False},
              "limit": n, "samples_buffer_size": 64}
    t0 = time.perf_counter()
    client = DatagoClient(json.dumps(config))
    images = pixels = 0
    while images < n:
        sample = client.get_sample()
        if sample is None:
            break
        images += 1
        pixels += sample.image.height * sample.image.width
    return images, pixels, time.perf_counter() - t0


def _datago_missing() -> str | None:
    try:
        import datago  # noqa: F401
    except ImportError as exc:
        return f"datago is not installed ({exc}); pip install datago to measure it"
    return None


def _calls(loader: Loader) -> float:
    """Python calls per batch on the threads the Loader starts (all but this one), over one epoch."""
    counts = [0]
    main = threading.get_ident()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call") and threading.get_ident() != main:
            counts[0] += 1

    threading.setprofile(hook)
    try:
        it = iter(loader)   # its threads start here, with the hook installed
    finally:
        threading.setprofile(None)   # type: ignore[arg-type]
    n = sum(1 for _ in it)
    return counts[0] / max(n, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    path = packed(args.cache, args.images, args.data)
    kinds: tuple[str, ...] = ("fixed", "center", "buckets")
    loaders = {k: _loader(k, path, args) for k in kinds}
    missing = "it reads a folder of image files: pass --data" if args.data is None else _datago_missing()
    if missing is None:
        kinds += ("datago",)
        n_files = len(loaders["fixed"].dataset)
    else:
        print(f"datago: skipped: {missing}", file=sys.stderr)
    print("routes:", {k: str(ld.route) for k, ld in loaders.items()}, file=sys.stderr)
    def run(k: str) -> tuple[int, float, float]:
        return _datago_epoch(args.data, n_files, args.size) if k == "datago" else _epoch(loaders[k])

    for k in kinds:   # warm-up: page cache, allocations
        run(k)
    runs: dict[str, list[tuple[int, float, float]]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            runs[k].append(run(k))
    calls = {k: _calls(loaders[k]) for k in loaders}
    for ld in loaders.values():
        ld.close()
    rate = {k: [n / s for n, _, s in runs[k]] for k in kinds}
    mpix = {k: [p / s / 1e6 for _, p, s in runs[k]] for k in kinds}
    ratio = [b / f for b, f in zip(rate["buckets"], rate["fixed"])]
    pix_ratio = [b / f for b, f in zip(mpix["buckets"], mpix["fixed"])]
    peer = [b / d for b, d in zip(rate["buckets"], rate["datago"])] if "datago" in rate else None
    whole = [b / c for b, c in zip(rate["buckets"], rate["center"])]
    report = {"data": str(args.data or f"generated x{args.images}"), "batch_size": args.batch_size,
              "threads": args.threads, "size": args.size, "rounds": args.rounds,
              **{f"{k}_images_per_s": statistics.median(rate[k]) for k in kinds},
              **{f"{k}_mpixels_per_s": statistics.median(mpix[k]) for k in kinds},
              "images_ratio": statistics.median(ratio), "pixels_ratio": statistics.median(pix_ratio),
              "images_ratio_center": statistics.median(whole),
              **{f"{k}_python_calls_per_batch": calls[k] for k in calls},
              "buckets_vs_datago": None if peer is None else statistics.median(peer)}
    print(f"| pipeline | images/s | Mpixel/s | Python calls/batch |\n| --- | --- | --- | --- |")
    for k in kinds:
        print(f"| {k} | {report[f'{k}_images_per_s']:,.0f} | {report[f'{k}_mpixels_per_s']:,.1f} | "
              f"{calls[k]:,.0f} |" if k in calls else f"| {k} | {report[f'{k}_images_per_s']:,.0f} | "
              f"{report[f'{k}_mpixels_per_s']:,.1f} | (its own threads, not Python) |")
    print(f"buckets/fixed: images/s {report['images_ratio']:.3f}, pixels/s {report['pixels_ratio']:.3f} "
          f"(medians of {args.rounds} per-round ratios)")
    print(f"buckets/center: images/s {report['images_ratio_center']:.3f}")
    if peer is not None:
        print(f"buckets/datago: images/s {report['buckets_vs_datago']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
