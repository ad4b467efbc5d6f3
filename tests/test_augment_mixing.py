"""Mixup / CutMix against timm's definitions (timm.data.mixup: written out here, and timm 1.0.31 itself where
tests/torchvision_helpers.py imports it), on CPU uint8 NHWC batches and float NCHW batches, plus determinism
and resume through a real Loader."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker.errors import ConfigError
from stoker.loader import Loader
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop
from stoker.transforms.mixing import MixParams, Mixup, batch_rng, soft_targets
from test_loader import build_packed
from torchvision_helpers import timm_data


def ks_two(a: np.ndarray, b: np.ndarray) -> float:
    grid = np.union1d(a, b)
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def timm_target(y: torch.Tensor, c: int, lam: float | torch.Tensor, smoothing: float) -> torch.Tensor:
    off = smoothing / c
    on = 1.0 - smoothing + off
    y1 = torch.full((len(y), c), off).scatter_(1, y.view(-1, 1), on)
    y2 = torch.full((len(y), c), off).scatter_(1, y.flip(0).view(-1, 1), on)
    return y1 * lam + y2 * (1.0 - lam)


def test_batch_lam_follows_beta_and_the_switch():
    m = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10)
    n = 3000
    params = [m.params(batch_rng(0, 0, b), 8, 32, 32) for b in range(n)]
    cut = np.array([p.cutmix[0] for p in params])
    assert abs(cut.mean() - 0.5) < 5 * 0.5 / math.sqrt(n)  # switch_prob = 0.5
    assert all((p.lam == p.lam[0]).all() and (p.cutmix == p.cutmix[0]).all() for p in params)  # one per batch
    mix_lams = np.array([p.lam[0] for p in params if not p.cutmix[0]])
    ref = np.random.default_rng(1).beta(0.8, 0.8, 20000)
    assert ks_two(mix_lams, ref) < 1.63 * math.sqrt(1 / len(mix_lams) + 1 / len(ref))


def _timm_box(monkeypatch: pytest.MonkeyPatch, draws: list, *args: Any, **kwargs: Any) -> tuple:
    """timm's own cutmix_bbox_and_lam, its np.random.randint calls answered from `draws` in order."""
    mixup = timm_data().mixup
    queue = list(draws)
    monkeypatch.setattr(mixup.np.random, "randint", lambda *a, **k: queue.pop(0))
    return mixup.cutmix_bbox_and_lam(*args, **kwargs)


def test_cutmix_box_and_corrected_lam_follow_timm(monkeypatch: pytest.MonkeyPatch):
    """The box of timm itself (1.0.31: the upper half of an odd side is the longer one), given the same draws."""
    m = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=10)
    h, w = 31, 47
    for b in range(200):
        rng_ours, rng_ref = batch_rng(3, 1, b), batch_rng(3, 1, b)
        p = m.params(rng_ours, 4, h, w)
        lam = float(rng_ref.beta(1.0, 1.0, 1)[0])  # Beta(1, 1), then the prob draw, then the centre
        rng_ref.random(1)
        cy, cx = int(rng_ref.integers(0, h, 1)[0]), int(rng_ref.integers(0, w, 1)[0])
        (yl, yh, xl, xh), lam_ref = _timm_box(monkeypatch, [cy, cx], (3, h, w), lam, correct_lam=True)
        assert p.cutmix.all()
        assert p.box[0].tolist() == [int(yl), int(yh), int(xl), int(xh)]
        assert p.lam[0] == pytest.approx(lam_ref)


def test_cutmix_minmax_box_follows_timm(monkeypatch: pytest.MonkeyPatch):
    m = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, cutmix_minmax=(0.2, 0.8), num_classes=10)
    h, w = 31, 47
    for b in range(200):
        rng_ours, rng_ref = batch_rng(4, 0, b), batch_rng(4, 0, b)
        p = m.params(rng_ours, 2, h, w)
        rng_ref.beta(1.0, 1.0, 1), rng_ref.random(1)
        ch = int(rng_ref.integers(int(h * 0.2), int(h * 0.8), 1)[0])
        cw = int(rng_ref.integers(int(w * 0.2), int(w * 0.8), 1)[0])
        # timm draws the corner in [0, size - cut] inclusive: our draw maps to its range
        yl = int(rng_ref.integers(0, h - ch + 1, 1)[0])
        xl = int(rng_ref.integers(0, w - cw + 1, 1)[0])
        (y0, y1, x0, x1), lam_ref = _timm_box(monkeypatch, [ch, cw, yl, xl], (3, h, w), 0.5, ratio_minmax=(0.2, 0.8))
        assert p.box[0].tolist() == [int(y0), int(y1), int(x0), int(x1)]
        assert p.lam[0] == pytest.approx(lam_ref)
    # the corner reaches the far edge, as timm's randint(0, size - cut + 1) does (the old range stopped short)
    boxes = np.array([m.params(batch_rng(5, 0, b), 2, h, w).box[0] for b in range(3000)])
    assert (boxes[:, 1] == h).any() and (boxes[:, 3] == w).any()


def test_mixup_pixels_and_targets_float_nchw():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 8, 10, generator=g)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    m = Mixup(mixup_alpha=1.0, label_smoothing=0.1, num_classes=5)
    p = MixParams(np.full(6, 0.3, np.float32), np.zeros(6, bool), np.zeros((6, 4), np.int64))
    expect = x * 0.3 + x.flip(0) * 0.7
    out, t = m.apply(x.clone(), y, p)
    assert torch.allclose(out, expect, atol=1e-6)
    assert torch.allclose(t, timm_target(y, 5, 0.3, 0.1), atol=1e-6)
    assert torch.allclose(t.sum(1), torch.ones(6))


