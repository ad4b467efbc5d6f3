"""Beyond one disk: pack throughput local vs Ray, a Loader epoch from S3 (cold cache, then warm)
vs local shards, and /dev/shm staging vs a page-cache-evicted disk.

    python benchmarks/bench_scale.py CACHE_DIR [--images 1000] [--json results.json]

CACHE_DIR keeps the generated ImageNet-like JPEGs (made on first use) and the packed outputs.
S3 is moto's server on localhost behind a proxy that caps bandwidth (--mbps, default 100 MB/s,
a typical single-stream S3 GET) to make it network-like. Every figure is a ratio to a baseline
measured in the same run; on a shared 2-core machine absolute times are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoker import Loader, RandomResizedCrop, Storage
from stoker.packing import PackOptions, pack
from stoker.reader import open_dataset
from stoker.storage import RemoteStorage
from stoker.staging import stage
from stoker.tools.synth import cached_imagenet_like

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def evict(folder: Path) -> None:
    """Ask the kernel to drop a folder's files from the page cache (advisory, no root needed)."""
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def epoch(source: Any, **kw: Any) -> float:
    with Loader(source, 64, seed=0, transforms=[RandomResizedCrop(160)], **kw, workers=2) as loader:
        t0 = time.perf_counter()
        n = sum(len(labels) for _, labels in loader)
        return n / (time.perf_counter() - t0)


def read_all(path: Path) -> float:
    """MB/s reading every sample's bytes (one byte per page: the I/O, not decode)."""
    with open_dataset(path) as ds:
        t0 = time.perf_counter()
        total = 0
        for i in range(len(ds)):
            data = np.frombuffer(ds.sample(i).data, np.uint8)
            total += len(data) + int(data[::4096].sum() * 0)
        return total / 1e6 / (time.perf_counter() - t0)


def bench_pack(images: Path, out: Path) -> dict[str, Any]:
    import ray

    res: dict[str, Any] = {}
    n = sum(1 for _ in images.rglob("*.jpg"))
    # local before and after Ray, so a page cache warmed by the first run favours neither engine
    t, _ = timed(lambda: pack(images, out / "local", options=PackOptions(workers=2), progress=False, overwrite=True))
    res["local_2_threads_first_img_s"] = n / t
    t_init, _ = timed(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                                       configure_logging=False))
    t, _ = timed(lambda: pack(images, out / "ray", options=PackOptions(engine="ray"), progress=False,
                              overwrite=True))
    ray.shutdown()
    res["ray_2_cpus_img_s"] = n / t
    res["ray_init_s"] = t_init
    t, _ = timed(lambda: pack(images, out / "local", options=PackOptions(workers=2), progress=False, overwrite=True))
    res["local_2_threads_after_img_s"] = n / t
    best_local = max(res["local_2_threads_first_img_s"], res["local_2_threads_after_img_s"])
    res["ray_vs_best_local"] = res["ray_2_cpus_img_s"] / best_local
    res["ray_with_init_vs_best_local"] = n / (n / res["ray_2_cpus_img_s"] + t_init) / best_local
    same = [s.sha256 for s in open_dataset(out / "local").manifest.shards] == \
        [s.sha256 for s in open_dataset(out / "ray").manifest.shards]
    res["identical_shards"] = same
    return res


def bench_s3(packed: Path, mbps: float) -> dict[str, Any]:
    from s3_helpers import S3Server

    server = S3Server()
    server.log.bandwidth = mbps * 1e6
    try:
        fs = server.filesystem()
        fs.mkdir("bench")
        for f in sorted(packed.iterdir()):
            fs.put_file(str(f), f"bench/ds/{f.name}")
        with tempfile.TemporaryDirectory() as cache:
            remote = dict(storage=Storage(cache_dir=cache, storage_options=server.storage_options()),
                          order="shard_window")
            local = epoch(packed, order="shard_window")
            cold = epoch("s3://bench/ds", **remote)
            warm = epoch("s3://bench/ds", **remote)
        return {"local_img_s": local, "s3_cold_img_s": cold, "s3_warm_img_s": warm,
                "cold_vs_local": cold / local, "warm_vs_local": warm / local, "mbps_cap": mbps}
    finally:
        server.stop()


def bench_stage(packed: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    evict(packed)
    res["disk_cold_read_mb_s"] = read_all(packed)
    res["disk_warm_read_mb_s"] = read_all(packed)
    evict(packed)
    res["disk_cold_epoch_img_s"] = epoch(packed)
    dest = Path("/dev/shm") / f"stoker-bench-{os.getpid()}"
    evict(packed)
    t, copy = timed(lambda: stage(packed, dest, persistent=False))
    with copy:
        res["stage_s"] = t
        res["shm_read_mb_s"] = read_all(dest)
        res["shm_epoch_img_s"] = epoch(dest)
    evict(packed)
    res["disk_cold_epoch_again_img_s"] = epoch(packed)
    res["read_shm_vs_cold_disk"] = res["shm_read_mb_s"] / res["disk_cold_read_mb_s"]
    disk_epoch = max(res["disk_cold_epoch_img_s"], res["disk_cold_epoch_again_img_s"])
    res["epoch_shm_vs_cold_disk"] = res["shm_epoch_img_s"] / disk_epoch
    # a run of 3 epochs over data the page cache cannot keep (bigger than RAM, or a network file
    # system): 3 cold reads, against one staging copy plus 3 epochs from memory
    with open_dataset(packed) as ds:
        n = len(ds)
    res["three_epochs_shm_incl_stage_vs_disk"] = (3 * n / disk_epoch) / (res["stage_s"] + 3 * n / res["shm_epoch_img_s"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--mbps", type=float, default=100.0, help="bandwidth cap of the S3 proxy, MB/s")
    ap.add_argument("--only", choices=["pack", "s3", "stage"], action="append",
                    help="run only these parts (repeatable; default all). Run `--only stage` under a read "
                         "throttle (a blkio cgroup) to see staging on a slow disk, as in docs/benchmarks.md")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    parts = args.only or ["pack", "s3", "stage"]
    images = cached_imagenet_like(args.cache, args.images)
    out = args.cache / f"scale-n{args.images}"
    packed = out / "local"
    results: dict[str, Any] = {}
    if "pack" in parts:
        results["pack"] = bench_pack(images, out)
    elif not (packed / "stoker.json").exists():
        pack(images, packed, options=PackOptions(workers=2), progress=False)
    if "s3" in parts:
        results["s3"] = bench_s3(packed, args.mbps)
    if "stage" in parts:
        results["stage"] = bench_stage(packed)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
