"""ImageNet-like generated data for the demo, the benchmarks and the tests.

A benchmark on white noise or flat colour measures the wrong thing: noise makes JPEGs several
times larger than photos and flat colour makes them tiny, so decode cost and I/O both come out
wrong. `synth_image` builds what a JPEG codec sees in a photo: smooth low-frequency colour fields,
objects with anti-aliased edges and their own shading, and fine texture whose strength varies
across the picture (smooth sky next to grass). `make_imagenet_like` writes a set of them with
ImageNet's statistics: mean about 400x350 pixels, shorter side 250-500, mixed aspect ratios,
JPEG quality 85-95 with 4:2:0 chroma, mean file size near 100 KB.

Every image is a pure function of `(seed, index)`, so a set is bit-identical however many
workers write it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import cv2
import numpy as np
import simplejpeg

from .._progress import Progress
from .._system import usable_cpus
from ..errors import ConfigError, StokerError

__all__ = [
    "ASPECT_RATIOS",
    "cached_imagenet_like",
    "make_imagenet_like",
    "make_tiny_jpegs",
    "sample_size",
    "synth_image",
]

# (long side / short side, weight): square, 5:4, 4:3, 3:2 and 16:9; weighted mean 1.26.
ASPECT_RATIOS: tuple[tuple[float, float], ...] = (
    (1.0, 0.35), (5 / 4, 0.10), (4 / 3, 0.35), (3 / 2, 0.12), (16 / 9, 0.08),
)
LANDSCAPE_FRACTION = 0.8           # ImageNet is mostly landscape
SHORT_SIDE_RANGE = (250, 500)      # pixels
QUALITY_RANGE = (85, 95)           # JPEG quality, inclusive
# Texture amplitudes (0-255 grey levels), tuned so the mean file lands near 100 KB (measured:
# 100 KB over the first 100 images of seed 0).
TEXTURE_AMPLITUDE = 80.0
CHROMA_AMPLITUDE = 11.0

_LAYOUTS = ("folder", "list")
_CHUNK = 16   # images per task sent to a worker process


def sample_size(rng: np.random.Generator) -> tuple[int, int]:
    """Draw one (height, width) in pixels.

    The shorter side follows a triangular distribution on 250-500 with its mode at 250 (mean
    333 px): with the aspect ratios above this gives a mean of about 400x350 (width x height),
    which a uniform shorter side on 250-500 cannot (its mean alone is 375).
    """
    lo, hi = SHORT_SIDE_RANGE
    short = rng.triangular(lo, lo, hi)
    ratios = np.array([r for r, _ in ASPECT_RATIOS])
    weights = np.array([w for _, w in ASPECT_RATIOS])
    ratio = float(rng.choice(ratios, p=weights / weights.sum()))
    long_ = short * ratio
    if rng.random() < LANDSCAPE_FRACTION:
        return int(round(short)), int(round(long_))
    return int(round(long_)), int(round(short))


def _smooth_field(rng: np.random.Generator, height: int, width: int, cells: int,
                  channels: int, interpolation: int = cv2.INTER_LINEAR) -> np.ndarray:
    """Random values on a coarse grid (about `cells` along the longer side), upsampled.

    float32 [height, width, channels], roughly unit variance.
    """
    gh = max(2, round(cells * height / max(height, width)))
    gw = max(2, round(cells * width / max(height, width)))
    grid = rng.standard_normal((gh, gw, channels), dtype=np.float32)
    out = cv2.resize(grid, (width, height), interpolation=interpolation)
    return out.reshape(height, width, channels)


def _noise(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Zero-mean, unit-variance uniform noise, float32 [height, width] (uniform: 4x faster than normal)."""
    out = rng.random((height, width), dtype=np.float32)
    out -= 0.5
    out *= 3.4641   # sqrt(12)
    return out


