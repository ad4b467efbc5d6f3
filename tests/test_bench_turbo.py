"""benchmarks/bench_turbo.py: TurboLoader's TBL path beside stoker's raw pack in `stoker bench` (a bench Peer),
measured where turboloader imports and skipped with the pip command where it does not; `stoker bench
--pipelines turbo-tbl` names the script."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from conftest import load_benchmark
from stoker.cli import main
from stoker.tools.bench import PIPELINES, peer_added, run_bench

bench_turbo = load_benchmark("bench_turbo")
HAS_TURBO = importlib.util.find_spec("turboloader") is not None


def test_turboloader_runs_beside_stokers_raw_pack_or_says_why_not(tiny_root: Path, tmp_path: Path) -> None:
    with peer_added(bench_turbo.PEER):
        result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                           pipelines=("stoker-train-raw256", "turbo-tbl"))
    assert "turbo-tbl" not in PIPELINES   # only while the peer is added
    turbo, raw = result.get("turbo-tbl"), result.get("stoker-train-raw256")
    assert turbo is not None and turbo.ratio_to == "stoker-train-raw256"
    assert raw is not None and raw.skipped is None and raw.images == 64 and math.isfinite(raw.images_per_s)
    if HAS_TURBO:
        assert turbo.skipped is None and turbo.images_per_s > 0 and turbo.ratio > 0
        assert (tmp_path / f"turbo-{bench_turbo.STORED}" / f"images-{bench_turbo.STORED}.tbl").is_file()
    else:   # reported as skipped, with the pip command, and the run went on
        assert turbo.skipped and "pip install 'stoker[turboloader]'" in turbo.skipped and turbo.ratio is None


def test_stoker_bench_names_the_script_that_runs_it_now(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--pipelines", "stoker-train-raw256,turbo-tbl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stoker bench: error: ") and "\n" not in err
    assert "turbo-tbl is not a pipeline of stoker bench" in err
    assert "run python benchmarks/bench_turbo.py --pipelines turbo-tbl (with stoker bench's other options)" in err


def test_script_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_turbo.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "benchmarks/bench_turbo.py" in out and "--pipelines" in out
