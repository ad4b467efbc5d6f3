"""Smoke tests of the benchmark engine (structure and sanity of the numbers; no timing thresholds),
plus exactness checks of the torchvision re-implementation the baseline falls back to."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.errors import ConfigError
from stoker.reader import open_dataset
from stoker.tools.baseline import (_TVCenterCrop, _TVRandomResizedCrop, _TVResize, _tv_to_normalized_tensor,
                                   list_image_folder)
from stoker.tools.bench import NOTE, BenchResult, PipelineResult, format_table, machine_info, run_bench
from stoker.tools.synth import make_tiny_jpegs
from torchvision_helpers import v1


def _check_ran(p: PipelineResult, images: int) -> None:
    assert p.skipped is None, p.skipped
    assert p.images == images
    assert len(p.rounds) == 1 and math.isfinite(p.images_per_s) and p.images_per_s > 0
    assert math.isfinite(p.cpu_percent) and p.cpu_percent > 0
    assert math.isfinite(p.cpu_ms_per_image) and p.cpu_ms_per_image > 0
    assert p.peak_rss_bytes > 10 * 2**20
    assert math.isfinite(p.first_batch_s) and p.first_batch_s > 0
    assert p.version   # which library did the work, e.g. "simplejpeg 1.9.0"


def _check_outputs(result: BenchResult, out: Path) -> None:
    obj = json.loads((out / "bench.json").read_text())
    assert obj == json.loads(json.dumps(result.to_json()))
    assert [p["name"] for p in obj["pipelines"]] == [p.name for p in result.pipelines]
    table = (out / "bench.md").read_text()
    assert NOTE in table and all(f"| {p.name} |" in table for p in result.pipelines)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "No chart" in table


def test_baselines_and_ceiling_in_process(tiny_root: Path, tmp_path: Path) -> None:
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                       pipelines=("baseline", "baseline-val", "ceiling"))
    assert (result.images, result.batch_size, result.workers, result.rounds) == (64, 16, 2, 1)
    assert result.data["images"] == 64 and result.data["mean_width"] == 200
    for name in ("baseline", "baseline-val", "ceiling"):
        _check_ran(result.get(name), 64)  # type: ignore[arg-type]
    ceiling = result.get("ceiling")
    assert ceiling.ratio_to == "baseline" and ceiling.ratio > 0  # type: ignore[union-attr,operator]
    assert result.pack_seconds > 0 and "torchvision" in result.baseline_transforms
    _check_outputs(result, tmp_path)


def test_stoker_pipelines_in_process(tiny_root: Path, tmp_path: Path) -> None:
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                       pipelines=("baseline", "baseline-val", "stoker-train", "stoker-val"))
    for name in ("stoker-train", "stoker-val"):
        p = result.get(name)
        _check_ran(p, 64)  # type: ignore[arg-type]
        assert p.ratio is not None and p.ratio > 0  # type: ignore[union-attr]
    assert result.get("stoker-val").ratio_to == "baseline-val"  # type: ignore[union-attr]


def test_the_process_mode_pipeline_counts_its_worker_process_cpu(tiny_root: Path, tmp_path: Path) -> None:
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                       pipelines=("baseline", "stoker-train", "stoker-train-process"))
    threads, process = result.get("stoker-train"), result.get("stoker-train-process")
    _check_ran(process, 64)  # type: ignore[arg-type]
    assert process.ratio_to == "baseline"  # type: ignore[union-attr]
    # the worker process's decode is counted (reaped children), not only this process's share
    assert process.cpu_ms_per_image > 0.5 * threads.cpu_ms_per_image  # type: ignore[union-attr]


def test_recipes_fast_mode_and_overhead_in_process(tiny_root: Path, tmp_path: Path) -> None:
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                       pipelines=("baseline", "stoker-train", "stoker-train-fast", "stoker-train-float",
                                  "stoker-train-raw256", "stoker-train-jpeg256", "overhead"))
    for name in ("stoker-train", "stoker-train-fast", "stoker-train-float", "stoker-train-raw256",
                 "stoker-train-jpeg256"):
        _check_ran(result.get(name), 64)  # type: ignore[arg-type]
    disk = {p.name: p.disk_bytes for p in result.pipelines}
    # 150x200 JPEGs: raw pixels cost more bytes than the packed JPEGs; nothing is read from nowhere
    assert disk["stoker-train-raw256"] > disk["stoker-train"] > 0 and disk["baseline"] > 0
    raw = open_dataset(tmp_path / "packed-raw256")
    assert {raw.sample(i).encoding for i in range(len(raw))} == {"raw"}
    overhead = result.get("overhead")
    _check_ran(overhead, 20_000)  # type: ignore[arg-type]
    assert overhead.ratio is None  # type: ignore[union-attr]
    table = format_table(result)
    assert "Per-sample overhead:" in table and "µs per sample on one thread" in table and "disk (MB)" in table


@pytest.mark.slow   # the CLI measures in a child process
def test_cli_json_is_the_result_and_writes_the_files(tiny_root: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import main

    assert main(["bench", "--data", str(tiny_root), "--batch-size", "32", "--rounds", "1", "--workers", "1",
                 "--pipelines", "ceiling", "--out", str(tmp_path), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in obj["pipelines"]] == ["ceiling"] and obj["note"] == NOTE
    assert json.loads((tmp_path / "bench.json").read_text())["pipelines"][0]["name"] == "ceiling"


@pytest.mark.slow   # a child process per pipeline
def test_isolated_run_reports_from_a_child_process(tiny_root: Path, tmp_path: Path) -> None:
    result = run_bench(tiny_root, batch_size=32, rounds=1, workers=1, isolate=True, out_dir=tmp_path,
                       pipelines=("ceiling",))
    _check_ran(result.get("ceiling"), 64)  # type: ignore[arg-type]
    assert result.get("ceiling").ratio is None  # type: ignore[union-attr]  (no baseline in this run)


def test_generates_data_when_no_folder_is_given(tmp_path: Path) -> None:
    result = run_bench(None, images=12, batch_size=8, rounds=1, workers=1, isolate=False, out_dir=tmp_path,
                       pipelines=("ceiling",))
    assert result.data["generated"] and result.images == 12
    assert len(list((tmp_path / "data").rglob("*.jpg"))) == 12


@pytest.mark.parametrize("kwargs", [{"rounds": 0}, {"batch_size": 0}, {"pipelines": ("baseline", "nope")},
                                    {"pipelines": ()}])
def test_bad_arguments(tiny_root: Path, kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        run_bench(tiny_root, isolate=False, **kwargs)


def test_table_shows_skipped_pipelines_and_the_note() -> None:
    result = BenchResult([PipelineResult("baseline", "b", images_per_s=100.0, rounds=[100.0]),
                          PipelineResult("dali", "d", skipped="not installed")],
                         images=10, batch_size=4, workers=2, rounds=1,
                         data={"images": 10, "generated": True, "mean_width": 400, "mean_height": 350,
                               "mean_file_kb": 100.0},
                         baseline_transforms="x", machine=machine_info())
    table = format_table(result)
    assert "skipped: not installed" in table and NOTE in table and "| baseline | 100 |" in table
    assert json.dumps(result.to_json())   # NaN fields become null, so this is valid JSON


def test_image_folder_listing_is_torchvision_order(tmp_path: Path) -> None:
    make_tiny_jpegs(tmp_path, 6, classes=3)
    samples, classes = list_image_folder(tmp_path)
    assert classes == ["class_000", "class_001", "class_002"]
    assert [label for _, label in samples] == sorted(label for _, label in samples)
    with pytest.raises(ConfigError):
        list_image_folder(tmp_path / "class_000")


# --- the torchvision re-implementation -------------------------------------------------------------

def test_random_resized_crop_params_in_bounds_and_fallback() -> None:
    rrc = _TVRandomResizedCrop(224)
    torch.manual_seed(0)
    for _ in range(200):
        i, j, h, w = rrc.get_params(500, 375)
        assert 0 <= i and 0 <= j and 0 < h and 0 < w and i + h <= 375 and j + w <= 500
    # A 1000x10 strip fits no crop of ratio 3/4..4/3 and area >= 8%: torchvision's central fallback.
    assert rrc.get_params(1000, 10) == (0, (1000 - 13) // 2, 10, 13)
    assert rrc(Image.new("RGB", (500, 375))).size == (224, 224)


def test_resize_center_crop_and_normalize() -> None:
    img = Image.new("RGB", (500, 375), (255, 0, 128))
    resized = _TVResize(256)(img)
    assert resized.size == (341, 256)                      # longer side int(256 * 500 / 375)
    assert _TVResize(256)(Image.new("RGB", (300, 600))).size == (256, 512)
    cropped = _TVCenterCrop(224)(resized)
    assert cropped.size == (224, 224)
    t = _tv_to_normalized_tensor(cropped)
    assert t.shape == (3, 224, 224) and t.dtype == torch.float32
    expected = (np.array([1.0, 0.0, 128 / 255]) - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    assert np.allclose(t[:, 100, 100].numpy(), expected, atol=1e-5)


def test_matches_real_torchvision_when_installed() -> None:
    tv = v1()  # torchvision.transforms, importable on a CPU-only torch too (tests/torchvision_helpers.py)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (375, 500, 3), dtype=np.uint8))
    for seed in range(20):
        torch.manual_seed(seed)
        ours = _TVRandomResizedCrop(224)(img)
        torch.manual_seed(seed)
        theirs = tv.RandomResizedCrop(224)(img)
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    ours_val = _tv_to_normalized_tensor(_TVCenterCrop(224)(_TVResize(256)(img)))
    theirs_val = tv.Compose([tv.Resize(256), tv.CenterCrop(224), tv.ToTensor(),
                             tv.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])(img)
    assert torch.equal(ours_val, theirs_val)


def test_ceiling_handles_samples_packed_as_raw_pixels(tmp_path: Path) -> None:
    root = make_tiny_jpegs(tmp_path / "raw", 8, classes=2, size=(32, 48))   # <= 64x64: packed raw
    result = run_bench(root, batch_size=4, rounds=1, workers=1, isolate=False, pipelines=("ceiling",))
    _check_ran(result.get("ceiling"), 8)  # type: ignore[arg-type]


def test_chart_bars_are_the_loaders_not_the_overhead_measurement(tmp_path: Path) -> None:
    """overhead runs on 16x16 raw images (tens of thousands of images/s): as a bar it would set the axis
    and draw the loaders as slivers, so the chart names its figure under the axis instead."""
    from stoker.tools.charts import bench_bars, bench_chart

    result = BenchResult([PipelineResult("baseline", "b", images_per_s=300.0, rounds=[300.0]),
                          PipelineResult("stoker-train", "s", images_per_s=950.0, rounds=[950.0]),
                          PipelineResult("ceiling", "c", images_per_s=1000.0, rounds=[1000.0]),
                          PipelineResult("dali", "d", skipped="not installed"),
                          PipelineResult("overhead", "o", images_per_s=40_000.0, rounds=[40_000.0])],
                         images=10, batch_size=4, workers=2, rounds=1, data={}, baseline_transforms="x",
                         machine={})
    bars, notes = bench_bars(result)
    assert [p.name for p in bars] == ["baseline", "stoker-train"]
    assert notes == ["not drawn: overhead (1 thread, 16x16 raw images) 25.0 µs of Python work per sample"]
    pytest.importorskip("matplotlib")
    assert bench_chart(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_neighbour_bench_is_not_a_stoker_bench_pipeline(tiny_root: Path) -> None:
    """The noisy-neighbour bench is a developer's script (benchmarks/bench_neighbour.py), not a pipeline."""
    with pytest.raises(ConfigError, match="neighbour"):
        run_bench(tiny_root, isolate=False, pipelines=("neighbour",))


