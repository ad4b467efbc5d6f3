"""Damaged and odd videos in a pack: each is packed correctly or skipped with a reason in skipped.jsonl,
never a crash or a hang; a hostile frame size is refused before anything is decoded."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")

import stoker  # noqa: E402
from stoker.errors import CorruptVideoError, DecompressionBombError, UnsupportedVideoError  # noqa: E402
from stoker.packing import PackOptions, pack  # noqa: E402
from stoker.tools.synth_video import VideoStyle, audio_only, corrupt, make_video, truncate  # noqa: E402
from stoker.video import VIDEO_INDEX_COLUMN, VideoIndex, probe_video  # noqa: E402

STYLE = VideoStyle(seconds=3, fps=10, size=(48, 64), keyframe_seconds=1)
LIMIT = 10**8


def _h264_huge_header() -> bytes:
    """A real H.264 MP4 of one 4096 x 4096 frame (its size is in the stream's header: a decoder
    allocates for it before it reads a pixel)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=1)
        stream.width = stream.height = 4096
        stream.pix_fmt, stream.options = "yuv420p", {"preset": "ultrafast"}
        frame = av.VideoFrame(4096, 4096, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def good() -> bytes:
    return make_video(1, classes=2, style=STYLE)


def test_each_bad_video_is_skipped_with_its_reason(good: bytes, tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    files = {
        "ok.mp4": good,
        "empty.mp4": b"",
        "audio.mp4": audio_only(),
        "truncated.mp4": truncate(good),                        # the MP4 index (at the end) is gone
        "text.mp4": b"this is not a video at all\n" * 40,
        "picture.mp4": _jpeg(),                                # an image with a video's name
    }
    for name, data in files.items():
        (root / "a" / name).write_bytes(data)
    summary = pack(root, tmp_path / "ds", progress=False)
    assert summary.packed == 1
    reasons = {json.loads(line)["key"]: json.loads(line)["reason"]
               for line in (tmp_path / "ds" / "skipped.jsonl").read_text().splitlines()}
    assert set(reasons) == {f"a/{n}" for n in files if n != "ok.mp4"}
    assert "empty" in reasons["a/empty.mp4"]
    assert "no video stream" in reasons["a/audio.mp4"]
    assert "not a readable video container" in reasons["a/truncated.mp4"]
    assert "not a readable video container" in reasons["a/text.mp4"]
    assert "an image" in reasons["a/picture.mp4"]


def test_truncated_faststart_mp4_is_caught() -> None:
    """With the index at the front (as streaming sites serve MP4s), a cut file still opens: the decoder
    meets the cut, or fewer frames decode than the container lists."""
    data = make_video(0, style=VideoStyle(seconds=3, fps=10, size=(48, 64), keyframe_seconds=1, faststart=True))
    assert probe_video(data, "whole", max_pixels=LIMIT).frames == 30
    with pytest.raises(CorruptVideoError, match="truncated|decoding failed"):
        probe_video(truncate(data, 0.6), "cut", max_pixels=LIMIT)


def test_corrupt_frames_are_refused_or_decode_to_their_index(good: bytes) -> None:
    """Bytes flipped inside the compressed frames: either the decoder reports it (the video is
    skipped) or it conceals the damage and every frame still decodes (the index matches the file)."""
    for seed in range(6):
        bad = corrupt(good, seed=seed)
        try:
            index = probe_video(bad, "bad", max_pixels=LIMIT)
        except CorruptVideoError:
            continue
        assert index.frames == probe_video(bad, "again", max_pixels=LIMIT).frames


def test_frame_size_over_the_limit_is_refused_before_decoding(tmp_path: Path) -> None:
    data = _h264_huge_header()
    with pytest.raises(DecompressionBombError, match="4096x4096"):
        probe_video(data, "big", max_pixels=4096 * 4096 - 1)
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "big.mp4").write_bytes(data)
    with pytest.raises(DecompressionBombError):
        pack(tmp_path / "src", tmp_path / "ds", progress=False,
             options=PackOptions(max_pixels=1_000_000, on_error="fail"))


def test_too_long_is_refused_not_hung(good: bytes) -> None:
    with pytest.raises(UnsupportedVideoError, match="longer than the pack-time limit"):
        probe_video(good, "long", max_pixels=LIMIT, max_frames=10)


def test_variable_frame_rate_and_rotated_videos_pack(tmp_path: Path) -> None:
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "vfr.mp4").write_bytes(make_video(0, style=VideoStyle(
        seconds=3, fps=10, size=(48, 64), vfr=True)))
    (tmp_path / "src" / "a" / "rot.mp4").write_bytes(make_video(0, style=VideoStyle(
        seconds=3, fps=10, size=(48, 64), rotation=270)))
    assert pack(tmp_path / "src", tmp_path / "ds", progress=False).packed == 2
    with stoker.open_dataset(tmp_path / "ds") as ds:
        rot = VideoIndex.from_json(ds.extra(0, VIDEO_INDEX_COLUMN))
        vfr = VideoIndex.from_json(ds.extra(1, VIDEO_INDEX_COLUMN))
        assert rot.rotation == 270 and (int(ds.heights[0]), int(ds.widths[0])) == (48, 64)
        gaps = np.diff(vfr.seconds(np.arange(vfr.frames)))
        assert gaps.max() - gaps.min() > 0.05


def test_on_error_fail_raises_the_video_error(tmp_path: Path) -> None:
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "empty.mp4").write_bytes(b"")
    with pytest.raises(CorruptVideoError, match="empty.mp4: the file is empty"):
        pack(tmp_path / "src", tmp_path / "ds", progress=False, options=PackOptions(on_error="fail"))


def _jpeg() -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()
