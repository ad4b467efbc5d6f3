"""Region + DCT-scaled JPEG decode (codecs.decode_jpeg_region): exactly the pixels of a whole decode
at the same scale followed by a crop, for every kind of JPEG; anything it does not serve goes back
to the whole-image path, which names the problem."""

from __future__ import annotations

import io
import math
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from conftest import jpeg_bytes, smooth_rgb
from stoker import _libjpeg, codecs
from stoker.errors import CorruptImageError

needs_region = pytest.mark.skipif(not codecs.region_decode_available(), reason=_libjpeg.describe())


def test_region_decoder_is_built_where_a_compiler_exists():
    """`pip install` compiles the extension wherever a C compiler exists (Linux, macOS), and Pillow's
    wheels carry a libjpeg-turbo for it: there the fast path must be present, not silently missing."""
    if os.name != "posix" or shutil.which("cc") is None:
        pytest.skip("no C compiler: the install falls back to whole-image decode by design")
    assert codecs.region_decode_available(), _libjpeg.describe()


def textured(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Edges and texture in every channel, so an off-by-one column or chroma row shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 3 + y) % 256, (y * 5) % 256, (x * y // 7) % 256], axis=-1)
    return (rgb + rng.integers(0, 40, rgb.shape)).clip(0, 255).astype(np.uint8)


def _exif() -> bytes:
    exif = Image.Exif()
    exif[0x010F] = "stoker-test-camera"
    exif[0x0112] = 1
    return exif.tobytes()


# (name, size, Pillow save options): the JPEG variants a dataset holds
KINDS = [
    ("444", (120, 152), {"subsampling": 0}),
    ("422", (120, 152), {"subsampling": 1}),
    ("420", (120, 152), {"subsampling": 2}),
    ("420-odd-size", (97, 61), {"subsampling": 2}),
    ("422-odd-size", (33, 255), {"subsampling": 1}),
    ("gray", (101, 77), {}),
    ("progressive-420", (120, 152), {"subsampling": 2, "progressive": True}),
    ("progressive-444", (75, 90), {"subsampling": 0, "progressive": True}),
    ("restart-markers", (120, 152), {"subsampling": 2, "restart_marker_blocks": 3}),
    ("restart-rows-444", (130, 90), {"subsampling": 0, "restart_marker_rows": 1}),
    ("restart-rows-422", (131, 97), {"subsampling": 1, "restart_marker_rows": 2}),
    ("restart-rows-gray", (150, 70), {"restart_marker_rows": 1}),
    ("exif", (64, 80), {"subsampling": 2, "exif": _exif()}),
]


def _encode(kind: str, size: tuple[int, int], opts: dict) -> bytes:
    rgb = textured(*size)
    return jpeg_bytes(rgb[..., 0] if kind == "gray" else rgb, quality=88, **opts)


def _windows(rng: np.random.Generator, h: int, w: int, n: int) -> list[tuple[int, int, int, int]]:
    fixed = [(0, h, 0, w), (0, 1, 0, 1), (h - 1, h, w - 1, w), (0, h, w - 1, w), (h // 3, h // 3 + 1, 0, w)]
    rand = []
    for _ in range(n):
        y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        rand.append((y0, int(rng.integers(y0 + 1, h + 1)), x0, int(rng.integers(x0 + 1, w + 1))))
    return fixed + rand


@needs_region
@pytest.mark.parametrize("fast", [False, True], ids=["accurate", "fast"])
@pytest.mark.parametrize("scale", [8, 4, 2, 1, 3, 6])
@pytest.mark.parametrize("kind,size,opts", KINDS, ids=[k[0] for k in KINDS])
def test_region_equals_whole_decode_then_crop(kind, size, opts, scale, fast):
    data = _encode(kind, size, opts)
    h, w = size
    sh, sw = math.ceil(h * scale / 8), math.ceil(w * scale / 8)
    if scale in (1, 2, 4, 8):  # the reference: simplejpeg (its own libjpeg-turbo build) at that scale
        whole = codecs.decode_rgb(data, "jpeg", kind, height=h, width=w, min_height=sh, min_width=sw, fast=fast)
    else:  # simplejpeg asks only for powers of two: the region decoder's own whole-image window
        whole = codecs.decode_jpeg_region(data, kind, height=h, width=w, scale=scale, window=(0, sh, 0, sw), fast=fast)
    assert whole.shape == (sh, sw, 3)
    rng = np.random.default_rng(scale * 10 + fast)
    for y0, y1, x0, x1 in _windows(rng, sh, sw, 25):
        got = codecs.decode_jpeg_region(data, kind, height=h, width=w, scale=scale, window=(y0, y1, x0, x1),
                                        fast=fast)
        np.testing.assert_array_equal(got, whole[y0:y1, x0:x1], err_msg=f"window {(y0, y1, x0, x1)}")


@needs_region
def test_restart_markers_let_the_decoder_start_below_the_top():
    """With restart markers the decode starts at the marker above the window (the seeking path),
    and the pixels are still those of a whole decode; without them it cannot, and says so."""
    rgb = textured(400, 96)
    mod = _libjpeg.region_decoder()
    for options, seeks in (({"restart_marker_rows": 1}, True), ({}, False)):
        data = jpeg_bytes(rgb, subsampling=2, **options)
        whole = codecs.decode_rgb(data, "jpeg", "k")
        for y0, y1 in ((300, 340), (33, 35), (380, 400)):
            got = np.empty((y1 - y0, 50, 3), np.uint8)
            assert mod.decode(data, got, 8, y0, y1, 20, 70) == (400, 96, seeks)
            np.testing.assert_array_equal(got, whole[y0:y1, 20:70])
        top = np.empty((10, 50, 3), np.uint8)  # too close to the top to gain anything: no seek
        assert mod.decode(data, top, 8, 5, 15, 20, 70)[2] is False


@needs_region
def test_fast_mode_is_close_but_not_identical():
    rgb = smooth_rgb(np.random.default_rng(3), 240, 320)
    data = jpeg_bytes(rgb, quality=90)
    window = (10, 230, 20, 300)
    exact = codecs.decode_jpeg_region(data, "k", height=240, width=320, scale=8, window=window).astype(np.float64)
    fast = codecs.decode_jpeg_region(data, "k", height=240, width=320, scale=8, window=window, fast=True)
    mse = np.mean((exact - fast) ** 2)
    assert 0 < mse and 10 * math.log10(255**2 / mse) > 35  # PSNR in dB


@needs_region
def test_region_lands_in_the_callers_buffer():
    data = jpeg_bytes(textured(64, 96))
    buf = np.zeros(40 * 50 * 3 + 17, np.uint8)
    got = codecs.decode_jpeg_region(data, "k", height=64, width=96, scale=8, window=(3, 43, 7, 57), out=buf)
    assert got.shape == (40, 50, 3) and np.shares_memory(got, buf)
    assert not buf[-17:].any()  # nothing written past the window


@needs_region
def test_threads_decode_independently():
    datas = [jpeg_bytes(textured(96 + i, 128, seed=i)) for i in range(4)]
    want = [codecs.decode_rgb(d, "jpeg", "k")[5:70, 9:101] for d in datas]
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(40):
            got = codecs.decode_jpeg_region(datas[i], "k", height=96 + i, width=128, scale=8, window=(5, 70, 9, 101))
            if not np.array_equal(got, want[i]):
                errors.append(f"thread {i} decoded different pixels")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


@needs_region
def test_unserved_files_go_back_to_the_whole_image_path():
    rgb = textured(48, 64)
    good = jpeg_bytes(rgb)
    cmyk = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(cmyk, "JPEG")
    truncated = good[: len(good) // 2]
    for data in (cmyk.getvalue(), truncated, b"\xff\xd8\xff" + b"\x00" * 50, b"", b"not a jpeg"):
        assert codecs.decode_jpeg_region(data, "k", height=48, width=64, scale=8, window=(0, 8, 0, 8)) is None
    with pytest.raises(CorruptImageError, match="k"):
        codecs.decode_rgb(truncated, "jpeg", "k")
    # a header larger than the limit is refused before anything is allocated for it
    assert codecs.decode_jpeg_region(good, "k", height=48, width=64, scale=8, window=(0, 8, 0, 8),
                                     max_pixels=48 * 64 - 1) is None


@needs_region
def test_a_stored_size_that_disagrees_with_the_header_is_corrupt():
    data = jpeg_bytes(textured(48, 64))
    with pytest.raises(CorruptImageError, match="stored size 40x64"):
        codecs.decode_jpeg_region(data, "k", height=40, width=64, scale=8, window=(0, 8, 0, 8))
    with pytest.raises(CorruptImageError, match="stored size 48x80"):
        codecs.decode_jpeg_region(data, "k", height=48, width=80, scale=8, window=(0, 8, 70, 80))
    with pytest.raises(ValueError, match="0 <= y0 < y1"):
        codecs.decode_jpeg_region(data, "k", height=48, width=64, scale=8, window=(5, 5, 0, 8))


@needs_region
def test_pillow_corpus_jpegs_decode_exactly_or_are_declined(pillow_corpus):
    served = declined = 0
    for path in sorted(pillow_corpus.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if not codecs.sniff_jpeg(data):
            continue
        try:
            h, w = codecs.probe(data, path.name).height, codecs.probe(data, path.name).width
        except codecs.ImageError:
            h, w = 64, 64  # unreadable header: the region path must decline it, not crash
        window = (h // 4, max(h // 4 + 1, 3 * h // 4), w // 4, max(w // 4 + 1, 3 * w // 4))
        try:
            got = codecs.decode_jpeg_region(data, path.name, height=h, width=w, scale=8, window=window)
        except CorruptImageError:
            declined += 1
            continue
        if got is None:
            declined += 1
            continue
        whole = codecs.decode_rgb(data, "jpeg", path.name)
        np.testing.assert_array_equal(got, whole[window[0]:window[1], window[2]:window[3]], err_msg=path.name)
        served += 1
    assert served > 20 and declined > 0


@needs_region
@pytest.mark.parametrize("setting,expect", [("none", "turned off"), ("/nonexistent/libjpeg.so", "cannot load")])
def test_environment_variable_chooses_or_disables_the_library(setting, expect):
    code = "from stoker import _libjpeg, codecs; print(codecs.region_decode_available()); print(_libjpeg.describe())"
    env = {**os.environ, _libjpeg.ENV: setting}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    available, text = out.stdout.splitlines()
    assert available == "False" and expect in text


@needs_region
def test_damaged_bytes_never_crash():
    """Random byte flips and truncations: a region, a decline (None) or a CorruptImageError, never a crash."""
    rng = np.random.default_rng(11)
    for kind, size, opts in KINDS[2], KINDS[6], KINDS[8], KINDS[9]:
        data = _encode(kind, size, opts)
        for _ in range(150):
            b = bytearray(data)
            for j in rng.integers(0, len(b), size=int(rng.integers(1, 6))):
                b[j] = int(rng.integers(0, 256))
            if rng.random() < 0.2:
                b = b[: int(rng.integers(2, len(b)))]
            try:
                got = codecs.decode_jpeg_region(bytes(b), kind, height=size[0], width=size[1],
                                                scale=int(rng.choice([1, 2, 4, 8])), window=(0, 5, 3, 9))
            except CorruptImageError:
                continue
            assert got is None or got.shape == (5, 6, 3)
