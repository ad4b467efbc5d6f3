"""The device bench (`stoker bench --device cuda`) run end to end on the CPU: the same pipelines, the same
measurement and table code, a tiny model and tiny images. Structure and ratios are checked against the
measured numbers; no timing thresholds."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import write_image
from stoker.errors import ConfigError
from stoker.tools import bench_gpu
from stoker.tools.bench import NOTE, BenchResult, PipelineResult, format_table, machine_info, run_bench
from stoker.tools.bench_gpu import device_pipelines, feed_of, model_label
from stoker.tools.synth import make_tiny_jpegs

TINY = f"{__name__}:tiny_model"


def tiny_model() -> nn.Module:
    """A few kFLOP per image: the bench's plumbing, not a model, is what these tests measure."""
    return nn.Sequential(nn.Conv2d(3, 4, 8, stride=8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3))


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_jpegs(tmp_path_factory.mktemp("bench-gpu") / "data", 60, classes=4, size=(90, 120))


@pytest.fixture(scope="module")
def cpu_run(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[BenchResult, Path]:
    """Every device pipeline of the tiny model, on the CPU, in this process."""
    out = tmp_path_factory.mktemp("bench-gpu-out")
    names = tuple(device_pipelines([TINY]))
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=out, device="cpu",
                       pipelines=names, models=[TINY], steps=2, warmup_steps=1)
    return result, out


def _check_ran(p: PipelineResult | None) -> PipelineResult:
    assert p is not None
    assert p.skipped is None, p.skipped
    assert len(p.rounds) == 1 and math.isfinite(p.images_per_s) and p.images_per_s > 0
    assert p.images_per_s == p.rounds[0]
    assert math.isfinite(p.cpu_percent) and p.cpu_ms_per_image > 0 and p.peak_rss_bytes > 10 * 2**20
    assert math.isfinite(p.first_batch_s) and p.first_batch_s > 0
    assert p.startup_share == pytest.approx(p.first_batch_s * p.images_per_s / p.images)   # one round
    assert p.peak_device_bytes == 0   # on the CPU: no device allocator to ask
    assert p.version
    return p


def test_pipeline_names_and_references() -> None:
    from torchvision_helpers import torchvision_importable   # imports it on a CPU-only torch too

    catalog = device_pipelines(["resnet50"] if torchvision_importable() else [TINY])
    label = next(n for n in catalog if n.startswith("train-")).split("-")[1]
    assert list(catalog)[:5] == ["cuda-baseline", "cuda-stoker", "cuda-stoker-gpu", "cuda-stoker-auto", f"train-{label}-synthetic"]
    assert catalog["cuda-stoker-gpu"][1] == "cuda-baseline" and catalog["cuda-baseline"][1] is None
    assert catalog["cuda-stoker-auto"][1] == "cuda-baseline" and feed_of("cuda-stoker-auto") == "stoker-auto"
    assert [n for n in catalog if n.startswith("train-")] == [
        f"train-{label}-{f}" for f in ("synthetic", "baseline", "stoker", "stoker-process", "stoker-interference",
                                       "stoker-gpu")]
    for feed in ("stoker", "stoker-process", "stoker-interference"):
        assert catalog[f"train-{label}-{feed}"][1] == f"train-{label}-synthetic"
    assert feed_of("train-resnet50-stoker-gpu") == "stoker-gpu" and feed_of("train-resnet50-stoker") == "stoker"
    with pytest.raises(ConfigError, match="unknown device pipeline"):   # a peer's feed, not added here
        feed_of("train-resnet50-dali")
    assert feed_of("cuda-stoker-gpu") == "stoker-gpu" and model_label("pkg.nets:make_net") == "make_net"
    assert feed_of("train-resnet18-stoker-interference") == "stoker-interference"
    assert feed_of("train-resnet18-stoker-process") == "stoker-process"


