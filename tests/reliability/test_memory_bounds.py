"""Memory one sample may take: peak RSS of a child process that packs (normalizes) one large image,
against its pixel count. Packing one 490 KB PNG of 13000^2 peaked at 5 GB (30 bytes a pixel: a float
difference image for the JPEG check, a copy per conversion); the bound now is about 7. The Loader
decodes a large JPEG at the scale its crop needs (7 MB for a 16 MP image under RandomResizedCrop(224))."""

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


def test_loading_a_large_packed_image_decodes_only_what_the_crop_needs(tmp_path: Path) -> None:
    """The Loader side of the bound: a 16 MP JPEG under RandomResizedCrop(224) is decoded at the
    smallest DCT scale that covers the crop (a regression to whole-image decodes would grow by 46 MB
    of RGB and more per sample)."""
    from stoker.packing import PackOptions, pack

    rgb = np.zeros((SIDE, SIDE, 3), np.uint8)
    rgb[::7, :, 0] = 200
    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.fromarray(rgb).save(tmp_path / "src" / "a" / "big.jpg", quality=90)
    Image.fromarray(rgb[:64, :64]).save(tmp_path / "src" / "a" / "small.jpg", quality=90)
    pack(tmp_path / "src", tmp_path / "packed", options=PackOptions(workers=1), progress=False)
    code = f"""
import gc, resource
from stoker import Loader, RandomResizedCrop, Sampling
from stoker.reader import open_dataset
with open_dataset({str(tmp_path / "packed")!r}) as ds:
    big = [i for i in range(len(ds)) if ds.heights[i] == {SIDE}]
    small = [i for i in range(len(ds)) if ds.heights[i] != {SIDE}]
warm = Loader({str(tmp_path / "packed")!r}, 1, transforms=[RandomResizedCrop(224)], workers=1, sampling=Sampling(indices=small))
next(iter(warm)); warm.close(); gc.collect()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for seed in range(4):
    loader = Loader({str(tmp_path / "packed")!r}, 1, transforms=[RandomResizedCrop(224)], workers=1,
                    sampling=Sampling(indices=big), seed=seed)
    next(iter(loader)); loader.close()
print("GREW", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""
    grew = _peak_mb(code)
    assert grew < 0.5 * SIDE * SIDE * 3 / 2**20, f"loading one {SIDE}x{SIDE} JPEG grew the process by {grew:.0f} MB"
