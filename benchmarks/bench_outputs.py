"""Loader throughput of each output relative to the uint8 torch output on the same data, same run.

    python benchmarks/bench_outputs.py CACHE_DIR [--images 1000] [--data FOLDER [--raw-side N]] [--rounds 5]
                                                 [--batch-size 64] [--threads 2]
                                                 [--outputs torch,numpy] [--json out.json]

CACHE_DIR keeps the generated ImageNet-like JPEGs (`stoker.tools.synth`), or with --data an image folder
of your own (real photographs), and the packed copy. Outputs (`--outputs`, the first is the base):
`torch` (uint8, the default), `numpy` (`device="numpy"`), `float32` (float32 normalized NCHW on the CPU,
`device=DeviceOptions(device="cpu", normalize="imagenet")`: written by the engine's threads row by
row) and `float32-two-pass` (the same batches made as before the engine wrote floats: uint8 rows, then
one pass over the batch). Every Loader runs the same train transforms (RandomResizedCrop(224),
RandomHorizontalFlip) with the same seed, so they decode and augment the same crops; only the output
differs. Each round is one whole epoch of each, in alternating order (forward, then reversed, ...;
one warm-up epoch of each before). The report gives each output's median and best images/s, its
median CPU time per image (the whole process, all threads: what the output costs, and far less swayed
by other processes on a shared machine than the wall clock), and the medians of the per-round ratios
to the base (the epochs nearest in time).
The loop touches each batch's first pixel (what a training step that reads the batch costs at
least); the batch is dropped before the next, so the ring reuses its slots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

from stoker import DeviceOptions, Loader, RandomHorizontalFlip, RandomResizedCrop, pack
from stoker.loader import passes
from stoker.packing import PackOptions
from stoker.tools.synth import cached_imagenet_like

OUTPUTS = ("torch", "numpy", "float32", "float32-two-pass")


def packed(cache: Path, n: int, data: Path | None, raw_side: int | None = None) -> Path:
    """The pack the bench reads (made once in `cache`): of `data`, or of `n` generated ImageNet-like JPEGs;
    `raw_side`: stored as raw pixels, the longer side at most that (the decode-once path)."""
    out = cache / ((f"packed-{data.name}" if data is not None else f"packed-n{n}") +
                   (f"-raw{raw_side}" if raw_side else ""))
    options = PackOptions(encoding="raw", max_side=raw_side) if raw_side else PackOptions()
    if not (out / "stoker.json").exists():
        pack(data if data is not None else cached_imagenet_like(cache, n), out, options=options,
             progress=False)
    return out


def _device(output: str) -> Any:
    if output == "numpy":
        return "numpy"
    return DeviceOptions(device="cpu", normalize="imagenet") if output.startswith("float32") else None


@contextlib.contextmanager
def _two_pass(output: str) -> Iterator[None]:
    """float32-two-pass: the pass starts without the engine's float output (passes.float_out), so the
    engine writes uint8 rows and the device stage converts the whole batch after, as before it."""
    if output != "float32-two-pass":
        yield
        return
    fused, passes.float_out = passes.float_out, lambda spec, opts: None
    try:
        yield
    finally:
        passes.float_out = fused


def _epoch(loader: Loader, output: str) -> tuple[int, float, float]:
    """(images, wall seconds, process CPU seconds) of one epoch."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    with _two_pass(output):
        batches = iter(loader)
    for images, _ in batches:
        float(images[0, 0, 0, 0])
        n += images.shape[0]
    return n, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--data", type=Path, help="an image folder to pack and read instead of generated JPEGs")
    ap.add_argument("--raw-side", type=int, default=None, metavar="N",
                    help="pack raw pixels, the longer side at most N (the decode-once path) instead of the JPEGs")
    ap.add_argument("--outputs", default="torch,numpy", help=f"comma-separated, the first the base; of {OUTPUTS}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    outputs = tuple(o.strip() for o in args.outputs.split(",") if o.strip())
    if len(outputs) < 2 or len(set(outputs)) != len(outputs) or not set(outputs) <= set(OUTPUTS):
        ap.error(f"--outputs: two or more distinct outputs of {OUTPUTS}, got {args.outputs!r}")
    data = packed(args.cache, args.images, args.data, args.raw_side)
    transforms = [RandomResizedCrop(224), RandomHorizontalFlip()]
    loaders = {o: Loader(data, args.batch_size, transforms=transforms, seed=0, workers=args.threads,
                         device=_device(o))
               for o in outputs}
    rates: dict[str, list[float]] = {o: [] for o in outputs}
    cpu_ms: dict[str, list[float]] = {o: [] for o in outputs}   # CPU milliseconds per image
    try:
        for o in outputs:   # warm-up: page cache, the rings, the threads' first allocations
            _epoch(loaders[o], o)
        for k in range(args.rounds):
            for o in (outputs if k % 2 == 0 else outputs[::-1]):
                n, s, cpu = _epoch(loaders[o], o)
                rates[o].append(n / s)
                cpu_ms[o].append(1e3 * cpu / n)
    finally:
        for loader in loaders.values():
            loader.close()
    base = outputs[0]
    result: dict = {o: {"median": statistics.median(r), "best": max(r), "rounds": r,
                        "cpu_ms_per_image": statistics.median(cpu_ms[o]), "cpu_rounds": cpu_ms[o],
                        "ratio_rounds": statistics.median(a / b for a, b in zip(r, rates[base])),
                        "cpu_ratio_rounds": statistics.median(a / b for a, b in zip(cpu_ms[o], cpu_ms[base])),
                        "ratio_best": max(r) / max(rates[base])}
                    for o, r in rates.items()}
    result["settings"] = {"images": args.images, "data": str(args.data) if args.data else None,
                          "batch_size": args.batch_size, "threads": args.threads, "rounds": args.rounds,
                          "outputs": outputs}
    print(f"| output | median images/s | best images/s | CPU ms/image | images/s / {base} (median of rounds) "
          f"| CPU / {base} |\n|---|---|---|---|---|---|")
    for o in outputs:
        r = result[o]
        print(f"| {o} | {r['median']:,.0f} | {r['best']:,.0f} | {r['cpu_ms_per_image']:.2f} | "
              f"{r['ratio_rounds']:.3f} | {r['cpu_ratio_rounds']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
