"""The per-sample work of a pack, run on worker threads (or Ray workers): read a source item, run the
pack function on it (``PackOptions(map=)``, :mod:`stoker.pack_map`), normalize what it gives (decode
check, upright RGB, ``max_side``, re-encode or raw pixels; a video is probed and indexed), and hand back
the rows a shard stores, or why the sample is skipped. Nothing here writes: the pack loop
(:mod:`stoker.packing`) consumes results in source order.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, NamedTuple

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from . import codecs, video
from .errors import ImageError, UnsupportedImageError
from .pack_map import PackSample, run_map
from .pack_options import PackOptions
from .sources import SourceItem
from .sources.base import read_bytes
from .video import VIDEO_ENCODING, VIDEO_INDEX_COLUMN

__all__ = ["Normalized", "Work", "normalize", "normalize_rgb", "normalize_video"]

#: With encoding="keep", a re-encoded JPEG must keep at least this PSNR (dB) against the
#: decoded source, or the sample is stored as PNG. Photos at quality 90 measure 32-42 dB.
MIN_PSNR_DB = 30.0


class Work(NamedTuple):
    """What a worker needs besides its samples: the options and the shards' schema (which the pack
    function's results are checked against)."""

    options: PackOptions
    label_type: str = "int64"
    num_classes: int = 0
    extra_columns: dict[str, str] = {}


class Normalized(NamedTuple):
    image: bytes
    encoding: str   # "jpeg" or "raw"
    height: int     # pixels, as stored
    width: int


def _decodes_cleanly(data: bytes) -> bool:
    """libjpeg-turbo decode in strict mode: the loader's fast path will take these bytes.

    At 1/8 scale: every coefficient is still entropy-decoded (where truncation and corruption
    show), only the inverse DCT shrinks. Measured: the same verdict as a full decode on 230
    truncated/bit-flipped files, for about 35% less time per ~100 KB photo."""
    try:
        simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True, min_height=1, min_width=1)
        return True
    except ValueError:
        return False


def _target_shape(height: int, width: int, max_side: int | None) -> tuple[int, int] | None:
    """(h, w) with the longer side shrunk to ``max_side``; None when no resize is needed."""
    longer = max(height, width)
    if max_side is None or longer <= max_side:
        return None
    scale = max_side / longer
    if height >= width:
        return max_side, max(1, round(width * scale))
    return max(1, round(height * scale)), max_side


