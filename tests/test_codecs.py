"""codecs: probe, fast JPEG decode with DCT scaling, Pillow fallback, raw views, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from stoker import codecs
from stoker.errors import CorruptImageError, DecompressionBombError, ImageError

from conftest import jpeg_bytes, smooth_rgb


@pytest.fixture
def rgb() -> np.ndarray:
    return smooth_rgb(np.random.default_rng(1), 375, 500)


def test_probe_reads_header(rgb):
    info = codecs.probe(jpeg_bytes(rgb), "a.jpg")
    assert (info.format, info.height, info.width, info.mode, info.orientation) == ("jpeg", 375, 500, "RGB", 1)
    assert codecs.is_plain_jpeg(info)


def test_probe_sees_exif_orientation(rgb):
    exif = Image.Exif()
    exif[0x0112] = 6
    info = codecs.probe(jpeg_bytes(rgb, exif=exif), "rot.jpg")
    assert info.orientation == 6 and info.upright_shape == (500, 375)
    assert not codecs.is_plain_jpeg(info)


def test_fast_decode_matches_pillow(rgb):
    data = jpeg_bytes(rgb)
    fast = codecs.decode_rgb(data, "jpeg", "a.jpg")
    slow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert fast.shape == (375, 500, 3)
    assert np.abs(fast.astype(int) - slow).mean() < 1.0


@pytest.mark.parametrize("min_h,min_w,expected", [(0, 0, (375, 500)), (100, 0, (188, 250)),
                                                   (47, 62, (47, 63)), (48, 0, (94, 125)), (376, 0, (375, 500))])
def test_dct_scaling_picks_smallest_sufficient_power_of_two(rgb, min_h, min_w, expected):
    out = codecs.decode_rgb(jpeg_bytes(rgb), "jpeg", "a.jpg", height=375, width=500, min_height=min_h, min_width=min_w)
    assert out.shape[:2] == expected == codecs.jpeg_scaled_shape(375, 500, min_h, min_w)
    assert out.shape[0] >= min(min_h, 375) and out.shape[1] >= min(min_w, 500)


def test_decode_into_preallocated_buffer(rgb):
    buf = np.empty(375 * 500 * 3, np.uint8)
    out = codecs.decode_rgb(jpeg_bytes(rgb), "jpeg", "a.jpg", min_height=90, out=buf)
    assert np.shares_memory(out, buf)


def test_grayscale_jpeg_becomes_rgb(rgb):
    gray = rgb[:, :, 0].copy()
    out = codecs.decode_rgb(jpeg_bytes(gray), "jpeg", "g.jpg")
    assert out.shape == (375, 500, 3)
    assert np.array_equal(out[:, :, 0], out[:, :, 2])


def test_cmyk_jpeg_decodes_like_pillow(rgb):
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=95)
    out = codecs.decode_rgb(buf.getvalue(), "jpeg", "cmyk.jpg")
    ref = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert out.shape == (375, 500, 3) and np.abs(out.astype(int) - ref).max() <= 2


def test_raw_is_zero_copy_view():
    data = bytearray(np.arange(2 * 3 * 3, dtype=np.uint8).tobytes())
    out = codecs.decode_rgb(memoryview(data), "raw", "r", height=2, width=3)
    assert out.shape == (2, 3, 3) and np.shares_memory(out, np.frombuffer(data, np.uint8))
    with pytest.raises(CorruptImageError, match="expected 3x3x3"):
        codecs.decode_rgb(data, "raw", "r", height=3, width=3)


def test_pillow_path_applies_exif_and_converts_modes(rgb):
    exif = Image.Exif()
    exif[0x0112] = 8
    data = jpeg_bytes(rgb, exif=exif)
    out = codecs.decode_pillow_rgb(data, "rot.jpg")
    ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert out.shape == (500, 375, 3) and np.array_equal(out, ref)
    png = io.BytesIO()
    Image.fromarray(rgb).convert("P").save(png, "PNG")
    assert codecs.decode_rgb(png.getvalue(), "png", "p.png").shape == (375, 500, 3)


def test_sixteen_bit_is_scaled_not_clipped():
    arr = np.full((8, 8), 40000, np.uint16)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    out = codecs.decode_pillow_rgb(buf.getvalue(), "deep.png")
    assert out.dtype == np.uint8 and int(out[0, 0, 0]) == round(40000 / 257)


@pytest.mark.parametrize("data,reason", [(b"", "empty"), (b"hello, not an image", "not an image"),
                                         (b"\xff\xd8\xff\xe0garbage", "bad.jpg")])
def test_bad_bytes_raise_image_errors_naming_the_key(data, reason):
    with pytest.raises(ImageError, match=reason) as info:
        codecs.decode_rgb(data, "jpeg", "bad.jpg")
    assert info.value.key == "bad.jpg"


def test_truncated_jpeg_is_corrupt(rgb):
    data = jpeg_bytes(rgb)
    with pytest.raises(CorruptImageError, match="bad.jpg"):
        codecs.decode_rgb(data[: len(data) // 2], "jpeg", "bad.jpg")


def test_decompression_bomb_refused_from_header():
    buf = io.BytesIO()
    Image.new("L", (4000, 4000)).save(buf, "PNG")
    with pytest.raises(DecompressionBombError, match="16,000,000 pixels"):
        codecs.probe(buf.getvalue(), "bomb.png", max_pixels=1_000_000)


def test_encode_jpeg_round_trip(rgb):
    out = codecs.decode_rgb(codecs.encode_jpeg(rgb, 95), "jpeg", "x")
    mse = np.mean((out.astype(np.float64) - rgb) ** 2)
    assert 10 * np.log10(255**2 / mse) > 30  # PSNR in dB
    with pytest.raises(ValueError, match="1..100"):
        codecs.encode_jpeg(rgb, 0)


def test_whole_pillow_corpus_decodes_or_fails_cleanly(pillow_corpus):
    decoded = refused = 0
    for path in sorted(p for p in pillow_corpus.rglob("*") if p.is_file()):
        data = path.read_bytes()
        try:
            info = codecs.probe(data, path.name)
            out = codecs.decode_pillow_rgb(data, path.name)
        except ImageError as exc:
            assert exc.reason
            refused += 1
            continue
        assert out.dtype == np.uint8 and out.shape == (*info.upright_shape, 3) and out.flags.c_contiguous
        decoded += 1
    assert decoded > 500 and refused > 10
