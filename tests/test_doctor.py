"""`stoker doctor`: loader alone, model step alone, both together, on a tiny dataset."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from stoker.cli import main
from stoker.doctor import DoctorReport, TrainStep, run_doctor, small_cnn
from stoker.errors import ConfigError
from stoker.packing import PackOptions, pack
from stoker.profiling import COMPUTE_BOUND, INPUT_BOUND
from stoker.synth import make_tiny_jpegs


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_jpegs(tmp_path_factory.mktemp("doctor") / "data", 48, classes=3, size=(72, 96))


@pytest.fixture(scope="module")
def packed(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("doctor") / "packed"
    pack(folder, out, options=PackOptions(workers=1), progress=False)
    return out


def test_small_cnn_trains_on_uint8_and_float_batches() -> None:
    step = TrainStep(small_cnn(3, width=4), "cpu", 3)
    step(torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8), torch.tensor([0, 2]))
    step(torch.randn(2, 3, 64, 64), torch.tensor([1, 5]))   # labels outside the classes wrap around
    step(torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8), ["a", "b"])   # non-class labels
    assert torch.isfinite(step.last_loss)


def test_doctor_on_a_pack_with_a_slow_model_step(packed: Path) -> None:
    def slow_step(images, labels) -> None:
        time.sleep(0.05)
    r = run_doctor(packed, batch_size=8, steps=3, size=32, model=slow_step, progress=False)
    assert isinstance(r, DoctorReport) and r.steps == 3 and r.verdict == COMPUTE_BOUND
    assert r.loader_images_per_s > r.step_images_per_s > 0
    assert "stoker doctor" in r.format() and "COMPUTE-BOUND" in r.format()
    assert json.loads(json.dumps(r.as_dict()))["profile"]["verdict"] == COMPUTE_BOUND


def test_doctor_with_the_builtin_model_on_a_folder(folder: Path) -> None:
    r = run_doctor(folder, batch_size=8, steps=2, size=32, transforms="val", progress=False)
    assert r.verdict in (INPUT_BOUND, COMPUTE_BOUND) and "small CNN (3 classes)" in r.model
    assert r.transforms == "val" and "loose files" in r.profile.loader


def test_steps_shrink_to_fit_a_small_dataset(packed: Path) -> None:
    r = run_doctor(packed, batch_size=16, steps=50, size=32, model=lambda x, y: None, progress=False)
    assert r.steps == 1   # 48 images: 3 batches of 16, one of them warm-up, one ends the last step


@pytest.mark.parametrize("kwargs", [{"transforms": "both"}, {"batch_size": 40}, {"model": "no_colon"},
                                    {"model": "not_a_module_xyz:f"}, {"model": 3}])
def test_bad_arguments(packed: Path, kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        run_doctor(packed, **{"size": 32, "progress": False, **kwargs})


def test_cli_doctor_json(packed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", str(packed), "--batch-size", "8", "--steps", "2", "--size", "32", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["verdict"] in (INPUT_BOUND, COMPUTE_BOUND) and obj["batch_size"] == 8
