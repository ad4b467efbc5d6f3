"""Token budgets (NaFlex) in stoker against timm's own NaFlex transforms in a DataLoader, alternating.

    pip install -e ".[test-torchvision]"     # timm, pinned
    python benchmarks/bench_naflex.py CACHE_DIR --data FOLDER [--patch 16] [--tokens 256] [--rounds 3]
                                                [--workers 2] [--batch-size 64]

FOLDER is an ImageFolder of photographs (../shared/corpora/realclasses.py builds one). Both sides make the
same batches' worth of work: each image decoded, resized (aspect kept) to its NaFlex grid of at most
`--tokens` patches, cut into patches, padded to `--tokens`, with coordinates and a validity mask:

- `timm`: a torch DataLoader (`--workers` worker processes) over the image files, each sample through
  timm's `ResizeToSequence(patch, tokens, interpolation="bilinear")` on the Pillow-decoded image and its
  `patchify_image`, padded and stacked by the collate;
- `stoker`: `Loader(pack, transforms=[TokenBudget(patch, tokens)])` on the packed folder, `--workers`
  threads, and again with `Workers(processes=--workers)` (the rows' Python in worker processes).

One epoch of each per round, the order alternating (one warm-up epoch each); images/s, medians of the
rounds, and the medians of the per-round ratios to timm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench_outputs import packed
from stoker import Loader, TokenBudget, Workers
from stoker.tools.tvimport import import_torchvision


class _TimmNaFlex(torch.utils.data.Dataset):
    def __init__(self, files: list[Path], patch: int, tokens: int) -> None:
        from timm.data import naflex_transforms

        self.files, self.patch, self.tokens = files, patch, tokens
        self.resize = naflex_transforms.ResizeToSequence(patch, tokens, interpolation="bilinear")
        self.patchify = naflex_transforms.patchify_image

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple:
        img = torch.from_numpy(np.array(Image.open(self.files[i]).convert("RGB"))).permute(2, 0, 1)
        got, coord, valid = self.patchify(self.resize(img), (self.patch, self.patch))
        out = torch.zeros((self.tokens, got.shape[1]), dtype=got.dtype)
        out[:len(got)] = got
        pad_coord = torch.zeros((self.tokens, 2), dtype=torch.int64)
        pad_coord[:len(got)] = coord
        return out, pad_coord, torch.arange(self.tokens) < len(got)


def _epoch(batches: Any) -> int:
    return sum(len(b[0]) for b in batches)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    if import_torchvision() is None:
        raise SystemExit("timm's transforms need torchvision here: pip install -e '.[test-torchvision]'")
    path = packed(args.cache, 0, args.data)
    files = sorted(p for p in args.data.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    timm_loader = torch.utils.data.DataLoader(_TimmNaFlex(files, args.patch, args.tokens), args.batch_size,
                                              shuffle=True, num_workers=args.workers, persistent_workers=True)
    budget = [TokenBudget(args.patch, args.tokens)]
    loaders: dict[str, Any] = {
        "timm": timm_loader,
        "stoker": Loader(path, args.batch_size, transforms=budget, workers=Workers(num_threads=args.workers)),
        "stoker-processes": Loader(path, args.batch_size, transforms=budget,
                                   workers=Workers(num_threads=args.workers, processes=args.workers,
                                                   persistent=True))}
    rates: dict[str, list[float]] = {k: [] for k in loaders}
    for ld in loaders.values():   # warm-up
        _epoch(ld)
    names = list(loaders)
    for r in range(args.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            n = _epoch(loaders[k])
            rates[k].append(n / (time.perf_counter() - t0))
    for k in ("stoker", "stoker-processes"):
        loaders[k].close()
    print(f"| pipeline | images/s | ratio to timm |\n| --- | --- | --- |")
    for k in names:
        ratio = statistics.median(a / b for a, b in zip(rates[k], rates["timm"]))
        print(f"| {k} | {statistics.median(rates[k]):,.0f} | {ratio:.2f} |")
    print(f"{len(files)} images, patch {args.patch}, {args.tokens} tokens, batch {args.batch_size}, "
          f"{args.workers} workers, {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
