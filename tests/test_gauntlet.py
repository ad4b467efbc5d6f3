"""The Pillow gauntlet: pack every file of Pillow's own test images (truncated and fuzzed files,
CMYK, EXIF orientations, 16-bit, palettes, animations, bombs) with two workers.

No crash, hang or memory blow-up; every file is either packed or skipped with a reason; every
file Pillow can fully load comes out as the same upright RGB picture.
"""

from __future__ import annotations

import io
import json
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from stoker import codecs
from stoker.packing import SKIPPED_NAME
from stoker.reader import open_dataset
from stoker.sources import open_source

# Tolerances for re-encoded JPEG samples. PSNR: what pack promises with encoding="keep" (it
# falls back to 4:4:4 chroma, then PNG, below 30 dB). Mean |diff|: measured, quality 90 leaves
# up to 4.8 levels on textured photo-like images and 5.2 on dithered palette images here; a
# wrong orientation, channel order or colour conversion gives 20+ levels and under 20 dB.
MIN_PSNR_DB = 30.0
MAX_MEAN_ABS_DIFF = 6.0
MEMORY_LIMIT = 4 << 30  # bytes of address space for the packing process and its workers

_PACK = """
import sys
from stoker.packing import PackOptions, pack
if __name__ == "__main__":
    print(pack(sys.argv[1], sys.argv[2], kind="files", options=PackOptions(workers=2), progress=False))
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _pillow_reference(path: Path) -> np.ndarray | None:
    """Pillow's own decode, EXIF transpose and RGB conversion; None when Pillow cannot load it.

    16-bit and 32-bit grey are scaled to 8 bits (Pillow's convert would clip them to white):
    the one place stoker's conversion deliberately differs from ``convert("RGB")``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(path.read_bytes()))
            img.seek(0)
            img.load()
            img = ImageOps.exif_transpose(img) or img
            if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
                return None if img.mode == "F" else _scaled_grey(img)
            return np.asarray(img.convert("RGB"))
    except Exception:
        return None


def _scaled_grey(img: Image.Image) -> np.ndarray:
    arr = np.asarray(img, dtype=np.int64)
    if img.mode != "I" or arr.max(initial=0) > 255:
        arr = (arr.clip(0, 65535) + 128) // 257
    return np.repeat(arr.clip(0, 255).astype(np.uint8)[:, :, None], 3, axis=2)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_pillow_gauntlet(pillow_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", _PACK, str(pillow_corpus), str(out)], capture_output=True,
                         text=True, timeout=120, preexec_fn=_limit_memory)
    assert run.returncode == 0, run.stderr[-3000:]
    candidates = {i.key: i.path for i in open_source(pillow_corpus, kind="files").items}
    skipped = [json.loads(line) for line in (out / SKIPPED_NAME).read_text().splitlines()]
    assert all(s["reason"].strip() and s["key"] in candidates for s in skipped)
    ds = open_dataset(out)
    packed = {ds.sample(i).key: i for i in range(len(ds))}
    assert len(packed) + len(skipped) == len(candidates)
    assert set(packed) | {s["key"] for s in skipped} == set(candidates)
    assert f"packed {len(packed)} images ({len(skipped)} skipped" in run.stdout

    skip_reason = {s["key"]: s["reason"] for s in skipped}
    problems, compared, worst = [], 0, (99.0, 0.0)
    for key, path in sorted(candidates.items()):
        expected = _pillow_reference(path)
        if expected is None:
            continue
        if key in skip_reason:
            if "pixels exceeds the limit" not in skip_reason[key]:
                problems.append(f"{key}: Pillow loads it, but it was skipped: {skip_reason[key]}")
            continue
        s = ds.sample(packed[key])
        got = codecs.decode_rgb(s.data, s.encoding, key, height=s.height, width=s.width)
        compared += 1
        if got.shape != expected.shape:
            problems.append(f"{key}: shape {got.shape}, Pillow gives {expected.shape}")
        elif s.encoding in ("raw", "png") or bytes(s.data) == path.read_bytes():
            if not np.array_equal(got, expected):
                problems.append(f"{key}: {s.encoding} sample differs from Pillow's pixels")
        else:
            mad, psnr = float(np.abs(got.astype(np.int64) - expected).mean()), _psnr(got, expected)
            worst = (min(worst[0], psnr), max(worst[1], mad))
            if mad > MAX_MEAN_ABS_DIFF or psnr < MIN_PSNR_DB:
                problems.append(f"{key}: re-encoded sample off: mean |diff| {mad:.2f}, PSNR {psnr:.1f} dB")
    assert compared > 400
    encodings = {ds.sample(i).encoding for i in range(len(ds))}
    assert {"jpeg", "raw"} <= encodings <= {"jpeg", "png", "raw"}
    ds.close()
    print(f"worst re-encoded sample: PSNR {worst[0]:.1f} dB, mean |diff| {worst[1]:.2f}")
    assert not problems, "\n".join(problems)
