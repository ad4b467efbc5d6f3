"""Clips: which frames a clip takes, one spatial plan per clip, and the decode into preallocated rows.

Given a video's stored bytes and its :class:`~stoker.video.VideoIndex`, a clip's frame numbers are a
pure function of ``(seed, epoch, sample index, clip)`` (:func:`clip_frames`, keyed like
:func:`stoker.order.sample_keys`), and so is its one crop/flip plan (:func:`plan_clip`, stoker's planned
geometry). :func:`decode_clip_into` checks the clip and hands it to a :class:`ClipDecoder`; the one
built, :class:`PyAVDecoder`, seeks to the keyframe at or before each run of wanted frames and decodes
forward only as far as the clip needs, converting (and downscaling, in the same swscale pass) only the
frames the clip keeps, into a uint8 ``[T, H, W, 3]`` array: the clip's rows of a batch slot. PyAV
(FFmpeg) releases the GIL while it decodes and converts, so clips decode in parallel on threads.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Protocol, Sequence

import numpy as np

from ..errors import ConfigError, CorruptVideoError
from ..order import TAG_CLIP, mix64, sample_keys, uniforms
from ..transforms.geometry import decode_minimums, resample_region_into, resampling
from ..transforms.user import apply_tail
from ..video import VideoIndex, open_container, require_av, upright, video_stream
from .kinds import Renderer
from .stats import WorkerTimes

__all__ = ["SAMPLINGS", "ClipDecoder", "ClipKind", "ClipPlan", "ClipStats", "Clips", "PyAVDecoder", "clip_frames",
           "clip_key", "decode_clip_into", "finish_clip", "plan_clip", "read_clip"]

SAMPLINGS = ("random", "uniform")


@dataclass(frozen=True)
class Clips:
    """Which frames make a clip: ``frames`` per clip, taken every ``stride`` frames or at ``fps`` frames
    per second of presentation time (one of the two; neither: stride 4), placed at random in the video
    (``sampling="random"``, training) or evenly (``"uniform"``, evaluation: clip ``c`` of
    ``clips_per_video`` centred in the c-th equal part). A video too short for the clip gets its frames
    spread evenly over the whole video (some repeat when it has fewer than ``frames``)."""

    frames: int = 16
    stride: int | None = None
    fps: float | None = None
    sampling: str = "random"
    clips_per_video: int = 1

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ConfigError:
            return ConfigError(f"clip option {name}={getattr(self, name)!r}: expected {expected}")
        if not isinstance(self.frames, int) or self.frames < 1:
            raise bad("frames", "a positive number of frames per clip")
        if self.stride is not None and self.fps is not None:
            raise ConfigError(f"clip options stride={self.stride!r} and fps={self.fps!r}: pass one of them "
                              "(frames apart, or frames per second of presentation time)")
        if self.stride is None and self.fps is None:
            object.__setattr__(self, "stride", 4)
        if self.stride is not None and (not isinstance(self.stride, int) or self.stride < 1):
            raise bad("stride", "a positive number of frames")
        if self.fps is not None and not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps)
                                         and self.fps > 0):
            raise bad("fps", "a positive number of frames per second")
        if self.sampling not in SAMPLINGS:
            raise bad("sampling", f"one of {SAMPLINGS}")
        if not isinstance(self.clips_per_video, int) or self.clips_per_video < 1:
            raise bad("clips_per_video", "a positive integer")


@dataclass(frozen=True)
class ClipStats:
    """What one clip cost: frames the decoder produced, frames the clip kept (distinct), seeks made, and
    frames passed over without decoding (non-reference H.264/HEVC pictures the clip does not keep).
    ``decoded / delivered`` is the waste: 1.0 means nothing was decoded in vain."""

    decoded: int
    delivered: int
    seeks: int
    skipped: int = 0


def clip_key(seed: int, epoch: int, sample: int, clip: int = 0) -> np.ndarray:
    """The uint64 root (a length-1 array) of one clip's random stream: a pure function of
    ``(seed, epoch, sample index, clip number)``, like :func:`stoker.order.sample_keys` for images. Draw 0
    places the clip in time, draws 1.. plan its one spatial augmentation."""
    return mix64(sample_keys(seed, epoch, np.array([sample]), tag=TAG_CLIP) ^ np.uint64(clip))


def _window(index: VideoIndex, window: tuple[float | None, float | None] | None) -> tuple[int, int]:
    """Frames [a, b) whose time lies in ``window`` (seconds from the first frame; a NaN or None end is
    open); the whole video when the window holds no frame."""
    if window is None:
        return 0, index.frames
    times = index.seconds(np.arange(index.frames))
    start, end = window
    a = 0 if start is None or not math.isfinite(start) else int(np.searchsorted(times, start - 1e-6, "left"))
    b = index.frames if end is None or not math.isfinite(end) else int(np.searchsorted(times, end + 1e-6, "right"))
    return (a, b) if b > a else (0, index.frames)


def clip_frames(index: VideoIndex, spec: Clips, u: float, clip: int = 0,
                window: tuple[float | None, float | None] | None = None) -> np.ndarray:
    """Frame numbers (int64 [spec.frames], presentation order) of one clip. ``u`` in [0, 1) places a
    random clip; ``clip`` picks the part for uniform sampling; ``window`` (start, end) seconds bounds the
    clip (a Kinetics annotation's segment)."""
    a, b = _window(index, window)
    t, k = spec.frames, spec.clips_per_video
    where = u if spec.sampling == "random" else (clip % k + 0.5) / k
    if spec.stride is not None:
        span = (t - 1) * spec.stride + 1
        if span > b - a:
            return np.rint(np.linspace(a, b - 1, t)).astype(np.int64)
        start = a + min(b - a - span, int(math.floor(where * (b - a - span + 1))))
        return start + np.arange(t, dtype=np.int64) * spec.stride
    times = index.seconds(np.arange(a, b))
    length = (t - 1) / spec.fps
    room = float(times[-1] - times[0]) - length
    if room < 0:
        wanted = np.linspace(times[0], times[-1], t)
    else:
        wanted = times[0] + where * room + np.arange(t) / spec.fps
    # each wanted instant shows the last frame presented at or before it
    return a + np.clip(np.searchsorted(times, wanted + 1e-9, "right") - 1, 0, b - a - 1).astype(np.int64)


@dataclass(frozen=True)
class ClipPlan:
    """One clip, planned: its frame numbers, one crop ``box`` (top, left, height, width in upright
    source pixels), the output ``size`` (height, width), ``flip``, and the clip's draws ``u`` (the tail
    of the transforms, colour ops included, reads the same draws for every frame)."""

    frames: np.ndarray
    box: np.ndarray
    size: tuple[int, int]
    flip: bool
    u: np.ndarray
    key: int


def plan_clip(index: VideoIndex, spec: Clips, pipeline: Any, *, seed: int, epoch: int, sample: int,
              clip: int = 0, window: tuple[float | None, float | None] | None = None) -> ClipPlan:
    """Plan one clip: its frames (:func:`clip_frames`) and one spatial plan for all of them, from
    ``pipeline`` (a :class:`stoker.transforms.Pipeline`). Deterministic in (seed, epoch, sample, clip)."""
    key = clip_key(seed, epoch, sample, clip)
    u = uniforms(key, 1 + max(pipeline.draws, 1))[0]
    frames = clip_frames(index, spec, float(u[0]), clip, window)
    h, w = index.upright
    plan = pipeline.plan(np.array([h]), np.array([w]), u[None, 1:])
    return ClipPlan(frames=frames, box=plan.box[0], size=(int(plan.size[0, 0]), int(plan.size[0, 1])),
                    flip=bool(plan.flip[0]), u=u[1:], key=int(key[0]))


def _decode_size(index: VideoIndex, box: Sequence[float], out_h: int, out_w: int) -> tuple[int, int]:
    """(height, width) of the upright frame to convert to: smaller than the video where the crop still
    keeps the output's resolution at half the size or less (swscale shrinks while converting to RGB)."""
    full_h, full_w = index.upright
    # swscale's area shrink is already antialiased: no headroom (the figures in docs/video.md)
    need_h, need_w = decode_minimums(box, out_h, out_w, full_h, full_w, headroom=1.0)
    scale = max(need_h / full_h, need_w / full_w)
    if scale > 0.5:
        return full_h, full_w
    return max(2, math.ceil(full_h * scale)), max(2, math.ceil(full_w * scale))


#: FFmpeg's threading per decoder under a pool of clip threads: one thread ("NONE"), measured best for
#: CPU per clip with as many clip threads as cores (docs/video.md, `benchmarks/bench_video.py`)
DEFAULT_FFMPEG_THREADS = 1
DEFAULT_FFMPEG_THREAD_TYPE = "NONE"
FFMPEG_THREAD_TYPES = ("NONE", "FRAME", "SLICE", "AUTO")


class ClipDecoder(Protocol):
    """What decodes a clip: given the video's stored bytes, its index and the clip's validated frame
    numbers, write row ``t`` of ``dst`` (uint8 [T, H, W, 3]) from frame ``frames[t]``, the crop ``box``
    (upright source pixels) resized to H x W and mirrored when ``flip``, and say what it cost.
    ``name`` identifies it in benchmarks and messages. :class:`PyAVDecoder` is the one built."""

    name: str

    def decode_into(self, data: bytes | memoryview, index: VideoIndex, frames: np.ndarray, dst: np.ndarray,
                    box: tuple[float, float, float, float], flip: bool, *, key: str) -> ClipStats: ...


def decode_clip_into(data: bytes | memoryview, index: VideoIndex, frames: np.ndarray, dst: np.ndarray,
                     box: Sequence[float] | None = None, flip: bool = False, *, key: str = "",
                     threads: int | None = None, thread_type: str | None = None,
                     decoder: ClipDecoder | None = None) -> ClipStats:
    """Decode the clip's ``frames`` into ``dst`` (uint8 [T, H, W, 3], row t gets frame ``frames[t]``),
    each the crop ``box`` (upright source pixels; None: the whole frame) resized to H x W, mirrored when
    ``flip``. ``decoder``: a :class:`ClipDecoder` (None: ``PyAVDecoder(threads, thread_type)``, FFmpeg
    on the calling thread; ``threads``/``thread_type`` are its FFmpeg threading and belong to it, so they
    cannot be given with another decoder). Raises ConfigError for a buffer of the wrong shape or a frame
    outside the video, CorruptVideoError when the bytes do not decode as the index says."""
    t_out = dst.shape[0]
    if len(frames) != t_out or dst.dtype != np.uint8 or dst.ndim != 4 or dst.shape[3] != 3:
        raise ConfigError(f"clip buffer {dst.shape} {dst.dtype}: expected uint8 [{len(frames)}, H, W, 3]")
    frames = np.asarray(frames, dtype=np.int64)
    outside = frames[(frames < 0) | (frames >= index.frames)]
    if len(outside):
        raise ConfigError(f"{key}: frame {int(outside[0])} is outside the video's {index.frames} frames")
    if decoder is None:
        decoder = PyAVDecoder(threads=DEFAULT_FFMPEG_THREADS if threads is None else threads,
                              thread_type=DEFAULT_FFMPEG_THREAD_TYPE if thread_type is None else thread_type)
    elif threads is not None or thread_type is not None:
        raise ConfigError(f"threads={threads!r}, thread_type={thread_type!r} with decoder={decoder.name!r}: "
                          "FFmpeg's threading is PyAVDecoder's own option; pass PyAVDecoder(threads=, thread_type=)")
    full_h, full_w = index.upright
    whole = (0.0, 0.0, float(full_h), float(full_w))
    return decoder.decode_into(data, index, frames, dst, whole if box is None else tuple(box), flip, key=key)


@dataclass(frozen=True)
class PyAVDecoder:
    """Clips decoded by FFmpeg through PyAV on the calling thread (PyAV releases the GIL while it decodes
    and converts, so clips decode in parallel on a pool of threads). Seeks to the keyframe at or before
    each run of wanted frames (only where that skips work) and decodes forward only up to the clip's last
    frame; frames in between are decoded (except H.264 and HEVC non-reference pictures, which nothing
    needs) but never converted. ``threads``/``thread_type``: FFmpeg's own threading inside each decoder
    (``threads=0``: FFmpeg picks; ``"NONE"``: one thread, the default)."""

    threads: int = DEFAULT_FFMPEG_THREADS
    thread_type: str = DEFAULT_FFMPEG_THREAD_TYPE
    name: ClassVar[str] = "pyav"

    def __post_init__(self) -> None:
        if self.thread_type not in FFMPEG_THREAD_TYPES:
            raise ConfigError(f"thread_type={self.thread_type!r}: expected one of {FFMPEG_THREAD_TYPES} "
                              "(FFmpeg's threading inside each decoder)")
        if not isinstance(self.threads, int) or self.threads < 0:
            raise ConfigError(f"threads={self.threads!r}: expected FFmpeg threads per decoder, 0 (FFmpeg picks) or more")

    def decode_into(self, data: bytes | memoryview, index: VideoIndex, frames: np.ndarray, dst: np.ndarray,
                    box: tuple[float, float, float, float], flip: bool, *, key: str) -> ClipStats:
        av = require_av()
        out_h, out_w = dst.shape[1], dst.shape[2]
        full_h, full_w = index.upright
        scaled_h, scaled_w = _decode_size(index, box, out_h, out_w)
        coded_h, coded_w = (scaled_w, scaled_h) if index.rotation % 180 else (scaled_h, scaled_w)
        win = resampling(box, scaled_h, scaled_w, full_h, full_w, size=(out_h, out_w))
        rows: dict[int, list[int]] = {}
        for row, f in enumerate(frames.tolist()):
            rows.setdefault(f, []).append(row)
        wanted = sorted(rows)
        keep = {int(index.pts[f]) for f in wanted}
        convert = _converter(av)
        container = open_container(data, key)
        counts = [0, 0]   # frames decoded, packets left undecoded
        seeks = 0
        try:
            stream = video_stream(container, key, max_pixels=index.width * index.height)
            stream.thread_type, stream.thread_count = self.thread_type, self.threads
            nonref = _nonref_test(stream)
            frames_it, pos = None, -1
            for target in wanted:
                if target <= pos:
                    continue   # written on the way to an earlier target
                start = index.keyframe_before(target)
                if frames_it is None or start > pos + 1:
                    if start > 0 or frames_it is not None:
                        container.seek(int(index.pts[start]), stream=stream, backward=True, any_frame=False)
                        seeks += 1
                    frames_it = _decoded(container, stream, keep, nonref, counts)
                for frame in frames_it:
                    n = int(np.searchsorted(index.pts, frame.pts)) if frame.pts is not None else -1
                    if n < 0 or n >= index.frames or index.pts[n] != frame.pts:
                        continue   # not a frame of the index (a leading frame of an open GOP)
                    pos = n
                    if n in rows:
                        rgb = convert.reformat(frame, format="rgb24", width=coded_w, height=coded_h,
                                               interpolation="AREA").to_ndarray()
                        _write(rgb, rows[n], dst, win, flip, index.rotation)
                    if n >= target:
                        break
                else:
                    raise CorruptVideoError(key, f"the video ended before frame {target} of the {index.frames} "
                                                 "its index lists; the stored bytes do not match the index: re-pack")
        except av.error.FFmpegError as exc:
            raise CorruptVideoError(key, f"decoding failed ({exc})") from None
        finally:
            container.close()
        return ClipStats(decoded=counts[0], delivered=len(wanted), seeks=seeks, skipped=counts[1])


_per_thread = threading.local()


def _converter(av: Any) -> Any:
    """This thread's swscale converter. ``frame.to_ndarray(format=)`` sets up a new swscale context for
    every frame, which cost more than decoding it (0.4-2.6 ms for a 256x340 frame, docs/video.md); one
    kept per thread is set up again only when a clip's sizes differ from the last one's."""
    convert = getattr(_per_thread, "convert", None)
    if convert is None:
        convert = _per_thread.convert = av.video.reformatter.VideoReformatter()
    return convert


def _decoded(container: Any, stream: Any, keep: set[int], nonref: Any, counts: list[int]) -> Any:
    """The stream's frames from the demuxer's position on. A packet holding a non-reference picture
    (H.264 or HEVC: no later frame is predicted from it) that the clip does not keep is never sent to
    the decoder: dropping such pictures is what FFmpeg's own ``skip_frame="NONREF"`` does, but decided
    per packet, so a kept non-reference frame is still decoded. ``counts``: [decoded, dropped], updated."""
    for packet in container.demux(stream):
        if nonref is not None and packet.size and packet.pts not in keep and nonref(memoryview(packet)):
            counts[1] += 1
            continue
        for frame in packet.decode():
            counts[0] += 1
            yield frame


def _nonref_test(stream: Any) -> Any:
    """For H.264 (``avcC``) and HEVC (``hvcC``) in MP4/Matroska: a function telling whether a packet's
    first slice is a non-reference picture; None for other codecs and Annex-B streams (every packet is
    decoded then)."""
    ctx = stream.codec_context
    extra = ctx.extradata
    if not extra or extra[0] != 1:
        return None
    if ctx.name == "h264" and len(extra) >= 5:
        return partial(_h264_nonref, nal_length=(extra[4] & 3) + 1)
    if ctx.name == "hevc" and len(extra) >= 23:
        layers = (extra[21] >> 3) & 7   # numTemporalLayers; 0: unknown
        # a sub-layer non-reference picture is unreferenced only in the highest temporal layer
        return partial(_hevc_nonref, nal_length=(extra[21] & 3) + 1, top=layers) if layers else None
    return None


def _first_slice(data: memoryview, nal_length: int, is_slice: Any) -> int | None:
    """Offset of the first coded-slice NAL unit's header in a length-prefixed packet, or None."""
    pos, end = 0, len(data)
    while pos + nal_length < end:
        size = int.from_bytes(data[pos:pos + nal_length], "big")
        if is_slice(data[pos + nal_length]):
            return pos + nal_length
        pos += nal_length + size
    return None


def _h264_nonref(data: memoryview, nal_length: int) -> bool:
    """True when the packet's first slice has nal_ref_idc 0: a picture no other picture refers to."""
    at = _first_slice(data, nal_length, lambda h: h & 0x1F in (1, 5))   # coded slice, non-IDR or IDR
    return at is not None and (data[at] >> 5) & 3 == 0


def _hevc_nonref(data: memoryview, nal_length: int, top: int) -> bool:
    """True when the packet's first slice is a sub-layer non-reference picture (TRAIL_N, TSA_N, STSA_N,
    RADL_N, RASL_N, RSV_VCL_N10/12/14) in the highest temporal layer: nothing refers to it."""
    at = _first_slice(data, nal_length, lambda h: (h >> 1) & 0x3F < 32)   # VCL NAL unit types 0..31
    if at is None or at + 1 >= len(data):
        return False
    kind, temporal = (data[at] >> 1) & 0x3F, (data[at + 1] & 7) - 1
    return kind <= 14 and kind % 2 == 0 and temporal == top - 1


def _write(rgb: np.ndarray, rows: list[int], dst: np.ndarray, win: Any, flip: bool, rotation: int) -> None:
    """Turn one converted frame (RGB, coded orientation) upright, crop and resize it into
    ``dst[rows[0]]``, and copy that row to the others."""
    y0, y1, x0, x1 = win.src
    region = upright(rgb, rotation)[y0:y1, x0:x1]
    if rotation:
        region = np.ascontiguousarray(region)
    first = dst[rows[0]]
    resample_region_into(region, win, first, flip)
    for r in rows[1:]:
        dst[r] = first


def finish_clip(pipeline: Any, plan: ClipPlan, dst: np.ndarray) -> None:
    """Run the transforms after the planned geometry (colour ops, user callables) on every frame of a
    decoded clip, with the clip's one set of draws: every frame gets the same jitter, flip and crop."""
    if not pipeline.tail:
        return
    offsets = pipeline.offsets[len(pipeline.prefix):]
    for t in range(dst.shape[0]):
        out = apply_tail(pipeline.tail, offsets, dst[t], plan.u, plan.key)
        if out.shape != dst.shape[1:]:
            raise ConfigError(f"a transform after the crop changed a frame's shape to {out.shape}; clips keep "
                              f"one shape {dst.shape[1:]}: put resizing ops before user callables")
        dst[t] = out


def _clip_source(dataset: Any, i: int) -> tuple[Any, VideoIndex, tuple[float | None, float | None] | None]:
    """Video sample ``i`` of a packed dataset: its stored sample, its index, and the window (start, end
    seconds) its ``start``/``end`` columns give (a Kinetics CSV), None without them."""
    from ..video import VIDEO_INDEX_COLUMN
    sample = dataset.sample(i)
    try:
        text = dataset.extra(i, VIDEO_INDEX_COLUMN)
    except (KeyError, ValueError):
        text = None
    if text is None:
        raise ConfigError(f"sample {i} ({sample.key}) has no video index: the dataset was not packed from "
                          "videos (pack them with stoker pack, samples='video')")
    index = VideoIndex.from_json(text)
    columns = getattr(dataset, "extra_columns", ())
    bounds = [dataset.extra(i, c) if c in columns else None for c in ("start", "end")]
    window = tuple(None if b is None else float(b) for b in bounds)
    return sample, index, None if window == (None, None) else window


def read_clip(dataset: Any, i: int, spec: Clips, pipeline: Any, *, seed: int = 0, epoch: int = 0,
              clip: int = 0, dst: np.ndarray | None = None, key_sample: int | None = None,
              **decode_options: Any) -> tuple[np.ndarray, ClipStats]:
    """One clip of video sample ``i`` of a packed dataset (``stoker.open_dataset``): planned, decoded
    and augmented into ``dst`` (uint8 [T, H, W, 3]; allocated when None). The clip lies inside the
    sample's ``start``/``end`` seconds where the dataset has those columns (a Kinetics CSV). This is the
    work one worker thread does per clip (the Loader's, through :class:`ClipKind`). ``key_sample``:
    the sample number of the clip's random stream (default ``i``; a weighted epoch keys by draw, so a
    video drawn twice gets two clips)."""
    sample, index, window = _clip_source(dataset, i)
    plan = plan_clip(index, spec, pipeline, seed=seed, epoch=epoch, sample=i if key_sample is None else key_sample,
                     clip=clip, window=window)
    if dst is None:
        dst = np.empty((spec.frames, *plan.size, 3), np.uint8)
    elif dst.shape[1:3] != plan.size:
        raise ValueError(f"the transforms give {plan.size[0]}x{plan.size[1]} frames for this video "
                         f"({index.upright[0]}x{index.upright[1]}); the batch is {dst.shape[1]}x{dst.shape[2]}")
    stats = decode_clip_into(sample.data, index, plan.frames, dst, plan.box, plan.flip, key=sample.key,
                             **decode_options)
    finish_clip(pipeline, plan, dst)
    return dst, stats


@dataclass(frozen=True)
class ClipKind:
    """A video pack's samples as a `kinds.SampleKind`: each row of a batch is one clip, uint8
    ``[T, H, W, 3]``, rendered by :func:`read_clip` straight into its slot row. Each video is listed
    ``clips_per_video`` times in a row in an epoch, and position ``p`` of the epoch holds clip
    ``p % clips_per_video`` of its video, so order, ranks, resume and replacement of a failed sample work
    on videos unchanged."""

    clips: Clips
    name: ClassVar[str] = "clip"
    plans_batch: ClassVar[bool] = False   # each clip plans its own crop (`plan_clip`), from its video's index
    per_row_python: ClassVar[str | None] = "video clips: each clip's frames are decoded and placed in a Python loop"
    cpu_only: ClassVar[str | None] = "video clips are decoded by PyAV"

    @property
    def frames(self) -> int:
        return self.clips.frames

    @property
    def per_item(self) -> int:
        return self.clips.clips_per_video

    @property
    def options(self) -> Clips:
        return self.clips

    def clip_of(self, positions: np.ndarray | int) -> np.ndarray | int:
        """The clip number of the epoch's position(s)."""
        return positions % self.clips.clips_per_video

    def extras(self, indices: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """With several clips per video, which video (``video``) and clip (``clip``) each row holds."""
        if self.clips.clips_per_video == 1:
            return {}
        return {"video": indices.astype(np.int64), "clip": np.asarray(self.clip_of(positions))}

    def render_row(self, filler: Renderer, idx: int, position: int, key: int, u: np.ndarray, box: tuple | None,
                   dst: np.ndarray, scratch: dict, times: WorkerTimes) -> None:
        """Clip ``clip_of(position)`` of video ``idx`` into ``dst`` (uint8 [T, H, W, 3]); a weighted epoch
        (``key_by_draw``) keys its random stream by the epoch position, not the video. ``key``, ``u`` and
        ``box``, the batch's image plan, do not apply: a clip plans its own."""
        t0 = time.perf_counter()
        read_clip(filler.ds, idx, self.clips, filler.pipe, seed=filler.seed, epoch=filler.epoch,
                  clip=int(self.clip_of(position)), dst=dst, key_sample=position if filler.spec.key_by_draw else None)
        times.decode += time.perf_counter() - t0

    def state(self) -> dict[str, str]:
        return {"clips": repr(self.clips)}
