"""stoker's pixels against torchvision's own, op by op, on real photographs: the tables of docs/transforms.md.

    pip install -e ".[test-torchvision]"
    python benchmarks/compare_torchvision.py [--photos DIR] [--crops 2000]

DIR holds JPEG photographs (default: the photographs of Pillow's test images, in
../shared/corpora/pillow-test-images beside this checkout, the same ones the tests use). Each is decoded by
Pillow, as torchvision's ImageFolder does. Printed as markdown:

1. resampling on the exact path (full-size decode, `decode_quality="exact"`), against torchvision's
   tensor kernels and against its PIL path;
2. the default path (DCT-scaled decode, then the antialiased remainder) against torchvision with the same
   RandomResizedCrop boxes (per-image difference), and as distributions over `--crops` random crops
   (per-image std and mean gradient, two-sample Kolmogorov-Smirnov p-values);
3. the per-sample pixel kernels (`transforms/pixels.py`) and their batched twins (`transforms/gpu.py`)
   against `torchvision.transforms.v2.functional` on the same photos.

For every op: the largest difference, the share of values that differ at all, and the share that differ by
more than 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from stoker import codecs  # noqa: E402
from stoker.transforms import (CenterCrop, Pipeline, RandomResizedCrop, Resize, crop_resize_into,  # noqa: E402
                               decode_minimums, gpu, pixels)
from test_torchvision_pixels import PHOTOS, crop_statistics, ks_pvalue  # noqa: E402
from torchvision_helpers import chw, hwc, v2, v2_functional  # noqa: E402

DEFAULT_PHOTOS = ROOT.parent / "shared" / "corpora" / "pillow-test-images"


def load(folder: Path) -> dict[str, tuple[bytes, np.ndarray]]:
    """name -> (JPEG bytes re-saved at quality 92, as a packed dataset holds them; the decoded RGB)."""
    names = [n for n in PHOTOS if (folder / n).exists()] if folder == DEFAULT_PHOTOS else \
        sorted(p.name for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    out = {}
    for name in names:
        with Image.open(folder / name) as im:
            rgb = im.convert("RGB")
        data = codecs.encode_jpeg(np.asarray(rgb), 92)
        with Image.open(__import__("io").BytesIO(data)) as im:
            out[name] = (data, np.asarray(im.convert("RGB")))
    if not out:
        sys.exit(f"no JPEG photographs in {folder}")
    return out


class Table:
    def __init__(self, title: str) -> None:
        self.title, self.rows = title, []

    def add(self, op: str, ours: list[np.ndarray], theirs: list[np.ndarray]) -> None:
        d = np.concatenate([np.abs(a.astype(np.int16) - b.astype(np.int16)).ravel() for a, b in zip(ours, theirs)])
        self.rows.append((op, int(d.max()), float((d > 0).mean()), float((d > 1).mean()), float(d.mean())))

    def print(self) -> None:
        print(f"\n{self.title}\n")
        print("| op | max difference | values that differ | differ by more than 1 | mean abs difference |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for op, worst, any_, over1, mean in self.rows:
            print(f"| {op} | {worst} | {any_:.3%} | {over1:.3%} | {mean:.3f} |")


def resampling(photos: dict) -> Table:
    tv, F = v2(), v2_functional()
    t = Table("Resampling, exact path (full-size decode) vs torchvision 0.28 (uint8 tensors; PIL where named)")
    cases: list[tuple[str, list, Callable]] = []
    for mode in ("bilinear", "bicubic", "nearest"):
        for aa in ((True, False) if mode != "nearest" else (True,)):
            tmode = tv.InterpolationMode(mode)
            label = f"{mode}{'' if aa else ', antialias=False'}"
            cases.append((f"Resize(256) {label}", [Resize(256, mode, aa)], tv.Resize(256, tmode, antialias=aa)))
            cases.append((f"Resize(256) + CenterCrop(224) {label}", [Resize(256, mode, aa), CenterCrop(224)],
                          tv.Compose([tv.Resize(256, tmode, antialias=aa), tv.CenterCrop(224)])))
    for name, ops, ref in cases:
        ours, theirs = [], []
        for _, img in photos.values():
            ours.append(Pipeline(ops).apply(img))
            theirs.append(hwc(ref(chw(img))))
        t.add(name, ours, theirs)
    ours, theirs, pil = [], [], []
    for _, img in photos.values():
        ours.append(Pipeline([Resize(256), CenterCrop(224)]).apply(img))
        pil.append(np.asarray(tv.Compose([tv.Resize(256), tv.CenterCrop(224)])(Image.fromarray(img))))
    t.add("Resize(256) + CenterCrop(224) vs torchvision's PIL path", ours, pil)
    ours, theirs = [], []
    for _, img in photos.values():
        x = chw(img)
        for _ in range(20):
            top, left, h, w = tv.RandomResizedCrop.get_params(x, [0.08, 1.0], [3 / 4, 4 / 3])
            out = np.empty((224, 224, 3), np.uint8)
            crop_resize_into(img, (top, left, h, w), out, False, *img.shape[:2])
            ours.append(out)
            theirs.append(hwc(F.resized_crop(x, top, left, h, w, [224, 224], antialias=True)))
    t.add("RandomResizedCrop(224), 20 boxes per photo (torchvision's get_params)", ours, theirs)
    return t


def fast_path(photos: dict, crops: int) -> tuple[Table, list[str]]:
    """The default path with torchvision's boxes (per-image differences), and the crop distributions."""
    tv, F = v2(), v2_functional()
    t = Table("Default path (DCT-scaled decode, then antialiased resampling) vs torchvision, same boxes")
    ours, theirs, per_image = [], [], []
    rrc = tv.RandomResizedCrop(224)
    torch.manual_seed(0)
    per_photo = max(1, crops // len(photos))
    for data, img in photos.values():
        h, w = img.shape[:2]
        x = chw(img)
        for _ in range(per_photo):
            box = rrc.make_params([x])
            top, left, bh, bw = box["top"], box["left"], box["height"], box["width"]
            mh, mw = decode_minimums((top, left, bh, bw), 224, 224, h, w)
            scaled = codecs.decode_rgb(data, "jpeg", "photo", height=h, width=w, min_height=mh, min_width=mw)
            out = np.empty((224, 224, 3), np.uint8)
            crop_resize_into(scaled, (top, left, bh, bw), out, False, h, w)
            ref = hwc(F.resized_crop(x, top, left, bh, bw, [224, 224], antialias=True))
            ours.append(out)
            theirs.append(ref)
            per_image.append(np.abs(out.astype(np.int16) - ref).mean())
    t.add(f"RandomResizedCrop(224), {len(ours)} crops", ours, theirs)
    t.add("Resize(256) + CenterCrop(224), through the Loader", *loader_vs_torchvision(photos))
    a, b = np.stack(ours), np.stack(theirs)
    pi = np.array(per_image)
    lines = [f"per-image mean |difference|: median {np.median(pi):.2f}, 95th percentile {np.percentile(pi, 95):.2f}, "
             f"max {pi.max():.2f} (0..255 units)"]
    for what, x1, x2 in zip(("std", "mean gradient"), crop_statistics(a), crop_statistics(b)):
        lines.append(f"{what}: stoker {x1.mean():.3f}, torchvision {x2.mean():.3f}, paired KS p = "
                     f"{ks_pvalue(x1, x2):.3f} over {len(x1)} crops")
    return t, lines


def loader_vs_torchvision(photos: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The Loader's default path on the photos (as JPEGs in a folder) and torchvision on Pillow's decode."""
    import tempfile

    import stoker
    from torchvision_helpers import images_hwc

    tv = v2()
    ref = tv.Compose([tv.Resize(256), tv.CenterCrop(224)])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "photos"
        folder.mkdir()
        names = sorted(photos)
        for k, name in enumerate(names):
            (folder / f"{k:03d}.jpg").write_bytes(photos[name][0])
        with stoker.Loader(stoker.open_loose(Path(tmp)), len(names), transforms=[Resize(256), CenterCrop(224)],
                           order="sequential") as loader:
            ours = list(images_hwc(next(iter(loader))[0]))
    return ours, [hwc(ref(chw(photos[name][1]))) for name in names]


def independent_crops(photos: dict, crops: int) -> list[str]:
    """Each side draws its own RandomResizedCrop boxes (stoker's planner, torchvision's get_params)."""
    tv = v2()
    per_photo = max(1, crops // len(photos))
    ours, theirs = [], []
    pipe = Pipeline([RandomResizedCrop(224)])
    rng = np.random.default_rng(1)
    torch.manual_seed(1)
    rrc = tv.RandomResizedCrop(224)
    for data, img in photos.values():
        h, w = img.shape[:2]
        for _ in range(per_photo):
            p = pipe.plan(np.array([h]), np.array([w]), rng.random((1, pipe.draws)))
            mh, mw = decode_minimums(p.box[0], 224, 224, h, w)
            scaled = codecs.decode_rgb(data, "jpeg", "photo", height=h, width=w, min_height=mh, min_width=mw)
            out = np.empty((224, 224, 3), np.uint8)
            crop_resize_into(scaled, p.box[0], out, False, h, w)
            ours.append(out)
            theirs.append(np.asarray(rrc(Image.fromarray(img))))
    a, b = np.stack(ours), np.stack(theirs)
    return [f"{what}: stoker {x1.mean():.3f}, torchvision {x2.mean():.3f}, KS p = {ks_pvalue(x1, x2):.3f} "
            f"({len(x1)} crops each, independent boxes, torchvision on PIL images)"
            for what, x1, x2 in zip(("std", "mean gradient"), crop_statistics(a), crop_statistics(b))]


def kernels(photos: dict) -> Table:
    F = v2_functional()
    t = Table("Pixel kernels vs torchvision.transforms.v2.functional (uint8 tensors)")
    imgs = [img[:384, :384] for _, img in photos.values()]
    one = torch.ones(1)
    cases: list[tuple[str, Callable, Callable, Callable]] = [
        ("brightness 1.4", lambda a: pixels.adjust_brightness(a, 1.4), lambda x: gpu.adjust_brightness(x, one * 1.4),
         lambda x: F.adjust_brightness(x, 1.4)),
        ("contrast 0.6", lambda a: pixels.adjust_contrast(a, 0.6), lambda x: gpu.adjust_contrast(x, one * 0.6),
         lambda x: F.adjust_contrast(x, 0.6)),
        ("saturation 1.5", lambda a: pixels.adjust_saturation(a, 1.5), lambda x: gpu.adjust_saturation(x, one * 1.5),
         lambda x: F.adjust_saturation(x, 1.5)),
        ("saturation 0.3", lambda a: pixels.adjust_saturation(a, 0.3), lambda x: gpu.adjust_saturation(x, one * 0.3),
         lambda x: F.adjust_saturation(x, 0.3)),
        ("hue 0.1", lambda a: pixels.adjust_hue(a, 0.1), lambda x: gpu.adjust_hue(x, one * 0.1),
         lambda x: F.adjust_hue(x, 0.1)),
        ("sharpness 1.8", lambda a: pixels.adjust_sharpness(a, 1.8), lambda x: gpu.adjust_sharpness(x, one * 1.8),
         lambda x: F.adjust_sharpness(x, 1.8)),
        ("posterize 3", lambda a: pixels.posterize(a, 3), lambda x: gpu.posterize(x, torch.tensor([3])),
         lambda x: F.posterize(x, 3)),
        ("solarize 128", lambda a: pixels.solarize(a, 128), lambda x: gpu.solarize(x, one * 128),
         lambda x: F.solarize(x, 128)),
        ("autocontrast", pixels.autocontrast, gpu.autocontrast, F.autocontrast),
        ("equalize", pixels.equalize, gpu.equalize, F.equalize),
        ("invert", pixels.invert, gpu.invert, F.invert),
        ("grayscale", lambda a: np.repeat(pixels.grayscale(a)[..., None], 3, 2), None,
         lambda x: F.rgb_to_grayscale(x, 3)),
        ("gaussian blur k=5 sigma=1.0", lambda a: pixels.gaussian_blur(a, (5, 5), (1.0, 1.0)), None,
         lambda x: F.gaussian_blur(x, [5, 5], [1.0, 1.0])),
        ("gaussian blur k=23 sigma=2.0", lambda a: pixels.gaussian_blur(a, (23, 23), (2.0, 2.0)), None,
         lambda x: F.gaussian_blur(x, [23, 23], [2.0, 2.0])),
        ("rotate 30, nearest", lambda a: pixels.rotate(a, 30.0), None, lambda x: F.rotate(x, 30.0)),
        ("rotate 30, bilinear", lambda a: pixels.rotate(a, 30.0, "bilinear"), None,
         lambda x: F.rotate(x, 30.0, F.InterpolationMode.BILINEAR)),
    ]
    for name, cpu_fn, batched_fn, ref_fn in cases:
        theirs = [hwc(ref_fn(chw(img))) for img in imgs]
        t.add(name, [cpu_fn(img.copy()) for img in imgs], theirs)
        if batched_fn is not None:
            t.add(f"{name} (batched)", [hwc(batched_fn(chw(img)[None])[0]) for img in imgs], theirs)
    return t


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=Path, default=DEFAULT_PHOTOS, help="a folder of JPEG photographs")
    parser.add_argument("--crops", type=int, default=2000, help="random crops for the distribution comparison")
    args = parser.parse_args(argv)
    photos = load(args.photos)
    print(f"{len(photos)} photographs from {args.photos.name}: "
          + ", ".join(f"{n} ({img.shape[1]}x{img.shape[0]})" for n, (_, img) in photos.items()))
    resampling(photos).print()
    table, lines = fast_path(photos, args.crops)
    table.print()
    print()
    for line in lines + independent_crops(photos, args.crops):
        print(f"- {line}")
    kernels(photos).print()


if __name__ == "__main__":
    main()
