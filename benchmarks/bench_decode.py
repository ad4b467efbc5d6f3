"""Decode + crop + resize of one 224 x 224 output per image, on one thread: whole-image decode
(today's simplejpeg path) against region decode, in accurate and fast modes.

    python benchmarks/bench_decode.py CACHE_DIR [--images 300] [--rounds 5] [--large 40] [--json out.json]

CACHE_DIR keeps the generated ImageNet-like JPEGs (about 400 x 350 px, made on first use);
`--large` adds that many 1200 x 900 images made by the same generator. Each variant runs every
image through the same crop plan (RandomResizedCrop(224) for train, Resize(256) + CenterCrop(224) for
val, seeded) and reports the thread CPU time per image, best of `--rounds` (the machine may be
shared: the best round is the least disturbed). Quality: PSNR (pooled over the images, and the worst
image) and max abs difference of the 224 x 224 output against the accurate whole-image path
(identical pixels give "exact").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stoker import codecs
from stoker.order import sample_keys, uniforms
from stoker.tools.synth import cached_imagenet_like, synth_image
from stoker.transforms import (CenterCrop, Pipeline, RandomResizedCrop, Resize, crop_resize_into, decode_minimums,
                               resample_region_into, resampling)

OUT = 224


def _load(cache: Path, n: int, large: int) -> list[tuple[str, bytes, int, int]]:
    root = cached_imagenet_like(cache / "imagenet-like", n)
    images = []
    for path in sorted(root.rglob("*.jpg"))[:n]:
        data = path.read_bytes()
        h, w = codecs.probe(data, path.name).height, codecs.probe(data, path.name).width
        images.append(("small", data, h, w))
    rng = np.random.default_rng(7)
    for i in range(large):
        rgb = synth_image(rng, 900, 1200)
        images.append(("large", codecs.encode_jpeg(rgb, 90), 900, 1200))
    return images


def _whole(data: bytes, h: int, w: int, box: Any, dst: np.ndarray, buf: np.ndarray, fast: bool) -> None:
    mh, mw = decode_minimums(box, OUT, OUT, h, w)
    sh, sw = codecs.jpeg_scaled_shape(h, w, mh, mw)
    img = codecs.decode_rgb(data, "jpeg", "k", height=h, width=w, min_height=mh, min_width=mw,
                            out=buf[:sh * sw * 3], fast=fast)
    crop_resize_into(img, box, dst, False, h, w)


def _region(data: bytes, h: int, w: int, box: Any, dst: np.ndarray, buf: np.ndarray, fast: bool) -> None:
    mh, mw = decode_minimums(box, OUT, OUT, h, w)
    n = codecs.jpeg_scale_eighths(h, w, mh, mw)
    r = resampling(box, math.ceil(h * n / 8), math.ceil(w * n / 8), h, w, size=(OUT, OUT))
    region = codecs.decode_jpeg_region(data, "k", height=h, width=w, scale=n, window=r.src, out=buf, fast=fast)
    resample_region_into(region, r, dst, False)


def _full_size_decode(data: bytes, h: int, w: int, box: Any, dst: np.ndarray, buf: np.ndarray, fast: bool) -> None:
    codecs.decode_rgb(data, "jpeg", "k", height=h, width=w, out=buf[:h * w * 3], fast=fast)


VARIANTS: dict[str, tuple[Callable[..., None], bool]] = {
    "full-size decode only (no crop, no resize)": (_full_size_decode, False),
    "whole image, DCT-scaled (before)": (_whole, False),
    "whole image, DCT-scaled, fast": (_whole, True),
    "region, DCT-scaled (now)": (_region, False),
    "region, DCT-scaled, fast": (_region, True),
}


def _mse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a.astype(np.float64) - b) ** 2))


def _psnr(mse: float) -> float:
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def run(images: list[tuple[str, bytes, int, int]], rounds: int) -> list[dict[str, Any]]:
    buf = np.empty(1200 * 900 * 3, np.uint8)
    dst = np.empty((OUT, OUT, 3), np.uint8)
    rows = []
    for group in sorted({g for g, *_ in images}, reverse=True):
        sel = [im for im in images if im[0] == group]
        hs = np.array([h for _, _, h, _ in sel])
        ws = np.array([w for _, _, _, w in sel])
        for task, pipe in (("train", Pipeline([RandomResizedCrop(OUT)])),
                           ("val", Pipeline([Resize(256), CenterCrop(OUT)]))):
            plan = pipe.plan(hs, ws, uniforms(sample_keys(0, 0, np.arange(len(sel))), max(pipe.draws, 1)))
            boxes = [plan.box[i].tolist() for i in range(len(sel))]
            refs = []
            for (_, data, h, w), box in zip(sel, boxes):
                _whole(data, h, w, box, dst, buf, False)
                refs.append(dst.copy())
            for name, (fn, fast) in VARIANTS.items():
                best = math.inf
                for _ in range(rounds):
                    t = time.thread_time()
                    for (_, data, h, w), box in zip(sel, boxes):
                        fn(data, h, w, box, dst, buf, fast)
                    best = min(best, (time.thread_time() - t) / len(sel) * 1e6)
                mses, maxdiff = [], 0
                if fn is not _full_size_decode:
                    for (_, data, h, w), box, ref in zip(sel, boxes, refs):
                        fn(data, h, w, box, dst, buf, fast)
                        mses.append(_mse(dst, ref))
                        maxdiff = max(maxdiff, int(np.abs(dst.astype(np.int16) - ref).max()))
                rows.append({"images": f"{group} ({len(sel)}, {int(hs.mean())}x{int(ws.mean())} px mean)",
                             "task": task, "variant": name, "cpu_us_per_image": round(best),
                             # pooled over all images (mean MSE), and the worst single image
                             "psnr_db": None if not mses else round(_psnr(float(np.mean(mses))), 1),
                             "psnr_worst_db": None if not mses else round(_psnr(max(mses)), 1),
                             "max_abs_diff": None if not mses else maxdiff})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache_dir", type=Path)
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--large", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not codecs.region_decode_available():
        from stoker import _libjpeg
        print(_libjpeg.describe(), file=sys.stderr)
        return 2
    rows = run(_load(args.cache_dir, args.images, args.large), args.rounds)
    print("| images | task | decode | CPU µs/image | PSNR vs before, dB (all / worst image) | max abs diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        q = "—" if r["psnr_db"] is None else (
            "exact" if math.isinf(r["psnr_worst_db"]) else f"{r['psnr_db']} / {r['psnr_worst_db']}")
        print(f"| {r['images']} | {r['task']} | {r['variant']} | {r['cpu_us_per_image']} | {q} | "
              f"{'—' if r['max_abs_diff'] is None else r['max_abs_diff']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
