"""How well each epoch order mixes labels into batches. The default layout is the worst case for
shard-local orders: a dataset packed class by class (what packing an ImageFolder tree gives), so a
shard holds only a few classes; `--packed shuffled` shows a dataset shuffled before packing.

    python benchmarks/shuffle_quality.py                      # ImageNet-like: 1000 classes x 100, shards of 1000
    python benchmarks/shuffle_quality.py --classes 100 --per-class 500 --shard-rows 2500 --batch-size 128

Per order, averaged over batches of one epoch (rank 0 of `--world-size`):
- distinct: distinct labels per batch, and its ratio to the global random order's;
- same-label pairs: the share of sample pairs in a batch with the same label, as a multiple of the
  global random order's (1.0 is as good as a full shuffle; higher means batches are lumpy);
- lag-1: the share of consecutive samples with the same label (the label autocorrelation at lag 1).
Pure arithmetic on indices: no images are read, the figures are exact for the given layout.
"""

from __future__ import annotations

import argparse

import numpy as np

from stoker.order import epoch_order, shard_window_order


def batch_stats(labels: np.ndarray, batch_size: int) -> tuple[float, float, float]:
    """(mean distinct labels per batch, mean same-label pair share per batch, lag-1 same-label share)."""
    n = len(labels) // batch_size * batch_size
    batches = labels[:n].reshape(-1, batch_size)
    distinct, pairs = [], []
    for b in batches:
        _, counts = np.unique(b, return_counts=True)
        distinct.append(len(counts))
        pairs.append((counts * (counts - 1)).sum() / (batch_size * (batch_size - 1)))
    lag1 = float(np.mean(labels[1:] == labels[:-1]))
    return float(np.mean(distinct)), float(np.mean(pairs)), lag1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--shard-rows", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--windows", default="1,2,4,8,16,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packed", choices=("by-class", "shuffled"), default="by-class",
                    help="the dataset's layout in the shards: class by class, or shuffled before packing")
    args = ap.parse_args()

    labels = np.repeat(np.arange(args.classes), args.per_class)  # packed class by class
    if args.packed == "shuffled":
        labels = labels[np.random.default_rng(12345).permutation(len(labels))]
    n = len(labels)
    rows = [args.shard_rows] * (n // args.shard_rows) + ([n % args.shard_rows] if n % args.shard_rows else [])
    orders: list[tuple[str, np.ndarray]] = [
        ("random (global)", epoch_order(n, seed=args.seed, epoch=0)),
        ("shard_random (block 64, window 32)", epoch_order(n, seed=args.seed, epoch=0, order="shard_random",
                                                           shard_rows=rows)),
    ]
    for w in (int(x) for x in args.windows.split(",")):
        orders.append((f"shard_window, window {w} shards", shard_window_order(
            rows, seed=args.seed, epoch=0, rank=0, world_size=args.world_size, window=w)))
    layout = "class by class" if args.packed == "by-class" else "in shuffled order"
    print(f"{n} samples, {args.classes} classes packed {layout}, {len(rows)} shards of "
          f"{args.shard_rows} rows, batch "
          f"{args.batch_size}, rank 0 of {args.world_size}\n")
    print("| order | distinct labels / batch | vs random | same-label pairs vs random | lag-1 same label |")
    print("| --- | ---: | ---: | ---: | ---: |")
    ref_distinct, ref_pairs, _ = batch_stats(labels[orders[0][1]], args.batch_size)
    for name, order in orders:
        distinct, pairs, lag1 = batch_stats(labels[order], args.batch_size)
        print(f"| {name} | {distinct:.1f} | {distinct / ref_distinct:.2f} | {pairs / ref_pairs:.1f}x | {lag1:.4f} |")


if __name__ == "__main__":
    main()