#: a peer as the benchmarks/ scripts define one: a "loader" of three batches, its own data made before timing
PEER_SCRIPT = '''
from pathlib import Path

from stoker.tools.bench import Peer


def prepare(root, work, workers):
    (work / "counted").mkdir(exist_ok=True)
    (work / "counted" / "made").write_text(str(root))
    return work / "counted"


def open_pipeline(spec):
    assert Path(spec.packed, "made").read_text() == spec.root   # what prepare made, before any timing

    def epoch():
        yield from [spec.batch_size] * 3
    return epoch, lambda: None


PEER = Peer(script=__file__, unavailable=lambda: None, version=lambda: "counter 1.0", prepare=prepare,
            pipelines={"count": ("three batches of nothing", "ceiling")},
            open=open_pipeline, note="counted, not decoded")
'''


@pytest.mark.slow   # a child process per pipeline
@pytest.mark.parametrize("isolate", [False, True])
def test_a_peer_runs_beside_stokers_pipelines_while_added(tiny_root: Path, tmp_path: Path, isolate: bool) -> None:
    """A peer's pipelines run like stoker's (in a child process, which loads the peer's script), are skipped
    with its reason where it cannot run, and are gone once the peer's block ends."""
    from dataclasses import replace

    from stoker.tools import bench

    script = tmp_path / "peer_counter.py"
    script.write_text(PEER_SCRIPT)
    peer = bench._load_peer(str(script))
    with bench.peer_added(peer):
        result = run_bench(tiny_root, batch_size=16, rounds=1, workers=1, isolate=isolate, out_dir=tmp_path / "out",
                           pipelines=("ceiling", "count"))
        with pytest.raises(ConfigError, match="count.*name pipelines"):
            with bench.peer_added(peer):
                pass
    count = result.get("count")
    assert count is not None and count.skipped is None and count.images == 48 and count.version == "counter 1.0"
    assert count.ratio_to == "ceiling" and count.ratio is not None and count.ratio > 0
    assert result.notes == ["counted, not decoded"] and "counted, not decoded" in format_table(result)
    assert count.disk_bytes == len(str(tiny_root))   # the folder prepare made is what it read
    assert "count" not in bench.PIPELINES and not bench._PEERS
    with pytest.raises(ConfigError, match="unknown pipelines"):
        run_bench(tiny_root, isolate=False, pipelines=("count",))
    never = replace(peer, unavailable=lambda: "no counter here: pip install counter")
    with bench.peer_added(never):
        result = run_bench(tiny_root, batch_size=16, rounds=1, workers=1, isolate=False, pipelines=("count",))
    assert result.get("count").skipped == "no counter here: pip install counter"   # type: ignore[union-attr]
