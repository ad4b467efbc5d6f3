"""benchmarks/bench_video.py with tiny settings: every pipeline runs on both packs, the waste figures are the
real decode counts (stoker's seek beats decoding from the start; the short-keyframe re-encode cuts
stoker's waste), the table and JSON land where the script says, and `stoker bench --video` names the script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")
pytest.importorskip("torch", reason="the DataLoader baselines need torch")

from conftest import load_benchmark  # noqa: E402
from stoker.cli import main  # noqa: E402
from stoker.errors import ConfigError  # noqa: E402
from stoker.tools.synth_video import VideoStyle, make_kinetics_like  # noqa: E402

bench_video = load_benchmark("bench_video")
run_video_bench = bench_video.run_video_bench

# 6 s at 25 fps, one keyframe (x264 puts one every 10 s): a random clip's keyframe is frame 0 as stored
TINY = VideoStyle(seconds=6, fps=25, size=(64, 96), keyframe_seconds=10)


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_kinetics_like(tmp_path_factory.mktemp("videos") / "src", 1, classes=4, style=TINY)


def test_script_runs_every_pipeline_on_both_packs(videos: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "video.json"
    assert bench_video.main([str(tmp_path / "cache"), "--data", str(videos), "--json", str(out), "--clips", "8",
                             "--rounds", "1", "--threads", "2", "--keyframes", "0.5", "--quiet"]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert table.startswith("clips of 16 frames") and result["settings"]["keyframes"] == 0.5
    best = result["best"]
    for pack in ("keep", "kf0.5"):
        for label in ("stoker pool=2", "stoker pool=1", "stoker pool=1 ffmpeg FRAME x2",
                      "stoker pool=2 ffmpeg FRAME x2", "stoker pool=2 ffmpeg AUTO", "DataLoader+PyAV workers=2"):
            row = best[f"{label} [{pack}]"]
            assert row["clips_per_s"] > 0 and row["cpu_ms_per_clip"] > 0, (label, pack, row)
            assert f"| {label} [{pack}] |" in table
        # decoding from the start to the clip's end: at least one frame per frame kept
        assert best[f"DataLoader+PyAV workers=2 [{pack}]"]["waste"] >= 1.0
        # stoker skips non-reference frames (and, re-encoded, seeks): less waste than the common script
        assert best[f"stoker pool=2 [{pack}]"]["waste"] < best[f"DataLoader+PyAV workers=2 [{pack}]"]["waste"]
    # a keyframe every half second: the seek lands near the clip, so far fewer frames decode in vain
    assert best["stoker pool=2 [kf0.5]"]["waste"] < 0.8 * best["stoker pool=2 [keep]"]["waste"]
    # the common script never seeks: the re-encode does not help it
    assert best["DataLoader+PyAV workers=2 [kf0.5]"]["waste"] == best["DataLoader+PyAV workers=2 [keep]"]["waste"]
    assert result["bytes"]["kf0.5"] > result["bytes"]["keep"]
    decord = [k for k in best if k.startswith("DataLoader+decord")]
    assert all(best[k]["waste"] is None for k in decord)   # decord does not say what it decoded: null, not a guess
    assert decord or "DataLoader+decord" in result["skipped"]


def test_bench_video_measures_a_given_pack_as_it_is(videos: Path, tmp_path: Path) -> None:
    from stoker.packing import PackOptions, pack
    packed = tmp_path / "packed"
    pack(videos, packed, options=PackOptions(workers=1), progress=False)
    result = run_video_bench(packed, cache=tmp_path / "cache", clips=4, rounds=1, threads=1, keyframes=0.5,
                             ffmpeg=False, decord=False)
    assert not (tmp_path / "cache" / "packed-packed-keep").exists()   # the given pack is not packed again
    assert result.bytes["keep"] < result.bytes["kf0.5"]
    assert sorted(result.best) == ["DataLoader+PyAV workers=1 [keep]", "DataLoader+PyAV workers=1 [kf0.5]",
                                   "stoker pool=1 [keep]", "stoker pool=1 [kf0.5]"]
    assert result.best["stoker pool=1 [kf0.5]"]["waste"] < result.best["stoker pool=1 [keep]"]["waste"]


def test_bench_video_refuses_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keyframes=0"):
        run_video_bench(cache=tmp_path, keyframes=0)
    with pytest.raises(ConfigError, match="clips=0"):
        run_video_bench(cache=tmp_path, clips=0)


def test_script_refuses_bad_settings_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_video.main([str(tmp_path), "--clips", "0"])
    assert exc.value.code == 2 and "clips=0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--video"], ["--video", "--device", "cuda"], ["--videos", "4"], ["--clips", "8"],
                                  ["--video-keyframes", "2"]])
def test_stoker_bench_video_names_the_script_that_runs_it_now(argv: list[str], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stoker bench: error: ") and "\n" not in err
    assert "python benchmarks/bench_video.py" in err
    assert not (tmp_path / "video").exists()
