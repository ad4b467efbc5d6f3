"""The decode="gpu" path's decoders side by side: each backend decodes the same batches of JPEGs and
crops, resizes and flips them into 224 x 224 rows (RandomResizedCrop(224) + flip, seeded), through
`GpuBatchDecoder` as the Loader runs it.

    python benchmarks/bench_gpu_decode.py CACHE_DIR [--device cuda] [--images 1024] [--batch 256]
                                          [--rounds 5] [--large 0] [--json out.json]

CACHE_DIR keeps the generated ImageNet-like JPEGs (about 400 x 350 px, made on first use); `--large`
adds that many 1200 x 900 images. On `--device cuda` the candidates are TorchCodec and nvImageCodec
(the hardware JPEG engines first); each round is timed from a synchronized device to a synchronized
device. This is where the backends are compared: `gpu_decoder="auto"` takes the first that works, it
times nothing. On `--device cpu` (any machine) the candidate is nvImageCodec's CPU backend: the same
library calls, CPU times, no GPU figure. Reported: ms per image through the whole
`GpuBatchDecoder.run` (decode, crop, resize, flip, store; best round: the machine may be shared), the
decode calls alone (a separate set of rounds, the device synchronized around each call), and decoded
megapixels per image.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoker import codecs
from stoker.errors import ConfigError
from stoker.device.gpu_decode import GpuBatchDecoder, NvImageCodecDecoder, make_decoder
from stoker.loading.jobs import GpuJob
from stoker.order import sample_keys, uniforms
from stoker.tools.synth import cached_imagenet_like, synth_image
from stoker.transforms import Pipeline, RandomHorizontalFlip, RandomResizedCrop

OUT = 224


class Counting:
    """A decoder that counts the pixels its inner decoder hands back and, when `timing` is set, the
    seconds spent decoding (the device synchronized around each call)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.pixels = inner, inner.name, 0
        self.writes_at_call = getattr(inner, "writes_at_call", False)
        self.timing: torch.device | None = None
        self.seconds = 0.0

    def decode(self, datas: list[torch.Tensor]) -> list[Any]:
        if self.timing is not None:
            _sync(self.timing)
        t0 = time.perf_counter()
        outs = self.inner.decode(datas)
        if self.timing is not None:
            _sync(self.timing)
            self.seconds += time.perf_counter() - t0
        self.pixels += sum(int(o.shape[1] * o.shape[2]) for o in outs if isinstance(o, torch.Tensor))
        return outs


def _images(cache: Path, n: int, large: int) -> list[tuple[bytes, int, int]]:
    root = cached_imagenet_like(cache / "imagenet-like", n)
    images = []
    for path in sorted(root.rglob("*.jpg"))[:n]:
        data = path.read_bytes()
        info = codecs.probe(data, path.name)
        images.append((data, info.height, info.width))
    rng = np.random.default_rng(7)
    images += [(codecs.encode_jpeg(synth_image(rng, 900, 1200), 90), 900, 1200) for _ in range(large)]
    return images


def _batches(images: list[tuple[bytes, int, int]], batch: int) -> list[list[GpuJob]]:
    pipe = Pipeline([RandomResizedCrop(OUT), RandomHorizontalFlip()])
    heights = np.array([h for _, h, _ in images])
    widths = np.array([w for _, _, w in images])
    plan = pipe.plan(heights, widths, uniforms(sample_keys(0, 0, np.arange(len(images))), pipe.draws))
    jobs = [GpuJob(i % batch, torch.frombuffer(bytearray(data), dtype=torch.uint8),
                   tuple(float(v) for v in plan.box[i]), bool(plan.flip[i]), h, w, f"img-{i}")
            for i, (data, h, w) in enumerate(images)]
    return [jobs[i:i + batch] for i in range(0, len(jobs), batch)]


def _candidates(device: torch.device) -> list[Counting]:
    if device.type == "cpu":
        return [Counting(NvImageCodecDecoder("cpu"))]
    out: list[Counting] = []
    for backend in ("torchcodec", "nvimgcodec"):
        try:
            out.append(Counting(make_decoder(backend, device)))
        except ConfigError as exc:
            print(f"{backend}: not measured: {exc}", file=sys.stderr)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cand: Counting, batches: list[list[GpuJob]], device: torch.device, rounds: int) -> dict[str, Any]:
    gpu = GpuBatchDecoder(cand, device)
    out = torch.empty((max(len(b) for b in batches), 3, OUT, OUT), dtype=torch.uint8, device=device)
    n = sum(len(b) for b in batches)
    gpu.run(batches[0], out[:len(batches[0])])  # warm-up: library set-up, work buffers
    best, failed = float("inf"), 0
    for _ in range(rounds):
        cand.pixels = 0
        _sync(device)
        t0 = time.perf_counter()
        failed = sum(len(gpu.run(b, out[:len(b)])) for b in batches)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    pixels = cand.pixels  # of one round
    decode = float("inf")
    cand.timing = device  # the decode calls alone, synchronized around each: a round of their own
    for _ in range(rounds):
        cand.seconds = 0.0
        for b in batches:
            gpu.run(b, out[:len(b)])
        decode = min(decode, cand.seconds)
    cand.timing = None
    return {"decoder": cand.name, "ms_per_image": 1000 * best / n, "decode_ms_per_image": 1000 * decode / n,
            "decoded_mpix_per_image": pixels / n / 1e6, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--large", type=int, default=0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    batches = _batches(_images(args.cache, args.images, args.large), args.batch)
    candidates = _candidates(device)
    if not candidates:
        print(f"no GPU JPEG decoder works on {device}: see the reasons above", file=sys.stderr)
        return 1
    rows = [measure(c, batches, device, args.rounds) for c in candidates]
    print(f"{sum(len(b) for b in batches)} images, batches of {args.batch}, RandomResizedCrop({OUT}) + flip, "
          f"on {device}; best of {args.rounds} rounds\n")
    print("| decoder | ms/image | decode alone, ms/image | decoded Mpx/image | failed |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['decoder']} | {r['ms_per_image']:.3f} | {r['decode_ms_per_image']:.3f} | "
              f"{r['decoded_mpix_per_image']:.3f} | {r['failed']} |")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "images": sum(len(b) for b in batches),
                                         "batch": args.batch, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
