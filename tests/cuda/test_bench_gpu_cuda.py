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
HAS_DALI = importable("nvidia.dali")
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
        if p.name.endswith("-dali") and not HAS_DALI:
            assert p.skipped and "pip install nvidia-dali" in p.skipped   # the optional peer: said how to get it
            continue
        assert p.skipped is None, f"{p.name}: {p.skipped}"
        assert math.isfinite(p.images_per_s) and p.images_per_s > 0, p.name
        assert p.peak_device_bytes > 0, p.name   # batches (and the model) lived in GPU memory
    loader = result.get("cuda-stoker")
    # a round is `steps` batches of a stream running on across passes: warm-up batches 0-2 of 300 images,
    # timed: 3, the partial 4 (44 images) and the next pass's 0
    assert loader is not None and loader.images == 64 + 44 + 64 and loader.ratio is not None
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


@pytest.mark.skipif(not HAS_DALI, reason="needs NVIDIA DALI: pip install nvidia-dali-cuda130")
@pytest.mark.parametrize("training", [False, True])
def test_the_dali_feed_hands_out_normalized_batches_in_gpu_memory(tmp_path: Path, training: bool) -> None:
    from stoker.tools import bench_gpu
    from stoker.tools.synth import make_tiny_jpegs

    root = make_tiny_jpegs(tmp_path / "data", 40, classes=4, size=(150, 200))
    dev = torch.device("cuda", torch.cuda.current_device())
    feed = bench_gpu.open_feed("dali", root=str(root), packed="", batch_size=16, workers=4, device=dev,
                               training=training)
    try:
        passes = [list(feed.epoch()) for _ in range(2)]   # the iterator resets itself between passes
    finally:
        feed.close()
    assert feed.version.endswith("decoders.image mixed")
    assert [len(p) for p in passes] == [2 if training else 3] * 2   # 40 = 16 + 16 + 8: the partial one dropped
    images, labels = passes[1][0]
    assert images.device == dev and labels.device == dev and images.shape == (16, 3, 224, 224)
    assert images.dtype == torch.float32 and labels.dtype == torch.int64 and labels.shape == (16,)
    assert images.is_contiguous(memory_format=torch.channels_last if training else torch.contiguous_format)
    # ImageNet-normalized RGB: (0 - 0.485) / 0.229 = -2.12 up to (1 - 0.406) / 0.225 = 2.64
    assert -2.2 < float(images.min()) < 0 < float(images.max()) < 2.7
    assert 0 <= int(labels.min()) <= int(labels.max()) < 4
