"""Same model, same seeds, two input pipelines: does training on stoker's batches reach torchvision's accuracy?

    pip install -e ".[test-torchvision]"
    python benchmarks/parity.py DATA [--seeds 5] [--epochs 8] [--size 96] [--batch-size 64] [--lr 0.1]
                                     [--workers 2] [--model resnet18] [--device cpu] [--out DIR]
    python benchmarks/parity.py DATA --inspect [--size 96] [--seed 0]

DATA is an ImageFolder with `train/` and `val/` (`../shared/corpora/realclasses.py OUT` builds a labelled
set of real photographs; an ImageNet directory works the same). Both pipelines are the classification recipe
of torchvision's references (RandomResizedCrop(size) + RandomHorizontalFlip for training, Resize(size / 0.875)
+ CenterCrop(size) for validation, then PILToTensor, ToDtype(scale=True) and ImageNet's Normalize), written
once with torchvision's own transforms:

- `torchvision`: `ImageFolder` + `DataLoader(num_workers=W, shuffle=True)`, PIL decode, as the references;
- `stoker`: the same transform objects handed to `stoker.Loader(packed split, ..., num_workers=W,
  shuffle=True)` (the splits are packed once into `--out`).

For each seed the model is initialised once (`torch.manual_seed(seed)`) and trained with each pipeline, the
pipelines taking turns on who goes first, one at a time: SGD (momentum 0.9, weight decay 1e-4) at `--lr`, cosine
over the epochs, cross-entropy. Each epoch logs training loss and training top-1 (on the augmented batches, as
the references print them), validation top-1, images/s of the whole training loop and the data wait (the time
spent in `next()` on the loader). At the end each trained model is also scored through the other pipeline's
validation batches. Written to `--out/parity.json` and printed as markdown: the per-epoch table (mean and spread
over seeds), the paired differences (stoker - torchvision) with a sign count, and the sampler's statistics.

`--inspect` trains nothing: it compares what the two pipelines hand the step in one epoch (the crop area,
aspect, centre and flip of stoker's planned boxes against torchvision's `RandomResizedCrop.get_params` on the
same image sizes, as Kolmogorov-Smirnov p-values; the normalized pixel statistics per image; the labels in
epoch order against ImageFolder's label for the same file; the class mix per batch; and the validation pixels
of the same files side by side).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import stoker  # noqa: E402
from stoker.order import sample_keys, uniforms  # noqa: E402
from stoker.tools.tvimport import import_torchvision  # noqa: E402
from test_torchvision_pixels import ks_pvalue  # noqa: E402  (the tests' two-sample Kolmogorov-Smirnov p-value)

PIPELINES = ("torchvision", "stoker")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def recipe(size: int) -> tuple[Any, Any]:
    """torchvision's reference classification presets at `size`: (train, val) Compose objects."""
    tv = import_torchvision()
    if tv is None:
        raise SystemExit("parity.py compares with torchvision's own pipeline: pip install -e '.[test-torchvision]'")
    import torchvision.transforms.v2 as v2
    tail = [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    train = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), *tail])
    val = v2.Compose([v2.Resize(int(size / 0.875), antialias=True), v2.CenterCrop(size), *tail])
    return train, val


def packed(data: Path, out: Path) -> tuple[Path, Path]:
    """The train and val splits packed once into `out` (a finished pack is reused)."""
    for split in ("train", "val"):
        stoker.pack(data / split, out / split, resume=True, progress=False)
    return out / "train", out / "val"


class Pipeline:
    """One pipeline's train and val loaders for a seed: `epoch(e)` iterates training batches of epoch e."""

    def __init__(self, kind: str, args: argparse.Namespace, seed: int, packs: tuple[Path, Path]) -> None:
        self.kind = kind
        train_tf, val_tf = recipe(args.size)
        if kind == "torchvision":
            tv = import_torchvision()
            data = torch.utils.data
            self.train_set = tv.datasets.ImageFolder(str(args.data / "train"), train_tf)
            val_set = tv.datasets.ImageFolder(str(args.data / "val"), val_tf)
            self.generator = torch.Generator().manual_seed(seed)
            self.train = data.DataLoader(self.train_set, args.batch_size, shuffle=True, num_workers=args.workers,
                                         generator=self.generator, persistent_workers=args.workers > 0)
            self.val = data.DataLoader(val_set, args.batch_size, num_workers=args.workers,
                                       persistent_workers=args.workers > 0)
        else:
            workers = stoker.Workers(num_threads=max(args.workers, 1), decode_quality=args.decode_quality)
            self.train = stoker.Loader(packs[0], args.batch_size, transforms=train_tf, seed=seed, shuffle=True,
                                       workers=workers)
            self.val = stoker.Loader(packs[1], args.batch_size, transforms=val_tf, shuffle=False, workers=workers)

    def epoch(self, e: int) -> Iterable:
        if self.kind == "stoker":
            self.train.set_epoch(e)
        return self.train

    def close(self) -> None:
        for loader in (self.train, self.val):
            if hasattr(loader, "close"):
                loader.close()


