"""Video samples: the pack-time index, clip sampling and clip decode, on files written by FFmpeg's own
encoders (PyAV). The reference for every decoded pixel is PyAV decoding the whole file from the start."""

from __future__ import annotations

import io

import numpy as np
import pytest

av = pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")

from stoker.loading.clips import (Clips, ClipStats, PyAVDecoder, clip_frames, clip_key, decode_clip_into, finish_clip,  # noqa: E402
                          plan_clip)
from stoker.errors import ConfigError  # noqa: E402
from stoker.tools.synth_video import CODECS, VideoStyle, make_video  # noqa: E402
from stoker.transforms import CenterCrop, ColorJitter, Pipeline, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402
from stoker.transforms.geometry import crop_resize_into  # noqa: E402
from stoker.video import VideoIndex, looks_like_video, probe_video  # noqa: E402

SMALL = VideoStyle(seconds=4, fps=10, size=(48, 64), keyframe_seconds=1)
LIMIT = 10**8


def reference(data: bytes) -> np.ndarray:
    """Every frame, decoded from the start by PyAV, turned upright by the display rotation."""
    with av.open(io.BytesIO(data)) as c:
        frames = [np.rot90(f.to_ndarray(format="rgb24"), f.rotation // 90) for f in c.decode(video=0)]
    return np.stack(frames)


@pytest.fixture(scope="module")
def h264() -> bytes:
    return make_video(1, classes=4, style=SMALL)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_index_and_clip_frames_match_a_full_decode_for_every_codec(codec: str) -> None:
    data = make_video(2, classes=4, style=VideoStyle(seconds=4, fps=10, size=(48, 64), keyframe_seconds=1,
                                                      codec=codec))
    assert looks_like_video(data)
    index = probe_video(data, "v", max_pixels=LIMIT)
    ref = reference(data)
    assert index.frames == len(ref) == 40
    assert index.keyframes.tolist() == [0, 10, 20, 30]
    assert index.upright == (48, 64) and index.rotation == 0
    assert index.fps == pytest.approx(10.0) and index.duration == pytest.approx(4.0)
    for frames in ([3, 7, 11, 15], [0, 0, 1, 2], [25, 26, 38, 39], [5, 30, 12, 1]):
        dst = np.zeros((4, 48, 64, 3), np.uint8)
        decode_clip_into(data, index, np.array(frames), dst)
        np.testing.assert_array_equal(dst, ref[frames])


def test_decode_seeks_and_stops_early(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    dst = np.zeros((4, 48, 64, 3), np.uint8)
    # frames 25..39: seek to keyframe 20 (not from 0), and nothing after the last frame is decoded
    stats = decode_clip_into(h264, index, np.array([25, 26, 38, 39]), dst)
    assert (stats.decoded + stats.skipped, stats.delivered, stats.seeks) == (7 + 10, 4, 2)
    assert stats.skipped > 0   # x264's non-reference B-frames the clip does not keep are never decoded
    stats = decode_clip_into(h264, index, np.array([0, 1, 2, 3]), dst)
    assert (stats.decoded, stats.skipped, stats.seeks) == (4, 0, 0)


@pytest.mark.parametrize("codec", ["h264", "hevc"])
def test_non_reference_frames_are_dropped_only_when_not_kept(codec: str) -> None:
    """Every frame, kept alone or in any stride, equals the full decode: a dropped picture is never one
    the clip keeps or one another frame is predicted from."""
    data = make_video(1, classes=4, style=VideoStyle(seconds=4, fps=10, size=(48, 64), keyframe_seconds=1,
                                                      codec=codec))
    index = probe_video(data, "v", max_pixels=LIMIT)
    ref = reference(data)
    skipped = 0
    for stride in (1, 2, 3, 5, 7):
        for first in range(stride):
            frames = np.arange(first, 40, stride)
            dst = np.zeros((len(frames), 48, 64, 3), np.uint8)
            skipped += decode_clip_into(data, index, frames, dst).skipped
            np.testing.assert_array_equal(dst, ref[frames])
    assert skipped > 0


def test_index_round_trips_through_json(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    back = VideoIndex.from_json(index.to_json())
    assert back.pts.tolist() == index.pts.tolist() and back.keyframes.tolist() == index.keyframes.tolist()
    assert (back.codec, back.width, back.height, back.time_base) == (index.codec, 64, 48, index.time_base)
    assert back.keyframe_before(19) == 10 and back.keyframe_before(20) == 20 and back.keyframe_before(0) == 0


def test_rotated_video_is_decoded_upright() -> None:
    upright = make_video(3, classes=4, style=SMALL)
    rotated = make_video(3, classes=4, style=VideoStyle(seconds=4, fps=10, size=(48, 64), keyframe_seconds=1,
                                                         rotation=90))
    index = probe_video(rotated, "r", max_pixels=LIMIT)
    assert index.rotation == 90 and (index.height, index.width) == (64, 48) and index.upright == (48, 64)
    dst = np.zeros((2, 48, 64, 3), np.uint8)
    decode_clip_into(rotated, index, np.array([4, 17]), dst)
    np.testing.assert_array_equal(dst, reference(rotated)[[4, 17]])
    # the same picture as the unrotated encode of the same frames (lossy: close, not equal)
    assert np.abs(dst.astype(int) - reference(upright)[[4, 17]]).mean() < 4


def test_variable_frame_rate_keeps_real_timestamps() -> None:
    data = make_video(0, style=VideoStyle(seconds=4, fps=10, size=(48, 64), keyframe_seconds=1, vfr=True))
    index = probe_video(data, "vfr", max_pixels=LIMIT)
    gaps = np.diff(index.seconds(np.arange(index.frames)))
    assert gaps.min() < 0.07 and gaps.max() > 0.13   # 50..150 ms apart, as written
    spec = Clips(frames=8, fps=5.0, sampling="uniform")
    frames = clip_frames(index, spec, 0.0)
    # one clip, centred: 8 instants 0.2 s apart; each frame is the last one shown at or before its instant
    span = float(index.seconds(index.frames - 1))
    wanted = (span - 7 / 5.0) / 2 + np.arange(8) / 5.0
    for f, w in zip(frames, wanted):
        assert index.seconds(f) <= w + 1e-9 and (f + 1 == index.frames or index.seconds(f + 1) > w)


def test_crop_box_and_flip_match_torchvision_style_resize_of_the_reference(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    ref = reference(h264)
    box = (5.0, 9.0, 30.0, 40.0)
    dst = np.zeros((3, 24, 32, 3), np.uint8)
    decode_clip_into(h264, index, np.array([2, 9, 33]), dst, box, flip=True)
    for row, f in enumerate([2, 9, 33]):
        want = np.zeros((24, 32, 3), np.uint8)
        crop_resize_into(ref[f], box, want, True, 48, 64)
        np.testing.assert_array_equal(dst[row], want)


def test_large_source_is_shrunk_while_converting() -> None:
    data = make_video(1, style=VideoStyle(seconds=1, fps=10, size=(192, 256), keyframe_seconds=1))
    index = probe_video(data, "big", max_pixels=LIMIT)
    dst = np.zeros((2, 24, 32, 3), np.uint8)
    decode_clip_into(data, index, np.array([0, 5]), dst)   # 8x smaller: swscale shrinks to 1/4 first
    ref = reference(data)
    for row, f in enumerate([0, 5]):
        want = np.zeros((24, 32, 3), np.uint8)
        crop_resize_into(ref[f], (0, 0, 192, 256), want, False, 192, 256)
        assert np.abs(dst[row].astype(int) - want).mean() < 3


def test_clip_frames_stride_random_uniform_and_short_videos(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)   # 40 frames
    spec = Clips(frames=4, stride=4)                  # spans 13 frames: starts 0..27
    starts = {int(clip_frames(index, spec, u)[0]) for u in np.linspace(0, 0.999, 200)}
    assert starts == set(range(28))
    np.testing.assert_array_equal(clip_frames(index, spec, 0.5), clip_frames(index, spec, 0.5)[0] + [0, 4, 8, 12])
    uniform = Clips(frames=4, stride=4, sampling="uniform", clips_per_video=3)
    assert [int(clip_frames(index, uniform, 0.9, c)[0]) for c in range(3)] == [4, 14, 23]   # floor(28 * (c + 0.5) / 3)
    long = Clips(frames=16, stride=4)                 # 61 frames wanted of 40: spread over the video
    frames = clip_frames(index, long, 0.3)
    assert frames[0] == 0 and frames[-1] == 39 and np.all(np.diff(frames) >= 0)
    # a window (start, end seconds, a Kinetics annotation) bounds the clip
    inside = clip_frames(index, Clips(frames=4, stride=2), 0.999, window=(1.0, 2.5))
    assert inside.min() >= 10 and inside.max() <= 25


def test_clip_draws_are_a_pure_function_of_seed_epoch_sample_clip(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    pipe = Pipeline([RandomResizedCrop(32), RandomHorizontalFlip()])
    spec = Clips(frames=4, stride=3)
    a = plan_clip(index, spec, pipe, seed=1, epoch=2, sample=7)
    b = plan_clip(index, spec, pipe, seed=1, epoch=2, sample=7)
    assert a.frames.tolist() == b.frames.tolist() and a.box.tolist() == b.box.tolist() and a.flip == b.flip
    others = [plan_clip(index, spec, pipe, seed=1, epoch=e, sample=s, clip=c)
              for e, s, c in ((3, 7, 0), (2, 8, 0), (2, 7, 1))]
    assert all(o.box.tolist() != a.box.tolist() for o in others)
    assert clip_key(1, 2, 7, 0)[0] != clip_key(1, 2, 7, 1)[0]
    assert a.size == (32, 32)


def test_one_augmentation_plan_per_clip(h264: bytes) -> None:
    """ColorJitter after the crop: every frame of a clip gets the same jitter (a static scene stays static)."""
    index = probe_video(h264, "v", max_pixels=LIMIT)
    pipe = Pipeline([CenterCrop(32), ColorJitter(brightness=0.8, contrast=0.8, saturation=0.8, hue=0.3)])
    plan = plan_clip(index, Clips(frames=3, stride=1), pipe, seed=0, epoch=0, sample=3)
    frames = np.array([5, 5, 5])   # one frame three times: the rows must come out identical
    dst = np.zeros((3, 32, 32, 3), np.uint8)
    decode_clip_into(h264, index, frames, dst, plan.box, plan.flip)
    plain = dst[0].copy()
    finish_clip(pipe, plan, dst)
    assert np.array_equal(dst[0], dst[1]) and np.array_equal(dst[1], dst[2])
    assert not np.array_equal(dst[0], plain)


def test_clip_spec_is_validated() -> None:
    assert Clips().stride == 4
    with pytest.raises(ConfigError, match="pass one of them"):
        Clips(stride=2, fps=5.0)
    with pytest.raises(ConfigError, match="frames=0"):
        Clips(frames=0)
    with pytest.raises(ConfigError, match="sampling"):
        Clips(sampling="center")


def test_bad_buffer_and_frames_are_refused(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    with pytest.raises(ConfigError, match="uint8"):
        decode_clip_into(h264, index, np.array([0, 1]), np.zeros((3, 8, 8, 3), np.uint8))
    with pytest.raises(ConfigError, match="outside the video"):
        decode_clip_into(h264, index, np.array([0, 40]), np.zeros((2, 8, 8, 3), np.uint8))


@pytest.mark.parametrize("threads, thread_type", [(2, "FRAME"), (2, "SLICE"), (0, "AUTO")])
def test_ffmpeg_threading_gives_the_same_pixels(h264: bytes, threads: int, thread_type: str) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    frames = np.array([25, 26, 38, 39, 3])
    ref = reference(h264)[frames]
    for decoder in (PyAVDecoder(threads=threads, thread_type=thread_type), None):
        dst = np.zeros((5, 48, 64, 3), np.uint8)
        if decoder is None:   # the same through decode_clip_into's own keywords
            decode_clip_into(h264, index, frames, dst, threads=threads, thread_type=thread_type)
        else:
            decode_clip_into(h264, index, frames, dst, decoder=decoder)
        np.testing.assert_array_equal(dst, ref)


class _Recording:
    """A ClipDecoder that records what decode_clip_into hands it and decodes with PyAV."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], tuple[float, ...], bool, str]] = []

    def decode_into(self, data, index, frames, dst, box, flip, *, key) -> ClipStats:
        self.calls.append((frames.tolist(), tuple(box), flip, key))
        return PyAVDecoder().decode_into(data, index, frames, dst, box, flip, key=key)


def test_decode_clip_into_hands_a_checked_clip_to_the_decoder(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    rec = _Recording()
    dst = np.zeros((2, 24, 32, 3), np.uint8)
    stats = decode_clip_into(h264, index, [7, 2], dst, None, True, key="a.mp4", decoder=rec)
    assert rec.calls == [([7, 2], (0.0, 0.0, 48.0, 64.0), True, "a.mp4")]
    assert stats.delivered == 2
    want = np.zeros_like(dst)
    decode_clip_into(h264, index, np.array([7, 2]), want, flip=True)
    np.testing.assert_array_equal(dst, want)
    # a bad clip never reaches the decoder
    with pytest.raises(ConfigError, match="outside the video"):
        decode_clip_into(h264, index, np.array([0, 40]), np.zeros((2, 8, 8, 3), np.uint8), decoder=rec)
    assert len(rec.calls) == 1


def test_ffmpeg_threading_belongs_to_the_pyav_decoder(h264: bytes) -> None:
    index = probe_video(h264, "v", max_pixels=LIMIT)
    dst = np.zeros((1, 8, 8, 3), np.uint8)
    with pytest.raises(ConfigError, match=r"PyAVDecoder\(threads="):
        decode_clip_into(h264, index, [0], dst, threads=2, decoder=_Recording())
    with pytest.raises(ConfigError, match="thread_type='frame'"):
        PyAVDecoder(thread_type="frame")
    with pytest.raises(ConfigError, match="threads=-1"):
        PyAVDecoder(threads=-1)


def test_one_swscale_converter_per_thread_and_one_conversion_per_kept_frame(h264: bytes, monkeypatch) -> None:
    import threading

    from av.video.reformatter import VideoReformatter

    import stoker.loading.clips as clips
    made: list[object] = []
    converted: list[int] = []

    class Counting:   # VideoReformatter cannot be subclassed: wrap it
        def __init__(self) -> None:
            self.real = VideoReformatter()
            made.append(self)

        def reformat(self, frame, *args, **kwargs):
            converted.append(frame.pts)
            return self.real.reformat(frame, *args, **kwargs)

    monkeypatch.setattr(av.video.reformatter, "VideoReformatter", Counting)
    monkeypatch.setattr(clips, "_per_thread", threading.local())
    index = probe_video(h264, "v", max_pixels=LIMIT)
    ref = reference(h264)

    def two_clips() -> None:
        for frames in ([3, 7, 7, 11], [30, 2, 21, 2]):
            dst = np.zeros((4, 48, 64, 3), np.uint8)
            decode_clip_into(h264, index, np.array(frames), dst)
            np.testing.assert_array_equal(dst, ref[frames])

    two_clips()
    worker = threading.Thread(target=two_clips)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    # set up once per thread, not once per frame (to_ndarray(format=) makes a swscale context per frame)
    assert len(made) == 2
    # a frame wanted twice is converted once
    assert len(converted) == 2 * (3 + 3)


def test_synth_refuses_hevc_frames_libx265_crashes_on() -> None:
    with pytest.raises(ConfigError, match="libx265 crashes"):
        make_video(0, style=VideoStyle(seconds=1, fps=10, size=(32, 48), codec="hevc"))
