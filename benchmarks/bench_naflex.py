"""Token budgets (NaFlex) in stoker against timm's own NaFlex loader, on the same images, alternating.

    pip install -e ".[test-torchvision]"     # timm, pinned
    python benchmarks/bench_naflex.py CACHE_DIR [--images 1000] [--real 1000] [--data FOLDER]
                                                [--patch 16] [--tokens 256] [--rounds 3] [--workers 2]
                                                [--batch-size 64] [--json out.json]

Image sets, each packed once under CACHE_DIR:
- `generated`: `--images` generated ImageNet-like JPEGs (`stoker.tools.synth`, about 400x350);
- `real`: `--real` photographs made by ../shared/corpora/realclasses.py (random crops of 12 photographs at
  ImageNet's sizes, JPEG), skipped with the reason where ../shared is not beside this checkout (or the
  script cannot build the set); `--real 0` skips it;
- `--data FOLDER`: an ImageFolder of your own, in place of both.

Both sides make the same batches: each image decoded, resized (aspect kept) to its NaFlex grid of at most
`--tokens` patches, cut into patches, padded to `--tokens`, float32 normalized with ImageNet's mean and std,
with each patch's coordinates and a validity mask ({patches [B, L, p*p*3], patch_coord, patch_valid}):

- `timm`: `timm.data.create_naflex_loader(is_training=True, no_aug=True, train_seq_lens=(tokens,))` over
  `timm.data.ImageDataset(folder)`, `--workers` worker processes: its training wrapper (a batch per worker,
  `ResizeToSequence`, `Patchify`, `NaFlexCollator`) and its prefetcher normalizing on the CPU;
- `stoker`: `Loader(pack, transforms=[TokenBudget(patch, tokens)], device=DeviceOptions("cpu",
  normalize="imagenet", memory_format="channels_last"))`, `--workers` threads, each batch viewed as patches
  (`patches()`: channels_last float batches are patch sequences in memory, no copy);
- `stoker-processes`: the same in `Workers(processes=--workers)` (the rows' Python out of this process);
- `stoker-uint8`: the same as `stoker` without the device stage: uint8 patches, what goes to a GPU (where
  the device stage normalizes on the device; timm's collate makes float32 patches on the CPU either way).

One epoch of each per round, the order alternating (one warm-up epoch each first); images/s, the medians
of the rounds, and the medians of the per-round ratios to timm.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from bench_outputs import packed   # the same packs as the output bench (run from benchmarks/ or as a script)
from stoker import DeviceOptions, Loader, TokenBudget, Workers
from stoker.loading.tokens import patches
from stoker.tools.synth import cached_imagenet_like
from stoker.tools.tvimport import import_torchvision

REALCLASSES = Path(__file__).resolve().parents[1].parent / "shared" / "corpora" / "realclasses.py"


def real_photos(cache: Path, n: int) -> tuple[Path | None, str]:
    """The real-photograph ImageFolder (built once in `cache`), or None and the reason it is skipped."""
    if n <= 0:
        return None, "--real 0"
    if not REALCLASSES.exists():
        return None, "../shared/corpora/realclasses.py is not beside this checkout"
    out = cache / f"realclasses-n{n}"
    if not (out / "val.txt").exists():
        done = subprocess.run([sys.executable, str(REALCLASSES), str(out), "--train", str(n), "--val", "0"],
                              capture_output=True, text=True)
        if done.returncode:
            return None, f"realclasses.py could not build the set: {done.stderr.strip().splitlines()[-1:]}"
    return out / "train", ""


def timm_loader(folder: Path, args: argparse.Namespace) -> Any:
    """timm's own NaFlex training loader, without augmentation (its eval resize: aspect kept, no crop)."""
    from timm.data import ImageDataset, create_naflex_loader

    with contextlib.redirect_stdout(io.StringIO()):   # its schedule's one-line report
        return create_naflex_loader(ImageDataset(str(folder)), patch_size=args.patch, train_seq_lens=(args.tokens,),
                                    max_seq_len=args.tokens, batch_size=args.batch_size, is_training=True,
                                    no_aug=True, num_workers=args.workers, device=torch.device("cpu"),
                                    pin_memory=False, persistent_workers=True)


def stoker_batches(loader: Loader, patch: int) -> Iterable[dict[str, torch.Tensor]]:
    """The Loader's batches in the dict timm's NaFlexVit takes."""
    for images, _, extras in loader:
        yield {"patches": patches(images, patch), "patch_coord": extras["patch_coord"],
               "patch_valid": extras["patch_valid"]}


def _epoch(batches: Iterable[Any]) -> int:
    n = 0
    for batch in batches:
        inputs = batch[0] if isinstance(batch, tuple) else batch
        n += len(inputs["patches"])
    return n


def bench_set(folder: Path, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Each pipeline's images/s per round on one image set, the order alternating."""
    budget = [TokenBudget(args.patch, args.tokens)]
    device = DeviceOptions("cpu", normalize="imagenet", memory_format="channels_last")
    threads = Workers(num_threads=args.workers)
    ours = {"stoker": Loader(path, args.batch_size, transforms=budget, device=device, workers=threads),
            "stoker-processes": Loader(path, args.batch_size, transforms=budget, device=device,
                                       workers=Workers(num_threads=args.workers, processes=args.workers,
                                                       persistent=True)),
            "stoker-uint8": Loader(path, args.batch_size, transforms=budget, workers=threads)}
    theirs = timm_loader(folder, args)
    epochs = {"timm": lambda: theirs,
              **{k: (lambda ld=ld: stoker_batches(ld, args.patch)) for k, ld in ours.items()}}
    rates: dict[str, list[float]] = {k: [] for k in epochs}
    images = {k: _epoch(make()) for k, make in epochs.items()}   # warm-up; each side's images per epoch
    names = list(epochs)
    try:
        for r in range(args.rounds):
            for k in (names if r % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                n = _epoch(epochs[k]())
                rates[k].append(n / (time.perf_counter() - t0))
    finally:
        for ld in ours.values():
            ld.close()
    return {"images": images, "rates": rates,
            "ratios": {k: statistics.median(a / b for a, b in zip(rates[k], rates["timm"])) for k in names}}


def report(name: str, result: dict[str, Any]) -> str:
    lines = [f"{name}: {result['images']['timm']} images an epoch", "| pipeline | images/s | ratio to timm |",
             "| --- | --- | --- |"]
    for k, rates in result["rates"].items():
        lines.append(f"| {k} | {statistics.median(rates):,.0f} | {result['ratios'][k]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--images", type=int, default=1000, help="generated JPEGs")
    ap.add_argument("--real", type=int, default=1000, help="real photographs (realclasses.py); 0 skips them")
    ap.add_argument("--data", type=Path, help="an ImageFolder of your own, in place of both sets")
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if import_torchvision() is None:
        raise SystemExit("timm's NaFlex loader needs torchvision here: pip install -e '.[test-torchvision]'")
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.data is not None:
        sets = {args.data.name: args.data}
    else:
        sets = {"generated": cached_imagenet_like(args.cache, args.images)}
        real, why = real_photos(args.cache, args.real)
        if real is None:
            print(f"real photographs skipped: {why}")
        else:
            sets["real"] = real
    results = {}
    for name, folder in sets.items():
        results[name] = bench_set(folder, packed(args.cache, 0, folder), args)
        print(report(name, results[name]), flush=True)
    print(f"patch {args.patch}, {args.tokens} tokens, batch {args.batch_size}, {args.workers} workers "
          f"(timm: processes; stoker: threads, or processes), {args.rounds} rounds")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
