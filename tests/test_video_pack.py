"""Packing videos from each source layout users have (class folders, `path label` lists, CSVs with
start/end seconds, WebDataset tars, Hugging Face Parquet), on files written by FFmpeg's encoders."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")

import stoker  # noqa: E402
from stoker.loading.clips import Clips, read_clip  # noqa: E402
from stoker.errors import ConfigError  # noqa: E402
from stoker.packing import PackOptions, pack  # noqa: E402
from stoker.tools.synth_video import VideoStyle, make_kinetics_like, make_video  # noqa: E402
from stoker.transforms import CenterCrop, Pipeline  # noqa: E402
from stoker.video import VIDEO_INDEX_COLUMN, VideoIndex, probe_video  # noqa: E402

STYLE = VideoStyle(seconds=3, fps=10, size=(48, 64), keyframe_seconds=1.5)


@pytest.fixture(scope="module")
def kinetics(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_kinetics_like(tmp_path_factory.mktemp("k") / "train", 2, classes=2, style=STYLE)


def _stored(out: Path) -> list[tuple[str, bytes, int, VideoIndex]]:
    with stoker.open_dataset(out) as ds:
        return [(ds.sample(i).key, bytes(ds.sample(i).data), ds.sample(i).label,
                 VideoIndex.from_json(ds.extra(i, VIDEO_INDEX_COLUMN))) for i in range(len(ds))]


def test_class_folders_pack_byte_for_byte_with_their_index(kinetics: Path, tmp_path: Path) -> None:
    summary = pack(kinetics, tmp_path / "ds", progress=False)
    assert summary.packed == 4 and summary.skipped == 0 and "4 videos" in summary.format()
    manifest = json.loads((tmp_path / "ds" / "stoker.json").read_text())
    assert manifest["classes"] == ["class_000", "class_001"]
    assert manifest["extra_columns"] == {VIDEO_INDEX_COLUMN: "string"}
    assert manifest["pack_options"]["samples"] == "video"
    for key, data, label, index in _stored(tmp_path / "ds"):
        assert data == (kinetics / key).read_bytes()
        assert label == int(key.startswith("class_001"))
        fresh = probe_video(data, key, max_pixels=10**8)
        assert index.pts.tolist() == fresh.pts.tolist() and index.keyframes.tolist() == [0, 15]
        assert (index.frames, index.codec) == (30, "h264")
    with stoker.open_dataset(tmp_path / "ds") as ds:
        assert (int(ds.heights[0]), int(ds.widths[0])) == (48, 64)
        with pytest.raises(ConfigError, match="is a video"):
            ds[0]
    assert stoker.verify(tmp_path / "ds", decode=True).problems == []


def test_path_label_list_and_csv_with_start_end(kinetics: Path, tmp_path: Path) -> None:
    videos = sorted(kinetics.rglob("*.mp4"))
    listing = tmp_path / "train.txt"
    listing.write_text("".join(f"{p} {k % 2}\n" for k, p in enumerate(videos)))
    assert pack(listing, tmp_path / "from_list", progress=False).packed == 4
    table = tmp_path / "train.csv"
    table.write_text("path,label,start,end\n" + "".join(f"{p},{k % 2},1.0,2.0\n" for k, p in enumerate(videos)))
    assert pack(table, tmp_path / "from_csv", progress=False).packed == 4
    manifest = json.loads((tmp_path / "from_csv" / "stoker.json").read_text())
    assert manifest["extra_columns"] == {"start": "float64", "end": "float64", VIDEO_INDEX_COLUMN: "string"}
    with stoker.open_dataset(tmp_path / "from_csv") as ds:
        spec, pipe = Clips(frames=4, stride=2), Pipeline([CenterCrop(32)])
        for seed in range(8):   # every clip lies inside the annotated 1.0-2.0 s (frames 10..20)
            clip, stats = read_clip(ds, 1, spec, pipe, seed=seed)
            assert clip.shape == (4, 32, 32, 3) and stats.delivered == 4
        from stoker.loading.clips import plan_clip
        index = VideoIndex.from_json(ds.extra(1, VIDEO_INDEX_COLUMN))
        for seed in range(8):
            frames = plan_clip(index, spec, pipe, seed=seed, epoch=0, sample=1, window=(1.0, 2.0)).frames
            assert frames.min() >= 10 and frames.max() <= 20


def test_webdataset_tar_of_videos(tmp_path: Path) -> None:
    tar_path = tmp_path / "train-000000.tar"
    with tarfile.open(tar_path, "w") as tf:
        for k in range(3):
            for name, payload in ((f"s{k:04d}.mp4", make_video(k % 2, classes=2, seed=k, style=STYLE)),
                                  (f"s{k:04d}.cls", str(k % 2).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    assert pack(tar_path, tmp_path / "ds", progress=False).packed == 3
    stored = _stored(tmp_path / "ds")
    assert [(key, label) for key, _, label, _ in stored] == [("s0000.mp4", 0), ("s0001.mp4", 1), ("s0002.mp4", 0)]


def test_hugging_face_parquet_with_video_bytes(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    data = [make_video(k % 2, classes=2, seed=k, style=STYLE) for k in range(3)]
    pq.write_table(pa.table({"video": pa.array(data, pa.binary()), "label": [0, 1, 0]}), tmp_path / "train.parquet")
    # the row keys carry no file ending: the bytes are recognised as a video container
    assert pack(tmp_path / "train.parquet", tmp_path / "ds", progress=False).packed == 3
    assert [d for _, d, _, _ in _stored(tmp_path / "ds")] == data


def test_reencode_with_short_keyframe_interval_and_max_side(tmp_path: Path) -> None:
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    rotated = VideoStyle(seconds=3, fps=10, size=(48, 64), keyframe_seconds=3, rotation=90)
    (src / "v.mp4").write_bytes(make_video(0, style=rotated))
    pack(tmp_path / "src", tmp_path / "keep", progress=False)
    pack(tmp_path / "src", tmp_path / "short", progress=False,
         options=PackOptions(video_keyframes=0.5, max_side=32))
    (_, kept, _, kept_index), = _stored(tmp_path / "keep")
    (_, short, _, index), = _stored(tmp_path / "short")
    assert kept_index.rotation == 90 and kept_index.keyframes.tolist() == [0]
    assert index.rotation == 0 and (index.height, index.width) == (24, 32)    # upright, longer side 32
    assert index.keyframes.tolist() == [0, 5, 10, 15, 20, 25] and index.frames == 30
    assert index.pts.tolist() != [] and index.codec == "h264"
    # the re-encoded frames show the same (upright) picture, shrunk
    with av.open(io.BytesIO(kept)) as c:
        first = np.rot90(next(c.decode(video=0)).to_ndarray(format="rgb24"), 1)
    with av.open(io.BytesIO(short)) as c:
        small = next(c.decode(video=0)).to_ndarray(format="rgb24")
    import cv2
    assert np.abs(cv2.resize(first, (32, 24), interpolation=cv2.INTER_AREA).astype(int) - small).mean() < 8


def test_pack_options_for_videos_are_validated() -> None:
    with pytest.raises(ConfigError, match="samples"):
        PackOptions(samples="audio")
    with pytest.raises(ConfigError, match="video_keyframes"):
        PackOptions(video_keyframes=0)
    with pytest.raises(ConfigError, match="video_crf"):
        PackOptions(video_crf=60)


def test_cli_pack_video_flags(kinetics: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from stoker.cli import main
    assert main(["pack", str(kinetics), str(tmp_path / "ds"), "--video-keyframes", "1", "--no-progress"]) == 0
    assert "packed 4 videos" in capsys.readouterr().out
    assert all(index.keyframes.tolist() == [0, 10, 20] for *_, index in _stored(tmp_path / "ds"))


def test_resume_of_a_finished_video_pack(kinetics: Path, tmp_path: Path) -> None:
    pack(kinetics, tmp_path / "ds", progress=False)
    again = pack(kinetics, tmp_path / "ds", progress=False, resume=True)
    assert again.already_complete and "complete pack of 4 videos" in again.format()


def test_cli_synth_videos(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.cli import main
    from stoker.tools import synth_video
    small = synth_video.VideoStyle(seconds=1, fps=10, size=(32, 48))
    real = synth_video.make_kinetics_like
    # the CLI's 10 s videos at 256x340 take seconds each: the same call, smaller
    monkeypatch.setattr(synth_video, "make_kinetics_like",
                        lambda out, n, **kw: real(out, n, classes=kw["classes"], seed=kw["seed"], style=small))
    assert main(["synth", str(tmp_path / "v"), "--videos", "4", "--classes", "2"]) == 0
    assert "wrote 4 Kinetics-like h264 videos" in capsys.readouterr().out
    assert sorted(p.relative_to(tmp_path / "v").as_posix() for p in (tmp_path / "v").rglob("*.mp4")) == [
        "class_000/video_00000.mp4", "class_000/video_00001.mp4", "class_001/video_00000.mp4",
        "class_001/video_00001.mp4"]


def test_without_pyav_a_video_pack_names_the_extra(kinetics: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from stoker.errors import MissingDependencyError
    monkeypatch.setitem(sys.modules, "av", None)   # import av raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'stoker\[video\]'"):
        pack(kinetics, tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds").exists()   # refused before anything is written