def test_device_bench_on_cpu_end_to_end(cpu_run: tuple[BenchResult, Path]) -> None:
    result, out = cpu_run
    assert (result.device, result.images, result.batch_size, result.steps, result.warmup_steps) == ("cpu", 60, 16, 2, 1)
    assert result.models == [TINY]
    # the loaders alone: every image of the epoch, into "device" memory
    # a round is `steps` batches of a stream running on across epochs, the start-up weighed against them
    base = _check_ran(result.get("cuda-baseline"))
    assert base.images == 2 * 16 and base.ratio is None
    # training on the GPU-resident (here: CPU-resident) batch and fed by the DataLoader baseline
    synthetic = _check_ran(result.get("train-tiny_model-synthetic"))
    fed = _check_ran(result.get("train-tiny_model-baseline"))
    for p in (synthetic, fed):
        assert p.images == 2 * 16 and 0.0 <= p.data_wait < 1.0
    assert fed.ratio_to == "train-tiny_model-synthetic"
    assert fed.ratio == pytest.approx(fed.images_per_s / synthetic.images_per_s)
    assert synthetic.data_wait < 0.5   # next() on a resident batch costs nothing
    # decode="gpu" needs CUDA: reported as skipped, with the reason, the run goes on
    for name in ("cuda-stoker-gpu", "train-tiny_model-stoker-gpu"):
        p = result.get(name)
        assert p is not None and p.skipped and "CUDA" in p.skipped and p.ratio is None
    # CPU decode straight into (CPU) device batches
    for name in ("cuda-stoker", "train-tiny_model-stoker"):
        p = _check_ran(result.get(name))
        assert p.ratio is not None and p.ratio > 0
    # the process mode's feed, and the interference control: the resident batch while the stoker feed runs
    process = _check_ran(result.get("train-tiny_model-stoker-process"))
    assert process.version.endswith(", processes=1") and process.images == 2 * 16
    control = _check_ran(result.get("train-tiny_model-stoker-interference"))
    assert control.version.endswith(", interference control") and control.data_wait < 0.5   # it never waits
    assert control.ratio == pytest.approx(control.images_per_s / synthetic.images_per_s)
    assert f"| train-tiny_model-stoker-interference | {control.ratio:.2f} | {control.images_per_s:,.0f} | - |" in \
        format_table(result)
    stoker_loader = _check_ran(result.get("cuda-stoker"))
    assert stoker_loader.images == 16 + 12   # warm-up: batches 0-1 of 60 images; timed: 2 and the partial 3
    assert stoker_loader.ratio == pytest.approx(stoker_loader.images_per_s / base.images_per_s)
    assert stoker_loader.gpu_split == "" and math.isnan(stoker_loader.gpu_share)   # CPU decode: no split to record
    # decode="auto" without CUDA: it runs, decoding on the CPU, and the result says why
    auto = _check_ran(result.get("cuda-stoker-auto"))
    assert auto.version.endswith(", decode='auto'") and auto.images == 16 + 12
    assert auto.ratio == pytest.approx(auto.images_per_s / base.images_per_s)
    assert auto.gpu_share == 0.0 and auto.gpu_split.startswith("CPU only: no GPU JPEG decoder works here")
    assert "CUDA" in auto.gpu_split and auto.gpu_phases == {}
    assert (f"cuda-stoker-auto: 0% of each batch's JPEGs on the GPU ({auto.gpu_split}); seconds per phase over the "
            "timed rounds: none (no batch went through the GPU decode path).") in format_table(result)
    assert result.pack_seconds > 0


class _NoGpuDecoder:
    """A Loader whose GPU decoder turns out to be missing when iteration starts (as decode="gpu" does)."""

    route = "gpu columns, share 1"   # decided when the Loader was made, as a Loader's is

    def __iter__(self):
        raise ConfigError("no GPU JPEG decoder is installed: pip install torchvision")

    def close(self) -> None:
        pass


def test_a_stoker_feed_that_cannot_start_is_skipped_with_its_reason(tiny_root: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_gpu, "_stoker_loader", lambda *args, **kwargs: _NoGpuDecoder())
    before = torch.backends.cudnn.benchmark
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=1, isolate=False, device="cpu", models=[TINY],
                       pipelines=("cuda-stoker", "train-tiny_model-synthetic", "train-tiny_model-stoker"), steps=1,
                       warmup_steps=0)
    for name in ("cuda-stoker", "train-tiny_model-stoker"):
        p = result.get(name)
        assert p is not None and p.skipped == "no GPU JPEG decoder is installed: pip install torchvision"
        assert p.ratio is None
    _check_ran(result.get("train-tiny_model-synthetic"))
    assert torch.backends.cudnn.benchmark is before   # set for the training measurement only, then restored


