"""Pack a source into Arrow shards: validate, normalize, write; in parallel and resumable.

Each sample is checked and normalized on a worker thread (:func:`normalize`): a JPEG that
the loader's fast path can decode as is (RGB or grey, EXIF-upright, no resize) keeps its
bytes after a strict decode check; everything else is decoded by Pillow, turned upright RGB,
optionally shrunk, and re-encoded as JPEG, or stored as raw pixels when tiny.

Results are consumed in source order, so the shards are the same for any worker count.
After every finished shard one fsynced line goes to ``OUT/.stoker-pack.jsonl`` (the
journal); ``resume=True`` checks it against the shards on disk and carries on from the
recorded source position, giving exactly what an uninterrupted run gives. The manifest is
written last, then the journal is removed. Every file in OUT is written through
:mod:`stoker.storage`; a URL no backend serves is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import io
import errno
import fnmatch
import json
import os
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from . import codecs, video
from ._progress import Progress
from ._system import parse_size, usable_cpus
from .errors import (OVERWRITE, RESUME, ConfigError, CorruptImageError, CorruptVideoError, DecompressionBombError,
                     ImageError, OutputError, SourceError, StokerError, UnsupportedImageError, UnsupportedVideoError)
from .integrity import shard_matches
from .shards import MANIFEST_NAME, Manifest, ShardInfo, ShardWriter, read_manifest, shard_name, write_manifest
from .sources import Source, SourceItem, open_source, unencodable_keys
from .sources.base import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, inside, read_bytes
from .storage import StorageBackend as Storage, as_storage, url_scheme
from .storage.lock import LockHeldError, holder_text
from .video import VIDEO_ENCODING, VIDEO_INDEX_COLUMN

__all__ = ["JOURNAL_NAME", "SKIPPED_NAME", "PackOptions", "PackSummary", "normalize", "pack"]

JOURNAL_NAME = ".stoker-pack.jsonl"
SKIPPED_NAME = "skipped.jsonl"
#: held (an OS file lock) by the pack writing the directory; the file stays, it is never data
LOCK_NAME = ".stoker.lock"
#: Seconds one task (a few samples) may take in a worker before the pack gives up on it.
TASK_TIMEOUT_S = 600.0
#: Samples per task handed to a worker thread: amortizes the per-task dispatch and result handling.
TASK_SAMPLES = 8
#: With encoding="keep", a re-encoded JPEG must keep at least this PSNR (dB) against the
#: decoded source, or the sample is stored as PNG. Photos at quality 90 measure 32-42 dB.
MIN_PSNR_DB = 30.0
_ERROR_TYPES = {cls.__name__: cls for cls in (CorruptImageError, UnsupportedImageError, CorruptVideoError,
                                               UnsupportedVideoError, DecompressionBombError, ImageError)}
#: PackOptions.samples: what a source's files are
SAMPLE_KINDS = ("auto", "image", "video")


@dataclass(frozen=True)
class PackOptions:
    """How samples are normalized and written. All but ``workers``, ``engine`` and ``address``
    shape the output: a Ray pack is the same bytes as a local one."""

    max_side: int | None = None      # shrink so the longer side is at most this many pixels
    encoding: str = "keep"           # keep: JPEG bytes kept when possible, else a faithful JPEG or PNG;
                                     # jpeg: every sample re-encoded as JPEG; raw: RGB pixels
    jpeg_quality: int = 90           # 1..100, for re-encoded samples
    raw_below: int = 64 * 64         # samples with <= this many pixels are stored raw (0: never)
    shard_size: int = 256 * 2**20    # bytes of image data per shard (a shard closes once it reaches this);
                                     # a size string ("16MiB", "1G") is turned into bytes
    workers: int | None = None       # threads; None: one per usable CPU; 1: in this thread
    engine: str = "local"            # local: threads here; ray: Ray workers (see stoker.ray_engine)
    address: str | None = None       # with engine="ray": the cluster ("auto", "ray://host:10001"); None: local
    on_error: str = "skip"           # skip: log bad files to skipped.jsonl; fail: stop at the first
    max_pixels: int = codecs.MAX_PIXELS  # decompression-bomb limit, pixels (None: the default)
    samples: str = "auto"            # auto: videos when the source lists video files (or bytes), else images
    video_keyframes: float | None = None  # videos: re-encode (H.264) with a keyframe every this many seconds;
                                     # None: stored byte-for-byte unless max_side shrinks them
    video_crf: int = 23              # quality of re-encoded videos (x264's CRF: lower is better, larger)

    def __post_init__(self) -> None:
        if self.max_pixels is None:
            object.__setattr__(self, "max_pixels", codecs.MAX_PIXELS)
        if isinstance(self.shard_size, str):   # "16MiB", as `stoker pack --shard-size` takes it
            object.__setattr__(self, "shard_size", parse_size(self.shard_size))
        def bad(name: str, expected: str) -> ConfigError:
            return ConfigError(f"pack option {name}={getattr(self, name)!r}: expected {expected}")
        if self.max_side is not None and (not isinstance(self.max_side, int) or self.max_side < 1):
            raise bad("max_side", "None or a positive number of pixels")
        if self.encoding not in ("keep", "jpeg", "raw"):
            raise bad("encoding", "'keep', 'jpeg' or 'raw'")
        if not isinstance(self.jpeg_quality, int) or not 1 <= self.jpeg_quality <= 100:
            raise bad("jpeg_quality", "an integer in 1..100")
        if not isinstance(self.raw_below, int) or self.raw_below < 0:
            raise bad("raw_below", "a pixel count >= 0")
        if not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise bad("shard_size", "a positive number of bytes")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise bad("workers", "None or a positive integer")
        if self.engine not in ("local", "ray"):
            raise bad("engine", "'local' or 'ray'")
        if self.address is not None and self.engine != "ray":
            raise bad("address", "None unless engine='ray'")
        if self.on_error not in ("skip", "fail"):
            raise bad("on_error", "'skip' or 'fail'")
        if not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise bad("max_pixels", "a positive pixel count")
        if self.samples not in SAMPLE_KINDS:
            raise bad("samples", f"one of {SAMPLE_KINDS}")
        if self.video_keyframes is not None and not (isinstance(self.video_keyframes, (int, float))
                                                     and 0 < self.video_keyframes <= 60):
            raise bad("video_keyframes", "None or seconds between keyframes in (0, 60]")
        if not isinstance(self.video_crf, int) or not 0 <= self.video_crf <= 51:
            raise bad("video_crf", "an integer in 0..51")

    def output_options(self) -> dict[str, Any]:
        """The options that decide the bytes written (not ``workers``, ``engine``, ``address``)."""
        opts = asdict(self)
        for name in ("workers", "engine", "address"):
            del opts[name]
        return opts


@dataclass
class PackSummary:
    """What a pack did. ``bytes_in``/``bytes_out`` count packed samples only (source vs stored)."""

    packed: int
    skipped: int
    bytes_in: int
    bytes_out: int
    seconds: float
    shards: int
    out: Path | str  # the dataset folder, or its URL
    already_complete: bool = False   # a resume found the pack finished: nothing was packed this time
    noun: str = "images"             # what the samples are: "images" or "videos"
    resumed: int = 0                 # of ``packed``, the samples an interrupted run had packed before

    def __str__(self) -> str:
        return self.format()

    def format(self) -> str:
        """One line for people: counts, shards, bytes in and out, time and images/s."""
        if self.already_complete:
            skipped = f" ({self.skipped:,} skipped)" if self.skipped else ""
            return (f"{self.out} already holds a complete pack of {self.packed:,} {self.noun}{skipped} in {self.shards} "
                    f"shard(s), {_mb(self.bytes_out)}: nothing to do")
        # the rate of this run's work: a resumed run did not pack what the interrupted one had
        rate = f", {(self.packed - self.resumed) / self.seconds:,.0f} {self.noun}/s" if self.seconds > 0 else ""
        skipped = f" ({self.skipped:,} skipped, see {self.out}/{SKIPPED_NAME})" if self.skipped else ""
        resumed = f" ({self.packed - self.resumed:,} now, {self.resumed:,} before the resume)" if self.resumed else ""
        return (f"packed {self.packed:,} {self.noun}{resumed}{skipped} into {self.shards} shard(s) in {self.out}: "
                f"{_mb(self.bytes_in)} in -> {_mb(self.bytes_out)} out, {self.seconds:.1f} s{rate}")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


# ---------------------------------------------------------------- normalize (runs in workers)

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


# A task is a list of source items. A result entry is either
# (True, image, encoding, height, width, bytes_in, {column: label-map PNG}) or (False, error type name, reason).
_Task = list[SourceItem]


def _read_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "file not found (was it removed after the source was listed?)"
    if isinstance(exc, IsADirectoryError):
        return "is a directory, not an image file"
    if isinstance(exc, PermissionError):
        return "cannot read file: permission denied"
    return f"cannot read: {exc.strerror or exc}"


def _process_one(item: SourceItem, options: PackOptions) -> tuple:
    """Read and normalize one sample; every failure becomes a (False, type, reason) result."""
    try:
        data = item.read()
    except OSError as exc:
        return (False, "CorruptImageError", _read_reason(exc))
    except Exception as exc:  # a record a source's reader chokes on costs one sample, not the run
        return (False, "CorruptImageError", f"cannot read the record: {type(exc).__name__}: {exc}")
    try:
        if options.samples == "video":
            out, index = normalize_video(data, item.key, options)
            return (True, out.image, out.encoding, out.height, out.width, len(data), {VIDEO_INDEX_COLUMN: index})
        out = normalize(data, item.key, options)
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
    return (True, out.image, out.encoding, out.height, out.width, len(data), maps)


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


def _process_task(task: _Task, options: PackOptions) -> list[tuple]:
    return [_process_one(entry, options) for entry in task]


# ---------------------------------------------------------------- parallel, in order

def _tasks(items: list[SourceItem], start: int, per_task: int) -> Iterator[_Task]:
    for lo in range(start, len(items), per_task):
        yield items[lo:lo + per_task]


def _run_in_order(tasks: Iterator[_Task], options: PackOptions, workers: int) -> Iterator[list[tuple]]:
    """Yield each task's results in task order; at most ``4 * workers`` tasks in flight.

    Threads, not processes: file reads, libjpeg-turbo and Pillow's decode, resize and encode
    release the GIL, so threads scale as far as the cores do (measured in docs/packing.md) with
    no start-up cost, no bytes piped between processes, and no ``__main__`` guard for callers.
    """
    if workers == 1:
        for task in tasks:
            yield _process_task(task, options)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="stoker-pack")
    window: deque[Future] = deque()
    try:
        for task in tasks:
            window.append(pool.submit(_process_task, task, options))
            if len(window) >= 4 * workers:
                yield _result(window.popleft())
        while window:
            yield _result(window.popleft())
    finally:
        # On Ctrl-C or an error: queued tasks are cancelled; running ones finish their few samples.
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future) -> list[tuple]:
    try:
        return future.result(timeout=TASK_TIMEOUT_S)
    except FutureTimeout:
        raise StokerError.spelled(f"a pack worker spent more than {TASK_TIMEOUT_S:.0f} s on {TASK_SAMPLES} samples "
                                  "and looks stuck (storage hung?); rerun with {resume}", {"resume": RESUME}) from None


# ---------------------------------------------------------------- journal and output folder

@dataclass
class _State:
    """Progress recorded in the journal: finished shards and what came before them."""

    shards: list[ShardInfo] = field(default_factory=list)
    consumed: int = 0   # source items handled (packed or skipped) up to the last finished shard
    packed: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    fingerprint: str = ""   # the source listing's, kept in the manifest for a later resume=True to check


#: the manifest's pack_options key holding the source listing's fingerprint (`_fingerprint`)
LISTING_KEY = "source_listing_sha256"


def _fingerprint(source: Source) -> str:
    """SHA-256 over every item's key, label and extras, and the label schema."""
    digest = hashlib.sha256()
    digest.update(json.dumps([source.label_type, source.classes, source.extra_columns]).encode())
    for item in source.items:
        listed = [item.key, item.label, item.extras] + ([item.label_maps] if item.label_maps else [])
        digest.update(json.dumps(listed, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _append_line(storage: Storage, obj: dict[str, Any]) -> None:
    """One fsynced line of the journal."""
    storage.append_line(JOURNAL_NAME, json.dumps(obj))


def _owned_files(storage: Storage) -> list[str]:
    """Files a pack writes into OUT (finished or not); nothing else there is touched."""
    names = {MANIFEST_NAME, JOURNAL_NAME, SKIPPED_NAME, f".{MANIFEST_NAME}.tmp", f".{JOURNAL_NAME}.tmp",
             f".{SKIPPED_NAME}.tmp"}
    present = storage.list()
    return ([n for n in sorted(names) if n in present] + fnmatch.filter(present, "shard-*.arrow")
            + fnmatch.filter(present, ".shard-*.arrow.tmp"))


def _remove(storage: Storage, names: list[str]) -> None:
    for name in names:
        storage.remove(name)


def _load_journal(storage: Storage, header: dict[str, Any]) -> _State:
    """Check the journal against ``header`` and the shards on disk; keep the valid prefix."""
    lines = storage.read_bytes(JOURNAL_NAME).decode("utf-8").splitlines()
    try:
        found = json.loads(lines[0]) if lines else {}
    except (json.JSONDecodeError, RecursionError):
        found = {}
    for field_name in ("items", "fingerprint", "pack_options"):
        if found.get(field_name) != header[field_name]:
            what = {"items": "number of source items", "fingerprint": "source listing (keys, labels, extras)",
                    "pack_options": "pack options or source"}[field_name]
            raise ConfigError.spelled(
                f"{storage.location} holds an unfinished pack whose {what} differs from this call "
                f"({_changes(found.get(field_name), header[field_name])}); resume with the "
                "same source and options, or pass {overwrite} to start over", {"overwrite": OVERWRITE})
    state, kept = _State(), [lines[0]]
    for line in lines[1:]:
        try:
            entry = json.loads(line)
            info = ShardInfo(**entry["shard"])
        except (json.JSONDecodeError, RecursionError, KeyError, TypeError):
            break  # a line torn by the crash: its shard is redone
        if info.file != shard_name(len(state.shards)) or not shard_matches(storage, info):
            break  # damaged or missing shard: redo from here
        state.shards.append(info)
        state.consumed, state.packed = entry["consumed"], entry["packed"]
        state.bytes_in, state.bytes_out = entry["bytes_in"], entry["bytes_out"]
        state.skipped.extend(entry["skipped"])
        kept.append(line)
    keep = {s.file for s in state.shards}
    present = storage.list()
    _remove(storage, [n for n in fnmatch.filter(present, "shard-*.arrow") if n not in keep]
            + fnmatch.filter(present, ".shard-*.arrow.tmp"))
    storage.write_atomic(JOURNAL_NAME, ("\n".join(kept) + "\n").encode())
    return state


def _changes(was: Any, now: Any) -> str:
    """What differs between the options a pack was made with and this call's, one `name: was X, now Y`
    per option (not the whole dicts, in which one changed value is hard to spot)."""
    if not (isinstance(was, dict) and isinstance(now, dict)):
        return f"was {was!r}, now {now!r}"
    unset = "(not set)"
    return "; ".join(f"{name}: was {was.get(name, unset)!r}, now {now.get(name, unset)!r}"
                     for name in sorted(set(was) | set(now), key=str) if was.get(name, unset) != now.get(name, unset))


def _finished_summary(storage: Storage, pack_options: dict[str, Any], started: float,
                      fingerprint: str) -> PackSummary:
    manifest = read_manifest(storage)
    stored = dict(manifest.pack_options)
    listed = stored.pop(LISTING_KEY, None)   # absent from packs made before it was recorded
    if stored != pack_options:
        raise ConfigError.spelled(
            f"{storage.location} already holds a finished pack made with other options or another "
            f"source ({_changes(manifest.pack_options, pack_options)}); pack with the same options to keep it, "
            "or pass {overwrite} to re-pack", {"overwrite": OVERWRITE})
    if listed is not None and listed != fingerprint:
        raise ConfigError.spelled(
            f"{storage.location} already holds a finished pack of {pack_options['source']} whose listing (file "
            "names, labels, extras) has changed since it was packed; pass {overwrite} to re-pack it, or choose "
            "another output directory", {"overwrite": OVERWRITE})
    _remove(storage, [JOURNAL_NAME])
    try:
        skipped = len(storage.read_bytes(SKIPPED_NAME).splitlines())
    except FileNotFoundError:
        skipped = 0
    return PackSummary(manifest.num_samples, skipped, 0, sum(s.bytes for s in manifest.shards),
                       time.perf_counter() - started, len(manifest.shards), _out_location(storage),
                       already_complete=True, noun=_noun(pack_options))


@contextmanager
def _locked_out(storage: Storage) -> Iterator[None]:
    """Create OUT and hold its lock for the whole pack: a second pack into it fails at once."""
    try:
        storage.makedirs()
    except (FileExistsError, NotADirectoryError):
        what = "is a file" if Path(storage.location).is_file() else "is under a file, not a folder"
        raise ConfigError(f"output {storage.location} {what}; expected a directory (empty, or holding a "
                          "pack to resume): choose another output path") from None
    lock = storage.lock(LOCK_NAME)
    try:
        lock.__enter__()
    except LockHeldError as exc:
        raise ConfigError(f"{storage.location} is being written by another pack: {holder_text(exc.holder)}; "
                          "wait for it to finish (then pass resume=True / --resume if it was stopped), or "
                          "choose another output directory") from None
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def _prepare_out(storage: Storage, header: dict[str, Any], resume: bool, overwrite: bool) -> _State | None:
    """Make OUT ready; returns the state to continue from, or None when the pack is finished."""
    owned = _owned_files(storage)
    has_manifest, has_journal = MANIFEST_NAME in owned, JOURNAL_NAME in owned
    if overwrite:
        _remove(storage, owned)
    elif resume and has_manifest:
        return None
    elif resume and has_journal:
        return _load_journal(storage, header)
    elif resume:
        _remove(storage, owned)  # shards with no journal are not ours to trust
    elif owned:
        state = "a finished pack" if has_manifest else "an unfinished pack"
        raise ConfigError.spelled(
            f"{storage.location} already holds {state} ({owned[0]}, ...); pass {{resume}} to finish it, "
            "{overwrite} to replace it, or choose an empty directory", {"resume": RESUME, "overwrite": OVERWRITE})
    _append_line(storage, header)
    return _State()


# ---------------------------------------------------------------- the pack loop

def _where(item: SourceItem) -> str:
    if item.path is not None:
        return str(item.path)
    return f"{item.container}:{item.key}"


class _Packer:
    """Consumes results in source order and rolls shards over at ``options.shard_size``."""

    def __init__(self, storage: Storage, source: Source, options: PackOptions, state: _State) -> None:
        self.storage, self.source, self.options, self.state = storage, source, options, state
        self.pending: list[dict[str, str]] = []   # skips since the last journal line
        self.writer = self._new_writer()

    def _new_writer(self) -> ShardWriter:
        return ShardWriter(self.storage, len(self.state.shards), label_type=self.source.label_type,
                           extra_columns=self.source.extra_columns)

    def take(self, pos: int, result: tuple) -> None:
        item, st = self.source.items[pos], self.state
        if result[0]:
            _, image, encoding, height, width, n_in, maps = result
            self.writer.add(item.key, image, encoding, height, width, item.label, {**item.extras, **maps})
            st.packed += 1
            st.bytes_in += n_in
            st.bytes_out += len(image)
        else:
            _, error_type, reason = result
            if self.options.on_error == "fail":
                raise _ERROR_TYPES[error_type](item.where(), reason)
            skip = {"key": item.key, "path": item.where(), "reason": reason}
            st.skipped.append(skip)
            self.pending.append(skip)
        if self.writer.nbytes >= self.options.shard_size:
            self.close_shard(pos + 1)

    def close_shard(self, consumed: int) -> None:
        st = self.state
        info = self.writer.finish()
        st.shards.append(info)
        st.consumed = consumed
        _append_line(self.storage, {
            "shard": asdict(info), "consumed": consumed, "packed": st.packed, "bytes_in": st.bytes_in,
            "bytes_out": st.bytes_out, "skipped": self.pending})
        self.pending = []
        self.writer = self._new_writer()


def pack(src: str | Path | Source, out: str | Path | Storage, *, options: PackOptions | None = None,
         resume: bool = False, progress: bool = True, overwrite: bool = False,
         **source_options: Any) -> PackSummary:
    """Pack ``src`` (see :func:`stoker.sources.open_source`) into a dataset directory ``out``.

    ``out`` may be a URL (``s3://bucket/ds``, any fsspec URL) or a Storage: each shard is uploaded
    whole once finished, the manifest last, so a reader never takes a half-written pack for done.

    Bad files are skipped and listed in ``out/skipped.jsonl`` (or, with ``on_error="fail"``,
    the first raises its ImageError). ``resume=True`` finishes an interrupted pack exactly as
    an uninterrupted run would have; ``overwrite=True`` replaces an existing pack. Raises
    SourceError, ConfigError, ImageError.
    """
    started = time.perf_counter()
    options = options or PackOptions()
    from .spelling import pack_keywords
    pack_keywords(source_options, open_source, PackOptions)  # max_side= is options=PackOptions(max_side=)
    if resume and overwrite:
        raise ConfigError.spelled("{resume} and {overwrite} contradict each other; pass one of them",
                                  {"resume": RESUME, "overwrite": OVERWRITE})
    if options.engine == "ray":  # before anything is written: a missing extra is named at once
        from .ray_engine import require_ray
        require_ray()
    storage = as_storage(out)  # before listing: a URL no backend serves is refused at once
    _refuse_out_inside_src(src, storage)
    codecs.quiet_decoder_messages()  # each bad file is reported in skipped.jsonl, not by libtiff on stderr
    source = src if isinstance(src, Source) else open_source(src, **source_options)
    kept, unnamed = unencodable_keys(source.items)
    if unnamed:  # before the fingerprint: a resume lists (and leaves out) the same files
        source = replace(source, items=kept, skipped=source.skipped + unnamed)
    if source.skipped and options.on_error == "fail":
        first = source.skipped[0]
        raise CorruptImageError(first["path"], first["reason"])
    source, options = _resolve_samples(source, options)
    pack_options = {**options.output_options(), "source": source.description, "source_kind": source.kind}
    header = {"format": "stoker-pack-journal", "items": len(source.items), "fingerprint": _fingerprint(source),
              "pack_options": pack_options}
    try:
        with _locked_out(storage):
            state = _prepare_out(storage, header, resume, overwrite)
            if state is None:
                return _finished_summary(storage, pack_options, started, header["fingerprint"])
            state.fingerprint = header["fingerprint"]
            return _pack_into(storage, source, options, state, pack_options, started, progress)
    except OSError as exc:
        if isinstance(exc, StokerError):
            raise
        # sources' read errors are skips, so an OSError here is OUT's: its writes, its folder
        raise OutputError(f"cannot write {storage.location}: {exc.strerror or exc}"
                          f"{f' ({exc.filename})' if exc.filename else ''}; "
                          f"{_OUTPUT_FIX.get(exc.errno, 'fix the output directory')}, then run the same "
                          "pack with resume=True (--resume): finished shards are kept",
                          path=storage.location, errno=exc.errno) from exc


def _resolve_samples(source: Source, options: PackOptions) -> tuple[Source, PackOptions]:
    """Decide whether the source's samples are videos (``samples="auto"``): yes when its keys end like
    video files, or, for keys without a file ending (a Hugging Face row), when the first sample's bytes
    start like a video container. A video pack stores each video's index in the ``video_index`` column."""
    samples = options.samples
    if samples == "auto":
        endings = {os.path.splitext(item.key)[1].lower() for item in source.items}
        if endings & VIDEO_EXTENSIONS:
            samples = "video"
        elif source.items and not endings & IMAGE_EXTENSIONS:
            try:
                samples = "video" if video.looks_like_video(source.items[0].read()[:16]) else "image"
            except OSError:
                samples = "image"   # that sample is skipped with its reason when packed
        else:
            samples = "image"
    if samples == "video":
        video.require_av()   # before anything is written: a missing extra is named at once
        if VIDEO_INDEX_COLUMN in source.extra_columns:
            raise SourceError(f"{source.description} has a column named {VIDEO_INDEX_COLUMN!r}, which a video pack "
                              "writes itself; rename that column", path=source.root)
        source = replace(source, extra_columns={**source.extra_columns, VIDEO_INDEX_COLUMN: "string"})
    return source, replace(options, samples=samples)


_OUTPUT_FIX = {errno.ENOSPC: "free some disk space (or choose an output directory on a disk with room)",
               errno.EDQUOT: "raise your disk quota or free some space",
               errno.EROFS: "the file system is read-only: choose a writable output directory",
               errno.EACCES: "make the output directory writable, or choose another",
               errno.EPERM: "make the output directory writable, or choose another"}


def _pack_into(storage: Storage, source: Source, options: PackOptions, state: _State,
               pack_options: dict[str, Any], started: float, progress: bool) -> PackSummary:
    resumed = state.packed   # already in finished shards (a resumed pack)
    packer = _Packer(storage, source, options, state)
    remaining = len(source.items) - state.consumed
    workers = max(1, min(options.workers or usable_cpus(), -(-remaining // TASK_SAMPLES)))
    bar = Progress("pack", len(source.items), initial=state.consumed, enabled=progress)
    pos = state.consumed
    if options.engine == "ray":
        from .ray_engine import RAY_TASK_SAMPLES, run_on_ray

        tasks = ([item.portable() for item in task] for task in _tasks(source.items, pos, RAY_TASK_SAMPLES))
        stream = run_on_ray(_process_task, tasks, options, address=options.address, timeout=TASK_TIMEOUT_S)
    else:
        stream = _run_in_order(_tasks(source.items, pos, TASK_SAMPLES), options, workers)
    try:
        for results in stream:
            for result in results:
                packer.take(pos, result)
                pos += 1
            bar.update(len(results))
            if packer.pending:
                bar.set_postfix(skipped=len(state.skipped))
        if packer.writer.rows:
            packer.close_shard(pos)
    except BaseException:
        packer.writer.abort()
        raise
    finally:
        stream.close()  # stops the workers now, not when the traceback is collected
        bar.close()
    return replace(_finish(storage, source, state, pack_options, started), resumed=resumed)


def _out_location(storage: Storage) -> Path | str:
    return Path(storage.location) if storage.in_place else storage.location


def _refuse_out_inside_src(src: str | Path | Source, storage: Storage) -> None:
    """A dataset written inside the folder it packs would be listed by the next pack of that
    folder (a class ``packed`` shifting every label, or its shards as images), and a killed
    pack there could not resume: refuse it. A list or table is not walked, so OUT may sit
    beside it; object storage is never inside a local folder."""
    if isinstance(src, Source) or isinstance(src, (list, tuple)) or not storage.in_place or url_scheme(src):
        return
    out = storage.location
    folder = os.path.realpath(Path(src).expanduser())
    target = os.path.realpath(Path(out).expanduser())
    if os.path.isdir(folder) and inside(Path(folder), target):
        raise SourceError(f"OUT {out} is inside the source folder {src}: the next pack of that folder would "
                          "list the packed dataset as data (an extra class, every label shifted); write OUT "
                          "outside the source folder", path=src)


def _finish(storage: Storage, source: Source, state: _State, pack_options: dict[str, Any],
            started: float) -> PackSummary:
    """skipped.jsonl, then the manifest (last), then drop the journal."""
    skipped = source.skipped + state.skipped   # refused while listing, then while packing
    lines = "".join(json.dumps(s) + "\n" for s in skipped)
    storage.write_atomic(SKIPPED_NAME, lines.encode())
    if state.packed == 0:
        raise SourceError(f"none of the {len(source.items) + len(source.skipped)} images in {source.description} "
                          f"could be packed; the reasons are in {storage.join(SKIPPED_NAME)}", path=source.root)
    manifest = Manifest(num_samples=state.packed, shards=state.shards, classes=source.classes,
                        label_type=source.label_type, extra_columns=source.extra_columns,
                        pack_options={**pack_options, LISTING_KEY: state.fingerprint})
    write_manifest(storage, manifest)
    _remove(storage, [JOURNAL_NAME])
    return PackSummary(state.packed, len(skipped), state.bytes_in, state.bytes_out,
                       time.perf_counter() - started, len(state.shards), _out_location(storage),
                       noun=_noun(pack_options))


def _noun(pack_options: dict[str, Any]) -> str:
    return "videos" if pack_options.get("samples") == "video" else "images"
