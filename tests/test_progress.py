"""The one progress helper: a bar on a terminal, log lines elsewhere, nothing when disabled."""

from __future__ import annotations

import logging

import pytest

from stoker._progress import LOGGER_NAME, Progress


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]


def test_off_a_terminal_it_logs_every_interval_and_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    with Progress("pack", 10, interval=0.0, terminal=False) as bar:
        bar.update(4)
        bar.set_postfix(skipped=1)
        bar.update(6)
    lines = _lines(caplog)
    assert len(lines) == 3   # two updates, then the closing line
    assert lines[0].startswith("pack: 4/10 img (40%), ")
    assert lines[1].startswith("pack: 10/10 img (100%), ") and lines[1].endswith("skipped=1")
    assert " img/s" in lines[0]


def test_log_lines_are_spaced_by_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    with Progress("verify decode", 1000, interval=3600.0, terminal=False) as bar:
        for _ in range(1000):
            bar.update()
    assert _lines(caplog) == [_lines(caplog)[0]]   # only the closing line within the hour
    assert _lines(caplog)[0].startswith("verify decode: 1,000/1,000 img (100%)")


def test_disabled_shows_nothing_and_still_counts(caplog: pytest.LogCaptureFixture,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    bar = Progress("pack", 5, enabled=False, interval=0.0, terminal=True)
    bar.update(5)
    bar.stage("anything")
    bar.close()
    assert bar.done == 5
    assert _lines(caplog) == []
    assert capsys.readouterr().err == ""


def test_stage_lines_name_the_step(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    with Progress("bench", 3, unit="pipeline", terminal=False) as bar:
        bar.stage("measuring baseline, 3 round(s)")
        bar.update()
    first = _lines(caplog)[0]
    assert first.startswith("bench: measuring baseline, 3 round(s) (0/3 pipeline (0%)")


def test_unknown_total_and_resumed_start(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    with Progress("stage", None, unit="file", terminal=False):
        pass
    with Progress("pack", 10, initial=6, terminal=False) as bar:
        bar.update(4)
    unknown, resumed = _lines(caplog)
    assert unknown.startswith("stage: 0 file")
    assert resumed.startswith("pack: 10/10 img (100%)")


def test_on_a_terminal_it_draws_a_bar_and_logs_nothing(caplog: pytest.LogCaptureFixture,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    with Progress("pack", 3, interval=0.0, terminal=True) as bar:
        bar.update(3)
    assert _lines(caplog) == []
    assert "3/3" in capsys.readouterr().err


def test_slow_units_show_seconds_per_unit_not_zero_per_second(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import stoker._progress as progress
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = Progress("bench", 5, unit="pipeline", terminal=False)
    now[0] += 90.0
    bar.update(2)
    assert bar.line() == "bench: 2/5 pipeline (40%), 45.0 s/pipeline"
    bar.update(1000)
    assert bar.line() == "bench: 1,002/5 pipeline (20040%), 11 pipeline/s"
    assert Progress("bench", 5, unit="pipeline", terminal=False).line() == "bench: 0/5 pipeline (0%)"
