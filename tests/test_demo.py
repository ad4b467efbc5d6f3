"""`stoker demo` end to end on a tiny configuration (the full one takes about a minute)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from stoker._progress import LOGGER_NAME
from stoker.profiling import INPUT_BOUND_WAIT
from stoker.tools.demo import run_demo


def test_tiny_demo_trains_twice_and_writes_table_json_chart(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    result = run_demo(tmp_path, images=48, batch_size=8, steps=3, progress=False)
    assert [r.name for r in result.runs] == ["baseline (DataLoader + PIL)", "stoker"]
    for run in result.runs:
        assert run.report.steps == 3 and run.report.images == 24 and run.report.images_per_s > 0
        # the verdict follows the measured data wait (which side wins depends on the machine)
        assert run.report.input_bound == (run.report.data_wait_fraction >= INPUT_BOUND_WAIT)
    out = capsys.readouterr().out
    assert "| training fed by | images/s | data wait |" in out and "speed-up" in out
    for run in result.runs:
        assert f"| {run.name} | {run.report.images_per_s:,.0f} |" in out and run.report.verdict in out
    assert "[4/4]" in out and ("share this machine's CPU cores" in out or result.device.startswith("cuda"))
    obj = json.loads((tmp_path / "demo.json").read_text())
    assert obj["speedup"] == pytest.approx(result.speedup) and len(obj["runs"]) == 2
    assert (tmp_path / "demo.md").read_text().startswith("| training fed by |")
    pytest.importorskip("matplotlib")
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_steps_capped_to_one_pass_and_progress_off_a_terminal_is_log_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    result = run_demo(tmp_path, images=32, batch_size=8, steps=100, progress=True)
    assert result.steps == 3   # 4 batches: one warm-up, three measured
    # a log file (stderr is not a terminal here) gets lines like pack's, never tqdm's carriage returns
    assert "\r" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert any(line.startswith("generate: 32/32 img (100%)") for line in lines)
    assert any(line.startswith("train: stoker: 4/4 step (100%)") for line in lines)


def test_cli_demo_options_parse() -> None:
    from stoker.cli import build_parser

    args = build_parser().parse_args(["demo", "--images", "40", "--steps", "2", "--batch-size", "8"])
    assert (args.images, args.steps, args.batch_size, args.device) == (40, 2, 8, None)
