"""Pack throughput at 1 and 2 workers, and reading every sample's bytes from shards vs loose files.

    python benchmarks/bench_pack.py CACHE_DIR [--images 2000] [--json results.json]

CACHE_DIR keeps the generated ImageNet-like JPEGs between runs (generated on first use) and the
packed outputs. Reading is measured twice per case: run 1 right after asking the kernel to drop
these files from the page cache (posix_fadvise DONTNEED, a request it may partly ignore; in a VM
the host's cache can still serve the reads), run 2 immediately after, warm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoker.packing import PackOptions, pack
from stoker.reader import open_dataset
from stoker.tools.baseline import list_image_folder
from stoker.tools.bench import machine_info
from stoker.tools.synth import cached_imagenet_like

PAGE = 4096


def touch(data: Any) -> int:
    """Read one byte per page (and the last): makes a memory-mapped view actually load its bytes."""
    buf = np.frombuffer(data, np.uint8)
    return int(buf[::PAGE].sum()) + int(buf[-1]) if len(buf) else 0


def evict(paths: list[Path]) -> None:
    """Ask the kernel to drop these files' pages from the page cache (advisory)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class TreeCPU:
    """CPU seconds of this process and every descendant (pack's workers are grandchildren via the
    forkserver), polled every 50 ms; a worker's last < 50 ms before it exits can be missed."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)

    def _poll(self) -> None:
        import psutil

        for child in self._me.children(recursive=True):
            try:
                t = child.cpu_times()
                self._seen[child.pid] = max(self._seen.get(child.pid, 0.0), t.user + t.system)
            except psutil.Error:
                pass

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._poll()

    def __enter__(self) -> "TreeCPU":
        self._poll()
        self._start = dict(self._seen)
        t = self._me.cpu_times()
        self._own0 = t.user + t.system
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        t = self._me.cpu_times()
        children = sum(v - self._start.get(pid, 0.0) for pid, v in self._seen.items())
        self.seconds = t.user + t.system - self._own0 + children


def warm(paths: list[Path]) -> None:
    for path in paths:
        path.read_bytes()


def bench_pack(root: Path, cache: Path, workers: list[int], files: list[Path]) -> list[dict[str, Any]]:
    """Pack `root` once per worker count (page cache warmed first, so this measures CPU scaling)."""
    rows = []
    for w in workers:
        warm(files)
        out = cache / f"packed-w{w}"
        start = time.perf_counter()
        with TreeCPU() as cpu:
            summary = pack(root, out, options=PackOptions(workers=w), progress=False, overwrite=True)
        seconds = time.perf_counter() - start
        rows.append({"workers": w, "images": summary.packed, "skipped": summary.skipped, "seconds": seconds,
                     "cpu_seconds": cpu.seconds, "cpu_percent": cpu.seconds / seconds * 100,
                     "images_per_s": summary.packed / seconds, "mb_in_per_s": summary.bytes_in / seconds / 1e6,
                     "shards": summary.shards})
    return rows


def read_shards(packed: Path, order: np.ndarray) -> tuple[int, int]:
    """open_dataset, then every sample's bytes in `order`; returns (samples, checksum)."""
    total = 0
    with open_dataset(packed) as ds:
        for i in order:
            total += touch(ds.sample(int(i)).data)
    return len(order), total


def read_loose(root: Path, order: np.ndarray) -> tuple[int, int]:
    """List the ImageFolder, then open and read every file in `order`; returns (files, checksum)."""
    samples, _ = list_image_folder(root)
    total = 0
    for i in order:
        with open(samples[int(i)][0], "rb") as f:
            total += touch(f.read())
    return len(order), total


