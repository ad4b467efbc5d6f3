"""The native batch engine against an earlier stoker, alternating, in one run (issue 37).

Each measurement runs in a fresh process importing one of two stoker source trees: this one
("after") and an earlier checkout ("before", e.g. `git archive main | tar -x -C OLD` with its extension
built in place: `python setup.py build_ext --inplace`). The two alternate, `--rounds` times each, on
the same packed JPEGs, and each process reports:

- Python calls per batch run by the loader's threads (`threading.setprofile`, Python and C calls;
  RandomResizedCrop(224) + flip, default Workers at 2 and 16 threads);
- images/s and process CPU ms per image (every thread's, native ones included) of the train
  (RandomResizedCrop 224 + flip) and val (Resize 256 + CenterCrop 224) pipelines on `--threads` threads;
- the step inflation of a dispatch-bound step (300 small torch ops, `bench_neighbour.make_step`'s)
  beside the train pipeline: the step's median with the loader against its median with no loader, in
  windows that alternate within the process.

    python benchmarks/bench_engine.py --before OLD/src DIR_OF_JPEGS [--rounds 2] [--batch-size 256]

DIR_OF_JPEGS is an ImageFolder tree (`stoker synth DIR --images 1200`); it is packed once next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "src"


def _calls(packed: str, batch: int, threads: int, batches: int = 2) -> float:
    from stoker import Loader, Workers
    from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

    counts: dict[int, int] = {}

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            k = threading.get_ident()
            counts[k] = counts.get(k, 0) + 1

    loader = Loader(packed, batch, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()], seed=0,
                    workers=Workers(num_threads=threads))
    threading.setprofile(hook)
    it = iter(loader)
    threading.setprofile(None)
    next(it)
    start = sum(list(counts.values()))
    for _ in range(batches):
        next(it)
    got = (sum(list(counts.values())) - start) / batches
    it.close()
    loader.close()
    return got


def _rate(packed: str, batch: int, threads: int, val: bool) -> tuple[float, float]:
    from stoker import Loader, Workers
    from stoker.transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize

    ops = [Resize(256), CenterCrop(224)] if val else [RandomResizedCrop(224), RandomHorizontalFlip()]
    loader = Loader(packed, batch, transforms=ops, seed=1, workers=Workers(num_threads=threads), drop_last=True)
    it = iter(loader)
    next(it)   # start-up is not the steady state
    n, c0, t0 = 0, time.process_time(), time.perf_counter()
    for x, _ in it:
        n += len(x)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    loader.close()
    return n / wall, cpu / n * 1e3


def _inflation(packed: str, batch: int, threads: int, windows: int = 3, steps: int = 10) -> tuple[float, float, float]:
    from stoker import Loader, Workers
    from bench_neighbour import make_step   # this folder's (the same step for both trees)
    from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

    step = make_step()
    for _ in range(20):
        step()
    alone: list[float] = []
    beside: list[float] = []

    def timed(into: list[float]) -> None:
        for _ in range(steps):
            t = time.perf_counter()
            step()
            into.append(time.perf_counter() - t)

    for w in range(windows):
        loader = Loader(packed, batch, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()], seed=w,
                        workers=Workers(num_threads=threads), drop_last=True)
        it = iter(loader)
        next(it)
        for _ in it:
            timed(beside)
        loader.close()
        for _ in range(len(loader) - 1):
            timed(alone)
    a, b = statistics.median(alone), statistics.median(beside)
    return a * 1e3, b * 1e3, (b / a - 1) * 100


def child(packed: str, batch: int, threads: int, only: str = "") -> dict:
    import stoker

    want = set(only.split(",")) if only else {"calls", "rates", "inflation"}
    out: dict = {"stoker": str(Path(stoker.__file__).parent)}
    if "calls" in want:
        out["calls_2"] = _calls(packed, batch, 2)
        out["calls_16"] = _calls(packed, batch, 16)
    if "rates" in want:
        out["train_ips"], out["train_cpu_ms"] = _rate(packed, batch, threads, False)
        out["val_ips"], out["val_cpu_ms"] = _rate(packed, batch, threads, True)
    if "inflation" in want:
        out["step_alone_ms"], out["step_beside_ms"], out["inflation_pct"] = _inflation(packed, batch, threads)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", type=Path, nargs="?")
    p.add_argument("--before", type=Path, help="the earlier stoker's src/ (its extension built in place)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--also", action="append", default=[], metavar="NAME=VALUE",
                   help="a further configuration: this tree with the environment variable set (e.g. "
                        "STOKER_ENGINE_NICE=10), alternating with the others")
    p.add_argument("--only", default="", help="comma-separated measures to run (calls,rates,inflation); default all")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch_size, args.threads, args.only)))
        return
    if args.before is None or args.data is None:
        p.error("give DIR_OF_JPEGS and --before OLD/src")
    packed = args.data.parent / (args.data.name + "-packed-engine")
    if not packed.exists():
        sys.path.insert(0, str(HERE))
        from stoker.packing import PackOptions, pack

        pack(args.data, packed, options=PackOptions(workers=args.threads), progress=False)
    configs = [("before", args.before.resolve(), {}), ("after", HERE, {})]
    configs += [(f"after {kv}", HERE, dict([kv.split("=", 1)])) for kv in args.also]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for r in range(args.rounds):
        for name, src, extra in configs:
            env = {**os.environ, **extra, "PYTHONPATH": str(src)}
            got = subprocess.run([sys.executable, __file__, "--child", str(packed), "--batch-size",
                                  str(args.batch_size), "--threads", str(args.threads), "--only", args.only],
                                 env=env, check=True, capture_output=True, text=True, cwd=str(Path(src).parent))
            results[name].append(json.loads(got.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {results[name][-1]}", flush=True)
    keys = [k for k in results["after"][0] if k != "stoker"]
    names = [name for name, _, _ in configs]
    print(f"\n| measure (median of {args.rounds}) | " + " | ".join(names) + " | " +
          " | ".join(f"{n} / before" for n in names[1:]) + " |")
    print("| --- |" + " ---: |" * (2 * len(names) - 1))
    for k in keys:
        med = [statistics.median(x[k] for x in results[n]) for n in names]
        print(f"| {k} | " + " | ".join(f"{m:,.2f}" for m in med) + " | " +
              " | ".join(f"{m / med[0] if med[0] else float('nan'):.2f}" for m in med[1:]) + " |")


if __name__ == "__main__":
    main()
