"""Clips from a video pack delivered to the GPU (skipped without one): the device stage converts
[B, T, 3, H, W] batches as B x T images, as the CPU stage does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")

import stoker  # noqa: E402
from stoker.packing import pack  # noqa: E402
from stoker.tools.synth_video import VideoStyle, make_kinetics_like  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TRAIN = [stoker.RandomResizedCrop(24), stoker.RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cuda-video")
    make_kinetics_like(root / "src", 2, classes=2, style=VideoStyle(seconds=2, fps=10, size=(40, 48)))
    pack(root / "src", root / "ds", progress=False)
    return root / "ds"


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_clips_on_the_gpu_equal_the_cpu_stage(videos: Path, memory_format: str) -> None:
    def run(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        opts = stoker.DeviceOptions(device, normalize="imagenet", memory_format=memory_format)
        with stoker.Loader(videos, 3, sampling=stoker.Sampling(clips=stoker.Clips(frames=4, stride=2)),
                           transforms=TRAIN, seed=4,
                           device=opts) as ld:
            return [(x.cpu(), y.cpu()) for x, y in ld]
    cpu, gpu = run("cpu"), run("cuda")
    assert len(gpu) == 2
    for (x, y), (rx, ry) in zip(gpu, cpu):
        assert x.shape == (3, 4, 3, 24, 24) and x.dtype == torch.float32
        torch.testing.assert_close(x, rx, atol=1e-5, rtol=0)
        assert torch.equal(y, ry)
