"""Soak: many epochs through one Loader; memory and thread count must stay flat.

    python benchmarks/soak.py [--epochs 50] [--images 512] [--threads 1] [--json soak.json]

Generates a small dataset (JPEGs of 48-96 px, written and packed into a temporary folder),
then runs `--epochs` full epochs with random transforms (RandomResizedCrop, flip, and a user
callable that adds seeded noise), a `break` part-way through every 5th epoch, and reports RSS
(psutil) and `threading.active_count()` after each epoch. Passes when RSS at the last epoch
is within 5% of epoch 5 and the thread count after every epoch equals the one before the
first. Not a test: it takes minutes; its results are recorded in docs/reliability.md.
Uses one worker thread by default to keep the machine usable for others.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import simplejpeg

from stoker import Loader, RandomHorizontalFlip, RandomResizedCrop
from stoker.packing import PackOptions, pack
from stoker.loader.options import Workers


def make_images(folder: Path, n: int, seed: int = 0) -> None:
    """``n`` smooth JPEGs of 48-96 px in 4 class folders."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        h, w = (int(v) for v in rng.integers(48, 97, size=2))
        y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
        x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
        img = rng.uniform(0, 255, (1, 1, 3)) + rng.uniform(-100, 100, (1, 1, 3)) * y \
            + rng.uniform(-100, 100, (1, 1, 3)) * x + rng.normal(0, 6, (h, w, 3))
        path = folder / f"c{i % 4}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(simplejpeg.encode_jpeg(img.clip(0, 255).astype(np.uint8), 90))


def noise(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A user transform: seeded noise added in place (allocates one small array per call)."""
    np.add(img, rng.integers(0, 8, size=img.shape, dtype=np.uint8), out=img, casting="unsafe")
    return img


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the per-epoch figures here")
    args = ap.parse_args(argv)
    proc = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="stoker-soak-") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "packed"
        make_images(src, args.images)
        pack(src, out, options=PackOptions(workers=1, shard_size=256 * 1024), progress=False)
        threads_before = threading.active_count()
        rows = []
        started = time.perf_counter()
        with Loader(out, args.batch, transforms=[RandomResizedCrop(32), RandomHorizontalFlip(), noise],
                    timeout=60, workers=Workers(num_threads=args.threads, prefetch=2)) as loader:
            for epoch in range(1, args.epochs + 1):
                t0 = time.perf_counter()
                samples = 0
                for k, (images, labels) in enumerate(loader):
                    samples += images.shape[0]
                    if epoch % 5 == 0 and k == len(loader) // 2:
                        break  # an abandoned pass every 5th epoch
                gc.collect()
                rows.append({"epoch": epoch, "samples": samples, "seconds": round(time.perf_counter() - t0, 3),
                             "rss_mib": round(proc.memory_info().rss / 2**20, 2),
                             "threads": threading.active_count(), "fds": proc.num_fds()})
                r = rows[-1]
                print(f"epoch {epoch:3d}  {r['samples']:5d} samples  {r['seconds']:6.2f} s  "
                      f"RSS {r['rss_mib']:8.2f} MiB  threads {r['threads']}  fds {r['fds']}", flush=True)
        total = time.perf_counter() - started
    threads_after = threading.active_count()
    ref = rows[min(4, len(rows) - 1)]["rss_mib"]
    last = rows[-1]["rss_mib"]
    drift = (last - ref) / ref
    threads_flat = threads_after == threads_before and len({r["threads"] for r in rows}) == 1
    fds_flat = len({r["fds"] for r in rows[4:]}) <= 1
    ok = abs(drift) <= 0.05 and threads_flat
    summary = {"epochs": args.epochs, "images": args.images, "batch": args.batch, "threads": args.threads,
               "seconds": round(total, 1), "rss_epoch5_mib": ref, "rss_last_mib": last,
               "rss_drift_pct": round(100 * drift, 2), "threads_before": threads_before,
               "threads_during": sorted({r["threads"] for r in rows}), "threads_after": threads_after,
               "fds_flat": fds_flat, "ok": ok}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "epochs": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