#: one colour per class, in ImageFolder's (sorted) class order
SOLID = {"amber": (200, 100, 30), "blue": (20, 120, 220)}


@pytest.fixture(scope="module")
def solid_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Single-colour JPEGs, 8 per class, in varied sizes: whatever the crop, resize and flip, every pixel of a
    sample normalizes to its class's colour."""
    root = tmp_path_factory.mktemp("solid") / "data"
    for c, rgb in SOLID.items():
        for i, (h, w) in enumerate([(90, 120), (120, 90), (64, 64), (50, 200)] * 2):
            write_image(root / c / f"{i:02d}.jpg", np.full((h, w, 3), rgb, np.uint8), quality=95)
    return root


def _pass_labels(feed: bench_gpu.Feed, training: bool, dtype: torch.dtype = torch.float32) -> list[int]:
    """One pass of `feed`, every batch checked against its labels' colours; the labels seen."""
    from stoker.device.stage import IMAGENET_MEAN, IMAGENET_STD

    colours = torch.tensor(list(SOLID.values()), dtype=torch.float32) / 255
    normalized = (colours - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)   # [class, channel]
    seen: list[int] = []
    for images, labels in feed.epoch():
        assert images.dtype == dtype and images.device.type == "cpu" and images.shape[1:] == (3, 224, 224)
        assert images.is_contiguous(memory_format=torch.channels_last if training else torch.contiguous_format)
        assert labels.dtype == torch.int64 and labels.shape == images.shape[:1]
        # a flat colour survives crop, resize and flip; JPEG rounds it by a level or two
        assert (images.float() - normalized[labels][:, :, None, None]).abs().max() < 0.06
        seen += labels.tolist()
    return seen


@pytest.mark.parametrize("name", ["baseline", "stoker"])
def test_loader_alone_feeds_hand_out_normalized_bfloat16(solid_root: Path, tmp_path: Path, name: str) -> None:
    import stoker

    stoker.pack(solid_root, tmp_path / "packed")
    feed = bench_gpu.open_feed(name, root=str(solid_root), packed=str(tmp_path / "packed"), batch_size=3,
                               workers=2, device=torch.device("cpu"), training=False, dtype=torch.bfloat16)
    try:
        seen = _pass_labels(feed, False, torch.bfloat16)
        # the baseline's pass is 16 // 3 batches of its ImageNet-long epoch; stoker's an epoch, the last batch partial
        assert len(seen) == (15 if name == "baseline" else 16) and set(seen) <= {0, 1}
    finally:
        feed.close()


def test_every_loader_alone_pipeline_asks_for_the_same_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    def fake_open_feed(feed: str, **kwargs: object) -> bench_gpu.Feed:
        asked.append(kwargs["dtype"])
        return bench_gpu.Feed(lambda: iter([(torch.zeros(2, 3, 4, 4), torch.zeros(2))]), lambda: None, "fake")

    monkeypatch.setattr(bench_gpu, "open_feed", fake_open_feed)
    for name in bench_gpu.LOADERS:
        run = bench_gpu.loader_epochs(name, root="", packed="", batch_size=2, workers=1, device="cpu", steps=1)
        assert list(run.epoch()) == [2]
        run.close()
    assert asked == [torch.bfloat16] * len(bench_gpu.LOADERS) and bench_gpu.LOADER_DTYPE == "bfloat16"


class _StandInDecoder:
    """The GPU decoder protocol (`gpu_decoder=` object) with simplejpeg on the CPU: CHW uint8 tensors."""

    name = "simplejpeg stand-in"

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor]:
        import simplejpeg

        return [torch.from_numpy(simplejpeg.decode_jpeg(d.numpy(), colorspace="RGB")).permute(2, 0, 1).contiguous()
                for d in datas]


