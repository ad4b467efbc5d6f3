"""Batched augmentations on a real GPU: the same draws give the same pixels as on the CPU (within the
ulp-level float differences the CPU tests allow), and the Loader's device thread runs the batch ops
(skipped without CUDA; tests/test_augment_gpu.py runs the same code on CPU tensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.loader import Loader
from stoker.loader.options import Targets
from stoker.transforms import RandomResizedCrop, batch_ops, gpu
from stoker.transforms.mixing import Mixup
from test_loader import build_packed
from torchvision_helpers import v2_functional

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("op", [batch_ops.BatchColorJitter(0.4, 0.4, 0.4, 0.1), batch_ops.BatchRandAugment(), batch_ops.BatchTrivialAugmentWide(),
                                batch_ops.BatchAutoAugment(), batch_ops.BatchGaussianBlur(9), batch_ops.BatchRandomGrayscale(0.5)])
def test_cuda_matches_cpu(op) -> None:
    x = torch.randint(0, 256, (32, 3, 48, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    params = op.params(np.random.default_rng(1), 32, 48, 64)
    on_cpu = op.apply(x, params)
    on_gpu = op.apply(x.cuda(), params).cpu()
    close = (on_cpu.int() - on_gpu.int()).abs() <= 1
    assert close.float().mean() > 0.99


@pytest.mark.parametrize("shift", [0.0, -0.5, -0.23, 0.04, 0.37])
def test_hue_on_cuda_gives_torchvisions_pixels(shift: float) -> None:
    """The hue kernel on CUDA against torchvision's adjust_hue (on the CPU): the input back at a zero shift,
    else equal on at least 99.9% of values and never more than 1 apart."""
    tv = v2_functional()
    x = torch.randint(0, 256, (32, 3, 48, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    want = torch.stack([tv.adjust_hue(img, shift) for img in x])
    out = gpu.adjust_hue(x.cuda(), torch.full((32,), shift, device="cuda")).cpu()
    if shift == 0.0:
        assert torch.equal(want, x) and torch.equal(out, x)
    diff = (out.int() - want.int()).abs()
    assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) >= 0.999, float((diff == 0).float().mean())


def test_loader_runs_batch_ops_on_the_gpu(tmp_path: Path) -> None:
    ds = build_packed(tmp_path / "ds", n=24)
    tf = [RandomResizedCrop(32), batch_ops.BatchRandAugment(), batch_ops.Normalize(), batch_ops.RandomErasing(0.5),
          Mixup(0.8, 1.0, num_classes=24)]
    x, t = next(iter(Loader(ds, 8, transforms=tf, device="cuda")))
    assert x.is_cuda and x.dtype == torch.float32 and x.shape == (8, 3, 32, 32)
    assert t.is_cuda and t.shape == (8, 24)


def test_padded_batches_bring_their_sizes_to_the_gpu(tmp_path: Path) -> None:
    from stoker.transforms import Resize
    from test_augment_coco import make_coco
    from stoker.packing import PackOptions, pack

    ann = make_coco(tmp_path)
    pack(ann, tmp_path / "packed", root=tmp_path / "images", options=PackOptions(workers=1), progress=False)
    loader = Loader(tmp_path / "packed", 4, transforms=[Resize(64)], targets=Targets(pad=True, masks=("masks",)),
                    device="cuda")
    x, _, extras = next(iter(loader))
    assert x.is_cuda and x.shape[2:] == loader.output_size
    assert extras["sizes"].is_cuda and extras["sizes"].shape == (4, 2)
    assert [m.shape[1:] for m in extras["masks"]] == [tuple(s) for s in extras["sizes"].tolist()]
