"""benchmarks/bench_datago.py: datago's aspect buckets beside stoker's in `stoker bench` (a bench Peer),
measured where datago imports and skipped with the pip command where it does not; `stoker bench
--pipelines datago` names the script."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from conftest import load_benchmark
from stoker.cli import main
from stoker.tools.bench import PIPELINES, peer_added, run_bench

bench_datago = load_benchmark("bench_datago")
HAS_DATAGO = importlib.util.find_spec("datago") is not None


def test_datago_runs_beside_stokers_buckets_or_says_why_not(tiny_root: Path, tmp_path: Path) -> None:
    with peer_added(bench_datago.PEER):
        result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                           pipelines=("stoker-train", "stoker-buckets", "datago"))
    assert "datago" not in PIPELINES   # only while the peer is added
    peer, buckets = result.get("datago"), result.get("stoker-buckets")
    assert peer is not None and peer.ratio_to == "stoker-buckets"
    assert buckets is not None and buckets.skipped is None and buckets.images > 0 and math.isfinite(buckets.images_per_s)
    if HAS_DATAGO:
        assert peer.skipped is None and peer.images == 64 and peer.ratio > 0
    else:   # reported as skipped, with the pip command, and the run went on
        assert peer.skipped and "pip install datago" in peer.skipped and peer.ratio is None


def test_stoker_bench_names_the_script_that_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--pipelines", "stoker-buckets,datago"]) == 2
    err = capsys.readouterr().err
    assert "datago is not a pipeline of stoker bench" in err and "benchmarks/bench_datago.py" in err
