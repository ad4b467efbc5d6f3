"""benchmarks/bench_calls.py: the Python calls per batch of the Loader's own threads, counted on the user's
data at the thread count given, the table and the JSON written to --out; `stoker bench --pipelines calls`
names the script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_benchmark
from stoker.cli import main
from stoker.errors import ConfigError
from stoker.tools.bench import run_bench

bench_calls = load_benchmark("bench_calls")


def test_script_counts_the_python_calls_per_batch(tiny_root: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # 16 batches of 4: more than the ring holds, so the threads make batches while they are counted
    assert bench_calls.main(["--data", str(tiny_root), "--batch-size", "4", "--workers", "2", "--out", str(tmp_path),
                             "--json", "--quiet"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj["calls"]) == {"2"} and obj["calls"]["2"] > 0 and obj["batch_size"] == 4
    assert obj["data"]["images"] == 64 and not obj["data"]["generated"]
    assert json.loads((tmp_path / "calls.json").read_text()) == obj
    assert "| 2 |" in (tmp_path / "calls.md").read_text()


@pytest.mark.parametrize("argv", [["--device", "cuda"], ["--recipe", "randaug"], ["--steps", "5"], ["--rounds", "2"]])
def test_script_takes_no_timing_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_calls.main(argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_calls_need_three_batches_and_thread_counts(tiny_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="--images"):
        bench_calls.run_calls(tiny_root, batch_size=32, threads=(1,))   # 64 images: 2 batches of 32
    with pytest.raises(ConfigError, match="--workers"):
        bench_calls.run_calls(tiny_root, threads=(0,))
    with pytest.raises(SystemExit) as exc:   # the script: one line, exit status 2
        bench_calls.main(["--data", str(tiny_root), "--batch-size", "32", "--workers", "1"])
    assert exc.value.code == 2 and "--images" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--device", "cuda"], ["--rounds", "2"]])
def test_stoker_bench_names_the_script_that_counts_them_now(argv: list[str], tiny_root: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--pipelines", "calls", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stoker bench: error: ") and "\n" not in err
    assert ("run python benchmarks/bench_calls.py [--data DIR] [--workers N] [--decode gpu | --decode auto "
            "--gpu-share 0.5]") in err   # the GPU half's count is one flag away
    with pytest.raises(ConfigError, match="benchmarks/bench_calls.py"):
        run_bench(tiny_root, isolate=False, pipelines=("calls", "stoker-train"))


@pytest.fixture(scope="module")
def small_packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,800 generated JPEGs of 72 x 96 (stored as JPEGs: above the pack's raw size), packed: enough batches
    of 128 to count in the steady state."""
    from stoker.tools.bench import _pack_once
    from stoker.tools.synth import make_tiny_jpegs

    root = tmp_path_factory.mktemp("calls-gpu")
    make_tiny_jpegs(root / "data", 1800, classes=4, size=(72, 96))
    _pack_once(root / "data", root / "packed", 2)
    return root / "packed"


@pytest.mark.parametrize("decode, share", [("gpu", None), ("auto", 0.5)])
def test_gpu_columns_calls_do_not_grow_with_the_rows(small_packed: Path, decode: str, share: float | None) -> None:
    """The GPU columns' path (decode="gpu", and the split at a fixed share) makes about as many Python calls
    per batch of 128 rows as per batch of 32, on the loader's threads together (the stand-in decoder's own
    calls aside): nothing runs per image in Python. Before the columns each row cost about 14 calls, so 96
    more rows made a batch of 128 cost well over twice a batch of 32; the bound leaves room for the
    counts' scatter on a loaded machine (idle waits, the workers running ahead of the count's window)."""
    calls = {n: bench_calls.python_calls(small_packed, n, 2, batches=4, decode=decode, gpu_share=share)
             for n in (32, 128)}
    assert calls[128] < 1.75 * calls[32], calls


def test_gpu_counts_take_only_the_known_paths(tiny_root: Path) -> None:
    with pytest.raises(ConfigError, match="decode"):
        bench_calls.python_calls(tiny_root, 4, 1, decode="nvjpeg")
