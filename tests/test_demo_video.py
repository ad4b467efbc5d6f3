"""`stoker demo --video` end to end on a tiny setup (the default one takes about a minute)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")

from stoker.tools.demo_video import PyAVClips, VideoDemoSetup, run_video_demo, video_cnn  # noqa: E402

TINY = VideoDemoSetup(videos=4, classes=2, seconds=1.2, fps=10, frame_size=(32, 48), keyframe_seconds=1.0,
                      frames=4, stride=2, size=16, batch_size=2, steps=2, rounds=1)


def test_tiny_video_demo_trains_on_both_feeds_and_writes_table_and_json(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    result = run_video_demo(tmp_path, TINY, device="cpu")
    names = list(result.runs)
    assert names[0].startswith("baseline (DataLoader + PyAV") and names[1].startswith("stoker (Loader with clips")
    for reports in result.runs.values():
        (report,) = reports
        assert report.steps == 2 and report.images == 4 and report.images_per_s > 0
    out = capsys.readouterr().out
    assert "| training fed by | clips/s | data wait |" in out and "round 1/1" in out
    assert f"stoker trained {result.speedup:.2f}x faster on clips" in out
    obj = json.loads((tmp_path / "demo-video.json").read_text())
    assert obj["speedup"] == pytest.approx(result.speedup) and obj["frames"] == 4 and len(obj["runs"]) == 2
    assert (tmp_path / "demo-video.md").read_text().startswith("| training fed by |")


def test_baseline_clips_and_model_shapes(tmp_path: Path) -> None:
    """The baseline gives what stoker's Loader gives per clip ([T, 3, H, W] uint8, the label of the
    class folder), including a video shorter than the clip; the model takes [B, T, 3, H, W]."""
    from stoker.tools.synth_video import VideoStyle, make_kinetics_like

    src = make_kinetics_like(tmp_path, 1, classes=2, style=VideoStyle(seconds=0.5, fps=10, size=(32, 48)))
    items = sorted((p, int(p.parent.name.rsplit("_", 1)[1])) for p in src.rglob("*.mp4"))
    clips = PyAVClips(items, frames=8, stride=2, size=16)   # 5 frames per video: frames repeat
    x, label = clips[1]
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.uint8 and label == 1
    logits = video_cnn(2)(torch.stack([x, clips[0][0]]).float())
    assert logits.shape == (2, 2)


def test_cli_demo_video_options_parse() -> None:
    from stoker.cli import build_parser

    args = build_parser().parse_args(["demo", "--video", "--videos", "8", "--rounds", "1", "--steps", "3"])
    assert (args.video, args.videos, args.rounds, args.steps, args.batch_size) == (True, 8, 1, 3, None)
