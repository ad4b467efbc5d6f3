"""Memory one sample may take: peak RSS of a child process that packs (normalizes) one large image,
against its pixel count. Packing one 490 KB PNG of 13000^2 peaked at 5 GB (30 bytes a pixel: a float
difference image for the JPEG check, a copy per conversion); the bound now is about 8."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from .rhelpers import run_child

SIDE = 4000   # 16 M pixels: 48 MB of RGB, a second or two to pack


def _peak_mb(code: str) -> float:
    proc = run_child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.split("GREW")[1])


def _big_png(path: Path, mode: str) -> Path:
    rgb = np.zeros((SIDE, SIDE, 3), np.uint8)
    rgb[::7, :, 0] = 200
    rgb[:, ::11, 1] = 90
    img = Image.fromarray(rgb)
    (img if mode == "RGB" else img.convert(mode)).save(path, compress_level=1)
    return path


def _normalize_code(path: Path, mode: str) -> str:
    return f"""
import gc, resource
from pathlib import Path
from stoker.packing import PackOptions, normalize
import io
import numpy as np
from PIL import Image
small = io.BytesIO()
Image.fromarray(np.full((64, 64, 3), 9, np.uint8)).convert({mode!r}).save(small, "PNG")
normalize(small.getvalue(), "warm-up.png", PackOptions())   # lazy imports and pools, not the sample
data = Path({str(path)!r}).read_bytes()
gc.collect()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = normalize(data, "big.png", PackOptions())
print(out.encoding, "GREW", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def test_packing_a_large_png_stays_near_its_pixels(tmp_path: Path) -> None:
    grew = _peak_mb(_normalize_code(_big_png(tmp_path / "big.png", "RGB"), "RGB"))
    rgb_mb = SIDE * SIDE * 3 / 2**20
    assert grew < 2.5 * rgb_mb, f"packing a {SIDE}x{SIDE} PNG ({rgb_mb:.0f} MB of RGB) grew the process by {grew:.0f} MB"


def test_converting_a_palette_png_stays_near_its_pixels(tmp_path: Path) -> None:
    grew = _peak_mb(_normalize_code(_big_png(tmp_path / "big.png", "P"), "P"))
    rgb_mb = SIDE * SIDE * 3 / 2**20
    assert grew < 2.5 * rgb_mb, f"packing a {SIDE}x{SIDE} palette PNG grew the process by {grew:.0f} MB"
