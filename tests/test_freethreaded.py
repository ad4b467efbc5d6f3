"""The compiled extension from many threads at once, with and without the GIL.

On a free-threaded interpreter (`.ci/freethreaded` builds CPython 3.13t and runs this file there) the
threads below really run the extension's code in parallel: any shared state it mutates without a
lock shows up as pixels that differ from the serial run. The same checks run on the normal
interpreter with the rest of the suite. Only numpy and Pillow are needed (no torch, no simplejpeg).
"""

from __future__ import annotations

import io
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _jpeg_module():
    """stoker._jpeg with Pillow's libjpeg-turbo loaded into it (the library stoker itself picks first)."""
    try:
        from stoker import _jpeg
        from stoker._libjpeg import _candidates
    except ImportError as exc:
        pytest.skip(f"the region decoder is not compiled here: {exc}")
    for path in _candidates():
        try:
            _jpeg.load(path)
            return _jpeg
        except RuntimeError:  # loaded already (by stoker itself, or an earlier test): one per process
            return _jpeg
        except OSError:
            continue
    pytest.skip("no libjpeg-turbo with partial decode found")


def _photo(seed: int, h: int = 240, w: int = 320, restart: bool = False) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // w, y * 255 // h, (x ^ y) & 255], -1).astype(np.int16)
    rgb = np.clip(rgb + rng.integers(-20, 21, rgb.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90, subsampling=2, **({"restart_marker_rows": 1} if restart else {}))
    data = buf.getvalue()
    return data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_the_extension_declares_it_needs_no_gil():
    """Importing a C module that does not declare itself safe turns the GIL back on for the whole
    process (with a RuntimeWarning): every thread of the loader would then serialise again."""
    _jpeg_module()
    if not FREE_THREADED:
        pytest.skip("the GIL is always on in this interpreter")
    assert not sys._is_gil_enabled()


@pytest.mark.parametrize("restart", [False, True])
def test_region_decodes_from_eight_threads_match_serial_and_pillow(restart):
    mod = _jpeg_module()
    images = [_photo(seed, restart=restart) for seed in range(4)]
    rng = np.random.default_rng(7)
    jobs = []
    for k in range(96):
        data, full = images[k % len(images)]
        h, w = full.shape[:2]
        y0, x0 = int(rng.integers(0, h - 16)), int(rng.integers(0, w - 16))
        y1, x1 = int(rng.integers(y0 + 8, h + 1)), int(rng.integers(x0 + 8, w + 1))
        jobs.append((k % len(images), y0, y1, x0, x1))

    def run(job):
        i, y0, y1, x0, x1 = job
        out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
        mod.decode(images[i][0], out, 8, y0, y1, x0, x1)
        return out

    serial = [run(j) for j in jobs]
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(run, jobs))
    for job, a, b in zip(jobs, serial, parallel):
        i, y0, y1, x0, x1 = job
        assert np.array_equal(a, b), f"job {job}: threads decode different pixels"
        assert np.array_equal(a, images[i][1][y0:y1, x0:x1]), f"job {job}: differs from Pillow's decode"