def bench_read(root: Path, packed: Path, files: list[Path]) -> list[dict[str, Any]]:
    shard_files = sorted(packed.glob("shard-*.arrow"))
    n = len(files)
    orders = {"sequential": np.arange(n), "shuffled": np.random.default_rng(0).permutation(n)}
    rows = []
    for order_name, order in orders.items():
        for method, fn, paths in (("shards", lambda o: read_shards(packed, o), shard_files),
                                  ("loose files", lambda o: read_loose(root, o), files)):
            evict(paths)
            runs = []
            for _ in range(2):
                start = time.perf_counter()
                count, checksum = fn(order)
                runs.append(count / (time.perf_counter() - start))
            rows.append({"method": method, "order": order_name, "run1_evicted_images_per_s": runs[0],
                         "run2_warm_images_per_s": runs[1], "checksum": checksum})
    return rows


def format_report(data: dict[str, Any], packs: list[dict[str, Any]], reads: list[dict[str, Any]],
                  machine: dict[str, Any]) -> str:
    lines = [f"Data: {data['images']} generated ImageNet-like JPEGs, {data['total_mb']:.0f} MB, mean "
             f"{data['mean_kb']:.1f} KB, mean {data['mean_width']:.0f}x{data['mean_height']:.0f} px",
             f"Machine: {machine['cpu']}, {machine['usable_cores']} usable cores, {machine['memory_gb']} GB RAM, "
             f"load average {machine['load_1m']} at the start (other processes competing for the cores)", "",
             "| pack workers | seconds | images/s | MB/s in | speed-up | CPU % (all processes) | CPU ms/image |",
             "|---|---|---|---|---|---|---|"]
    base = packs[0]["images_per_s"]
    for p in packs:
        lines.append(f"| {p['workers']} | {p['seconds']:.1f} | {p['images_per_s']:,.0f} | {p['mb_in_per_s']:.1f} | "
                     f"{p['images_per_s'] / base:.2f}x | {p['cpu_percent']:.0f} | "
                     f"{p['cpu_seconds'] * 1000 / p['images']:.2f} |")
    lines += ["", "| read every sample's bytes | order | run 1: after evicting (images/s) | run 2: warm (images/s) |",
              "|---|---|---|---|"]
    for r in reads:
        lines.append(f"| {r['method']} | {r['order']} | {r['run1_evicted_images_per_s']:,.0f} | "
                     f"{r['run2_warm_images_per_s']:,.0f} |")
    by = {(r["method"], r["order"]): r for r in reads}
    lines.append("")
    for order in ("sequential", "shuffled"):
        s, f = by[("shards", order)], by[("loose files", order)]
        lines.append(f"shards / loose files, {order}: run 1 {s['run1_evicted_images_per_s'] / f['run1_evicted_images_per_s']:.1f}x, "
                     f"run 2 {s['run2_warm_images_per_s'] / f['run2_warm_images_per_s']:.1f}x")
    lines += ["", "Pack runs start with the source files in the page cache (read once before each run), so the "
              "speed-up is CPU scaling. Read run 1 follows posix_fadvise(DONTNEED) on the files read: the kernel "
              "may keep some pages, and a VM's host may cache the disk. Ratios from one run are what count."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="folder for the generated images and the packed outputs")
    parser.add_argument("--images", type=int, default=2000, help="images to generate (default 2000)")
    parser.add_argument("--workers", default="1,2", help="pack worker counts to time (default 1,2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    root = cached_imagenet_like(args.cache, args.images, workers=2)
    samples, _ = list_image_folder(root)
    files = [Path(p) for p, _ in samples]
    sizes = np.array([f.stat().st_size for f in files])
    from PIL import Image
    dims = np.array([Image.open(f).size for f in files[:: max(1, len(files) // 500)]])
    data = {"images": len(files), "total_mb": sizes.sum() / 1e6, "mean_kb": sizes.mean() / 1e3,
            "mean_width": dims[:, 0].mean(), "mean_height": dims[:, 1].mean()}
    workers = [int(w) for w in args.workers.split(",")]
    machine = machine_info()
    packs = bench_pack(root, args.cache, workers, files)
    reads = bench_read(root, args.cache / f"packed-w{workers[-1]}", files)
    print(format_report(data, packs, reads, machine))
    if args.json:
        args.json.write_text(json.dumps({"data": data, "pack": packs, "read": reads, "machine": machine},
                                        indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
