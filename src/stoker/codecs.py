"""Probe, decode and encode images.

Three paths, one result (upright RGB uint8 ``[H, W, 3]``):

- the region path: one rectangle of a JPEG at a DCT scale of n/8 (:func:`decode_jpeg_region`),
  through libjpeg-turbo's partial decode, so a crop costs a fraction of a full decode. It needs the
  optional compiled extension (see ``_libjpeg``); its pixels are exactly those of the fast path
  followed by a crop, so the output does not depend on whether it is installed;
- the fast path: JPEG through libjpeg-turbo (simplejpeg), which releases the GIL and can
  downscale in the DCT domain by n/8, so a crop that will be shrunk is never decoded at
  full size;
- the fallback: Pillow for everything else (PNG, GIF, TIFF, WebP, BMP, CMYK JPEG, EXIF-rotated
  files, 16-bit, palette), turned upright with the EXIF orientation and converted to RGB.

Every failure becomes an ``ImageError`` subclass naming the sample and the reason.
"""

from __future__ import annotations

import ctypes
import io
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Union

import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from . import _libjpeg
from .errors import (
    CorruptImageError,
    DecompressionBombError,
    ImageError,
    UnsupportedImageError,
)

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]

#: Default decompression-bomb limit in pixels (twice Pillow's warning threshold, the point
#: where Pillow itself refuses). Checked from the header, before any pixel is decoded.
MAX_PIXELS: int = 2 * 89_478_485

#: Encodings a stored sample may have. "raw" is H*W*3 RGB bytes.
ENCODINGS = ("jpeg", "png", "webp", "raw", "image")

_EXIF_ORIENTATION = 0x0112
_JPEG_SOI = b"\xff\xd8\xff"


@dataclass(frozen=True)
class ImageInfo:
    """What the header of an image says, without decoding pixels."""

    format: str  # lower-case Pillow format name: "jpeg", "png", "gif", "tiff", ...
    height: int  # pixels, as stored (before EXIF rotation)
    width: int
    mode: str  # Pillow mode: "RGB", "L", "CMYK", "P", "I;16", ...
    orientation: int  # EXIF orientation 1..8; 1 when absent or unreadable
    n_frames: int

    @property
    def upright_shape(self) -> tuple[int, int]:
        """(height, width) after the EXIF rotation is applied."""
        if self.orientation in (5, 6, 7, 8):
            return self.width, self.height
        return self.height, self.width


def _as_bytes_io(data: Buffer) -> io.BytesIO:
    return io.BytesIO(data if isinstance(data, (bytes, bytearray)) else memoryview(data).cast("B"))


def _nbytes(data: Buffer) -> int:
    return data.nbytes if isinstance(data, (memoryview, np.ndarray)) else len(data)


