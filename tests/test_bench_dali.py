"""benchmarks/bench_dali.py: NVIDIA DALI's pipelines beside stoker's in `stoker bench` (a bench Peer): they run
where DALI imports (its wheel runs CPU-only, so here on the CPU), are skipped with the pip command where it
does not, hand out what stoker's feeds hand out, and `stoker bench` names the script for them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from conftest import BrokenImport, load_benchmark
from stoker.cli import main
from stoker.tools import bench_gpu
from stoker.tools.bench import PIPELINES, BenchResult, PipelineResult, format_table, machine_info, peer_added, run_bench
from stoker.tools.bench_gpu import device_pipelines, feed_of
from test_bench_gpu import TINY, _check_ran, _pass_labels, solid_root, tiny_root  # noqa: F401 (fixtures)

bench_dali = load_benchmark("bench_dali")
HAS_DALI = bench_dali.why_unavailable() is None
needs_dali = pytest.mark.skipif(not HAS_DALI, reason="needs NVIDIA DALI: pip install nvidia-dali-cuda130 (CI leaves "
                                "this 200 MB optional extra out)")


@pytest.fixture
def dali() -> Iterator[ModuleType]:
    with peer_added(bench_dali.PEER):
        yield bench_dali


def test_the_peer_adds_its_pipelines_while_it_is_added(dali: ModuleType) -> None:
    catalog = device_pipelines([TINY])
    assert list(catalog)[:5] == ["cuda-baseline", "cuda-stoker", "cuda-stoker-gpu", "cuda-stoker-auto", "cuda-dali"]
    assert catalog["cuda-dali"][1] == "cuda-baseline"
    assert list(catalog)[-1] == "train-tiny_model-dali"
    assert catalog["train-tiny_model-dali"][1] == "train-tiny_model-synthetic"
    assert feed_of("train-resnet50-dali") == "dali" and feed_of("cuda-dali") == "dali"
    assert PIPELINES["dali"][1] == "baseline" and PIPELINES["dali-val"][1] == "baseline-val"


def test_the_peer_is_gone_after_its_block() -> None:
    with peer_added(bench_dali.PEER):
        pass
    assert "dali" not in PIPELINES and "cuda-dali" not in bench_gpu.LOADERS and "dali" not in bench_gpu.FEEDS
    assert "cuda-dali" not in device_pipelines([TINY])


def test_cpu_pipelines_run_or_are_skipped_with_the_pip_command(dali: ModuleType, tiny_root: Path,
                                                               tmp_path: Path) -> None:
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                       pipelines=("baseline", "baseline-val", "dali", "dali-val"))
    for name, reference in (("dali", "baseline"), ("dali-val", "baseline-val")):
        p = result.get(name)
        assert p is not None and p.ratio_to == reference
        if HAS_DALI:
            assert p.skipped is None and p.images_per_s > 0 and p.version.startswith("nvidia.dali ")
        else:   # reported as skipped, with the pip command, and the run went on
            assert p.skipped and "pip install nvidia-dali" in p.skipped and p.ratio is None
    _check_ran(result.get("baseline"))


def test_device_pipelines_on_the_cpu(dali: ModuleType, tiny_root: Path, tmp_path: Path) -> None:
    """cuda-dali and train-<model>-dali ran where DALI imports (here on the CPU), or were skipped with the pip
    command; the table says how DALI's figures were made."""
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path, device="cpu",
                       pipelines=("cuda-baseline", "cuda-dali", "train-tiny_model-synthetic",
                                  "train-tiny_model-baseline", "train-tiny_model-dali"),
                       models=[TINY], steps=2, warmup_steps=1)
    assert any("DALI reads the ImageFolder" in note for note in result.notes)
    loader, fed = result.get("cuda-dali"), result.get("train-tiny_model-dali")
    if not HAS_DALI:
        for p in (loader, fed):
            assert p is not None and p.skipped and "pip install nvidia-dali" in p.skipped and p.ratio is None
        return
    loader, fed = _check_ran(loader), _check_ran(fed)
    assert loader.images == 16 + 12   # as stoker's: each epoch of 60 samples ends with its partial batch
    assert loader.ratio == pytest.approx(loader.images_per_s / result.get("cuda-baseline").images_per_s)
    assert fed.images == 2 * 16 and 0.0 <= fed.data_wait < 1.0
    assert fed.ratio == pytest.approx(fed.images_per_s / result.get("train-tiny_model-synthetic").images_per_s)
    for p in (loader, fed):
        assert p.version.startswith("nvidia.dali ") and p.version.endswith(", decoders.image cpu")
    vs_base = fed.images_per_s / result.get("train-tiny_model-baseline").images_per_s
    assert f"| train-tiny_model-dali | {fed.ratio:.2f} | {fed.images_per_s:,.0f} | {vs_base:.2f}x |" in \
        format_table(result)


