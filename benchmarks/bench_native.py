"""Python under the GIL per sample, with the native chunk path on and off (issue 29).

Worker threads share the training process: every microsecond they run Python is a microsecond the
training loop's own Python waits for the GIL. This measures it with a probe: a thread spinning pure
Python counts its iterations alone, then while one stoker worker thread renders an epoch; the share
of iterations lost is the share of time the loader held the GIL, and that time divided by the
samples rendered is its Python per sample (it includes the consumer thread's per-batch `next()`).
Native on and off alternate, several rounds each, in one process (`stoker.native.ON`).

    python benchmarks/bench_native.py DIR_OF_JPEGS [--rounds 3] [--batch-size 64]

DIR_OF_JPEGS is an ImageFolder tree (`stoker synth DIR --images 600`); it is packed once next to it.
Needs a machine with a core free for the probe (on a busy machine the probe loses time to other
processes as well: compare the on/off figures of one run, not across runs).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import stoker
from stoker import native
from stoker.transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize

PIPELINES = {"train": [RandomResizedCrop(224), RandomHorizontalFlip()], "val": [Resize(256), CenterCrop(224)]}


def spin(stop: threading.Event, counts: list[int]) -> None:
    n = 0
    while not stop.is_set():
        for _ in range(200):  # pure Python: needs the GIL the whole time
            n += 1
    counts.append(n)


def probe(seconds: float | None, work=None) -> tuple[float, float, int]:
    """(probe iterations per second, seconds, samples) while `work` runs (or alone for `seconds`)."""
    stop, counts, samples = threading.Event(), [], [0]
    t = threading.Thread(target=spin, args=(stop, counts))
    t0 = time.perf_counter()
    t.start()
    if work is None:
        time.sleep(seconds)
    else:
        runner = threading.Thread(target=lambda: samples.__setitem__(0, work()))
        runner.start()
        runner.join()
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join()
    return counts[0] / elapsed, elapsed, samples[0]


def epoch(data: Path, transforms: list, batch_size: int) -> int:
    n = 0
    with stoker.Loader(data, batch_size, transforms=transforms, seed=0, device="numpy",
                       workers=stoker.Workers(num_threads=1, prefetch=2)) as loader:
        for batch in loader:
            n += len(batch[1])
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("images", type=Path, help="ImageFolder tree of JPEGs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    packed = args.images.with_name(args.images.name + "-packed")
    if not (packed / "manifest.json").exists():
        stoker.pack(args.images, packed, progress=False)
    if not native.chunks_available():
        raise SystemExit("the native path is unavailable here (extension not built, or STOKER_NATIVE=off)")
    for name, transforms in PIPELINES.items():
        per_sample: dict[bool, list[float]] = {True: [], False: []}
        epoch(packed, transforms, args.batch_size)  # warm: page cache, imports, libjpeg
        for _ in range(args.rounds):
            for on in (True, False):
                native.ON = on
                alone, _, _ = probe(1.0)
                busy, elapsed, samples = probe(None, lambda: epoch(packed, transforms, args.batch_size))
                lost = max(0.0, 1.0 - busy / alone)
                per_sample[on].append(lost * elapsed / samples * 1e6)
        native.ON = True
        for on in (False, True):
            v = per_sample[on]
            print(f"{name:5s} native {'on ' if on else 'off'}: GIL held {statistics.median(v):5.1f} us/sample "
                  f"(median of {len(v)}: {', '.join(f'{x:.1f}' for x in v)})")


if __name__ == "__main__":
    main()