def _resize(rgb: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Antialiased downscale: Lanczos, after a box reduce by an integer factor when the image
    is more than 3x the target (Pillow's reducing_gap; same quality, less work)."""
    if rgb.shape[:2] == shape:
        return rgb
    img = Image.fromarray(rgb).resize((shape[1], shape[0]), Image.Resampling.LANCZOS, reducing_gap=3.0)
    return np.asarray(img)


def normalize(data: bytes, key: str, options: PackOptions) -> Normalized:
    """Turn one source file into what a shard stores. Raises ImageError subclasses.

    Plain JPEGs (RGB/grey, orientation 1) that need no resize keep their bytes when
    ``options.encoding == "keep"``; everything else becomes upright RGB, shrunk to
    ``options.max_side``, then raw pixels (``encoding="raw"`` or at most ``raw_below``
    pixels), or a JPEG at ``options.jpeg_quality`` (with "keep", only when that JPEG stays
    within MIN_PSNR_DB of the pixels; otherwise lossless PNG).
    """
    info = codecs.probe(data, key, max_pixels=options.max_pixels)
    target = _target_shape(info.height, info.width, options.max_side)
    plain = codecs.is_plain_jpeg(info)
    tiny = info.height * info.width <= options.raw_below
    if plain and options.encoding == "keep" and target is None and not tiny and _decodes_cleanly(data):
        return Normalized(data if isinstance(data, bytes) else bytes(data), "jpeg", info.height, info.width)
    if plain and target is not None and min(target) >= 16:
        # Like Pillow's thumbnail(): decode at the smallest n/8 DCT scale still >= 2x the target
        # (much less work for big photos), then Lanczos. At 1x the result measurably loses detail;
        # below 16 px the DCT scale's edge padding shows, so tiny targets decode at full size.
        rgb = codecs.decode_rgb(data, "jpeg", key, height=info.height, width=info.width,
                                min_height=2 * target[0], min_width=2 * target[1])
    else:
        rgb = codecs.decode_pillow_rgb(data, key, max_pixels=options.max_pixels)
    return normalize_rgb(rgb, options)


def normalize_rgb(rgb: np.ndarray, options: PackOptions) -> Normalized:
    """Upright RGB pixels (uint8 [H, W, 3]) as a shard stores them: shrunk to ``max_side``, then raw,
    JPEG or (``encoding="keep"``, when a JPEG would not be faithful) PNG, as :func:`normalize` says."""
    target = _target_shape(rgb.shape[0], rgb.shape[1], options.max_side)
    if target is not None:
        rgb = _resize(rgb, target)
    h, w = rgb.shape[:2]
    if options.encoding == "raw" or h * w <= options.raw_below:
        return Normalized(np.ascontiguousarray(rgb).tobytes(), "raw", h, w)
    if options.encoding == "jpeg":
        return Normalized(codecs.encode_jpeg(rgb, options.jpeg_quality), "jpeg", h, w)
    image, encoding = _faithful_encode(rgb, options.jpeg_quality)
    return Normalized(image, encoding, h, w)


def normalize_video(data: bytes, key: str, options: PackOptions) -> tuple[Normalized, str]:
    """One video as a shard stores it, and its index (JSON for the ``video_index`` column): the bytes
    as given, after every frame decoded once (:func:`stoker.video.probe_video`), or, with ``max_side``
    (when the video is larger) or ``video_keyframes``, re-encoded to H.264 upright and indexed again.
    Height and width are of the upright frames. Raises ImageError subclasses (CorruptVideoError, ...)."""
    index = video.probe_video(data, key, max_pixels=options.max_pixels)
    shrink = options.max_side is not None and max(index.upright) > options.max_side
    if shrink or options.video_keyframes is not None:
        data = video.reencode(data, key, index, max_side=options.max_side, keyframe_seconds=options.video_keyframes,
                              crf=options.video_crf, max_pixels=options.max_pixels)
        index = video.probe_video(data, key, max_pixels=options.max_pixels)
    height, width = index.upright
    return Normalized(data if isinstance(data, bytes) else bytes(data), VIDEO_ENCODING, height, width), index.to_json()


#: pixels compared at a time (6 MB of float64 differences): a whole-image float difference of a
#: 169 MP image was 2 GB
_COMPARE_PIXELS = 1 << 18


def _faithful(a: np.ndarray, b: np.ndarray) -> bool:
    """PSNR of `b` against `a` (uint8 images) >= MIN_PSNR_DB, summed a strip of rows at a time."""
    rows = max(1, _COMPARE_PIXELS // max(a.shape[1], 1))
    total = 0
    for y in range(0, a.shape[0], rows):
        diff = (a[y:y + rows].astype(np.float64) - b[y:y + rows]).ravel()
        total += float(np.dot(diff, diff))   # exact: under 2**53 for a strip
    mse = total / max(a.size, 1)
    return mse == 0 or 10 * np.log10(255.0**2 / mse) >= MIN_PSNR_DB


def _faithful_encode(rgb: np.ndarray, quality: int) -> tuple[bytes, str]:
    """JPEG when it keeps the picture (4:2:0, else 4:4:4 chroma), else lossless PNG.

    Photos pass at 4:2:0; drawings, palette and 1-bit images with hard colour edges lose too
    much there (down to 12 dB PSNR at quality 90), so they get full chroma or PNG.
    """
    rgb = np.ascontiguousarray(rgb)
    for subsampling in ("420", "444"):
        data = simplejpeg.encode_jpeg(rgb, quality=quality, colorspace="RGB", colorsubsampling=subsampling)
        if _faithful(simplejpeg.decode_jpeg(data, colorspace="RGB"), rgb):
            return data, "jpeg"
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG", compress_level=6)
    return buf.getvalue(), "png"


# A task is a list of source items. A result per item is either (True, bytes read, [rows]), a row being
# (key, image, encoding, height, width, label, extras) (none when the pack function dropped the item),
# or (False, error type name, reason).
_Task = list[SourceItem]
#: one sample to normalize: (key, encoded bytes or None, pixels or None, label, extras)
_Made = tuple[str, Any, Any, Any, Any]


def _read_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "file not found (was it removed after the source was listed?)"
    if isinstance(exc, IsADirectoryError):
        return "is a directory, not an image file"
    if isinstance(exc, PermissionError):
        return "cannot read file: permission denied"
    return f"cannot read: {exc.strerror or exc}"


def _process_one(item: SourceItem, work: Work) -> tuple:
    """Read one sample, run the pack function on it and normalize what it gives; every failure becomes
    a (False, type, reason) result."""
    options = work.options
    try:
        data = item.read()
    except OSError as exc:
        return (False, "CorruptImageError", _read_reason(exc))
    except Exception as exc:  # a record a source's reader chokes on costs one sample, not the run
        return (False, "CorruptImageError", f"cannot read the record: {type(exc).__name__}: {exc}")
    if options.map is None:
        return _stored(item, data, [(item.key, data, None, item.label, item.extras)], options)
    sample = PackSample(item.key, data, item.label, item.extras, max_pixels=options.max_pixels)
    try:
        made = run_map(options.map, sample, work.label_type, work.num_classes, work.extra_columns)
    except ImageError as exc:   # MapFunctionError, or the sample's bytes failing to decode for the function
        return (False, type(exc).__name__, exc.reason)
    # bytes when the function left them (a plain JPEG keeps them), else the pixels it set
    return _stored(item, data, [(s.key, s.data, None if s.data is not None else s.image, s.label, dict(s.extras))
                                for s in made], options)


def _stored(item: SourceItem, data: bytes, made: list[_Made], options: PackOptions) -> tuple:
    """The rows of the samples `made` from `item` (its bytes `data`), or the first one's failure."""
    rows = []
    for key, encoded, pixels, label, extras in made:
        try:
            if options.samples == "video":
                if encoded is None:
                    return (False, "MapFunctionError", f"the pack function set pixels on the video {key!r}; a video "
                                                       "sample takes encoded bytes: sample.replace(data=...)")
                out, index = normalize_video(encoded, key, options)
                rows.append((key, out.image, out.encoding, out.height, out.width, label,
                             {**extras, VIDEO_INDEX_COLUMN: index}))
                continue
            if encoded is None:   # the pack function's pixels: the limit a source image gets, before any work on them
                codecs.check_pixels(key, pixels.shape[1], pixels.shape[0], options.max_pixels)
            out = normalize(encoded, key, options) if encoded is not None else normalize_rgb(pixels, options)
        except ImageError as exc:
            return (False, type(exc).__name__, exc.reason)
        except MemoryError:
            return (False, "DecompressionBombError", "ran out of memory while decoding")
        except Exception as exc:  # a library failing on odd input must cost one sample, not the run
            return (False, "CorruptImageError", f"decode failed: {type(exc).__name__}: {exc}")
        try:
            maps = {column: _label_map(item, path, data, out, options) for column, path in item.label_maps.items()}
        except ImageError as exc:
            return (False, type(exc).__name__, exc.reason)
        except OSError as exc:
            return (False, "CorruptImageError", f"label map: {_read_reason(exc)}")
        except Exception as exc:
            return (False, "CorruptImageError", f"label map decode failed: {type(exc).__name__}: {exc}")
        rows.append((key, out.image, out.encoding, out.height, out.width, label, {**extras, **maps}))
    return (True, len(data), rows)


def _label_map(item: SourceItem, path: Path, data: bytes, out: Normalized, options: PackOptions) -> bytes:
    """One sample's label-map PNG as the shard stores it: its bytes exactly as given, or, when the
    image was shrunk (``max_side``), resized to the stored size with nearest neighbour (ids stay ids;
    the same pixel-centre mapping the Loader uses) and re-encoded as PNG in the same mode. Its size
    must be the image's; an image that its EXIF orientation turns upright is refused, since its mask
    would not turn with it. Raises ImageError naming both files."""
    raw = read_bytes(path)
    try:
        img = codecs.open_label_map(raw, str(path), max_pixels=options.max_pixels)
    except ImageError as exc:   # the skip record names the image; say which mask file is wrong
        raise type(exc)(item.where(), f"label map {path}: {exc.reason}") from None
    info = codecs.probe(data, item.key, max_pixels=options.max_pixels)
    if info.orientation != 1:
        raise UnsupportedImageError(item.where(), f"EXIF orientation {info.orientation} turns this image upright "
                                    f"when packed, but not its label map {path}; save the image upright "
                                    "(without the orientation tag) to pack it with its mask")
    if (img.height, img.width) != (info.height, info.width):
        raise UnsupportedImageError(item.where(), f"the image is {info.width}x{info.height} but its label map "
                                    f"{path} is {img.width}x{img.height}; a mask must match its image pixel "
                                    "for pixel")
    try:   # decoded whole even when kept as is: a truncated PNG has a sound header
        ids = codecs.decode_label_map(raw, str(path), max_pixels=options.max_pixels)
    except ImageError as exc:
        raise type(exc)(item.where(), f"label map {path}: {exc.reason}") from None
    if (out.height, out.width) == (info.height, info.width):
        return raw
    small = cv2.resize(ids, (out.width, out.height), interpolation=cv2.INTER_NEAREST_EXACT)
    return codecs.encode_label_map(small, img)


def _process_task(task: _Task, work: Work) -> list[tuple]:
    return [_process_one(entry, work) for entry in task]
