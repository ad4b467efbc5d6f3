"""benchmarks/bench_spdl.py: SPDL's batch decode beside stoker in `stoker bench` (a bench Peer), measured
where SPDL can decode (its FFmpeg libraries present) and skipped with the fix where it cannot; `stoker
bench --pipelines spdl` names the script."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_benchmark
from stoker.cli import main
from stoker.tools.bench import PIPELINES, peer_added, run_bench

bench_spdl = load_benchmark("bench_spdl")


def test_spdl_runs_beside_stoker_or_says_why_not(tiny_root: Path, tmp_path: Path) -> None:
    missing = bench_spdl.why_unavailable()
    with peer_added(bench_spdl.PEER):
        result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                           pipelines=("stoker-val", "spdl"))
    assert "spdl" not in PIPELINES   # only while the peer is added
    peer = result.get("spdl")
    assert peer is not None and peer.ratio_to == "stoker-val"
    if missing is None:
        assert peer.skipped is None and peer.images == 64 and peer.ratio > 0
    else:   # reported as skipped, with the fix, and the run went on
        assert peer.skipped and ("pip install spdl" in peer.skipped or "FFmpeg" in peer.skipped)
        assert result.get("stoker-val").skipped is None


def test_stoker_bench_names_the_script_that_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--pipelines", "stoker-val,spdl"]) == 2
    err = capsys.readouterr().err
    assert "spdl is not a pipeline of stoker bench" in err and "benchmarks/bench_spdl.py" in err


def test_all_the_peers_in_one_run(tiny_root: Path, tmp_path: Path) -> None:
    """benchmarks/bench_peers.py adds every peer at once: each of their pipelines is measured or skipped with
    its fix in the same run as stoker's."""
    bench_peers = load_benchmark("bench_peers")
    import contextlib

    with contextlib.ExitStack() as stack:
        for peer in bench_peers.PEERS:
            stack.enter_context(peer_added(peer))
        result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                           pipelines=("stoker-train", "stoker-val", "stoker-buckets", "datago", "spdl"))
    for name in ("datago", "spdl"):
        got = result.get(name)
        assert got is not None and (got.skipped is not None or got.images == 64)
    assert not {"datago", "spdl", "dali", "turbo-tbl"} & set(PIPELINES)
