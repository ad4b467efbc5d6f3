"""Video samples at pack time: recognise them, check them, and build the per-video index.

A video is stored byte-for-byte (or re-encoded with short keyframe intervals, :func:`reencode`) beside
its :class:`VideoIndex`: every frame's presentation timestamp, which frames are keyframes, the coded
size and the display rotation. With the index, a clip is located without probing the file
(:mod:`stoker.clips` plans and decodes clips). Nothing here imports torch: packing never does.

Decoding a file that claims a huge frame size, or never ends, is bounded: :func:`probe_video` refuses
frames over ``max_pixels`` before decoding, and stops after ``max_frames`` frames or ``max_seconds``.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from .errors import CorruptVideoError, DecompressionBombError, MissingDependencyError, UnsupportedVideoError

__all__ = ["VIDEO_ENCODING", "VIDEO_INDEX_COLUMN", "VideoIndex", "looks_like_video", "open_container", "probe_video", "reencode",
           "require_av", "upright", "video_stream"]

#: the shard column (string, JSON) that holds each video's :class:`VideoIndex`
VIDEO_INDEX_COLUMN = "video_index"
#: the shard's ``encoding`` of a video sample (the container and codec are in its index)
VIDEO_ENCODING = "video"
#: pack-time bounds on one video: frames decoded and seconds spent checking it
MAX_FRAMES = 200_000
MAX_SECONDS = 300.0


def require_av() -> Any:
    """The PyAV module, or MissingDependencyError with the install command."""
    try:
        import av
    except ImportError:
        raise MissingDependencyError("videos need PyAV (FFmpeg's libraries, bundled in its wheel); run: "
                                     "pip install 'stoker[video]'", package="av") from None
    return av


def looks_like_video(data: bytes | memoryview) -> bool:
    """True for the first bytes of an MP4/MOV (``ftyp``), Matroska/WebM (EBML) or AVI (``RIFF....AVI``)
    container: how bytes without a file name (a Hugging Face row) are recognised."""
    head = bytes(data[:12])
    return head[4:8] == b"ftyp" or head[:4] == b"\x1a\x45\xdf\xa3" or (head[:4] == b"RIFF" and head[8:11] == b"AVI")


# ---------------------------------------------------------------- the index (pack time)

@dataclass(frozen=True, eq=False)
class VideoIndex:
    """What a clip needs to know about one stored video, computed once at pack time.

    ``pts``: int64 [frames], presentation timestamps in ``time_base`` units, ascending (presentation
    order); ``keyframes``: int64, the frame numbers (indices into ``pts``) a decoder can start at;
    ``width``/``height``: coded pixels; ``rotation``: degrees counter-clockwise that turn a decoded frame
    upright (FFmpeg's display matrix, as ``VideoFrame.rotation`` reads it); ``fps``: frames per second
    over the whole video (variable-rate videos keep their real timestamps in ``pts``)."""

    codec: str
    container: str
    width: int
    height: int
    rotation: int
    time_base: tuple[int, int]
    pts: np.ndarray
    keyframes: np.ndarray
    fps: float
    duration: float

    @property
    def frames(self) -> int:
        return len(self.pts)

    @property
    def upright(self) -> tuple[int, int]:
        """(height, width) of a frame once turned upright: what the shard's height/width columns hold."""
        return (self.width, self.height) if self.rotation % 180 else (self.height, self.width)

    def seconds(self, frames: np.ndarray | int) -> np.ndarray:
        """Presentation time in seconds of the given frame numbers, from the first frame."""
        num, den = self.time_base
        return (self.pts[frames] - self.pts[0]) * (num / den)

    def keyframe_before(self, frame: int) -> int:
        """The last keyframe at or before ``frame`` (the first frame when none is)."""
        k = int(np.searchsorted(self.keyframes, frame, side="right")) - 1
        return int(self.keyframes[k]) if k >= 0 else 0

    def to_json(self) -> str:
        return json.dumps({"codec": self.codec, "container": self.container, "width": self.width,
                           "height": self.height, "rotation": self.rotation, "time_base": list(self.time_base),
                           "fps": round(self.fps, 6), "duration": round(self.duration, 6),
                           "pts": self.pts.tolist(), "keyframes": self.keyframes.tolist()}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> VideoIndex:
        obj = json.loads(text)
        return cls(codec=obj["codec"], container=obj["container"], width=int(obj["width"]),
                   height=int(obj["height"]), rotation=int(obj["rotation"]),
                   time_base=(int(obj["time_base"][0]), int(obj["time_base"][1])),
                   pts=np.asarray(obj["pts"], dtype=np.int64), keyframes=np.asarray(obj["keyframes"], dtype=np.int64),
                   fps=float(obj["fps"]), duration=float(obj["duration"]))


def open_container(data: bytes | memoryview, key: str) -> Any:
    av = require_av()
    if len(data) == 0:
        raise CorruptVideoError(key, "the file is empty (0 bytes)")
    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise CorruptVideoError(key, f"not a readable video container ({exc})") from None


def video_stream(container: Any, key: str, max_pixels: int) -> Any:
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["no streams"]
        raise UnsupportedVideoError(key, f"no video stream (the file holds {', '.join(kinds)}): "
                                         "an audio-only file cannot be a video sample")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        raise UnsupportedVideoError(key, "its video stream is in a codec FFmpeg has no decoder for")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > max_pixels:
        raise DecompressionBombError(key, f"frames of {width}x{height} pixels exceed the limit of {max_pixels:,} "
                                          "pixels; raise max_pixels (--max-pixels) if the video is genuine")
    return stream


def probe_video(data: bytes | memoryview, key: str, *, max_pixels: int, max_frames: int = MAX_FRAMES,
                max_seconds: float = MAX_SECONDS) -> VideoIndex:
    """Decode every frame of the first video stream once (the pack-time check), and return its index.

    Raises CorruptVideoError (unreadable, truncated, decoder errors, no frames, timestamps missing or
    repeated), UnsupportedVideoError (no video stream; past ``max_frames`` or ``max_seconds``) or
    DecompressionBombError (a frame size over ``max_pixels``, refused before decoding)."""
    av = require_av()
    container = open_container(data, key)
    try:
        fmt = container.format.name.split(",")[0]
        if fmt.endswith("_pipe") or fmt == "image2":   # FFmpeg opens a JPEG or PNG as a one-frame video
            raise UnsupportedVideoError(key, f"an image ({fmt.removesuffix('_pipe')}), not a video; pack images and "
                                             "videos as separate datasets")
        stream = video_stream(container, key, max_pixels)
        stream.thread_type, stream.thread_count = "NONE", 1   # the pack's own pool is the parallelism
        declared = stream.frames
        pts: list[int] = []
        keys: list[int] = []
        rotation, started = 0, time.perf_counter()
        try:
            for frame in container.decode(stream):
                if frame.pts is None:
                    raise CorruptVideoError(key, f"frame {len(pts)} has no presentation timestamp")
                if frame.width * frame.height > max_pixels:
                    raise DecompressionBombError(key, f"frame {len(pts)} is {frame.width}x{frame.height}, over the "
                                                      f"limit of {max_pixels:,} pixels")
                if not pts:
                    rotation = int(round(frame.rotation / 90.0)) * 90 % 360
                if frame.key_frame:
                    keys.append(len(pts))
                pts.append(frame.pts)
                if len(pts) > max_frames or time.perf_counter() - started > max_seconds:
                    raise UnsupportedVideoError(key, f"longer than the pack-time limit ({len(pts):,} frames decoded "
                                                     f"in {time.perf_counter() - started:.0f} s); cut it into clips")
        except av.error.FFmpegError as exc:
            raise CorruptVideoError(key, f"decoding failed at frame {len(pts)} ({exc})") from None
        if not pts:
            raise CorruptVideoError(key, "the video stream has no decodable frames")
        if declared and len(pts) < declared:
            raise CorruptVideoError(key, f"truncated: the container lists {declared} frames, {len(pts)} decode")
        order = np.argsort(pts, kind="stable")
        sorted_pts = np.asarray(pts, dtype=np.int64)[order]
        if np.any(np.diff(sorted_pts) <= 0):
            raise CorruptVideoError(key, "two frames share a presentation timestamp; re-mux the file")
        keyframes = np.sort(order.argsort()[np.asarray(keys, dtype=np.int64)])   # decode order -> presentation
        if not len(keyframes) or keyframes[0] != 0:
            keyframes = np.concatenate([[0], keyframes]).astype(np.int64)   # a decoder starts at the first frame
        tb = stream.time_base
        span = float((sorted_pts[-1] - sorted_pts[0]) * tb) if len(pts) > 1 else 0.0
        rate = float(stream.average_rate or 0) or ((len(pts) - 1) / span if span > 0 else 0.0)
        fps = (len(pts) - 1) / span if span > 0 else rate
        duration = span + (1.0 / fps if fps > 0 else 0.0)
        return VideoIndex(codec=stream.codec_context.name, container=fmt, width=stream.codec_context.width,
                          height=stream.codec_context.height, rotation=rotation,
                          time_base=(tb.numerator, tb.denominator), pts=sorted_pts,
                          keyframes=keyframes.astype(np.int64), fps=fps, duration=duration)
    finally:
        container.close()


def reencode(data: bytes | memoryview, key: str, index: VideoIndex, *, max_side: int | None,
             keyframe_seconds: float | None, crf: int = 23, max_pixels: int) -> bytes:
    """The video as H.264 (libx264) in MP4: upright (rotation applied), its longer side shrunk to at most
    ``max_side``, a keyframe every ``keyframe_seconds`` (None: x264's default, 250 frames), every frame's
    timestamp kept (variable frame rates stay variable). Short keyframe intervals make a random clip cheap
    to reach (a seek lands near it) for more bytes; docs/video.md has the measured trade."""
    av = require_av()
    h, w = index.upright
    if max_side is not None and max(h, w) > max_side:
        s = max_side / max(h, w)
        h, w = max(2, round(h * s)), max(2, round(w * s))
    h, w = h - h % 2, w - w % 2   # 4:2:0 needs even sizes
    out = io.BytesIO()
    src = open_container(data, key)
    try:
        stream = video_stream(src, key, max_pixels)
        dst = av.open(out, mode="w", format="mp4")
        rate = max(1, round(index.fps)) if index.fps > 0 else 25
        enc = dst.add_stream("libx264", rate=rate)
        enc.width, enc.height, enc.pix_fmt = w, h, "yuv420p"
        enc.time_base = stream.time_base
        params = "scenecut=0"
        if keyframe_seconds is not None:
            gop = max(1, round(keyframe_seconds * (index.fps or 25)))
            params = f"keyint={gop}:min-keyint={gop}:scenecut=0"
        enc.options = {"crf": str(crf), "preset": "veryfast", "x264-params": params}
        for frame in src.decode(stream):
            rgb = upright(frame.to_ndarray(format="rgb24"), index.rotation)
            if rgb.shape[:2] != (h, w):
                rgb = cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA)
            new = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            new.pts, new.time_base = frame.pts, stream.time_base
            for packet in enc.encode(new):
                dst.mux(packet)
        for packet in enc.encode():
            dst.mux(packet)
        dst.close()
    except av.error.FFmpegError as exc:
        raise CorruptVideoError(key, f"re-encoding failed ({exc})") from None
    finally:
        src.close()
    return out.getvalue()


def upright(rgb: np.ndarray, rotation: int) -> np.ndarray:
    """A decoded frame turned upright: ``rotation`` degrees counter-clockwise (a view, no copy)."""
    return np.rot90(rgb, rotation // 90) if rotation else rgb