@pytest.mark.parametrize("how, error", [("missing", "ModuleNotFoundError"), ("broken", "RuntimeError")])
def test_dali_pipelines_are_skipped_with_the_pip_command_where_dali_does_not_import(
        dali: ModuleType, tiny_root: Path, monkeypatch: pytest.MonkeyPatch, how: str, error: str) -> None:
    for name in [n for n in sys.modules if n == "nvidia.dali" or n.startswith("nvidia.dali.")]:
        monkeypatch.delitem(sys.modules, name)
    if how == "missing":
        monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    else:
        broken = BrokenImport("nvidia", "nvidia.dali", message="libdali.so: undefined symbol")
        monkeypatch.setattr(sys, "meta_path", [broken, *sys.meta_path])
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=1, isolate=False, device="cpu", models=[TINY],
                       pipelines=("cuda-dali", "train-tiny_model-synthetic", "train-tiny_model-dali"), steps=1,
                       warmup_steps=0)
    for name in ("cuda-dali", "train-tiny_model-dali"):
        p = result.get(name)
        assert p is not None and p.skipped is not None and p.ratio is None
        assert error in p.skipped and "pip install nvidia-dali-cuda130" in p.skipped
    _check_ran(result.get("train-tiny_model-synthetic"))   # the run went on
    # the feed says the same where it is opened (in the pipeline's own process, under `stoker bench`)
    with pytest.raises(bench_gpu.FeedUnavailable, match=f"{error}.*pip install nvidia-dali-cuda130"):
        bench_gpu.open_feed("dali", root=str(tiny_root), packed="", batch_size=16, workers=1,
                            device=torch.device("cpu"), training=True)


@needs_dali
@pytest.mark.parametrize("training", [False, True])
def test_dali_batches_are_normalized_rgb_nchw_as_stokers_are(dali: ModuleType, solid_root: Path, tmp_path: Path,
                                                             training: bool) -> None:
    import stoker

    stoker.pack(solid_root, tmp_path / "packed")
    for name in ("stoker", "dali"):
        feed = bench_gpu.open_feed(name, root=str(solid_root), packed=str(tmp_path / "packed"), batch_size=3,
                                   workers=2, device=torch.device("cpu"), training=training)
        try:
            passes = [_pass_labels(feed, training) for _ in range(3)]   # passes run on into each other
        finally:
            feed.close()
        # 16 images in batches of 3: the partial last batch of a pass dropped for training, else handed out
        assert [len(p) for p in passes] == [15 if training else 16] * 3, name
        assert set(passes[0]) == {0, 1}, name
        if name == "dali":
            assert feed.version.startswith("nvidia.dali ") and feed.version.endswith("decoders.image cpu")


def test_table_for_a_dali_row(dali: ModuleType) -> None:
    pipes = [PipelineResult(name, name, images_per_s=rate, rounds=[rate], ratio_to=ref) for name, rate, ref in (
        ("train-resnet50-synthetic", 3000.0, None), ("train-resnet50-baseline", 1500.0, "train-resnet50-synthetic"),
        ("train-resnet50-dali", 2400.0, "train-resnet50-synthetic"), ("cuda-baseline", 5000.0, None),
        ("cuda-dali", 15000.0, "cuda-baseline"))]
    pipes[1].ratio, pipes[2].ratio, pipes[4].ratio = 0.5, 0.8, 3.0
    result = BenchResult(pipes, images=5000, batch_size=256, workers=16, rounds=3,
                         data={"images": 5000, "generated": True, "mean_width": 399, "mean_height": 349,
                               "mean_file_kb": 95.0}, baseline_transforms="x", machine=machine_info(),
                         device="cuda", models=["resnet50"], steps=100, warmup_steps=10)
    table = format_table(result)
    assert "| train-resnet50-dali | 0.80 | 2,400 | 1.60x |" in table   # a peer's feed: against the baseline too
    assert "| cuda-dali | 15,000 | 3.00x cuda-baseline |" in table


@pytest.mark.parametrize("argv, command", [
    (["--pipelines", "baseline,dali,dali-val"], "python benchmarks/bench_dali.py --pipelines dali,dali-val ("),
    (["--pipelines", "cuda-dali"], "python benchmarks/bench_dali.py --pipelines cuda-dali --device cuda ("),
    (["--device", "cuda:1", "--pipelines", "cuda-stoker,train-resnet50-dali"],
     "python benchmarks/bench_dali.py --pipelines train-resnet50-dali --device cuda:1 ("),
])
def test_stoker_bench_names_the_script_that_runs_them_now(argv: list[str], command: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stoker bench: error: ") and "\n" not in err
    assert "is not a pipeline of stoker bench; from a checkout of the project run " + command in err


def test_script_help_and_its_default_pipelines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_dali.main(["--help"])
    assert exc.value.code == 0 and "benchmarks/bench_dali.py" in capsys.readouterr().out
    assert {"dali", "dali-val", "baseline", "baseline-val"} <= set(bench_dali.CPU_PIPELINES)