def test_the_split_loader_records_its_share_why_and_the_phases_of_its_timed_rounds(
        tiny_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """cuda-stoker-auto where a GPU decoder works (a CPU stand-in here, half of each batch given to it): the
    result carries the split and the GPU path's seconds per phase in the timed rounds, not the warm-up's."""
    from dataclasses import replace

    made: list[object] = []
    real = bench_gpu._stoker_loader

    def with_stand_in(packed: str, batch_size: int, **options: object) -> object:
        options["device"] = replace(options["device"], gpu_decoder=_StandInDecoder(), gpu_share=0.5)
        made.append(real(packed, batch_size, **options))
        return made[-1]

    monkeypatch.setattr(bench_gpu, "_stoker_loader", with_stand_in)
    caplog.set_level("INFO", logger="stoker.bench")
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, device="cpu",
                       pipelines=("cuda-baseline", "cuda-stoker-auto"), steps=2)
    auto = _check_ran(result.get("cuda-stoker-auto"))
    assert auto.gpu_share == 0.5 and auto.gpu_split.startswith("fixed: 50% of each batch's JPEGs on the GPU")
    (loader,) = made
    total = loader.stats.gpu_phases   # since the loader was made: warm-up round and timed round
    assert set(auto.gpu_phases) == set(total) and auto.gpu_phases["decode_s"] > 0
    assert auto.gpu_phases["resample_s"] > 0 and loader.stats.gpu_decoded > 0
    assert all(0 <= auto.gpu_phases[k] <= total[k] + 1e-6 for k in total)
    assert auto.gpu_phases["decode_s"] < total["decode_s"]   # the warm-up round's decode is left out
    line = next(ln for ln in format_table(result).splitlines() if ln.startswith("cuda-stoker-auto: "))
    assert line.startswith(f"cuda-stoker-auto: 50% of each batch's JPEGs on the GPU ({auto.gpu_split}); seconds "
                           f"per phase over the timed rounds: ")
    assert f"decode {auto.gpu_phases['decode_s']:.2f}" in line and "none (" not in line
    assert line in caplog.text   # logged where it was measured: the pipeline's process, in a GPU session's log


def _pipe(name: str, rate: float | None, ratio_to: str | None = None) -> PipelineResult:
    if rate is None:
        return PipelineResult(name, name, skipped="not here", ratio_to=ratio_to)
    return PipelineResult(name, name, images_per_s=rate, rounds=[rate], ratio_to=ratio_to)


def test_outputs_written(cpu_run: tuple[BenchResult, Path]) -> None:
    result, out = cpu_run
    obj = json.loads((out / "bench.json").read_text())
    assert obj == json.loads(json.dumps(result.to_json()))
    assert obj["device"] == "cpu" and obj["steps"] == 2 and "targets" not in obj
    table = (out / "bench.md").read_text()
    assert table == format_table(result) + "\n"
    assert NOTE in table and "fed / synthetic" in table and "| target |" not in table
    assert "stoker-interference is the control" in table
    for p in result.pipelines:
        assert f"| {p.name} |" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_for_device_results() -> None:
    pipes = [_pipe("cuda-baseline", 5000.0), _pipe("cuda-stoker", 20000.0, "cuda-baseline"),
             _pipe("train-resnet50-synthetic", 3000.0), _pipe("train-resnet50-baseline", 1500.0,
                                                              "train-resnet50-synthetic"),
             _pipe("train-resnet50-stoker", 2970.0, "train-resnet50-synthetic"),
             _pipe("train-resnet50-stoker-gpu", 2400.0, "train-resnet50-synthetic")]
    pipes[1].ratio, pipes[3].ratio, pipes[4].ratio, pipes[5].ratio = 4.0, 0.5, 0.99, 0.8
    result = BenchResult(pipes, images=5000, batch_size=256, workers=16, rounds=3,
                         data={"images": 5000, "generated": True, "mean_width": 399, "mean_height": 349,
                               "mean_file_kb": 95.0}, baseline_transforms="x", machine=machine_info(),
                         device="cuda", models=["resnet50"], steps=100, warmup_steps=10)
    table = format_table(result)
    assert "| pipeline | fed / synthetic | images/s | vs baseline feed |" in table   # fed / synthetic first
    assert "| train-resnet50-stoker | 0.99 | 2,970 | 1.98x |" in table
    assert "| train-resnet50-stoker-gpu | 0.80 | 2,400 | 1.60x |" in table   # every loader's feed: against the baseline too
    assert "| train-resnet50-baseline | 0.50 | 1,500 | - |" in table
    assert "| train-resnet50-synthetic | - | 3,000 | - |" in table
    assert "| cuda-stoker | 20,000 | 4.00x cuda-baseline |" in table
    assert "19 steps per pass over the images" in table and "1,281,167 samples" in table


