"""NumPy-output Loader throughput relative to the torch-output Loader on the same data, same run.

    python benchmarks/bench_outputs.py CACHE_DIR [--images 1000] [--rounds 5] [--batch-size 64]
                                                 [--threads 2] [--json out.json]

CACHE_DIR keeps the generated ImageNet-like JPEGs (`stoker.tools.synth`) and their packed copy. Both
Loaders run the same train transforms (RandomResizedCrop(224), RandomHorizontalFlip) with the same
seed, so they decode and augment the same crops; only the output type differs. Each round is one
whole epoch of each, in alternating order (torch first, then numpy first, ...; one warm-up epoch of
each before). The report gives each output's median and best images/s, its median CPU time per
image (the whole process, all threads: what the output costs, and far less swayed by other processes
on a shared machine than the wall clock), and the medians of the per-round ratios numpy / torch (the
pair of epochs nearest in time).
The loop touches each batch's first pixel (what a training step that reads the batch costs at
least); the batch is dropped before the next, so the ring reuses its slots.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from stoker import Loader, RandomHorizontalFlip, RandomResizedCrop, pack
from stoker.packing import PackOptions
from stoker.tools.synth import cached_imagenet_like

OUTPUTS = ("torch", "numpy")


def _packed(cache: Path, n: int) -> Path:
    out = cache / f"packed-n{n}"
    if not (out / "stoker.json").exists():
        pack(cached_imagenet_like(cache, n), out, options=PackOptions(), progress=False)
    return out


def _epoch(loader: Loader) -> tuple[int, float, float]:
    """(images, wall seconds, process CPU seconds) of one epoch."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for images, _ in loader:
        int(images[0, 0, 0, 0])
        n += images.shape[0]
    return n, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    data = _packed(args.cache, args.images)
    transforms = [RandomResizedCrop(224), RandomHorizontalFlip()]
    loaders = {o: Loader(data, args.batch_size, transforms=transforms, seed=0, workers=args.threads,
                         device="numpy" if o == "numpy" else None)
               for o in OUTPUTS}
    rates: dict[str, list[float]] = {o: [] for o in OUTPUTS}
    cpu_ms: dict[str, list[float]] = {o: [] for o in OUTPUTS}   # CPU milliseconds per image
    try:
        for o in OUTPUTS:   # warm-up: page cache, the rings, the threads' first allocations
            _epoch(loaders[o])
        for k in range(args.rounds):
            for o in (OUTPUTS if k % 2 == 0 else OUTPUTS[::-1]):
                n, s, cpu = _epoch(loaders[o])
                rates[o].append(n / s)
                cpu_ms[o].append(1e3 * cpu / n)
    finally:
        for loader in loaders.values():
            loader.close()
    result: dict = {o: {"median": statistics.median(r), "best": max(r), "rounds": r,
                        "cpu_ms_per_image": statistics.median(cpu_ms[o]), "cpu_rounds": cpu_ms[o]}
                    for o, r in rates.items()}
    result["ratio_rounds"] = statistics.median(a / b for a, b in zip(rates["numpy"], rates["torch"]))
    result["cpu_ratio_rounds"] = statistics.median(a / b for a, b in zip(cpu_ms["numpy"], cpu_ms["torch"]))
    result["ratio_best"] = result["numpy"]["best"] / result["torch"]["best"]
    result["settings"] = {"images": args.images, "batch_size": args.batch_size, "threads": args.threads,
                          "rounds": args.rounds}
    print("| output | median images/s | best images/s | CPU ms/image |\n|---|---|---|---|")
    for o in OUTPUTS:
        r = result[o]
        print(f"| {o} | {r['median']:,.0f} | {r['best']:,.0f} | {r['cpu_ms_per_image']:.2f} |")
    print(f"numpy / torch images/s: {result['ratio_rounds']:.3f} (median of the rounds' ratios), "
          f"{result['ratio_best']:.3f} (best rounds); CPU per image: {result['cpu_ratio_rounds']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