def make_model(name: str, classes: int, seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    tv = import_torchvision()
    return getattr(tv.models, name)(num_classes=classes).to(device).to(memory_format=torch.channels_last)


def timed(batches: Iterable) -> Iterable[tuple[Any, Any, float]]:
    """(images, labels, seconds spent in next()) for each batch."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            images, labels = next(it)
        except StopIteration:
            return
        yield images, labels, time.perf_counter() - t0


def evaluate(model: torch.nn.Module, batches: Iterable, device: str) -> float:
    model.eval()
    right = seen = 0
    with torch.no_grad():
        for images, labels in batches:
            logits = model(images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last))
            right += int((logits.argmax(1).cpu() == labels).sum())
            seen += len(labels)
    return 100.0 * right / max(seen, 1)


def train_run(kind: str, seed: int, args: argparse.Namespace, packs: tuple[Path, Path], classes: int
              ) -> tuple[list[dict[str, float]], torch.nn.Module, Pipeline]:
    """Train one model with pipeline `kind`; one record per epoch."""
    pipe = Pipeline(kind, args, seed, packs)
    model = make_model(args.model, classes, seed, args.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    rows = []
    for e in range(args.epochs):
        model.train()
        loss_sum = right = seen = 0.0
        wait = 0.0
        t0 = time.perf_counter()
        for images, labels, waited in timed(pipe.epoch(e)):
            wait += waited
            x = images.to(args.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = labels.to(args.device, non_blocking=True)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(y)
            right += float((logits.argmax(1) == y).sum())
            seen += len(y)
        seconds = time.perf_counter() - t0
        sched.step()
        rows.append({"epoch": e, "train_loss": loss_sum / seen, "train_top1": 100.0 * right / seen,
                     "val_top1": evaluate(model, pipe.val, args.device), "images_per_s": seen / seconds,
                     "data_wait_s": wait, "seconds": seconds})
        print(f"  {kind:11s} seed {seed} epoch {e}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1].items()
                                                                    if k != "epoch"), flush=True)
    return rows, model, pipe


def run(args: argparse.Namespace) -> dict[str, Any]:
    packs = packed(args.data, args.out)
    classes = len([p for p in (args.data / "train").iterdir() if p.is_dir()])
    torch.set_num_threads(args.threads)
    runs: dict[str, dict[int, list]] = {k: {} for k in PIPELINES}
    cross: dict[str, dict[int, dict[str, float]]] = {k: {} for k in PIPELINES}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        order = PIPELINES if seed % 2 == 0 else PIPELINES[::-1]   # who goes first alternates
        done: dict[str, tuple[torch.nn.Module, Pipeline]] = {}
        for kind in order:
            rows, model, pipe = train_run(kind, seed, args, packs, classes)
            runs[kind][seed] = rows
            done[kind] = (model, pipe)
        for kind, (model, _) in done.items():   # each model through both validation pipelines
            cross[kind][seed] = {other: evaluate(model, pipe.val, args.device) for other, (_, pipe) in done.items()}
        for _, pipe in done.values():
            pipe.close()
        write(args, runs, cross)
    return {"runs": runs, "cross": cross}


def write(args: argparse.Namespace, runs: dict, cross: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "parity.json").write_text(json.dumps({"settings": settings, "runs": runs, "cross": cross},
                                                     indent=1))


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 \
        else f"{values[0]:.2f}"


def table(result: dict[str, Any]) -> str:
    """The markdown tables: per epoch (mean ± sd over seeds), paired differences, final accuracies."""
    runs, cross = result["runs"], result["cross"]
    seeds = sorted(set(runs["stoker"]) & set(runs["torchvision"]), key=int)
    if not seeds:
        return "no seed finished with both pipelines"
    epochs = len(runs["stoker"][seeds[0]])
    keys = ("train_loss", "train_top1", "val_top1")
    lines = [f"Mean ± sd over {len(seeds)} seeds.", "",
             "| epoch | " + " | ".join(f"{k} {p}" for k in keys for p in ("torchvision", "stoker")) + " |",
             "|---" * (1 + 2 * len(keys)) + "|"]
    for e in range(epochs):
        cells = [_spread([runs[p][s][e][k] for s in seeds]) for k in keys for p in ("torchvision", "stoker")]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    lines += ["", "Paired differences, stoker - torchvision (same seed, same epoch):", "",
              "| measure | mean | sd | stoker higher in | t (paired) |", "|---|---|---|---|---|"]
    for k in keys:
        d = [runs["stoker"][s][e][k] - runs["torchvision"][s][e][k] for s in seeds for e in range(epochs)]
        last = [runs["stoker"][s][-1][k] - runs["torchvision"][s][-1][k] for s in seeds]
        t = statistics.mean(d) / (statistics.stdev(d) / math.sqrt(len(d))) if len(d) > 1 and statistics.stdev(d) else 0
        lines.append(f"| {k}, all epochs | {statistics.mean(d):+.3f} | {statistics.stdev(d) if len(d) > 1 else 0:.3f} "
                     f"| {sum(x > 0 for x in d)} of {len(d)} | {t:+.2f} |")
        lines.append(f"| {k}, last epoch | {statistics.mean(last):+.3f} | "
                     f"{statistics.stdev(last) if len(last) > 1 else 0:.3f} | {sum(x > 0 for x in last)} of "
                     f"{len(last)} | |")
    lines += ["", "| pipeline | final val top-1 | through the other's val | images/s | data wait, s per epoch |",
              "|---|---|---|---|---|"]
    for p in PIPELINES:
        other = "stoker" if p == "torchvision" else "torchvision"
        final = [runs[p][s][-1]["val_top1"] for s in seeds]
        crossed = [cross[p][s][other] for s in seeds if s in cross[p]]
        speed = [r["images_per_s"] for s in seeds for r in runs[p][s]]
        wait = [r["data_wait_s"] for s in seeds for r in runs[p][s]]
        lines.append(f"| {p} | {_spread(final)} | {_spread(crossed) if crossed else '-'} | "
                     f"{statistics.median(speed):.1f} | {statistics.median(wait):.2f} |")
    return "\n".join(lines)


# ---- --inspect: what each pipeline hands the step ----------------------------------------------------------

def crop_features(boxes: np.ndarray, heights: np.ndarray, widths: np.ndarray) -> dict[str, np.ndarray]:
    """Area share, log aspect and the centre's relative position of (top, left, height, width) boxes."""
    top, left, h, w = (boxes[:, k].astype(np.float64) for k in range(4))
    return {"area": h * w / (heights * widths), "log aspect": np.log(w / h),
            "centre y": (top + h / 2) / heights, "centre x": (left + w / 2) / widths}


def sampler_statistics(args: argparse.Namespace, packs: tuple[Path, Path], epochs: int = 4) -> list[str]:
    """stoker's planned RandomResizedCrop boxes and flips (the Loader's own draws) against torchvision's
    get_params and RandomHorizontalFlip on the same image sizes."""
    tv = import_torchvision()
    train_tf, _ = recipe(args.size)
    loader = stoker.Loader(packs[0], args.batch_size, transforms=train_tf, seed=args.seed, shuffle=True)
    spec = loader.plan.spec.pipeline
    ds = loader.dataset
    heights, widths = ds.heights.astype(np.int64), ds.widths.astype(np.int64)
    ours_boxes, ours_flip, theirs_boxes, theirs_flip, hs, ws = [], [], [], [], [], []
    torch.manual_seed(args.seed)
    for e in range(epochs):
        idx = loader.epoch_indices(e)
        u = uniforms(sample_keys(args.seed, e, idx), spec.draws)
        plan = spec.plan(heights[idx], widths[idx], u)
        ours_boxes.append(plan.box)
        ours_flip.append(plan.flip)
        hs.append(heights[idx])
        ws.append(widths[idx])
        for h, w in zip(heights[idx].tolist(), widths[idx].tolist()):
            theirs_boxes.append(tv.transforms.RandomResizedCrop.get_params(torch.empty(1, h, w), [0.08, 1.0],
                                                                          [3 / 4, 4 / 3]))
            theirs_flip.append(bool(torch.rand(1) < 0.5))
    loader.close()
    h, w = np.concatenate(hs), np.concatenate(ws)
    ours = crop_features(np.concatenate(ours_boxes), h, w)
    theirs = crop_features(np.asarray(theirs_boxes, dtype=np.float64), h, w)
    lines = [f"Crop boxes over {epochs} epochs of {len(idx)} samples (stoker's planner with the Loader's draws, "
             f"torchvision's RandomResizedCrop.get_params on the same sizes):", "",
             "| feature | stoker mean | torchvision mean | KS p |", "|---|---|---|---|"]
    for name in ours:
        lines.append(f"| {name} | {ours[name].mean():.4f} | {theirs[name].mean():.4f} | "
                     f"{ks_pvalue(ours[name], theirs[name]):.3f} |")
    lines.append(f"| flip rate | {np.concatenate(ours_flip).mean():.4f} | {np.mean(theirs_flip):.4f} | |")
    return lines


def inspect(args: argparse.Namespace) -> str:
    """Compare what each pipeline hands the training step in epoch 0 (no training)."""
    packs = packed(args.data, args.out)
    tv = import_torchvision()
    lines = sampler_statistics(args, packs)
    # labels in epoch order against ImageFolder's label for the same file, and the class mix per batch
    train_tf, val_tf = recipe(args.size)
    folder = tv.datasets.ImageFolder(str(args.data / "train"))
    label_of = {Path(p).relative_to(args.data / "train").as_posix(): y for p, y in folder.samples}
    stats: dict[str, dict[str, list]] = {}
    for kind in PIPELINES:
        pipe = Pipeline(kind, args, args.seed, packs)
        got: dict[str, list] = {"labels": [], "mean": [], "std": [], "mean gradient": [], "top class share": []}
        for images, labels in pipe.epoch(0):
            x = images.float()
            got["labels"].append(labels.numpy())
            got["mean"].append(x.mean(dim=(1, 2, 3)).numpy())
            got["std"].append(x.std(dim=(1, 2, 3)).numpy())
            got["mean gradient"].append((x.diff(dim=2).abs().mean(dim=(1, 2, 3))
                                         + x.diff(dim=3).abs().mean(dim=(1, 2, 3))).numpy())   # sharpness
            got["top class share"].append(np.bincount(labels.numpy()).max() / len(labels))
        if kind == "stoker":
            idx = pipe.train.epoch_indices(0)
            expect = np.array([label_of[pipe.train.dataset.sample(int(i)).key] for i in idx])
            labels = np.concatenate(got["labels"])[:len(expect)]
            lines += ["", f"stoker's labels in epoch order against ImageFolder's for the same files: "
                          f"{int((labels == expect).sum())} of {len(expect)} agree"]
        stats[kind] = got
        pipe.close()
    lines += ["", "Per image, epoch 0 (normalized pixels): distributions compared", "",
              "| statistic | torchvision mean | stoker mean | KS p |", "|---|---|---|---|"]
    for name in ("mean", "std", "mean gradient"):
        a, b = (np.concatenate(stats[k][name]) for k in PIPELINES)
        lines.append(f"| per-image {name} | {a.mean():.4f} | {b.mean():.4f} | {ks_pvalue(a, b):.3f} |")
    a, b = (np.asarray(stats[k]["top class share"]) for k in PIPELINES)
    lines.append(f"| largest class share of a batch | {a.mean():.4f} | {b.mean():.4f} | {ks_pvalue(a, b):.3f} |")
    # validation pixels of the same files: deterministic, so compared image by image
    val_folder = tv.datasets.ImageFolder(str(args.data / "val"), val_tf)
    loader = stoker.Loader(packs[1], len(val_folder), transforms=val_tf, shuffle=False,
                           workers=stoker.Workers(decode_quality=args.decode_quality))
    ours, ours_labels = next(iter(loader))
    key_to_row = {loader.dataset.sample(i).key: i for i in range(len(loader.dataset))}
    diffs, agree = [], 0
    for k, (path, y) in enumerate(val_folder.samples):
        row = key_to_row[Path(path).relative_to(args.data / "val").as_posix()]
        theirs, _ = val_folder[k]
        diffs.append((ours[row] - theirs).abs().flatten() * 255 * STD[1])   # about pixel levels
        agree += int(ours_labels[row]) == y
    loader.close()
    d = torch.cat(diffs)
    lines += ["", f"Validation pixels, file by file ({len(diffs)} images, ~levels): mean |diff| "
                  f"{float(d.mean()):.3f}, share > 1 level {float((d > 1).float().mean()):.4f}, max "
                  f"{float(d.max()):.1f}; labels agree on {agree} of {len(diffs)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="an ImageFolder with train/ and val/")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="--inspect's seed")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch's intra-op threads")
    ap.add_argument("--model", default="resnet18", help="a torchvision.models constructor")
    ap.add_argument("--decode-quality", default="exact", choices=("exact", "accurate", "fast"),
                    help="stoker's Workers(decode_quality=)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("parity-out"))
    ap.add_argument("--inspect", action="store_true", help="compare the batches only, train nothing")
    args = ap.parse_args(argv)
    args.data = args.data.resolve()
    if args.inspect:
        print(inspect(args))
        return
    print(table(run(args)))
    print()
    print("\n".join(sampler_statistics(args, packed(args.data, args.out))))


if __name__ == "__main__":
    main()