def test_device_chart_draws_reference_lines_only_when_given(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from stoker.tools.charts import device_bench_chart

    pipes = [_pipe("cuda-baseline", 5000.0), _pipe("cuda-stoker", 20000.0, "cuda-baseline"),
             _pipe("cuda-stoker-gpu", 15000.0, "cuda-baseline"),
             _pipe("train-resnet50-synthetic", 3000.0), _pipe("train-resnet50-stoker", 2970.0,
                                                              "train-resnet50-synthetic"),
             _pipe("train-resnet50-stoker-gpu", 2900.0, "train-resnet50-synthetic")]
    pipes[1].ratio, pipes[2].ratio, pipes[4].ratio, pipes[5].ratio = 4.0, 3.0, 0.99, 2900 / 3000
    result = BenchResult(pipes, images=5000, batch_size=256, workers=16, rounds=3, data={}, baseline_transforms="x",
                         machine={}, device="cuda:0", models=["resnet50"], steps=100, warmup_steps=10)
    plain, lined = tmp_path / "plain.png", tmp_path / "lined.png"
    assert device_bench_chart(result, plain)
    assert device_bench_chart(result, lined, rate_line=15_000.0, share_lines={"resnet50": 0.97})
    for png in (plain, lined):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plain.read_bytes() != lined.read_bytes()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_asked_without_cuda_says_how_to_fix(tiny_root: Path) -> None:
    with pytest.raises(ConfigError, match="sees no CUDA GPU; install a CUDA build of torch"):
        run_bench(tiny_root, device="cuda", isolate=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "cpu", "pipelines": ("cuda-baseline", "baseline")}, "belong to the CPU bench"),
    ({"device": "cpu", "pipelines": ("cuda-baseline", "train-nope-stoker")}, "unknown pipelines"),
    ({"device": "cpu", "pipelines": ("cuda-baseline",), "models": []}, "at least one"),
    ({"device": "cpu", "pipelines": ("cuda-baseline",), "models": ["no.such.module:net"]}, "cannot load"),
    ({"device": "cpu", "pipelines": ("cuda-baseline",), "models": [TINY, TINY]},
     "give each model once"),
    ({"device": "cpu", "pipelines": ("cuda-baseline",), "models": [TINY], "steps": 0}, "steps >= 1"),
    ({"steps": 5}, "device bench"),   # a CPU bench with training options
    ({"device": "tpu"}, "not a device torch understands"),
])
def test_bad_arguments(tiny_root: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        run_bench(tiny_root, isolate=False, **kwargs)


def test_too_few_images_for_a_training_batch(tiny_root: Path) -> None:
    with pytest.raises(ConfigError, match="less than one batch"):
        run_bench(tiny_root, batch_size=64, isolate=False, device="cpu", models=[TINY],
                  pipelines=("train-tiny_model-baseline",))


@pytest.mark.slow   # the CLI measures in a child process
def test_cli_device_flags(tiny_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import main

    # the isolated child imports the model by name: a model every installation has
    assert main(["bench", "--data", str(tiny_root), "--device", "cpu", "--models", "stoker.tools.train:small_cnn",
                 "--pipelines", "train-small_cnn-synthetic", "--steps", "1", "--warmup-steps", "0",
                 "--batch-size", "4", "--rounds", "1", "--workers", "1", "--out", str(tmp_path), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    [p] = obj["pipelines"]
    assert p["name"] == "train-small_cnn-synthetic" and p["images"] == 4 and p["images_per_s"] > 0
    assert obj["models"] == ["stoker.tools.train:small_cnn"] and obj["steps"] == 1


@pytest.mark.parametrize("argv, err", [
    (["--steps", "0"], "expected a positive integer, got '0'"),
    (["--warmup-steps", "-1"], "expected an integer >= 0, got '-1'"),
])
def test_cli_rejects_bad_numbers(argv: list[str], err: str, capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2 and err in capsys.readouterr().err


@pytest.mark.parametrize("argv, err", [
    (["--steps", "5"], "device bench"),
    (["--device", "cpu", "--pipelines", "cuda-baseline", "--models", ""], "at least one"),
    (["--device", "cuda:x"], "not a device torch understands"),
])
def test_cli_reports_config_errors(tiny_root: Path, tmp_path: Path, argv: list[str], err: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import main

    assert main(["bench", "--data", str(tiny_root), "--out", str(tmp_path), *argv]) == 2
    assert err in capsys.readouterr().err


def test_loader_rounds_run_on_across_passes_without_restarting_the_baseline(tiny_root: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # 60 images in batches of 16: 3 full batches a pass; rounds of 5 batches cross passes, and the
    # baseline's DataLoader epoch (as long as ImageNet-1k's) is started once, not once per pass
    from torch.utils.data import DataLoader

    starts = []
    real_iter = DataLoader.__iter__
    monkeypatch.setattr(DataLoader, "__iter__", lambda self: starts.append(1) or real_iter(self))
    run = bench_gpu.loader_epochs("cuda-baseline", root=str(tiny_root), packed="", batch_size=16, workers=1,
                                  device="cpu", steps=5)
    try:
        assert [list(run.epoch()) for _ in range(3)] == [[16] * 5] * 3
    finally:
        run.close()
    assert run.split is None   # only stoker's GPU decode feeds have a split to record
    assert len(starts) == 1
    with pytest.raises(ConfigError, match="steps must be at least 1"):
        bench_gpu.loader_epochs("cuda-baseline", root=str(tiny_root), packed="", batch_size=16, workers=1,
                                device="cpu", steps=0)


def test_the_table_flags_a_start_up_that_weighs_on_the_run() -> None:
    quick = PipelineResult("cuda-stoker", "s", images_per_s=9000.0, rounds=[9000.0], first_batch_s=0.05,
                           startup_share=0.002)
    slow = PipelineResult("cuda-baseline", "b", images_per_s=3000.0, rounds=[3000.0], first_batch_s=1.5,
                          startup_share=0.05)
    result = BenchResult([slow, quick], images=5000, batch_size=256, workers=16, rounds=3, data={},
                         baseline_transforms="", machine={}, device="cuda:0", models=[], steps=100, warmup_steps=10)
    text = "\n".join(bench_gpu.format_tables(result))
    assert "Start-up of cuda-baseline (1.50 s) is 5.0% of its timed run" in text
    assert f"--steps {bench_gpu.steps_for_startup(100, 0.05)}" in text and "Start-up of cuda-stoker " not in text
    assert bench_gpu.steps_for_startup(100, 0.05) >= 500   # 5% at 100 steps: 1% needs 5x the steps


def test_the_interference_feed_hands_out_the_resident_batch_and_drains_a_loader_batch_per_step(
        solid_root: Path, tmp_path: Path) -> None:
    import stoker

    stoker.pack(solid_root, tmp_path / "packed")
    feed = bench_gpu.open_feed("stoker-interference", root=str(solid_root), packed=str(tmp_path / "packed"),
                               batch_size=3, workers=1, device=torch.device("cpu"), training=True)
    try:
        assert feed.discarded is not None and feed.discarded() == 1   # the loader started before the first batch
        batches = [b for _, b in zip(range(20), feed.epoch())]        # 20 steps: passes of 5 batches, run on
        assert all(images is batches[0][0] for images, _ in batches)  # one resident batch, never a loader's
        assert batches[0][0].shape == (3, 3, 224, 224)
        deadline = time.monotonic() + 60
        while feed.discarded() < 21 and time.monotonic() < deadline:  # one loader batch per step, on its thread
            time.sleep(0.05)
        assert feed.discarded() == 21
    finally:
        feed.close()
