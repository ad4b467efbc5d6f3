"""Kinetics-like generated videos for the tests and the video benchmark, written by FFmpeg's own
encoders through PyAV (H.264 with libx264, HEVC with libx265, VP9 with libvpx, AV1 with SVT-AV1, MPEG-4
part 2), plus the damaged and odd files a real crawl holds (corrupt, truncated, zero-length,
audio-only, variable frame rate, rotated).

Kinetics clips are 10 s at 25-30 fps with a short side of 256-340 pixels and a keyframe every
2-10 s. The content depends on the class so that a model can learn it: a textured background
(fixed per video) with a disc that moves in the class's direction, in the class's colour, while the
background pans slowly; each video is a pure function of ``(seed, index, label)``.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from fractions import Fraction
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from ..errors import ConfigError
from ..video import require_av

__all__ = ["CODECS", "VideoStyle", "audio_only", "corrupt", "make_kinetics_like", "make_video", "truncate"]

#: codec name -> (PyAV encoder, container format, file ending)
CODECS: dict[str, tuple[str, str, str]] = {
    "h264": ("libx264", "mp4", ".mp4"),
    "hevc": ("libx265", "mp4", ".mp4"),
    "vp9": ("libvpx-vp9", "webm", ".webm"),
    "av1": ("libsvtav1", "mp4", ".mp4"),
    "mpeg4": ("mpeg4", "mp4", ".mp4"),
}


@dataclass(frozen=True)
class VideoStyle:
    """How a generated video is written. ``size`` (height, width) in pixels, ``keyframe_seconds`` between
    keyframes, ``rotation`` degrees counter-clockwise stored in the display matrix (the pixels are
    stored turned the other way, as a phone does), ``vfr``: frame times jitter around 1/fps."""

    seconds: float = 10.0
    fps: int = 25
    size: tuple[int, int] = (256, 340)
    keyframe_seconds: float = 10.0
    codec: str = "h264"
    rotation: int = 0
    vfr: bool = False
    crf: int = 23
    faststart: bool = False   # the MP4 index (moov) before the frames, as streaming sites serve files


def _frames(label: int, classes: int, count: int, height: int, width: int, seed: int) -> np.ndarray:
    """uint8 [count, height, width, 3]: the upright frames of one video."""
    rng = np.random.default_rng([seed, label, count, height, width])
    cells = rng.normal(0.0, 1.0, (6, 8, 3)).astype(np.float32)
    big = cv2.resize(cells, (width * 2, height * 2), interpolation=cv2.INTER_CUBIC)
    grain = rng.normal(0.0, 10.0, (height * 2, width * 2, 1)).astype(np.float32)
    background = np.clip(110 + 35 * big + grain, 0, 255).astype(np.uint8)
    angle = 2 * math.pi * label / max(classes, 1)
    hue = int(180 * label / max(classes, 1))
    colour = cv2.cvtColor(np.array([[[hue, 220, 255]]], np.uint8), cv2.COLOR_HSV2RGB)[0, 0].tolist()
    radius = max(3, min(height, width) // 8)
    speed = min(height, width) / 40.0   # pixels per frame
    x0, y0 = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height
    out = np.empty((count, height, width, 3), np.uint8)
    for i in range(count):
        dy, dx = int(i * 0.5) % height, int(i * 0.8) % width   # a slow pan, so every frame changes
        frame = np.ascontiguousarray(background[dy:dy + height, dx:dx + width])
        # the disc travels in the class's direction, wrapping at the borders
        cx = int((x0 + i * speed * math.cos(angle)) % width)
        cy = int((y0 + i * speed * math.sin(angle)) % height)
        cv2.circle(frame, (cx, cy), radius, colour, -1, lineType=cv2.LINE_AA)
        out[i] = frame
    return out


def make_video(label: int = 0, *, classes: int = 10, seed: int = 0, style: VideoStyle = VideoStyle()) -> bytes:
    """One encoded video (the container's bytes) of class ``label``."""
    av = require_av()
    if style.codec not in CODECS:
        raise ConfigError(f"codec {style.codec!r}: expected one of {sorted(CODECS)}")
    encoder, fmt, _ = CODECS[style.codec]
    height, width = style.size
    if encoder == "libx265" and min(height, width) < 48:
        # measured: libx265 in PyAV 18.1's wheel aborts the process (heap corruption) on 48x32 frames
        raise ConfigError(f"hevc videos of {width}x{height}: libx265 crashes on frames this small; "
                          "use at least 48 pixels a side")
    count = max(1, round(style.seconds * style.fps))
    frames = _frames(label, classes, count, height, width, seed)
    with tempfile.TemporaryDirectory() as tmp:   # faststart rewrites the file by name
        path = os.path.join(tmp, "video" + CODECS[style.codec][2])
        out = av.open(path, mode="w", format=fmt, options={"movflags": "faststart"} if style.faststart else {})
        _encode(av, out, encoder, frames, style)
        with open(path, "rb") as fh:
            return fh.read()


def _encode(av: Any, out: Any, encoder: str, frames: np.ndarray, style: VideoStyle) -> None:
    height, width = style.size
    gop = max(1, round(style.keyframe_seconds * style.fps))
    if encoder == "libsvtav1":
        os.environ.setdefault("SVT_LOG", "1")   # SVT-AV1 prints its banner to stderr unless told not to
    stream = out.add_stream(encoder, rate=style.fps)
    stored_h, stored_w = (width, height) if style.rotation % 180 else (height, width)
    stream.width, stream.height, stream.pix_fmt = stored_w, stored_h, "yuv420p"
    stream.codec_context.gop_size = gop
    options = {"crf": str(style.crf)} if encoder in ("libx264", "libx265", "libvpx-vp9") else {}
    if encoder == "libx264":
        options.update({"preset": "veryfast", "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0"})
    elif encoder == "libx265":
        options.update({"preset": "ultrafast", "x265-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:log-level=error"})
    elif encoder == "libvpx-vp9":
        options.update({"b": "0", "deadline": "realtime", "cpu-used": "8", "g": str(gop)})
    elif encoder == "libsvtav1":
        options.update({"preset": "12", "svtav1-params": f"keyint={gop}"})
    stream.options = options
    if style.rotation:
        stream.set_display_rotation(style.rotation)
    time_base = 1000 if style.vfr else style.fps
    stream.time_base = stream.codec_context.time_base = Fraction(1, time_base)
    rng = np.random.default_rng([int(frames[0, 0, 0, 0]), len(frames), 7])
    pts = 0
    for i, upright in enumerate(frames):
        # stored turned by -rotation, so that turning it by the display rotation gives `upright` back
        pixels = np.ascontiguousarray(np.rot90(upright, -(style.rotation // 90))) if style.rotation else upright
        frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
        frame.pts, frame.time_base = (pts if style.vfr else i), Fraction(1, time_base)
        pts += int(rng.integers(round(500 / style.fps), round(1500 / style.fps) + 1)) if style.vfr else 1
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()


def audio_only(seconds: float = 1.0) -> bytes:
    """An MP4 holding one AAC audio stream and no video."""
    av = require_av()
    buf = io.BytesIO()
    out = av.open(buf, mode="w", format="mp4")
    stream = out.add_stream("aac", rate=16000)
    samples = int(16000 * seconds)
    tone = (0.2 * np.sin(np.arange(samples) * 2 * math.pi * 440 / 16000)).astype(np.float32)[None, :]
    for lo in range(0, samples, 1024):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(tone[:, lo:lo + 1024]), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, lo
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buf.getvalue()


def truncate(data: bytes, fraction: float = 0.5) -> bytes:
    """The first ``fraction`` of a file: a download that stopped."""
    return data[:int(len(data) * fraction)]


def corrupt(data: bytes, seed: int = 0, count: int = 64) -> bytes:
    """``count`` random bytes overwritten in the middle half of the file (compressed frames, away from
    the container's header and, for a plain MP4, its index at the end)."""
    rng = np.random.default_rng(seed)
    raw = bytearray(data)
    for pos in rng.integers(len(raw) // 4, 3 * len(raw) // 4, count):
        raw[pos] = int(rng.integers(0, 256))
    return bytes(raw)


def make_kinetics_like(out_dir: str | Path, per_class: int, *, classes: int = 4, seed: int = 0,
                       style: VideoStyle = VideoStyle()) -> Path:
    """Write ``out_dir/<class>/<video>`` (the Kinetics folder layout) with ``per_class`` videos of each
    class; returns ``out_dir``."""
    root = Path(out_dir)
    ext = CODECS[style.codec][2] if style.codec in CODECS else ".mp4"
    for label in range(classes):
        folder = root / f"class_{label:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (folder / f"video_{i:05d}{ext}").write_bytes(
                make_video(label, classes=classes, seed=seed * 1_000_003 + i, style=style))
    return root