def _texture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Fine texture, float32 [height, width], about unit amplitude, from three parts in random
    proportions: sharp-edged blobs (foliage, gravel: band-passed noise through a steep ramp),
    streaks (grass, fur, wood grain: noise stretched along one axis) and faint sensor grain."""
    blob_scale = float(rng.uniform(1.5, 3.5))
    bh, bw = max(2, int(height / blob_scale)), max(2, int(width / blob_scale))
    blobs = cv2.resize(_noise(rng, bh, bw), (width, height), interpolation=cv2.INTER_LINEAR)
    blobs *= np.float32(2.5)
    np.clip(blobs, -1.0, 1.0, out=blobs)   # a steep ramp: blob edges a pixel or two wide
    along = int(rng.integers(6, 16))
    if rng.random() < 0.5:   # vertical streaks
        small = _noise(rng, max(2, height // along), width)
    else:
        small = _noise(rng, height, max(2, width // along))
    streaks = cv2.resize(small, (width, height), interpolation=cv2.INTER_LINEAR)
    mix = float(rng.uniform(0.2, 0.8))
    tex = blobs * np.float32(mix)
    tex += streaks * np.float32(0.9 * (1.0 - mix))
    tex += _noise(rng, height, width) * np.float32(0.12)
    return tex


def _chroma(rng: np.random.Generator, strength: np.ndarray, amplitude: float
            ) -> tuple[np.ndarray, np.ndarray]:
    """Two colour-difference noise planes at half resolution, upsampled: float32 [H, W] each."""
    height, width = strength.shape
    h2, w2 = -(-height // 2), -(-width // 2)
    local = cv2.resize(strength, (w2, h2), interpolation=cv2.INTER_AREA) * np.float32(amplitude)
    return tuple(cv2.resize(_noise(rng, h2, w2) * local, (width, height),  # type: ignore[return-value]
                            interpolation=cv2.INTER_LINEAR) for _ in range(2))


def _palette_colour(rng: np.random.Generator, hue: float | None = None) -> np.ndarray:
    """An RGB colour (0-255 float32) with photo-like saturation; `hue` in [0, 1) when fixed."""
    h = rng.random() if hue is None else hue
    s = rng.uniform(0.15, 0.8)
    v = rng.uniform(0.25, 0.85)
    i = int(h * 6) % 6
    f = h * 6 - math.floor(h * 6)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return np.array(rgb, np.float32) * 255.0


def _shape_points(rng: np.random.Generator, kind: int, cx: float, cy: float, r: float) -> np.ndarray:
    """Outline of a rotated box (kind 1) or an irregular polygon (kind 2) around (cx, cy)."""
    n = 4 if kind == 1 else int(rng.integers(3, 8))
    if kind == 1:
        angles = np.arange(n) * (np.pi / 2) + rng.uniform(0, np.pi)
        radii = np.full(n, r)
    else:
        angles = np.sort(rng.uniform(0, 2 * np.pi, n))
        radii = r * rng.uniform(0.5, 1.0, n)
    return np.stack([cx + radii * np.cos(angles), cy + radii * np.sin(angles)], axis=1)


def _add_object(rng: np.random.Generator, img: np.ndarray, kind: int, scale: float,
                hue: float | None) -> None:
    """Composite one shaded object (ellipse, box or polygon) with anti-aliased, maybe blurred
    edges into `img` (float32 HxWx3) in place; only the object's bounding box is touched."""
    height, width = img.shape[:2]
    r = scale * min(height, width) * rng.uniform(0.5, 1.0)
    cx, cy = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
    blur = float(rng.choice([0.0, 0.0, 0.8, 2.0]))   # some objects in focus, some not
    pad = r + 3 * blur + 2
    x0, x1 = max(0, int(cx - pad)), min(width, int(cx + pad) + 1)
    y0, y1 = max(0, int(cy - pad)), min(height, int(cy + pad) + 1)
    mask = np.zeros((y1 - y0, x1 - x0), np.uint8)
    if kind == 0:
        axes = (int(r), int(r * rng.uniform(0.4, 1.0)))
        cv2.ellipse(mask, (int(cx) - x0, int(cy) - y0), axes, float(rng.uniform(0, 180)), 0, 360,
                    255, -1, cv2.LINE_AA)
    else:
        pts = _shape_points(rng, kind, cx - x0, cy - y0, r)
        cv2.fillPoly(mask, [pts.astype(np.int32)], 255, cv2.LINE_AA)
    alpha = mask.astype(np.float32) * (1.0 / 255.0)
    if blur > 0:
        alpha = cv2.GaussianBlur(alpha, (0, 0), blur)
    shade = _palette_colour(rng, hue) + 30.0 * _smooth_field(rng, y1 - y0, x1 - x0, 3, 3)
    region = img[y0:y1, x0:x1]
    region[...] = cv2.blendLinear(region, shade, 1.0 - alpha, alpha)


