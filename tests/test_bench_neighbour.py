"""The noisy-neighbour bench (benchmarks/bench_neighbour.py): its output's structure on real photographs
(no timing thresholds), and the GIL probe against a load whose GIL hold is known."""

from __future__ import annotations

import ctypes
import json
import math
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import load_benchmark
from stoker.errors import ConfigError

bench = load_benchmark("bench_neighbour")
format_neighbour, gil_share, run_neighbour = bench.format_neighbour, bench.gil_share, bench.run_neighbour

#: photographs among Pillow's test images whose headers are sound
PHOTOS = ("flower.jpg", "flower2.jpg", "hopper.jpg", "iptc.jpg", "exif_gps_typeerror.jpg", "exif-72dpi-int.jpg",
          "icc_profile_big.jpg", "xmp_test.jpg")


@pytest.fixture(scope="module")
def photo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder of 48 real photographs (the corpus's 8, six times over, in two classes)."""
    from conftest import CORPUS_MISSING, PILLOW_CORPUS

    if not PILLOW_CORPUS.is_dir():
        pytest.skip(CORPUS_MISSING)
    root = tmp_path_factory.mktemp("neighbour") / "photos"
    for k in range(6):
        for name in PHOTOS:
            (root / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
            shutil.copy(PILLOW_CORPUS / name, root / f"c{k % 2}" / f"{k}-{name}")
    return root


def _hold_gil(hold_us: int, idle_s: float, truth: list[float]) -> Callable[[Callable[[], None], float], int]:
    """A load that holds the GIL for `hold_us` µs at a time (libc's usleep through ctypes.PyDLL, which
    keeps the GIL: no CPU used, so other work on the machine cannot blur it), then sleeps `idle_s` without
    it; appends the share of the window it held the GIL to `truth`."""
    usleep = ctypes.PyDLL(None).usleep

    def run(mark: Callable[[], None], seconds: float) -> int:
        held = [0.0]

        def load() -> None:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t = time.perf_counter()
                if hold_us:
                    usleep(hold_us)
                held[0] += time.perf_counter() - t
                time.sleep(idle_s)
        mark()
        t0 = time.perf_counter()
        worker = threading.Thread(target=load)
        worker.start()
        worker.join(timeout=30.0)
        wall = time.perf_counter() - t0
        truth.append(held[0] / wall)
        return max(1, round(held[0] * 1e6))   # units: µs held, so us_per_unit is the share of it the probe saw
    return run


def _in_one_of(tries: int, measure: Callable[[], tuple[bool, object]]) -> None:
    """Passes when one of `tries` measurements is within its bounds. Other processes on a shared machine
    can blur one window; a probe that miscounts (a sleeping load counted as holding the GIL, a hold
    missed) is out of bounds in every one, and the assertion shows them all."""
    seen = []
    for _ in range(tries):
        ok, what = measure()
        if ok:
            return
        seen.append(what)
    raise AssertionError(f"out of bounds in all {tries} measurements: {seen}")


@pytest.mark.parametrize("hold_us,idle_s", [(2000, 0.003), (500, 0.0015)])
def test_probe_measures_a_known_gil_hold(hold_us: int, idle_s: float) -> None:
    def measure() -> tuple[bool, object]:
        truth: list[float] = []
        got = gil_share(_hold_gil(hold_us, idle_s, truth), seconds=0.25, rounds=3)
        # The load waits for the GIL the probe holds before each hold (up to the 5 ms switch interval), so
        # its share is below hold / (hold + idle); what it held is what it measured itself.
        want = sum(truth) / len(truth)
        assert want > 0.02   # the load ran
        ok = (abs(got.share - want) <= 0.05 + 0.3 * want
              and got.us_per_unit == pytest.approx(got.share / want, rel=0.2)   # µs seen per µs held: about 1
              # Linux: the probe's blocked time, not its lost progress; the probe alone is (nearly) never blocked
              and (got.method != "blocked" or abs(got.share_alone) < 0.1))
        return ok, (got, want)
    _in_one_of(3, measure)


def test_probe_sees_no_gil_held_by_a_sleeping_load() -> None:
    def measure() -> tuple[bool, object]:
        got = gil_share(_hold_gil(0, 0.002, []), seconds=0.3, rounds=2)
        if got.method != "blocked":
            pytest.skip("without the scheduler's times the probe's lost progress counts CPU contention too")
        return abs(got.share) < 0.05, got
    _in_one_of(3, measure)


def test_neighbour_on_real_photos(photo_root: Path, tmp_path: Path) -> None:
    result = run_neighbour(photo_root, batch_size=4, workers=1, rounds=1, batches=2, steps_per_batch=3,
                           step_ops=30, gil_seconds=0.1, out_dir=tmp_path)
    assert [r.name for r in result.rows] == ["none", "stoker-1", "stoker-process-1", "dataloader-1"]
    assert [(r.feed, r.threads) for r in result.rows] == [("none", 0), ("stoker", 1), ("stoker-process", 1),
                                                          ("dataloader", 1)]
    for r in result.rows:
        assert r.steps == 6 and len(r.step_ms) == 6
        assert 0 < r.step_median_ms <= r.step_p90_ms < 1000
        assert 0 < r.step_share <= 1.0
        assert math.isfinite(r.inflation_median_pct) and math.isfinite(r.inflation_p90_pct)
    none = result.rows[0]
    assert none.inflation_median_pct == 0.0 and none.images_per_s == 0.0
    assert all(r.images_per_s > 0 for r in result.rows[1:])
    assert set(result.gil) == {"stoker", "stoker-process", "dataloader"}
    for g in result.gil.values():
        # 0.1 s windows: the scheduler's account lags by up to a time slice at each reading, which a loaded
        # machine lengthens, so here the share is only a number (its accuracy is the probe tests' above)
        assert math.isfinite(g["share"]) and g["share"] <= 1.0
        assert g["units_per_s"] > 0 and math.isfinite(g["us_per_unit"])
    assert result.data["images"] == 48 and not result.data["generated"]
    assert json.loads((tmp_path / "neighbour.json").read_text()) == json.loads(json.dumps(result.to_json()))
    table = (tmp_path / "neighbour.md").read_text()
    assert table == format_neighbour(result) + "\n"
    assert all(f"| {r.name} |" in table for r in result.rows) and "µs per sample" in table
    assert set(result.calls) == {"2", "16", "batch_size"} and all(c > 0 for c in result.calls.values())
    assert result.calls["batch_size"] == 4   # 48 photos: too few for batches of 256
    assert "Python calls per batch" in table


def test_a_load_that_never_marks_its_start_is_refused() -> None:
    with pytest.raises(ConfigError, match="mark"):
        gil_share(lambda mark, seconds: 0, seconds=0.01, rounds=1)


def test_too_few_images_for_a_window_names_the_fix(photo_root: Path) -> None:
    with pytest.raises(ConfigError, match="--images"):
        run_neighbour(photo_root, batch_size=16, workers=1, rounds=1, batches=3)


@pytest.mark.slow   # the script's own window sizes
def test_script(photo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--data", str(photo_root), "--batch-size", "2", "--workers", "1", "--rounds", "1",
                       "--out", str(tmp_path), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in obj["rows"]] == ["none", "stoker-1", "stoker-process-1", "dataloader-1"]
    assert obj["batch_size"] == 2
    assert (tmp_path / "neighbour.md").is_file()


def test_python_work_holds_the_gil_for_its_time_and_crosses_to_a_worker_process() -> None:
    import pickle

    import numpy as np

    from stoker.transforms import adapt

    PythonWork = bench.PythonWork

    img = np.zeros((4, 4, 3), np.uint8)
    t0 = time.perf_counter()
    assert PythonWork(3000)(img) is img
    assert time.perf_counter() - t0 >= 0.003
    op = pickle.loads(pickle.dumps(adapt(PythonWork(50), input="numpy", random="none")))   # Workers(processes=1)
    assert op.fn.us == 50
    with pytest.raises(ConfigError, match="python_us"):
        run_neighbour(Path("nowhere"), python_us=-1)


def test_stoker_bench_has_no_neighbour_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--python-us", "100"])
    assert "--python-us" in capsys.readouterr().err


def test_the_stoker_process_feed_takes_the_process_count(tmp_path: Path) -> None:
    """`--processes P`: the stoker-process feed at N threads runs min(N, P) worker processes."""
    _Data, _open_feed = bench._Data, bench._open_feed

    from test_loader import build_packed

    with pytest.raises(ConfigError, match="--processes"):
        run_neighbour(tmp_path, processes=0)
    data = _Data(tmp_path, build_packed(tmp_path / "ds", n=8), 8, processes=3)
    for threads, want in ((2, 2), (1, 1)):
        it, close = _open_feed("stoker-process", threads, data, 4, seed=0)
        try:
            x, _ = next(it)
            assert x.shape == (4, 3, 224, 224) and len(it._run.children) == want
        finally:
            close()