def check_pixels(key: str, width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise CorruptImageError(key, f"header gives an empty size {width}x{height}")
    if width * height > max_pixels:
        raise DecompressionBombError(
            key,
            f"{width}x{height} = {width * height:,} pixels exceeds the limit of {max_pixels:,} "
            "(raise max_pixels if the image is genuine)",
        )


def check_stored_size(key: str, height: int, width: int, max_pixels: int = MAX_PIXELS) -> None:
    """Refuse a sample whose stored (height, width) is empty or over ``max_pixels`` before anything is
    planned or allocated from it: a packed dataset's size columns are data, like its bytes."""
    if height <= 0 or width <= 0:
        raise CorruptImageError(key, f"the dataset stores an empty size {height}x{width} for this image; "
                                     f"re-pack the dataset")
    if height * width > max_pixels:
        raise DecompressionBombError(
            key, f"the dataset stores a size of {height}x{width} = {height * width:,} pixels for this image, "
                 f"over the limit of {max_pixels:,}; re-pack the dataset")


def _open(data: Buffer, key: str, max_pixels: int) -> Image.Image:
    if _nbytes(data) == 0:
        raise CorruptImageError(key, "file is empty (0 bytes)")
    try:
        img = Image.open(_as_bytes_io(data))
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(key, f"refused before decoding: {exc}") from None
    except UnidentifiedImageError:
        raise CorruptImageError(key, "not an image Pillow can identify") from None
    except Exception as exc:  # fuzzed headers make Pillow raise almost anything
        raise CorruptImageError(key, f"unreadable header: {type(exc).__name__}: {exc}") from None
    check_pixels(key, img.width, img.height, max_pixels)
    return img


_quieted = threading.Event()


def quiet_decoder_messages() -> None:
    """Stop Pillow's decoders from printing about each odd file they meet, once per process.

    libtiff prints its warnings and errors straight to stderr (hundreds of lines for a folder of
    scanned TIFFs with private tags), and Pillow's TIFF and EXIF readers emit a ``UserWarning`` per
    damaged tag. stoker reports every sample that fails itself (``SampleError``, the skip log, pack's
    ``skipped.jsonl``), so those lines only repeat it. libtiff's handlers are process-wide, so this
    is done by the loose-file reader and by ``pack``, the two places that decode users' raw files,
    not at import. Best effort: where Pillow's libtiff does not export its handler setters (static
    builds on Windows) libtiff keeps printing.
    """
    if _quieted.is_set():
        return
    _quieted.set()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
    try:
        from PIL import _imaging

        lib = ctypes.CDLL(_imaging.__file__)   # symbol lookup includes the libtiff it links
        for setter in (lib.TIFFSetWarningHandler, lib.TIFFSetErrorHandler):
            setter.argtypes, setter.restype = [ctypes.c_void_p], ctypes.c_void_p
            setter(None)   # libtiff's documented way to turn a handler off
    except (OSError, AttributeError, ImportError):
        pass


def _orientation(img: Image.Image) -> int:
    if img.format == "TIFF":
        return 1  # Pillow's TIFF loader applies the orientation itself while decoding
    try:
        value = img.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # broken EXIF is common and never fatal: treat as upright
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def probe(data: Buffer, key: str, *, max_pixels: int = MAX_PIXELS) -> ImageInfo:
    """Read the header: format, stored size, mode, EXIF orientation, frame count.

    Raises CorruptImageError, UnsupportedImageError or DecompressionBombError.
    """
    img = _open(data, key, max_pixels)
    fmt = (img.format or "unknown").lower()
    return ImageInfo(
        format=fmt,
        height=img.height,
        width=img.width,
        mode=img.mode,
        orientation=_orientation(img),
        n_frames=_n_frames(img),
    )


def _n_frames(img: Image.Image) -> int:
    try:
        return int(getattr(img, "n_frames", 1))
    except Exception:  # counting frames walks the file; a broken frame chain counts as one
        return 1


def is_plain_jpeg(info: ImageInfo) -> bool:
    """True for a JPEG the fast path decodes as is: RGB or grayscale, no EXIF rotation."""
    return info.format == "jpeg" and info.mode in ("RGB", "L") and info.orientation == 1


#: pixels converted at a time (a strip of rows): converting a whole image through numpy would hold
#: Pillow's copy, a bytes copy and the array at once (and 8 bytes a pixel for 16-bit and float modes)
_STRIP_PIXELS = 1 << 20
_ORIENTATION = 0x0112   # the EXIF tag


def _strips(img: Image.Image):
    """(first row, end row, the strip as an image) covering `img` top to bottom."""
    rows = max(1, _STRIP_PIXELS // max(img.width, 1))
    for y0 in range(0, img.height, rows):
        y1 = min(img.height, y0 + rows)
        yield y0, y1, img.crop((0, y0, img.width, y1))


def _to_rgb(img: Image.Image, key: str) -> np.ndarray:
    """`img` as RGB ``uint8 [H, W, 3]``, converted a strip of rows at a time: besides Pillow's own
    decoded image, only the output array and one strip are held."""
    mode = img.mode
    out = np.empty((img.height, img.width, 3), np.uint8)
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # 16-bit data scaled to 8 bits (Pillow's convert would clip at 255, turning most 16-bit
        # images white); 32-bit "I" holding 8-bit values is kept as is; float in [0, 1] scaled by 255
        dtype = np.float64 if mode == "F" else np.int64
        top = max((float(np.nanmax(np.asarray(strip, dtype=dtype), initial=0)) for _, _, strip in _strips(img)),
                  default=0.0)
        for y0, y1, strip in _strips(img):
            arr = np.asarray(strip, dtype=dtype)
            if mode == "F":
                gray = np.nan_to_num(arr * 255.0 if top <= 1.0 else arr).round().clip(0, 255).astype(np.uint8)
            else:
                if mode != "I" or top > 255:
                    arr = (arr.clip(0, 65535) + 128) // 257
                gray = arr.clip(0, 255).astype(np.uint8)
            out[y0:y1] = gray[:, :, None]
        return out
    try:
        for y0, y1, strip in _strips(img):
            out[y0:y1] = np.asarray(strip if mode == "RGB" else strip.convert("RGB"), dtype=np.uint8)
    except (ValueError, OSError) as exc:
        raise UnsupportedImageError(key, f"cannot convert mode {mode} to RGB: {exc}") from None
    return out


def decode_pillow_rgb(data: Buffer, key: str, *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode any image Pillow reads into upright RGB ``uint8 [H, W, 3]``.

    First frame of animations; EXIF orientation applied; palette, CMYK, grayscale, 1-bit,
    16-bit and alpha modes converted (alpha is dropped, as ``Image.convert("RGB")`` does).
    """
    img = _open(data, key, max_pixels)
    try:
        img.seek(0)
        img.load()
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(key, f"refused while decoding: {exc}") from None
    except Exception as exc:  # fuzzed files make Pillow raise almost anything (TypeError too)
        raise CorruptImageError(key, f"decode failed: {type(exc).__name__}: {exc}") from None
    try:   # exif_transpose copies the image even when there is nothing to turn: asked only then
        turned = img.getexif().get(_ORIENTATION, 1) not in (1, None)
        upright = (ImageOps.exif_transpose(img) or img) if turned else img
    except Exception:  # a broken EXIF block must not lose an otherwise good image
        upright = img
    try:
        return _to_rgb(upright, key)
    except ImageError:
        raise
    except Exception as exc:
        raise CorruptImageError(key, f"decode failed: {type(exc).__name__}: {exc}") from None


def jpeg_scale_eighths(height: int, width: int, min_height: int, min_width: int,
                       *, powers_of_two: bool = True) -> int:
    """The DCT scaling numerator n (image decoded at n/8 size) for the smallest decoded size
    that is still at least ``min_height`` x ``min_width``. With ``powers_of_two`` only 1/8,
    1/4, 1/2 and 1 are used: libjpeg-turbo has fast SIMD inverse DCTs for those."""
    if min_height <= 0 and min_width <= 0:
        return 8  # no minimum asked for: full size
    candidates = (1, 2, 4, 8) if powers_of_two else tuple(range(1, 9))
    for n in candidates:
        if math.ceil(height * n / 8) >= min_height and math.ceil(width * n / 8) >= min_width:
            return n
    return 8


def jpeg_scaled_shape(height: int, width: int, min_height: int, min_width: int,
                      *, powers_of_two: bool = True) -> tuple[int, int]:
    """(h, w) that :func:`decode_rgb` returns for a JPEG of that size and those minimums."""
    n = jpeg_scale_eighths(height, width, min_height, min_width, powers_of_two=powers_of_two)
    return math.ceil(height * n / 8), math.ceil(width * n / 8)


def _decode_jpeg(data: Buffer, key: str, height: int, width: int, min_height: int,
                 min_width: int, out: np.ndarray | None, powers_of_two: bool, fast: bool) -> np.ndarray:
    if _nbytes(data) == 0:
        raise CorruptImageError(key, "sample is empty (0 bytes)")
    if out is not None and height and width:
        # `out` was sized from the stored size, which is data too: a header and a stored size that
        # both claim 65,500 x 65,500 would have the decoder fill 12 GB before anything says no
        check_stored_size(key, height, width)
    if out is None:
        # the decoder allocates what the header claims: refuse bombs first (a shard is data, its
        # height/width columns cannot be trusted to match the bytes). With `out`, its size bounds it.
        try:
            head_h, head_w = simplejpeg.decode_jpeg_header(data)[:2]
        except ValueError:
            pass  # no readable header: the decode below fails and says why
        else:
            check_pixels(key, head_w, head_h, MAX_PIXELS)
    try:
        if (min_height > 0 or min_width > 0) and not (height and width):
            height, width = simplejpeg.decode_jpeg_header(data)[:2]
        req_h = req_w = 0
        if height and width and (min_height > 0 or min_width > 0):
            req_h, req_w = jpeg_scaled_shape(height, width, min_height, min_width,
                                             powers_of_two=powers_of_two)
        return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=req_h, min_width=req_w,
                                      buffer=out, fastdct=fast, fastupsample=fast)
    except ValueError as exc:
        message = str(exc)
    # CMYK/YCCK and other colour spaces TurboJPEG will not turn into RGB: Pillow handles them.
    # Truncated or corrupt data fails there too, with Pillow's reason.
    if "buffer" in message and "small" in message:
        raise CorruptImageError(key, f"header size disagrees with the stored size {height}x{width}: {message}")
    try:
        return decode_pillow_rgb(data, key)
    except CorruptImageError as exc:
        raise CorruptImageError(key, f"JPEG decode failed: {message}; Pillow: {exc.reason}") from None


def decode_rgb(data: Buffer, encoding: str, key: str, *, height: int = 0, width: int = 0,
               min_height: int = 0, min_width: int = 0, out: np.ndarray | None = None,
               powers_of_two: bool = True, fast: bool = False) -> np.ndarray:
    """Decode one stored sample into upright RGB ``uint8 [h, w, 3]``.

    - ``"jpeg"``: libjpeg-turbo; with ``min_height``/``min_width`` the image is downscaled in
      the DCT domain to the smallest n/8 size that still meets them (height/width, when known,
      spare a header parse). The pixels go into ``out`` when given (a C-contiguous uint8 buffer
      of at least h*w*3 bytes), so a worker can decode without allocating. ``fast``: libjpeg-turbo's
      fast integer IDCT and plain (not smooth) chroma upsampling; see docs/decoding.md for the cost.
    - ``"raw"``: a zero-copy view of the bytes as ``[height, width, 3]``.
    - anything else: :func:`decode_pillow_rgb` (full size).
    """
    if encoding == "jpeg":
        return _decode_jpeg(data, key, height, width, min_height, min_width, out, powers_of_two, fast)
    if encoding == "raw":
        flat = np.frombuffer(data, dtype=np.uint8)
        if height <= 0 or width <= 0 or flat.size != height * width * 3:
            raise CorruptImageError(
                key, f"raw sample holds {flat.size} bytes, expected {height}x{width}x3 = {height * width * 3}")
        return flat.reshape(height, width, 3)
    return decode_pillow_rgb(data, key)


def region_decode_available() -> bool:
    """True when :func:`decode_jpeg_region` can serve requests (the optional extension is built
    and found a libjpeg-turbo); ``_libjpeg.describe()`` says why not."""
    return _libjpeg.region_decoder() is not None


def decode_jpeg_region(data: Buffer, key: str, *, height: int, width: int, scale: int,
                       window: tuple[int, int, int, int], out: np.ndarray | None = None,
                       fast: bool = False, max_pixels: int = MAX_PIXELS) -> np.ndarray | None:
    """Rows ``y0:y1`` and columns ``x0:x1`` (``window``) of a ``height`` x ``width`` JPEG decoded at
    ``scale``/8 of its size (the scaled size is ``ceil(height * scale / 8)`` by ``ceil(width * scale / 8)``).

    The pixels are exactly those of the whole image decoded at that scale (:func:`decode_rgb` with
    the same ``fast``) and then cropped, but rows below the window are never decoded, rows above it
    are only entropy-decoded, and only the MCU columns covering it go through the inverse DCT.
    Returns an ``[y1-y0, x1-x0, 3]`` array (a view of ``out`` when given), or None when this path
    does not serve the file (region decoder not installed, CMYK/YCCK, damaged data, more than
    ``max_pixels`` pixels): the caller then decodes the whole image, which says what is wrong.
    Raises CorruptImageError when the header's size disagrees with ``height`` x ``width``.
    """
    mod = _libjpeg.region_decoder()
    if mod is None or not 1 <= scale <= 8:
        return None
    y0, y1, x0, x1 = window
    if not (0 <= y0 < y1 and 0 <= x0 < x1):
        raise ValueError(f"window must be (y0, y1, x0, x1) with 0 <= y0 < y1 and 0 <= x0 < x1, got {window}")
    shape = (y1 - y0, x1 - x0, 3)
    n = shape[0] * shape[1] * 3
    dst = np.empty(shape, np.uint8) if out is None else out.reshape(-1)[:n].reshape(shape)
    try:
        got = mod.decode(data, dst, scale, y0, y1, x0, x1, fast=fast, max_pixels=float(max_pixels))
    except (mod.JpegError, mod.UnsupportedError, mod.TooLargeError):
        return None
    except ValueError as exc:  # a window outside the decoded image: the stored size is wrong
        raise CorruptImageError(key, f"header size disagrees with the stored size {height}x{width}: {exc}") from None
    want = (math.ceil(height * scale / 8), math.ceil(width * scale / 8))
    if tuple(got[:2]) != want:
        raise CorruptImageError(
            key, f"header size gives {got[0]}x{got[1]} at scale {scale}/8, the stored size "
                 f"{height}x{width} gives {want[0]}x{want[1]}; re-pack the dataset")
    return dst


def sniff_jpeg(data: Buffer) -> bool:
    """True when the bytes start with a JPEG marker (cheap: three bytes)."""
    head = bytes(memoryview(data).cast("B")[:3]) if not isinstance(data, (bytes, bytearray)) else bytes(data[:3])
    return head == _JPEG_SOI


def encode_jpeg(rgb: np.ndarray, quality: int = 90) -> bytes:
    """Encode RGB ``uint8 [H, W, 3]`` as a baseline 4:2:0 JPEG (libjpeg-turbo)."""
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be within 1..100, got {quality}")
    return simplejpeg.encode_jpeg(np.ascontiguousarray(rgb), quality=quality, colorspace="RGB",
                                  colorsubsampling="420")


# ---------------------------------------------------------------- label maps (segmentation masks)

#: PNG modes that hold one class id per pixel, and the dtype their ids decode to. A palette PNG
#: ("P", VOC's style) gives its indices, never the palette's colours; 16-bit ids come as int32
#: (torch has no arithmetic on uint16).
LABEL_MAP_MODES = {"1": np.uint8, "L": np.uint8, "P": np.uint8, "I;16": np.int32, "I;16B": np.int32,
                   "I;16L": np.int32, "I": np.int32}


def open_label_map(data: Buffer, key: str, *, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """A label map's header, checked: a PNG (lossless; a JPEG would blur the ids at every edge)
    whose mode holds class ids (L, P, 1, I;16, I), not colours. Raises UnsupportedImageError or
    CorruptImageError naming ``key`` (the mask file)."""
    img = _open(data, key, max_pixels)
    if img.format != "PNG":
        lossy = " (lossy: its edges would hold ids that are not classes)" if img.format in ("JPEG", "WEBP") else ""
        raise UnsupportedImageError(key, f"a label map must be a PNG of class ids, found a {img.format} file{lossy}; "
                                         "save the masks as PNG (mode L, P or I;16)")
    if img.mode not in LABEL_MAP_MODES:
        raise UnsupportedImageError(key, f"a label map holds one class id per pixel (PNG mode L, P or I;16), found "
                                         f"mode {img.mode} (colours or an alpha channel); convert it to class ids "
                                         "first")
    return img


def decode_label_map(data: Buffer, key: str, *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """A label-map PNG as an ``[H, W]`` array of class ids: uint8 (modes L, P, 1) or int32 (16- and
    32-bit ids). Raises CorruptImageError / UnsupportedImageError naming ``key``."""
    img = open_label_map(data, key, max_pixels=max_pixels)
    try:
        ids = np.asarray(img)
    except Exception as exc:  # a truncated or damaged PNG fails while its rows are read
        raise CorruptImageError(key, f"label map does not decode: {type(exc).__name__}: {exc}") from None
    return ids.astype(LABEL_MAP_MODES[img.mode], copy=False)


def encode_label_map(ids: np.ndarray, like: Image.Image) -> bytes:
    """Class ids ``[H, W]`` as a PNG in the mode of ``like`` (its palette kept for mode P)."""
    dtype = np.uint8 if like.mode in ("1", "L", "P") else np.int32 if like.mode == "I" else np.uint16
    img = Image.fromarray(np.ascontiguousarray(ids, dtype))   # the dtype picks the mode: L, I or I;16
    if like.mode == "P":
        img.putpalette(like.getpalette() or [])
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=6)
    return buf.getvalue()
