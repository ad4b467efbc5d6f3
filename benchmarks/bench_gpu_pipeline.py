"""The pipelined GPU decode path measured on the CPU, with a stand-in decoder of fixed latency and rate.

    python benchmarks/bench_gpu_pipeline.py [--images 256] [--batch 16] [--latency-ms 100 200] [--rounds 3]
                                            [--only overlap split calls] [--json out.json]
    STOKER_NATIVE=off python benchmarks/bench_gpu_pipeline.py --only split    # a slower CPU side

No GPU involved: `tests/gpu_standin.py`'s `FixedRateDecoder` blocks each call for its latency (GIL
released), as a library that decodes while it is called does, and the device side's resample and
convert run on the CPU. Two questions, each answered with figures measured in the same run:

1. **Overlap.** With a decoder of latency L per batch, device-side batches/s should approach
   1/max(L, R), R being the time of everything else per batch (measured in the same rounds with a
   decoder of zero latency: 1/R batches/s), not the serial 1/(L + R). Steady state: timed from the
   arrival of the third batch of an epoch to its last, after a warm-up epoch. Reported: batches/s, the ideal,
   overlap = measured / ideal (target >= 0.9), and the speed-up over the serial figure.
2. **Split.** decode="auto" with a stand-in decoder beside one worker thread, against fixed shares
   (gpu_share= 0 ... 1, alternating rounds): images/s of each, where the automatic share settled (at
   the end, and its mean over the timed epoch), the two sides' rates as the controller measured them
   beside each other, and each side's rate alone (G: gpu_share=1, C: gpu_share=0) with their ratio
   G / (G + C); and the automatic split kept (its probe windows off, so it never falls back to the
   CPU alone): the mean share it hands out against G / (G + C). Each split run is four epochs on one Loader (the controller learns across them), the
   last one timed. The CPU rows take the native batch engine; under `STOKER_NATIVE=off` (read at
   import) they take the per-row path with torch's resize, a CPU side slow enough that a stand-in of
   300 img/s adds capacity on a 2-core machine.
3. **Calls.** Python calls per batch on the worker (or coordinator) threads for a split batch, the
   CPU share through the engine against the per-row path (`STOKER_ENGINE=off`), at gpu_share=0 and
   0.5, and for decode="gpu"; the GPU's rows prepared a chunk at a time (`Filler.queue_gpu_rows`)
   against one at a time (the path before it); beside them, the device thread's and the decode
   thread's (the stand-in's own work inside its `decode` not counted): each Python call needs the
   GIL the training loop's thread wants.

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

import threading

import numpy as np
import torch

import stoker
from stoker import native
from stoker.codecs import encode_jpeg
from stoker.device.gpu_split import SplitControl
from stoker.tools.synth import synth_image
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gpu_standin import FixedRateDecoder  # noqa: E402 (tests/gpu_standin.py: the tests' stand-in decoder)

OPS = [RandomResizedCrop(64), RandomHorizontalFlip()]
STANDIN_DECODE = FixedRateDecoder.decode.__code__


def make_dataset(root: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / "src" / f"c{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = int(rng.integers(96, 128)), int(rng.integers(112, 144))
        (folder / f"{i:05d}.jpg").write_bytes(encode_jpeg(synth_image(rng, h, w), quality=90))
    stoker.pack(str(root / "src"), str(root / "packed"), progress=False)
    return root / "packed"


def run(packed: Path, batch: int, device: stoker.DeviceOptions, threads: int, warm: int = 1,
        shares: list | None = None, kept: bool = False) -> tuple[float, stoker.Loader]:
    """Steady-state batches/s of one epoch: from the arrival of batch 2 to the last (the pipeline's
    start and the first batches' ramp are not timed), after `warm` warm-up epochs. `shares`: gets the
    settled GPU share after each timed batch. `kept`: the automatic split without its probe windows
    (it never tries the CPU alone), so the balance is measured alone."""
    loader = stoker.Loader(packed, batch, transforms=OPS, seed=0, device=device,
                           workers=stoker.Workers(num_threads=threads))
    if kept:
        loader._passes._split = SplitControl(threads, None, probe_every=1 << 30, warmup=1 << 30)
    for _ in range(warm):
        for _ in loader:
            pass
    stamps = []
    for _ in loader:
        stamps.append(time.perf_counter())
        if shares is not None:
            shares.append(loader.stats.gpu_share)
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
    runs: dict[Any, list[float]] = {s: [] for s in (*SHARES, None, "kept")}
    settled, means, beside, reasons, balance = [], [], [], [], []
    for _ in range(rounds):
        for share in runs:
            seen: list[float] = []
            r, loader = run(packed, batch, stoker.DeviceOptions(
                "cpu", decode="auto", gpu_share=None if share == "kept" else share,
                gpu_decoder=FixedRateDecoder(images_per_s=rate)), 1, warm=3, shares=seen, kept=share == "kept")
            runs[share].append(r * batch)
            if share == "kept":
                balance.append(statistics.fmean(seen))
            if share is None:
                ctrl = loader._passes._split   # the controller's own view: both sides' rates beside each other
                settled.append(loader.stats.gpu_share)
                means.append(statistics.fmean(seen))
                beside.append((ctrl.gpu_rate or 0.0, ctrl.cpu_rate or 0.0, ctrl.balanced))
                reasons.append(loader.stats.gpu_split)
    img_s = {("auto" if s is None else s): statistics.median(v) for s, v in runs.items()}
    g, c = img_s[1.0], img_s[0.0]
    best = max((v, s) for s, v in img_s.items() if s not in ("auto", "kept"))
    return {"stand_in_img_per_s": rate, "img_per_s": img_s, "gpu_alone": g, "cpu_alone": c,
            "alone_ratio": g / (g + c), "settled": statistics.median(settled), "settled_all": settled,
            "kept_share": statistics.median(balance), "kept_share_all": balance,
            "mean_settled": statistics.median(means), "mean_settled_all": means, "beside": beside,
            "reason": reasons[-1], "best_fixed": best[1], "auto_over_best": img_s["auto"] / best[0],
            "auto_over_cpu": img_s["auto"] / c, "cpu_path": "engine" if native.ON else "per-row (STOKER_NATIVE=off)"}


def _per_row_gpu(self: Any, plan: Any, r0: int, r1: int, slot: Any, scratch: dict, times: Any) -> list:
    """The GPU's rows one at a time (`Filler.queue_gpu` per row): the path before `queue_gpu_rows`."""
    return self.fill_rows(plan, range(r0, r1), slot, scratch, times)


def calls(packed: Path, batch: int, rounds: int) -> dict[str, float]:
    """Python calls per batch on the worker / coordinator threads (`threading.setprofile`, the threads
    named stoker-worker-*; the device thread's and the decode thread's beside them, keys ending
    " [device thread]" and " [decode thread]", the stand-in decoder's own calls inside its `decode` not
    counted, one call each): a split
    batch's CPU share through the engine and through the per-row path (STOKER_ENGINE=off), at
    gpu_share 0, 0.5 and 1 (decode="gpu"); the GPU's rows a chunk at a time (`Filler.queue_gpu_rows`)
    and, for comparison, one at a time as before it. Medians of `rounds` alternating runs of one epoch."""
    from stoker.loading.render import Filler

    out: dict[str, list[float]] = {}
    chunked = Filler.queue_gpu_rows
    for _ in range(rounds):
        for engine_on, share, gpu_rows in ((True, 0.0, "chunk"), (True, 0.5, "chunk"), (True, 0.5, "per-row"),
                                           (False, 0.0, "chunk"), (False, 0.5, "chunk"), (False, 0.5, "per-row"),
                                           (True, 1.0, "chunk"), (True, 1.0, "per-row")):
            counts: dict[int, int] = {}
            device: dict[int, int] = {}
            decoding: dict[int, int] = {}
            inside: list[Any] = [None]  # the stand-in's decode frame while the decode thread is in it

            def hook(frame: Any, event: str, arg: Any) -> None:
                name = threading.current_thread().name
                if name == "stoker-decode":   # the decoder's own work (the stand-in's header parse) not counted
                    if inside[0] is not None:
                        if event == "return" and frame is inside[0]:
                            inside[0] = None
                        return
                    if event == "call" and frame.f_code is STANDIN_DECODE:
                        inside[0] = frame
                if event in ("call", "c_call"):
                    into = (counts if name.startswith("stoker-worker") else device if name == "stoker-device"
                            else decoding if name == "stoker-decode" else None)
                    if into is not None:
                        ident = threading.get_ident()
                        into[ident] = into.get(ident, 0) + 1

            if engine_on:
                os.environ.pop("STOKER_ENGINE", None)
            else:
                os.environ["STOKER_ENGINE"] = "off"
            Filler.queue_gpu_rows = chunked if gpu_rows == "chunk" else _per_row_gpu  # type: ignore[method-assign]
            decode = "gpu" if share == 1.0 else "auto"
            loader = stoker.Loader(packed, batch, transforms=OPS, seed=0, workers=stoker.Workers(num_threads=2),
                                   device=stoker.DeviceOptions("cpu", decode=decode,
                                                               gpu_share=None if share == 1.0 else share,
                                                               gpu_decoder=FixedRateDecoder()))
            threading.setprofile(hook)
            try:
                it = iter(loader)
            finally:
                threading.setprofile(None)  # type: ignore[arg-type]
            n = sum(1 for _ in it)
            loader.close()
            Filler.queue_gpu_rows = chunked  # type: ignore[method-assign]
            cpu = "CPU rows: engine" if engine_on else "CPU rows: per-row"
            key = (f"decode='gpu', GPU rows: {gpu_rows}" if share == 1.0 else
                   f"{cpu}, gpu_share={share}" + (f", GPU rows: {gpu_rows}" if share else ""))
            out.setdefault(key, []).append(sum(counts.values()) / n)
            out.setdefault(key + " [device thread]", []).append(sum(device.values()) / n)
            out.setdefault(key + " [decode thread]", []).append(sum(decoding.values()) / n)
    os.environ.pop("STOKER_ENGINE", None)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[100.0, 200.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu-rate", type=float, default=300.0, help="the stand-in's images/s in the split runs")
    ap.add_argument("--only", nargs="+", choices=("overlap", "split", "calls"), default=("overlap", "split", "calls"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        packed = make_dataset(Path(tmp), args.images)
        if "overlap" in args.only:
            out["overlap"] = overlap(packed, args.batch, [ms / 1e3 for ms in args.latency_ms], args.rounds)
        if "split" in args.only:
            out["split"] = split(packed, args.batch, args.rounds, args.gpu_rate)
        if "calls" in args.only and native.ON:
            out["calls"] = calls(packed, 64, args.rounds)
    if "overlap" in out:
        print(f"overlap ({args.images} images, batches of {args.batch}, 64 x 64, median of {args.rounds} "
              f"alternating rounds)")
        print("| decoder latency | rest alone | pipelined | ideal 1/max(L, R) | serial 1/(L + R) | overlap | vs serial |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in out["overlap"]:
            print(f"| {r['latency_ms']:.0f} ms | {r['rest_batches_per_s']:.1f}/s | {r['batches_per_s']:.1f}/s | "
                  f"{r['ideal_batches_per_s']:.1f}/s | {r['serial_batches_per_s']:.1f}/s | {r['overlap']:.2f} | "
                  f"{r['over_serial']:.2f}x |")
    if "split" in out:
        sp = out["split"]
        print(f"\nsplit (one worker thread, CPU rows: {sp['cpu_path']}, a stand-in of {sp['stand_in_img_per_s']:.0f} "
              f"img/s; images/s, median of {args.rounds} alternating rounds)")
        print("| gpu_share | " + " | ".join(str(k) for k in sp["img_per_s"]) + " |")
        print("| --- |" + " --- |" * len(sp["img_per_s"]))
        print("| img/s | " + " | ".join(f"{v:.0f}" for v in sp["img_per_s"].values()) + " |")
        beside = ", ".join(f"G {g:.0f} C {c:.0f} -> {b:.2f}" for g, c, b in sp["beside"])
        print(f"auto settled at {sp['settled']:.2f} (rounds: {', '.join(f'{v:.2f}' for v in sp['settled_all'])}; "
              f"mean over the timed epoch {sp['mean_settled']:.2f}); {sp['reason']}\n"
              f"each side alone: G {sp['gpu_alone']:.0f}, C {sp['cpu_alone']:.0f} img/s, G/(G+C) "
              f"{sp['alone_ratio']:.2f}; beside each other, as the controller measured them: {beside}\n"
              f"the split kept (no probe windows): mean share over the timed epoch {sp['kept_share']:.2f} (rounds: "
              f"{', '.join(f'{v:.2f}' for v in sp['kept_share_all'])}), {sp['kept_share'] / sp['alone_ratio']:.2f}x "
              f"G/(G+C)\n"
              f"auto {sp['auto_over_best']:.2f}x the best fixed share ({sp['best_fixed']}), {sp['auto_over_cpu']:.2f}x "
              f"the CPU alone")
    if "calls" in out:
        print(f"\nPython calls per batch of 64 (median of {args.rounds})")
        print("| | worker / coordinator threads | device thread | decode thread |\n| --- | --- | --- | --- |")
        for k, v in out["calls"].items():
            if not k.endswith(" thread]"):
                print(f"| {k} | {v:,.0f} | {out['calls'][k + ' [device thread]']:,.0f} | "
                      f"{out['calls'][k + ' [decode thread]']:,.0f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
