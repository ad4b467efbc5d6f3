"""`stoker demo` end to end on a tiny configuration (the full one takes about a minute)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from stoker._progress import LOGGER_NAME
from stoker._system import ratio_words
from stoker.tools.demo import (QUEUE_MULTIPLE, DemoResult, DemoRun, demo_model, format_table, plan_steps, run_demo,
                               set_ceiling)


def test_tiny_demo_trains_synthetic_and_both_feeds_and_writes_table_json_chart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_demo(tmp_path, images=48, batch_size=8, steps=3, progress=False)
    assert result.synthetic.name.startswith("synthetic")
    assert [r.name for r in result.runs] == ["DataLoader + PIL", "stoker"]
    assert result.control is not None and "control" in result.control.name
    assert result.rows == [result.synthetic, *result.runs, result.control]
    warmup, steps, queue = plan_steps(3, result.loader_cores)
    assert (result.warmup_steps, result.steps, result.queue_batches) == (warmup, steps, queue)
    assert result.steps >= QUEUE_MULTIPLE * result.queue_batches > 3   # the window is well past every queue
    for run in result.rows:
        # 48 images, batches of 8: the timed window runs over several passes, the feeds never restart
        assert run.steps == result.steps and run.images_per_s == pytest.approx(result.steps * 8 / run.seconds)
        assert run.cpu_percent > 0 and 0 <= run.wait_s < run.seconds
        assert run.fed_ratio == pytest.approx(run.images_per_s / result.synthetic.images_per_s)
    assert result.synthetic.fed_ratio == pytest.approx(1.0)
    assert result.speedup == pytest.approx(result.runs[1].images_per_s / result.runs[0].images_per_s)
    out = capsys.readouterr().out
    assert "| training fed by | images/s | fed / synthetic | data wait |" in out
    for run in result.rows[1:]:
        assert f"| {run.name} | {run.images_per_s:,.0f} | {run.fed_ratio:.2f} |" in out
    words = ratio_words(result.speedup)   # the sign decides the word: never "0.25x faster"
    assert f"stoker trained {words} than DataLoader + PIL" in out and "nan" not in out.lower()
    assert f"{result.control.fed_ratio:.2f}" in out and "interference control" in out
    assert "[6/6]" in out and ("share this machine's CPU cores" in out or result.device.startswith("cuda"))
    obj = json.loads((tmp_path / "demo.json").read_text())
    assert obj["speedup"] == pytest.approx(result.speedup) and len(obj["runs"]) == 4
    assert obj["runs"][1]["fed_ratio"] == pytest.approx(result.runs[0].fed_ratio)
    assert (tmp_path / "demo.md").read_text().startswith("| training fed by |")
    pytest.importorskip("matplotlib")
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_window_is_four_times_the_largest_queue() -> None:
    # 16 DataLoader workers x prefetch_factor 2: 32 batches queued; stoker's ring holds 4
    assert plan_steps(30, 16) == (34, 128, 32)
    assert plan_steps(30, 1) == (6, 30, 4) and plan_steps(3, 1) == (6, 16, 4) and plan_steps(3, 3) == (8, 24, 6)


def _run(name: str, rate: float, synthetic: float) -> DemoRun:
    return DemoRun(name, name, rate, 10, 10 * 64 / rate, 0.1, 150.0, 0.5, rate / synthetic)


@pytest.mark.parametrize("base, fast, words", [(1000.0, 1900.0, "1.90x faster"), (4000.0, 1000.0, "4.00x slower")])
def test_the_headline_follows_the_sign(base: float, fast: float, words: str) -> None:
    result = DemoResult(_run("synthetic", 2000.0, 2000.0), [_run("DataLoader + PIL", base, 2000.0),
                                                            _run("stoker", fast, 2000.0)],
                        "m", 48, 64, 10, 6, 4, "cuda:0", 16, 16, 16)
    text = format_table(result)
    assert f"stoker trained {words} than DataLoader + PIL" in text and "0.25x faster" not in text
    assert f"fed / synthetic: stoker {fast / 2000:.2f}, DataLoader + PIL {base / 2000:.2f}" in text


def test_the_model_is_resnet18_on_a_gpu_and_the_small_cnn_on_a_cpu() -> None:
    import torch

    from stoker.tools.train import load_model

    assert demo_model(False)[0] == "stoker.tools.train:small_cnn"
    spec, name = demo_model(True)
    assert spec in ("resnet18", "stoker.tools.train:resnet18") and "ResNet-18" in name
    # built without weights, never downloaded: torchvision's, or the same network where it does not import
    assert sum(p.numel() for p in load_model(spec).parameters()) == 11_689_512
    assert load_model("stoker.tools.train:resnet18")(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)


def test_progress_off_a_terminal_is_log_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    result = run_demo(tmp_path, images=32, batch_size=8, steps=1, progress=True)
    # a log file (stderr is not a terminal here) gets lines like pack's, never tqdm's carriage returns
    assert "\r" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    total = result.warmup_steps + result.steps
    assert any(line.startswith("generate: 32/32 img (100%)") for line in lines)
    assert any(line.startswith(f"train: stoker: {total}/{total} step (100%)") for line in lines)


def test_cli_demo_options_parse() -> None:
    from stoker.cli import build_parser

    args = build_parser().parse_args(["demo", "--images", "40", "--steps", "2", "--batch-size", "8"])
    assert (args.images, args.steps, args.batch_size, args.device) == (40, 2, 8, None)


def test_ratio_words_follow_the_sign_and_never_say_nan() -> None:
    assert ratio_words(1.9) == "1.90x faster" and ratio_words(0.25) == "4.00x slower"
    assert ratio_words(1.002) == "as fast" and ratio_words(0.5, faster="ahead", slower="behind") == "2.00x behind"
    assert ratio_words(None) == ratio_words(float("nan")) == ratio_words(0.0) == "not measured"


def test_the_ceiling_is_the_faster_of_two_synthetic_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold first synthetic window (slower than a fed one) must not make a feed look faster than no feed:
    the synthetic run is repeated last and the faster window is the ceiling."""
    import stoker.tools.demo as demo

    rates = iter([100.0, 80.0, 120.0, 140.0, 150.0])   # synthetic (cold), DataLoader, stoker, control, synthetic
    order: list[str] = []

    def fake_train(feed, name, description, *args, **kwargs):
        order.append(feed)
        return _run(name, next(rates), 1.0)
    monkeypatch.setattr(demo, "_train", fake_train)
    result = run_demo(tmp_path / "demo", images=48, batch_size=8, steps=2, device="cpu", progress=False)
    assert order == ["synthetic", "baseline", "stoker", "stoker-interference", "synthetic"]
    assert result.synthetic.images_per_s == 150.0 and result.synthetic.fed_ratio == pytest.approx(1.0)
    assert [r.fed_ratio for r in result.runs] == pytest.approx([80 / 150, 120 / 150])
    assert result.control is not None and result.control.fed_ratio == pytest.approx(140 / 150)