def synth_image(rng: np.random.Generator, height: int, width: int, *, label: int | None = None,
                classes: int = 10) -> np.ndarray:
    """A photo-like RGB image: uint8 array [height, width, 3], C-contiguous.

    With `label` given, the largest object's hue and shape depend on the class (`label` of
    `classes`), so a model trained on the set can learn something; otherwise all is random.
    """
    if height < 1 or width < 1:
        raise ConfigError(f"synth_image: expected height and width >= 1 pixel, got {height}x{width}")
    # Background: a low-frequency colour field around a vertical gradient (sky/ground-like),
    # dimmed toward the corners like a lens.
    top, bottom = _palette_colour(rng), _palette_colour(rng)
    ramp = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    img = 35.0 * _smooth_field(rng, height, width, 4, 3, cv2.INTER_CUBIC)
    img += top * (1 - ramp) + bottom * ramp

    n_objects = int(rng.integers(4, 15))
    for k in range(n_objects):
        main = k == n_objects - 1 and label is not None
        hue = ((label % classes) + rng.uniform(-0.2, 0.2)) / classes % 1.0 if main else None
        kind = (label % 3) if main else int(rng.integers(0, 3))
        scale = rng.uniform(0.3, 0.45) if main else rng.uniform(0.08, 0.35)
        _add_object(rng, img, kind, scale, hue)

    # Texture whose strength varies over the picture (smooth regions next to busy ones):
    # luminance at 1-8 px scales, plus chroma at the 2 px scale that 4:2:0 JPEG keeps.
    strength = _smooth_field(rng, height, width, 3, 1)[:, :, 0]
    strength *= 0.6
    strength += 1.1
    np.clip(strength, 0.2, 2.0, out=strength)
    luma = _texture(rng, height, width)
    luma *= strength
    luma *= TEXTURE_AMPLITUDE
    cr, cb = _chroma(rng, strength, CHROMA_AMPLITUDE)
    yy = np.linspace(-1, 1, height, dtype=np.float32)[:, None]
    xx = np.linspace(-1, 1, width, dtype=np.float32)[None, :]
    vignette = 1.0 - 0.18 * (xx * xx + yy * yy)   # light falloff toward the corners, like a lens
    # Whole planes merged with OpenCV: NumPy broadcasting over a trailing axis of 3 is slow.
    img *= cv2.merge([vignette] * 3)
    img += cv2.merge([luma + cr, luma - 0.5 * (cr + cb), luma + cb])
    np.clip(img, 0, 255, out=img)
    return img.astype(np.uint8)


def _image_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index, 0x5EED])


def _write_one(root: Path, rel: str, seed: int, index: int, label: int, classes: int) -> int:
    """Generate and write image `index`; returns its size in bytes."""
    rng = _image_rng(seed, index)
    height, width = sample_size(rng)
    quality = int(rng.integers(QUALITY_RANGE[0], QUALITY_RANGE[1] + 1))
    pixels = synth_image(rng, height, width, label=label, classes=classes)
    data = simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling="420")
    path = root / rel
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)   # never leave a half-written JPEG behind an interrupted run
    return len(data)


def _write_chunk(root: Path, jobs: Sequence[tuple[int, str, int]], seed: int, classes: int) -> int:
    """Write images (index, relative path, label); returns bytes written."""
    return sum(_write_one(root, rel, seed, i, label, classes) for i, rel, label in jobs)


def _plan(n: int, classes: int, seed: int, layout: str) -> list[tuple[str, int]]:
    """(relative path, label) for each image index; labels are a seeded balanced shuffle."""
    labels = np.arange(n) % classes
    np.random.default_rng([seed, 0xC1A55]).shuffle(labels)
    if layout == "folder":
        return [(f"class_{int(c):03d}/img_{i:06d}.jpg", int(c)) for i, c in enumerate(labels)]
    return [(f"images/img_{i:06d}.jpg", int(c)) for i, c in enumerate(labels)]


def _check_args(n: int, classes: int, layout: str) -> None:
    if n < 1:
        raise ConfigError(f"expected n >= 1 images, got {n}")
    if classes < 1:
        raise ConfigError(f"expected classes >= 1, got {classes}")
    if layout not in _LAYOUTS:
        raise ConfigError(f"expected layout 'folder' or 'list', got {layout!r}")


