"""Python under the GIL per sample, with the native chunk path on and off (issue 29).

Worker threads share the training process: every microsecond they run Python is a microsecond the
training loop's own Python waits for the GIL. This measures it as the Python stretches between
GIL-releasing calls: the worker thread's CPU time (`time.thread_time`, one worker thread) minus the
CPU time it spends inside the calls that release the GIL (stoker._jpeg's region decode, resize and
chunk render, libtorch's resize, simplejpeg's decode, OpenCV's flip and border), per sample rendered.
Thread CPU time counts only what the thread ran, so a busy machine slows it without skewing it.
Native on and off alternate, several rounds each, in one process (`stoker.native.ON`).

    python benchmarks/bench_native.py DIR_OF_JPEGS [--rounds 3] [--batch-size 64]

DIR_OF_JPEGS is an ImageFolder tree (`stoker synth DIR --images 600`); it is packed once next to it.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import cv2
import simplejpeg

import stoker
from stoker import _jpeg, native, slots
from stoker.transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize, geometry

PIPELINES = {"train": [RandomResizedCrop(224), RandomHorizontalFlip()], "val": [Resize(256), CenterCrop(224)]}
_local = threading.local()


def _released(fn):
    """`fn`, adding the calling thread's CPU time inside it to its `released` counter."""
    def call(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _local.released = getattr(_local, "released", 0.0) + time.thread_time() - t0
    return call


def instrument() -> list[tuple[float, float]]:
    """Wrap the GIL-releasing calls and the worker loop; returns the list each worker thread appends
    (its CPU seconds, the CPU seconds inside GIL-releasing calls) to when it ends."""
    for owner, name in ((_jpeg, "decode"), (_jpeg, "resample"), (geometry, "_BILINEAR_AA"),
                        (simplejpeg, "decode_jpeg"), (cv2, "flip"), (cv2, "copyMakeBorder")):
        setattr(owner, name, _released(getattr(owner, name)))
    done: list[tuple[float, float]] = []
    work = slots.Run._work

    def timed(self) -> None:
        _local.released = 0.0
        t0 = time.thread_time()
        try:
            work(self)
        finally:
            done.append((time.thread_time() - t0, _local.released))
    slots.Run._work = timed
    return done


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
    if not (packed / "stoker.json").exists():
        stoker.pack(args.images, packed, progress=False)
    if not native.engine_available():
        raise SystemExit("the native path is unavailable here (extension not built, or STOKER_NATIVE=off)")
    done = instrument()
    for name, transforms in PIPELINES.items():
        held: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        epoch(packed, transforms, args.batch_size)  # warm: page cache, imports, libjpeg
        for _ in range(args.rounds):
            for on in (True, False):
                native.ON = on
                done.clear()
                samples = epoch(packed, transforms, args.batch_size)
                total, released = map(sum, zip(*done))
                held[on].append((total - released) / samples * 1e6)
                cpu[on].append(total / samples * 1e3)
        native.ON = True
        for on in (False, True):
            print(f"{name:5s} native {'on ' if on else 'off'}: Python under the GIL "
                  f"{statistics.median(held[on]):5.1f} us/sample (rounds: {', '.join(f'{x:.1f}' for x in held[on])}); "
                  f"worker CPU {statistics.median(cpu[on]):.2f} ms/sample")


if __name__ == "__main__":
    main()
