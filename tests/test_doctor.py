"""`stoker doctor`: loader alone, model step alone, both together, on a tiny dataset."""

from __future__ import annotations

import json
import logging
import time
import types
from pathlib import Path

import pytest
import torch

from stoker._progress import LOGGER_NAME
from stoker.cli import main
from stoker.errors import ConfigError
from stoker.packing import PackOptions, pack
from stoker.profiling import COMPUTE_BOUND, UNDECIDED
from stoker.tools.doctor import DoctorReport, default_device, run_doctor
from stoker.tools.synth import make_tiny_jpegs
from stoker.tools.train import TrainStep, small_cnn


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_jpegs(tmp_path_factory.mktemp("doctor") / "data", 48, classes=3, size=(72, 96))


@pytest.fixture(scope="module")
def packed(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("doctor") / "packed"
    pack(folder, out, options=PackOptions(workers=1), progress=False)
    return out


@pytest.fixture(scope="module")
def big_packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Enough images for a verdict: 104 in batches of 8 make 13 batches, 11 measured steps."""
    folder = make_tiny_jpegs(tmp_path_factory.mktemp("doctor-big") / "data", 104, classes=3, size=(48, 64))
    out = tmp_path_factory.mktemp("doctor-big") / "packed"
    pack(folder, out, options=PackOptions(workers=1), progress=False)
    return out


def test_train_step_takes_uint8_and_float_batches_and_any_labels() -> None:
    torch.manual_seed(0)
    step = TrainStep(small_cnn(3, width=4), "cpu")
    before = [p.detach().clone() for p in step.model.parameters()]
    step(torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8), torch.tensor([0, 2]))
    labels = torch.tensor([1, 5])
    step(torch.randn(2, 3, 64, 64), labels)   # labels outside the classes wrap around
    assert labels.tolist() == [1, 5]          # ... without touching the caller's tensor
    step(torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8), ["a", "b"])   # non-class labels
    assert torch.isfinite(step.last_loss)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, step.model.parameters()))   # it trained


def test_train_step_normalizes_uint8_like_the_device_stage() -> None:
    from stoker.device.stage import IMAGENET_MEAN, IMAGENET_STD

    step = TrainStep(small_cnn(3, width=4), "cpu")
    x = step.prepare(torch.full((1, 3, 2, 2), 255, dtype=torch.uint8))
    assert x.shape == (1, 3, 2, 2)
    expected = [(1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    assert torch.allclose(x[0, :, 0, 0], torch.tensor(expected))
    channels_last = TrainStep(small_cnn(3, width=4), "cpu", channels_last=True)
    assert channels_last.prepare(torch.randn(1, 3, 8, 8)).is_contiguous(memory_format=torch.channels_last)


def test_default_device_goes_through_parse_device() -> None:
    assert default_device("cpu") == "cpu"
    assert default_device(None) == ("cuda:0" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="not a device torch understands"):
        default_device("gpu0")


def test_doctor_on_a_pack_with_a_slow_model_step(big_packed: Path) -> None:
    def slow_step(images, labels) -> None:
        time.sleep(0.05)
    r = run_doctor(big_packed, batch_size=8, steps=10, size=32, model=slow_step, progress=False)
    assert isinstance(r, DoctorReport) and r.steps == 10 and r.verdict == COMPUTE_BOUND
    assert r.loader_images_per_s > r.step_images_per_s > 0
    # fed / synthetic and the interference control: a sleeping step loses (almost) nothing to the loader
    assert r.profile.synthetic_images_per_s == r.step_images_per_s
    assert r.profile.fed_ratio is not None and r.profile.fed_ratio > 0.9
    assert r.profile.interference_ratio is not None and r.profile.interference_ratio > 0.9
    text = r.format()
    assert "stoker doctor" in text and "COMPUTE-BOUND" in text and "fed / synthetic  " in text
    assert "interference     " in text and "nan" not in text.lower()
    obj = json.loads(json.dumps(r.as_dict()))
    assert obj["profile"]["verdict"] == COMPUTE_BOUND and obj["fed_ratio"] == pytest.approx(r.profile.fed_ratio)
    assert obj["interference_ratio"] == pytest.approx(r.profile.interference_ratio)


def test_doctor_measures_the_step_beside_the_running_loader(big_packed: Path) -> None:
    """The interference control runs the step while the Loader runs on another thread, its batches dropped:
    a step that is slower whenever that happens shows it in the control, not in the synthetic figure."""
    import threading

    def step(images, labels) -> None:
        beside = any(t.name == "stoker-interference-control" for t in threading.enumerate())
        time.sleep(0.1 if beside else 0.01)   # 10x: wide of a loaded machine's oversleeping
    r = run_doctor(big_packed, batch_size=8, steps=10, size=32, model=step, progress=False)
    assert r.profile.interference_ratio is not None and r.profile.interference_ratio < 0.5
    assert r.step_images_per_s > 2 * r.profile.interference_images_per_s
    assert f"interference     {r.profile.interference_ratio:.2f} of synthetic" in r.format()


def test_doctor_with_the_builtin_model_on_a_folder(folder: Path) -> None:
    r = run_doctor(folder, batch_size=8, steps=2, size=32, transforms="val", progress=False)
    assert "small CNN (3 classes)" in r.model and r.device == "cpu"
    assert r.transforms == "val" and "loose files" in r.profile.loader
    assert r.loader_images_per_s > 0 and r.step_images_per_s > 0 and r.profile.steps == 2
    # two steps make no verdict: the report says how many more it needs, and no figure reads nan
    assert r.verdict == UNDECIDED and "a verdict needs at least 10: 8 more" in r.format()
    assert "nan" not in r.format().lower()



def test_steps_shrink_to_fit_a_small_dataset(packed: Path, capsys: pytest.CaptureFixture[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    r = run_doctor(packed, batch_size=16, steps=50, size=32, model=lambda x, y: None, progress=True)
    assert r.steps == 1   # 48 images: 3 batches of 16, one of them warm-up, one ends the last step
    # off a terminal, progress is log lines (as pack's), no tqdm carriage returns in a log file
    assert "\r" not in capsys.readouterr().err
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME][-1].startswith("doctor: 7/7 batch")


@pytest.mark.parametrize("kwargs", [{"transforms": "both"}, {"batch_size": 40}, {"model": "no_colon"},
                                    {"model": "not_a_module_xyz:f"}, {"model": 3}])
def test_bad_arguments(packed: Path, kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        run_doctor(packed, **{"size": 32, "progress": False, **kwargs})


class _SleepyModel(torch.nn.Module):
    """A model whose forward takes 50 ms: the loop is compute-bound whatever the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return self.head(x.mean(dim=(2, 3)))


def sleepy_model() -> torch.nn.Module:
    return _SleepyModel()


def test_cli_doctor_json_with_a_model_by_name(big_packed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", str(big_packed), "--batch-size", "8", "--steps", "10", "--size", "32", "--json",
                 "--model", f"{__name__}:sleepy_model"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["verdict"] == COMPUTE_BOUND and obj["batch_size"] == 8
    assert obj["model"] == f"{__name__}:sleepy_model" and obj["profile"]["steps"] == 10
    assert obj["fed_ratio"] > 0.9 and obj["profile"]["min_verdict_steps"] == 10


def test_the_loaders_gpu_memory_is_its_peak_above_what_was_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The doctor reports the loader's GPU memory (DALI's GPU pipeline once halved the largest batch that
    fit): the peak of torch's allocator while the loader runs alone, above the model already there."""
    from stoker.tools import doctor

    allocated = {"now": 100, "peak": 100}
    calls: list[str] = []

    def reset(device: str) -> None:
        calls.append(f"reset {device}")
        allocated["peak"] = allocated["now"]

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)

    def loader_alone() -> float:
        allocated["peak"] = max(allocated["peak"], 100 + 4 * 38_535_168)   # four batches in flight, then freed
        return 12_000.0

    assert doctor.gpu_memory_of("cuda:1", loader_alone) == (12_000.0, 4 * 38_535_168)
    assert calls == ["reset cuda:1"]
    assert doctor.gpu_memory_of("cpu", loader_alone) == (12_000.0, None) and calls == ["reset cuda:1"]
    profile = types.SimpleNamespace(images_per_s=2_900.0, verdict="COMPUTE-BOUND", format=lambda: "",
                                    as_dict=lambda: {}, fed_ratio=None, interference_images_per_s=None,
                                    interference_ratio=None)
    report = doctor.DoctorReport("ds", "m", "cuda:1", 256, 8, 16, "train", 12_000.0, 3_000.0, profile,
                                 loader_gpu_bytes=4 * 38_535_168)
    assert "\n  loader GPU mem   154.1 MB at peak, running alone (batches in flight" in report.format()
    assert report.as_dict()["loader_gpu_bytes"] == 4 * 38_535_168
    report.loader_gpu_bytes = None   # on the CPU: no such line
    assert "loader GPU mem" not in report.format() and "loader batches" not in report.format()
    report.loader_batch_bytes = 3 * 38_535_168 + 8 * 256   # LoaderStats.device_peak_bytes
    assert "\n  loader batches   115.6 MB at peak: the device batches it built ahead" in report.format()
    assert report.as_dict()["loader_batch_bytes"] == 3 * 38_535_168 + 8 * 256


def test_cli_doctor_takes_the_decode_and_names_the_flag(big_packed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import build_parser

    assert build_parser().parse_args(["doctor", "x", "--decode", "auto"]).decode == "auto"
    assert build_parser().parse_args(["doctor", "x"]).decode == "cpu"
    assert main(["doctor", str(big_packed), "--device", "cpu", "--decode", "gpu", "--batch-size", "8",
                 "--size", "32"]) == 2
    err = capsys.readouterr().err
    assert "stoker doctor: error: decode='gpu' needs a CUDA device" in err and "--decode cpu" in err