def test_a_control_faster_than_the_synthetic_windows_is_the_ceiling(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The step ran faster beside a running loader (the control at 1.08 to 1.29 of synthetic in fresh-clone
    demos): then the control is the ceiling, and no feed reads above what the held batch reached."""
    import stoker.tools.demo as demo

    rates = iter([100.0, 80.0, 120.0, 160.0, 140.0])   # synthetic, DataLoader, stoker, control, synthetic
    monkeypatch.setattr(demo, "_train", lambda feed, name, *a, **k: _run(name, next(rates), 1.0))
    result = run_demo(tmp_path / "demo", images=48, batch_size=8, steps=2, device="cpu", progress=False)
    assert result.ceiling == 160.0 and result.control.fed_ratio == pytest.approx(1.0)
    assert [r.fed_ratio for r in result.runs] == pytest.approx([80 / 160, 120 / 160])
    assert result.synthetic.fed_ratio == pytest.approx(140 / 160)
    assert "here the control: the step ran faster beside the running loader" in format_table(result)


@pytest.mark.parametrize("control, words", [(1500.0, "the model kept 0.75 of its speed: the loader's cost"),
                                            (1980.0, "kept all of its speed (0.99 of synthetic, no more than 5% below it")])
def test_the_control_is_worded_by_its_size(control: float, words: str) -> None:
    result = DemoResult(_run("synthetic", 2000.0, 2000.0), [_run("DataLoader + PIL", 1000.0, 2000.0),
                                                            _run("stoker", 1800.0, 2000.0)],
                        "m", 48, 64, 10, 6, 4, "cuda:0", 16, 16, 16, control=_run("control", control, 2000.0))
    set_ceiling(result)
    assert words in format_table(result)
