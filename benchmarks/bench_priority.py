"""The engine pool's priority (`Workers(nice=)`) against a competing CPU load and beside a dispatch-bound step.

    python benchmarks/bench_priority.py CACHE_DIR [--data FOLDER] [--nice 0,5,10,19] [--rounds 2]
                                                  [--max-threads fixed,default] [--threads 2] [--seconds 4]
                                                  [--json out.json]

For each nice value and each `--max-threads` (`Workers(max_threads=)`: `fixed`, the pool never grows;
`default`, its default; or a number), in a fresh process each (rounds alternating over the settings):

- `alone`: images/s of RandomResizedCrop(224) + flip, batch 64, `--threads` engine threads, nothing else running;
- `loaded`: the same beside one busy process per usable core (a Python spin loop at nice 0, another job on
  the machine): images/s, its ratio to `alone` at the same nice value with the pool that never grows (what
  the loader keeps when the machine is not its own), and the most threads the pool ran;
- `step`: a dispatch-bound step (300 tiny torch ops on one thread, the shape of a small model's training
  step on a GPU host) timed in windows alternating with and without the loader running beside it in the
  same process: the median step time with the loader over without (what the loader costs the trainer).

CACHE_DIR keeps the generated ImageNet-like JPEGs (or --data, a folder of real photographs) and its pack.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def _spin() -> None:   # a competing job: one busy core
    while True:
        pass


def _most(value: str, threads: int) -> int | None:
    return threads if value == "fixed" else None if value == "default" else int(value)


def _rate(path: str, nice: int, threads: int, seconds: float, most: str = "fixed") -> tuple[float, int]:
    """images/s, and the most threads the pool ran."""
    from stoker import Loader, RandomHorizontalFlip, RandomResizedCrop, Workers

    with Loader(path, 64, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()],
                workers=Workers(num_threads=threads, nice=nice, persistent=True,
                                max_threads=_most(most, threads))) as ld:
        sum(1 for _ in ld)   # warm-up epoch
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            n += sum(len(x) for x, _ in ld)
        return n / (time.perf_counter() - t0), ld.stats.pool_threads_peak


def _step_inflation(path: str, nice: int, threads: int, seconds: float, most: str = "fixed") -> float:
    import torch

    from stoker import Loader, RandomHorizontalFlip, RandomResizedCrop, Workers

    torch.set_num_threads(1)
    x = torch.zeros(16)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(300):
            x.add_(1.0)
        return time.perf_counter() - t0

    stop = threading.Event()

    def feed(ld: Loader) -> None:
        while not stop.is_set():
            for _ in ld:
                if stop.is_set():
                    break

    with_loader, without = [], []
    with Loader(path, 64, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()],
                workers=Workers(num_threads=threads, nice=nice, persistent=True,
                                max_threads=_most(most, threads))) as ld:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            without += [step() for _ in range(200)]
            stop.clear()
            t = threading.Thread(target=feed, args=(ld,))
            t.start()
            time.sleep(0.2)
            with_loader += [step() for _ in range(200)]
            stop.set()
            t.join()
    return statistics.median(with_loader) / statistics.median(without)


def _child(args: list[str]) -> None:
    kind, path, nice, threads, seconds, most = args[0], args[1], int(args[2]), int(args[3]), float(args[4]), args[5]
    if kind == "loaded":
        spinners = [mp.Process(target=_spin, daemon=True) for _ in os.sched_getaffinity(0)]
        for p in spinners:
            p.start()
        try:
            print(json.dumps(_rate(path, nice, threads, seconds, most)))
        finally:
            for p in spinners:
                p.kill()
    elif kind == "alone":
        print(json.dumps(_rate(path, nice, threads, seconds, most)))
    else:
        print(json.dumps(_step_inflation(path, nice, threads, seconds, most)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--nice", default="0,5,10,19")
    ap.add_argument("--max-threads", default="fixed,default",
                    help="Workers(max_threads=) values: fixed (never grows), default, or numbers")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_outputs import packed

    path = str(packed(args.cache, args.images, args.data))
    settings = [(int(n), m) for n in args.nice.split(",") for m in args.max_threads.split(",")]
    got: dict[tuple[int, str, str], list] = {}
    for r in range(args.rounds):
        for nice, most in (settings if r % 2 == 0 else settings[::-1]):
            for kind in ("alone", "loaded", "step"):
                out = subprocess.run([sys.executable, __file__, "--child", kind, path, str(nice), str(args.threads),
                                      str(args.seconds), most], check=True, capture_output=True, text=True).stdout
                got.setdefault((nice, most, kind), []).append(json.loads(out.strip().splitlines()[-1]))
    report = {}
    print("| nice | max_threads | alone images/s | loaded images/s | loaded / alone | pool threads loaded | "
          "step with loader / without |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for nice, most in settings:
        alone = statistics.median(r for r, _ in got[nice, most, "alone"])
        fixed = got.get((nice, "fixed", "alone"), got[nice, most, "alone"])   # the pool that never grows, alone
        base = statistics.median(r for r, _ in fixed)
        loaded = statistics.median(r for r, _ in got[nice, most, "loaded"])
        peak = max(p for _, p in got[nice, most, "loaded"])
        step = statistics.median(got[nice, most, "step"])
        report[f"{nice}/{most}"] = {"alone": alone, "loaded": loaded, "kept": loaded / base, "threads": peak,
                                    "step_inflation": step}
        print(f"| {nice} | {most} | {alone:,.0f} | {loaded:,.0f} | {loaded / base:.2f} | {peak} | {step:.3f} |",
              flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        sys.exit(main())
