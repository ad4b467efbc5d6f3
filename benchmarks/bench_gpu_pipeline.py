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
2. **Split.** decode="auto" with a stand-in decoder beside one worker thread, against fixed shares
   (gpu_share= 0 ... 1, alternating rounds): images/s of each, where the automatic share settled, and
   each side's rate alone (G: gpu_share=1, C: gpu_share=0) with their ratio G / (G + C).

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

# the CPU share of a split batch takes the per-row path: compare like with like
os.environ.setdefault("STOKER_NATIVE", "off")

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


SHARES = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)


def split(packed: Path, batch: int, rounds: int, rate: float) -> dict[str, Any]:
    """decode="auto" against fixed shares (gpu_share=), alternating: images/s of each, and where the
    automatic split settled. Each side's rate alone is gpu_share=1 (the stand-in and the device side)
    and gpu_share=0 (the worker thread's per-row path)."""
    runs: dict[Any, list[float]] = {s: [] for s in (*SHARES, None)}
    settled, reasons = [], []
    for _ in range(rounds):
        for share in runs:
            r, loader = run(packed, batch, stoker.DeviceOptions(
                "cpu", decode="auto", gpu_share=share, gpu_decoder=FixedRateDecoder(images_per_s=rate)), 1)
            runs[share].append(r * batch)
            if share is None:
                settled.append(loader.stats.gpu_share)
                reasons.append(loader.stats.gpu_split)
    img_s = {("auto" if s is None else s): statistics.median(v) for s, v in runs.items()}
    g, c = img_s[1.0], img_s[0.0]
    best = max((v, s) for s, v in img_s.items() if s != "auto")
    return {"stand_in_img_per_s": rate, "img_per_s": img_s, "gpu_alone": g, "cpu_alone": c,
            "alone_ratio": g / (g + c), "settled": statistics.median(settled), "settled_all": settled,
            "reason": reasons[-1], "best_fixed": best[1], "auto_over_best": img_s["auto"] / best[0],
            "auto_over_cpu": img_s["auto"] / c}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[100.0, 200.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu-rate", type=float, default=300.0, help="the stand-in's images/s in the split runs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        packed = make_dataset(Path(tmp), args.images)
        over = overlap(packed, args.batch, [ms / 1e3 for ms in args.latency_ms], args.rounds)
        shares = split(packed, args.batch, args.rounds, args.gpu_rate)
    print(f"overlap ({args.images} images, batches of {args.batch}, 64 x 64, median of {args.rounds} alternating "
          f"rounds)")
    print("| decoder latency | rest alone | pipelined | ideal 1/max(L, R) | serial 1/(L + R) | overlap | vs serial |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in over:
        print(f"| {r['latency_ms']:.0f} ms | {r['rest_batches_per_s']:.1f}/s | {r['batches_per_s']:.1f}/s | "
              f"{r['ideal_batches_per_s']:.1f}/s | {r['serial_batches_per_s']:.1f}/s | {r['overlap']:.2f} | "
              f"{r['over_serial']:.2f}x |")
    sp = shares
    print(f"\nsplit (one worker thread, a stand-in of {sp['stand_in_img_per_s']:.0f} img/s; images/s, median of "
          f"{args.rounds} alternating rounds)")
    print("| gpu_share | " + " | ".join(str(k) for k in sp["img_per_s"]) + " |")
    print("| --- |" + " --- |" * len(sp["img_per_s"]))
    print("| img/s | " + " | ".join(f"{v:.0f}" for v in sp["img_per_s"].values()) + " |")
    print(f"auto settled at {sp['settled']:.2f} ({sp['reason']}); each side alone: G {sp['gpu_alone']:.0f}, "
          f"C {sp['cpu_alone']:.0f} img/s, G/(G+C) {sp['alone_ratio']:.2f}; auto {sp['auto_over_best']:.2f}x the "
          f"best fixed share ({sp['best_fixed']}), {sp['auto_over_cpu']:.2f}x the CPU alone")
    if args.json:
        args.json.write_text(json.dumps({"overlap": over, "split": shares}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