def test_cutmix_pastes_the_partners_box_in_both_layouts():
    x = torch.randint(0, 256, (4, 12, 16, 3), dtype=torch.uint8)
    y = torch.tensor([1, 2, 3, 4])
    m = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=5)
    box = np.array([[2, 7, 3, 11]] * 4)
    lam = np.full(4, 1 - 5 * 8 / (12 * 16), np.float32)
    p = MixParams(lam, np.ones(4, bool), box)
    nhwc, t = m.apply(x.clone(), y, p)
    expect = x.clone()
    expect[:, 2:7, 3:11] = x.flip(0)[:, 2:7, 3:11]
    assert torch.equal(nhwc, expect)
    nchw, _ = m.apply(x.permute(0, 3, 1, 2).float(), y, p)
    assert torch.equal(nchw.permute(0, 2, 3, 1).to(torch.uint8), expect)
    assert torch.allclose(t, timm_target(y, 5, float(lam[0]), 0.0))


def test_elem_mode_mixes_each_sample_with_its_own_lam():
    m = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem", num_classes=3, label_smoothing=0.0)
    p = m.params(batch_rng(0, 0, 5), 64, 16, 16)
    assert len(np.unique(p.lam)) > 10 and 0 < p.cutmix.sum() < 64
    x = torch.rand(64, 3, 16, 16)
    y = torch.randint(0, 3, (64,))
    out, t = m.apply(x.clone(), y, p)
    for i in range(64):  # timm's _mix_elem loop, the reference
        j = 63 - i
        if p.cutmix[i]:
            yl, yh, xl, xh = p.box[i]
            ref = x[i].clone()
            ref[:, yl:yh, xl:xh] = x[j][:, yl:yh, xl:xh]
        else:
            ref = x[i] * float(p.lam[i]) + x[j] * (1 - float(p.lam[i]))
        assert torch.allclose(out[i], ref, atol=1e-6), i
    assert torch.allclose(t, timm_target(y, 3, torch.from_numpy(p.lam).view(-1, 1), 0.0), atol=1e-6)


def test_uint8_mixup_rounds_like_timms_collate():
    x = torch.randint(0, 256, (4, 5, 6, 3), dtype=torch.uint8)
    p = MixParams(np.full(4, 0.37, np.float32), np.zeros(4, bool), np.zeros((4, 4), np.int64))
    out, _ = Mixup(num_classes=4).apply(x.clone(), torch.arange(4), p)
    ref = np.rint(x.numpy() * np.float32(0.37) + x.flip(0).numpy().astype(np.float32) * np.float32(0.63))
    assert np.array_equal(out.numpy(), ref.astype(np.uint8))


def test_multi_hot_targets_and_bad_labels():
    t = soft_targets(torch.tensor([[1.0, 0.0, 1.0]]), 3, smoothing=0.3, multi_label=False)
    assert torch.allclose(t, torch.tensor([[0.8, 0.1, 0.8]]))
    with pytest.raises(ConfigError, match="num_classes"):
        soft_targets(torch.tensor([0, 7]), 5)
    with pytest.raises(ConfigError, match="nothing would be mixed"):
        Mixup(mixup_alpha=0.0, cutmix_alpha=0.0)


def test_multi_hot_targets_are_smoothed_toward_half_as_timm_multi_label():
    mixup = timm_data().mixup
    t = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    for lam in (1.0, 0.7):
        m = Mixup(mixup_alpha=1.0, label_smoothing=0.2, num_classes=4)
        ref = mixup.mixup_target(t, 4, lam, 0.2, multi_label=True)
        p = MixParams(np.full(2, lam, np.float32), np.zeros(2, bool), np.zeros((2, 4), np.int64))
        _, ours = m.apply(torch.zeros(2, 3, 4, 4), t, p)
        assert torch.allclose(ours, ref)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("mix") / "ds", n=40)


def test_mixing_over_a_loader_is_deterministic_and_resumes(packed: Path):
    mix = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=40)
    tf = [RandomResizedCrop(24), RandomHorizontalFlip()]

    def run(loader, stop=None):
        out = []
        for k, (x, t) in enumerate(mix.over(loader)):
            out.append((x.clone(), t.clone()))
            if stop is not None and k + 1 == stop:
                break
        return out

    full = run(Loader(packed, 8, transforms=tf, seed=3, workers=1))
    other = run(Loader(packed, 8, transforms=tf, seed=3, workers=2))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full, other))
    first = Loader(packed, 8, transforms=tf, seed=3, workers=2)
    run(first, stop=2)
    state = first.state_dict()
    resumed = Loader(packed, 8, transforms=tf, seed=3, workers=2)
    resumed.load_state_dict(state)
    rest = run(resumed)
    assert len(rest) == len(full) - 2
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[2:], rest))
    assert any(not torch.equal(a[1], full[0][1]) for a in full[1:])  # batches do differ


@pytest.mark.parametrize("mode", ["batch", "elem"])
def test_mixing_on_a_device_never_blocks_the_host(mode):
    """Per batch on the device thread: the draws go up with non-blocking copies from pinned memory, and the
    labels are not read back (their range is checked on the host, before the upload)."""
    from sync_helpers import HostSyncs

    mix = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode, num_classes=10)
    x = torch.empty((16, 3, 32, 32), device="meta")
    with HostSyncs() as syncs:
        images, targets = mix(x, torch.zeros(16, dtype=torch.int64, device="meta"), seed=1, epoch=0, batch=2)
    assert syncs.seen == [] and targets.shape == (16, 10)


def test_labels_out_of_range_are_refused_on_the_host():
    with pytest.raises(ConfigError, match=r"labels must lie in \[0, num_classes=10\), got 0..10"):
        Mixup(num_classes=10)(torch.zeros(2, 3, 4, 4), torch.tensor([0, 10]))
