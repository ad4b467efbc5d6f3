"""The pipelined GPU decode path measured on the CPU, with a stand-in decoder of fixed latency and rate.

    python benchmarks/bench_gpu_pipeline.py [--images 256] [--batch 16] [--latency-ms 100 200] [--rounds 3]
                                            [--json out.json]

No GPU involved: `stoker.tools.gpu_standin.FixedRateDecoder` blocks each call for its latency (GIL
released), as a library that decodes while it is called does, and the device side's resample and
convert run on the CPU. Two questions, each answered with figures measured in the same run:

1. **Overlap.** With a decoder of latency L per batch, device-side batches/s should approach
   1/max(L, R), R being the time of everything else per batch (measured in the same rounds with a
   decoder of zero latency: 1/R batches/s), not the serial 1/(L + R). Steady state: timed from the
   arrival of the third batch of an epoch to its last, after a warm-up epoch. Reported: batches/s, the ideal,
   overlap = measured / ideal (target >= 0.9), and the speed-up over the serial figure.
2. **Split.** decode="auto" with a stand-in decoder beside one worker thread: the GPU side of rate G and the CPU side of rate
   C img/s, each side's rate measured alone in the same setup (gpu_share=1, gpu_share=0; alternating
   rounds): the share of each batch given to the GPU should settle at G / (G + C) (target: within 10%).

Runs the Loader end to end (`DeviceOptions("cpu", decode="gpu" / "auto", gpu_decoder=...)`) on small
generated JPEGs (about 110 x 130 px, made in a temporary folder). torch runs one intra-op thread
(`torch.set_num_threads(1)`): on a small shared machine its thread pool otherwise stalls the small
ops of the resample by orders of magnitude. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("STOKER_NATIVE", "off")  # the CPU share of a split batch takes the per-row path: compare like with like

import numpy as np  # noqa: E402
import torch  # noqa: E402

import stoker  # noqa: E402
from stoker.codecs import encode_jpeg  # noqa: E402
from stoker.tools.gpu_standin import FixedRateDecoder  # noqa: E402
from stoker.tools.synth import synth_image  # noqa: E402
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop  # noqa: E402

OPS = [RandomResizedCrop(64), RandomHorizontalFlip()]


def make_dataset(root: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / "src" / f"c{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = int(rng.integers(96, 128)), int(rng.integers(112, 144))
        (folder / f"{i:05d}.jpg").write_bytes(encode_jpeg(synth_image(rng, h, w), quality=90))
    stoker.pack(str(root / "src"), str(root / "packed"), progress=False)
    return root / "packed"


def run(packed: Path, batch: int, device: stoker.DeviceOptions, threads: int) -> tuple[float, stoker.Loader]:
    """Steady-state batches/s of one epoch: from the arrival of batch 2 to the last (the pipeline's
    start and the first batches' ramp are not timed), after a warm-up epoch."""
    loader = stoker.Loader(packed, batch, transforms=OPS, seed=0, device=device,
                           workers=stoker.Workers(num_threads=threads))
    for _ in loader:
        pass
    stamps = [time.perf_counter() for _ in loader]
    loader.close()
    return (len(stamps) - 3) / (stamps[-1] - stamps[2]), loader


def overlap(packed: Path, batch: int, latencies: list[float], rounds: int) -> list[dict[str, Any]]:
    results = []
    for latency in latencies:
        rest, piped = [], []
        for _ in range(rounds):  # alternating: a change of machine load hits both
            rate0, _ = run(packed, batch, stoker.DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder()), 2)
            rest.append(rate0)
            rate, _ = run(packed, batch, stoker.DeviceOptions(
                "cpu", decode="gpu", gpu_decoder=FixedRateDecoder(latency_s=latency)), 2)
            piped.append(rate)
        r0, r = statistics.median(rest), statistics.median(piped)
        ideal = min(1 / latency, r0)
        serial = 1 / (latency + 1 / r0)
        results.append({"latency_ms": latency * 1e3, "rest_batches_per_s": r0, "batches_per_s": r,
                        "ideal_batches_per_s": ideal, "serial_batches_per_s": serial, "overlap": r / ideal,
                        "over_serial": r / serial})
    return results


def split(packed: Path, batch: int, rounds: int) -> list[dict[str, Any]]:
    """Each side's capacity measured alone in the split's own setup (gpu_share=1: the stand-in and the
    device side; gpu_share=0: the worker thread's per-row path), alternating with decode="auto"."""
    results = []
    for rate in (300.0, 150.0):
        gpu_alone, cpu_alone, shares = [], [], []
        for _ in range(rounds):
            g, _ = run(packed, batch, stoker.DeviceOptions("cpu", decode="auto", gpu_share=1.0,
                                                           gpu_decoder=FixedRateDecoder(images_per_s=rate)), 1)
            c, _ = run(packed, batch, stoker.DeviceOptions("cpu", decode="auto", gpu_share=0.0,
                                                           gpu_decoder=FixedRateDecoder(images_per_s=rate)), 1)
            _, loader = run(packed, batch, stoker.DeviceOptions("cpu", decode="auto",
                                                                gpu_decoder=FixedRateDecoder(images_per_s=rate)), 1)
            gpu_alone.append(g * batch)
            cpu_alone.append(c * batch)
            shares.append(loader.stats.gpu_share)
        gpu, cpu, got = statistics.median(gpu_alone), statistics.median(cpu_alone), statistics.median(shares)
        want = gpu / (gpu + cpu)
        results.append({"stand_in_img_per_s": rate, "gpu_alone_img_per_s": gpu, "cpu_alone_img_per_s": cpu,
                        "want_share": want, "share": got, "shares": shares, "error": abs(got - want) / want})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[100.0, 200.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        packed = make_dataset(Path(tmp), args.images)
        over = overlap(packed, args.batch, [ms / 1e3 for ms in args.latency_ms], args.rounds)
        shares = split(packed, args.batch, args.rounds)
    print(f"overlap ({args.images} images, batches of {args.batch}, 64 x 64, median of {args.rounds} alternating "
          f"rounds)")
    print("| decoder latency | rest alone | pipelined | ideal 1/max(L, R) | serial 1/(L + R) | overlap | vs serial |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in over:
        print(f"| {r['latency_ms']:.0f} ms | {r['rest_batches_per_s']:.1f}/s | {r['batches_per_s']:.1f}/s | "
              f"{r['ideal_batches_per_s']:.1f}/s | {r['serial_batches_per_s']:.1f}/s | {r['overlap']:.2f} | "
              f"{r['over_serial']:.2f}x |")
    print("\nsplit (decode='auto', one worker thread; each side alone: gpu_share=1 and gpu_share=0)")
    print("| stand-in rate | GPU side alone G | CPU side alone C | G/(G+C) | settled share | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in shares:
        print(f"| {r['stand_in_img_per_s']:.0f} img/s | {r['gpu_alone_img_per_s']:.0f} img/s | "
              f"{r['cpu_alone_img_per_s']:.0f} img/s | {r['want_share']:.2f} | {r['share']:.2f} | {r['error']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps({"overlap": over, "split": shares}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
