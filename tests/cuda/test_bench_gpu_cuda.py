"""`stoker bench --device cuda` for real, very small: every device pipeline runs (or says why not) on a GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cuda_helpers import importable
from stoker.errors import ConfigError
from stoker.tools.bench import format_table, run_bench
from stoker.tools.bench_gpu import device_pipelines

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HAS_TORCHVISION = importable("torchvision")
MODEL = "resnet18" if HAS_TORCHVISION else "stoker.tools.train:small_cnn"
LABEL = MODEL.rpartition(":")[2]


def test_small_device_bench_completes(tmp_path: Path) -> None:
    before = torch.backends.cudnn.benchmark
    result = run_bench(None, images=300, batch_size=64, workers=4, rounds=1, out_dir=tmp_path, device="cuda",
                       models=[MODEL], steps=3, warmup_steps=1)
    assert result.device.startswith("cuda:") and result.machine["gpu"] and result.machine["cuda_version"]
    assert [p.name for p in result.pipelines] == list(device_pipelines([MODEL]))
    for p in result.pipelines:
        if p.name.endswith("stoker-gpu") and p.skipped is not None:
            assert p.skipped   # no GPU JPEG decoder installed: said why, the run went on
            continue
        assert p.skipped is None, f"{p.name}: {p.skipped}"
        assert math.isfinite(p.images_per_s) and p.images_per_s > 0, p.name
        assert p.peak_device_bytes > 0, p.name   # batches (and the model) lived in GPU memory
    loader = result.get("cuda-stoker")
    assert loader is not None and loader.images == 300 and loader.ratio is not None
    for feed in ("baseline", "stoker"):
        p = result.get(f"train-{LABEL}-{feed}")
        assert p is not None and p.images == 3 * 64 and p.ratio is not None and p.ratio > 0
        assert 0.0 <= p.data_wait <= 1.0
    table = (tmp_path / "bench.md").read_text()
    assert table == format_table(result) + "\n"
    assert json.loads((tmp_path / "bench.json").read_text())["machine"]["gpu"] == result.machine["gpu"]
    assert torch.backends.cudnn.benchmark is before   # the bench set it in its child processes only


def test_in_process_training_restores_cudnn_benchmark(tmp_path: Path) -> None:
    before = torch.backends.cudnn.benchmark
    result = run_bench(None, images=64, batch_size=32, workers=2, rounds=1, isolate=False, out_dir=tmp_path,
                       device="cuda", models=["stoker.tools.train:small_cnn"], steps=2, warmup_steps=1,
                       pipelines=("train-small_cnn-synthetic", "train-small_cnn-stoker"))
    assert torch.backends.cudnn.benchmark is before
    synthetic, fed = result.get("train-small_cnn-synthetic"), result.get("train-small_cnn-stoker")
    assert synthetic is not None and synthetic.skipped is None and synthetic.peak_device_bytes > 0
    assert fed is not None and fed.skipped is None
    assert fed.ratio == pytest.approx(fed.images_per_s / synthetic.images_per_s)


def test_a_device_index_this_machine_lacks() -> None:
    with pytest.raises(ConfigError, match="CUDA GPU"):
        run_bench(None, device=f"cuda:{torch.cuda.device_count()}", isolate=False)