def _write_layout(out_dir: Path, plan: Sequence[tuple[str, int]], layout: str) -> Path:
    """Create folders (and train.txt for layout='list'); returns what a source should open."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub in sorted({rel.rsplit("/", 1)[0] for rel, _ in plan}):
        (out_dir / sub).mkdir(exist_ok=True)
    if layout == "folder":
        return out_dir
    listing = out_dir / "train.txt"
    listing.write_text("".join(f"{rel} {label}\n" for rel, label in plan))
    return listing


def make_imagenet_like(out_dir: str | Path, n: int, *, classes: int = 10, seed: int = 0,
                       workers: int | None = None, layout: str = "folder", progress: bool = False) -> Path:
    """Write `n` ImageNet-like JPEGs; returns the ImageFolder root, or the train.txt path.

    layout="folder": `out_dir/class_XXX/img_XXXXXX.jpg` (classes balanced, seeded shuffle).
    layout="list": `out_dir/images/img_XXXXXX.jpg` plus `out_dir/train.txt` ("<path> <label>").
    Files are bit-identical for the same `seed` whatever `workers` is (default: the CPUs this
    process may use; worker processes, so call it under `if __name__ == "__main__":` in scripts).
    About 20 ms of CPU per image. `progress`: a bar on a terminal, log lines (`stoker.progress`) elsewhere.
    """
    _check_args(n, classes, layout)
    root = Path(out_dir)
    plan = _plan(n, classes, seed, layout)
    result = _write_layout(root, plan, layout)
    jobs = [(i, rel, label) for i, (rel, label) in enumerate(plan)]
    chunks = [jobs[k:k + _CHUNK] for k in range(0, n, _CHUNK)]
    workers = min(workers or usable_cpus(), len(chunks))
    with Progress("synth", n, enabled=progress) as bar:
        if workers <= 1:
            for chunk in chunks:
                _write_chunk(root, chunk, seed, classes)
                bar.update(len(chunk))
        else:
            _write_in_processes(root, chunks, seed, classes, workers, bar)
    return result


def _write_in_processes(root: Path, chunks: Sequence[Sequence[tuple[int, str, int]]], seed: int, classes: int,
                        workers: int, bar: Progress) -> None:
    # Processes, not threads: the many small NumPy/OpenCV calls per image hold the GIL long enough
    # that two threads measured slower than one.
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    try:
        futures = [pool.submit(_write_chunk, root, chunk, seed, classes) for chunk in chunks]
        for fut, chunk in zip(futures, chunks):
            fut.result(timeout=600)   # a chunk takes well under a second; a stuck write is a real fault
            bar.update(len(chunk))
    except BrokenProcessPool:
        raise StokerError("an image-generation worker process died (crashed, killed, or out of memory). "
                          "When make_imagenet_like() runs from a script, keep the call under "
                          "`if __name__ == \"__main__\":` (workers re-import the main module), "
                          "or pass workers=1") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)   # on error (or Ctrl-C) stop queued work


def cached_imagenet_like(cache_dir: str | Path, n: int, *, classes: int = 10, seed: int = 0,
                         workers: int | None = None) -> Path:
    """An ImageFolder of `n` generated images under `cache_dir`, generated only the first time.

    The set lives in `cache_dir/imagenet-like-n{n}-c{classes}-s{seed}/`; a `.complete` marker
    next to it is written last, so an interrupted generation is redone, never half-used.
    """
    cache = Path(cache_dir)
    name = f"imagenet-like-n{n}-c{classes}-s{seed}"
    root, marker = cache / name, cache / f"{name}.complete"
    if not marker.exists():
        make_imagenet_like(root, n, classes=classes, seed=seed, workers=workers)
        marker.write_text(f"{n} images, {classes} classes, seed {seed}\n")
    return root


def make_tiny_jpegs(out_dir: str | Path, n: int = 8, *, classes: int = 2, size: tuple[int, int] = (48, 64),
                    seed: int = 0, layout: str = "folder", quality: int = 90) -> Path:
    """A handful of small photo-like JPEGs for tests, in milliseconds.

    Same layouts and return value as `make_imagenet_like`; every image is `size` = (height, width)
    pixels.
    """
    _check_args(n, classes, layout)
    root = Path(out_dir)
    plan = _plan(n, classes, seed, layout)
    result = _write_layout(root, plan, layout)
    for i, (rel, label) in enumerate(plan):
        pixels = synth_image(_image_rng(seed, i), size[0], size[1], label=label, classes=classes)
        data = simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling="420")
        (root / rel).write_bytes(data)
    return result
