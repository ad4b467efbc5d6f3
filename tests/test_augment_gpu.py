"""Batched ops (transforms.gpu) against the per-sample ops (colour, policy, pixels; themselves checked
against torchvision's formulas in test_augment_cpu), on torch tensors on the CPU; the same code runs on CUDA
(tests/cuda repeats the comparison there when a GPU is present)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.errors import ConfigError
from stoker.loader import Loader
from stoker.transforms import RandomResizedCrop, colour, pixels, policy
from stoker.transforms import batch_ops as B
from stoker.transforms import gpu as G
from stoker.transforms.mixing import Mixup
from test_loader import build_packed
from torchvision_helpers import v2_functional

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def batch() -> np.ndarray:
    """8 images with structure and noise, [8, 33, 47, 3] uint8."""
    rng = np.random.default_rng(3)
    y, x = np.mgrid[0:33, 0:47].astype(np.float32)
    imgs = []
    for k in range(8):
        base = np.stack([120 + 100 * np.sin(x / (5 + k)), 90 + 80 * np.cos(y / 7), 60 + 50 * np.sin((x + y) / 11)], -1)
        imgs.append(np.clip(base + rng.normal(0, 15, base.shape), 0, 255).astype(np.uint8))
    imgs[5][:] = 128  # a flat image: autocontrast/equalize leave it alone
    return np.stack(imgs)


def nchw(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(b).permute(0, 3, 1, 2).contiguous().to(DEVICE)


def back(x: torch.Tensor) -> np.ndarray:
    return x.permute(0, 2, 3, 1).cpu().numpy()


def within(a: np.ndarray, b: np.ndarray, tol: int) -> None:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert d.max() <= tol, f"max difference {d.max()}"


FACTORS = np.array([0.0, 0.3, 0.7, 1.0, 1.2, 1.5, 1.9, 0.5], np.float32)


@pytest.mark.parametrize("gpu_fn,cpu_fn,tol", [(G.adjust_brightness, pixels.adjust_brightness, 0),
                                                (G.adjust_contrast, pixels.adjust_contrast, 1),
                                                (G.adjust_saturation, pixels.adjust_saturation, 1),
                                                (G.adjust_sharpness, pixels.adjust_sharpness, 1)])
def test_blends_match_per_sample(batch, gpu_fn, cpu_fn, tol):
    out = back(gpu_fn(nchw(batch), torch.from_numpy(FACTORS).to(DEVICE)))
    for k, f in enumerate(FACTORS):
        within(out[k], cpu_fn(batch[k], float(f)), tol)


@pytest.mark.parametrize("shift", [0.0, -0.5, -0.23, -0.01, 0.04, 0.37, 0.5])
def test_hue_gives_torchvisions_pixels(batch, shift):
    """Against torchvision's own adjust_hue: identical at a zero shift (the input back), and otherwise equal
    on at least 99.9% of values and never more than 1 apart (float HSV on both sides, other op orders)."""
    tv = v2_functional()
    noise = torch.from_numpy(np.random.default_rng(7).integers(0, 256, (24, 3, 33, 47), dtype=np.uint8))
    x = torch.cat([noise, torch.from_numpy(batch).permute(0, 3, 1, 2)])
    out = G.adjust_hue(x.to(DEVICE), torch.full((len(x),), shift, device=DEVICE)).cpu()
    want = torch.stack([tv.adjust_hue(img, shift) for img in x])
    if shift == 0.0:
        assert torch.equal(want, x) and torch.equal(out, x)
    diff = (out.int() - want.int()).abs()
    assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) >= 0.999, float((diff == 0).float().mean())


def test_hue_posterize_solarize_autocontrast_equalize_invert(batch):
    x = nchw(batch)
    assert torch.equal(G.adjust_hue(x, torch.zeros(8, device=DEVICE)), x)  # a zero shift changes nothing
    hues = np.linspace(-0.5, 0.45, 8).astype(np.float32)
    out = back(G.adjust_hue(x, torch.from_numpy(hues).to(DEVICE)))
    for k, f in enumerate(hues):
        within(out[k], pixels.adjust_hue(batch[k], float(f)), 1)  # the per-sample op rounds its own way (cv2)
    bits = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8], device=DEVICE)
    out = back(G.posterize(x, bits))
    thr = torch.tensor([0, 10, 100, 128, 178.5, 200, 255, 256], dtype=torch.float32, device=DEVICE)
    sol = back(G.solarize(x, thr))
    ac, eq, inv = back(G.autocontrast(x)), back(G.equalize(x)), back(G.invert(x))
    for k in range(8):
        assert np.array_equal(out[k], pixels.posterize(batch[k], int(bits[k])))
        assert np.array_equal(sol[k], pixels.solarize(batch[k], float(thr[k])))
        within(ac[k], pixels.autocontrast(batch[k]), 1)  # float32 ties at integers: torch and numpy may round apart
        assert np.array_equal(eq[k], pixels.equalize(batch[k]))
        assert np.array_equal(inv[k], pixels.invert(batch[k]))


@pytest.mark.parametrize("name", ["ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"])
def test_geometric_ops_match_per_sample(batch, name):
    mags = {"ShearX": 0.3, "ShearY": 0.25, "TranslateX": 14.6, "TranslateY": 9.0, "Rotate": 30.0}[name]
    signed = np.array([1, -1, 0.5, -0.5, 1, -1, 0.2, 0.9]) * mags
    for fill in (None, (10, 20, 30)):
        out = back(G.apply_policy_op(nchw(batch), name, signed, fill=fill))
        for k, m in enumerate(signed):
            ref = policy.apply_op(batch[k], name, float(m), fill=fill)
            assert (out[k] == ref).all(-1).mean() > 0.99, (name, m, fill)


def test_blur_and_grayscale_match_per_sample(batch):
    op = B.BatchGaussianBlur((5, 9), sigma=(0.3, 2.0))
    sig = op.params(np.random.default_rng(0), 8, 33, 47)
    out = back(op.apply(nchw(batch), sig))
    for k, s in enumerate(sig):
        within(out[k], pixels.gaussian_blur(batch[k], (5, 9), (float(s), float(s))), 1)
    g = B.BatchRandomGrayscale(p=0.5)
    mask = np.array([True, False] * 4)
    out = back(g.apply(nchw(batch), mask))
    for k in range(8):
        ref = colour.RandomGrayscale(1.0).apply(batch[k], True) if mask[k] else batch[k]
        within(out[k], ref, 1)


@pytest.mark.parametrize("op", [B.BatchRandAugment(), B.BatchTrivialAugmentWide(), B.BatchAutoAugment()])
def test_policies_match_the_per_sample_ops_they_drew(batch, op):
    big = np.concatenate([batch] * 4)
    ids, mags = op.params(np.random.default_rng(1), len(big), 33, 47)
    out = back(op.apply(nchw(big), (ids, mags)))
    close = []
    for k in range(len(big)):
        ref = big[k]
        for step in range(ids.shape[1]):
            if ids[k, step] >= 0:
                ref = policy.apply_op(ref, G.OPS[ids[k, step]], float(mags[k, step]))
        close.append((np.abs(out[k].astype(int) - ref.astype(int)) <= 1).all(-1).mean())
    # blends differ by at most 1 (rounding); an op after a blend (equalize, solarize) can move a few pixels more
    assert np.mean(close) > 0.97 and min(close) > 0.8


def test_policy_draws_follow_torchvision():
    n = 20000
    rng = np.random.default_rng(2)
    ids, mags = B.BatchRandAugment().params(rng, n, 224, 224)
    counts = np.bincount(ids.ravel(), minlength=len(G.OPS))
    used = [G.OPS.index(s) for s in policy.augmentation_space("randaugment", 31, 224, 224)]
    sd = math.sqrt(2 * n / 14)
    assert np.abs(counts[used] - 2 * n / 14).max() < 5 * sd and counts.sum() == 2 * n
    rot = mags[ids == G.OPS.index("Rotate")]
    assert set(np.round(rot, 4)) == {9.0, -9.0}
    ids, mags = B.BatchAutoAugment().params(rng, n, 224, 224)
    p_inv = np.mean((ids == G.OPS.index("Invert")).any(1))
    assert abs(p_inv - 3 * 0.6 / 25) < 5 * math.sqrt(0.072 * 0.928 / n)
    ids, mags = B.BatchTrivialAugmentWide().params(rng, n, 224, 224)
    assert abs(np.abs(mags[ids == G.OPS.index("TranslateX")]).max() - 32.0) < 1e-4


def test_colorjitter_batched_order_and_factors(batch):
    op = B.BatchColorJitter(0.4, 0.4, 0.4, 0.1)
    order, factors = op.params(np.random.default_rng(4), 8, 33, 47)
    out = back(op.apply(nchw(batch), (order, factors)))
    for k in range(8):
        ref = colour.ColorJitter(0.4, 0.4, 0.4, 0.1).apply(batch[k], (order[k], tuple(float(f) for f in factors[k])))
        assert (np.abs(out[k].astype(int) - ref.astype(int)) <= 2).mean() > 0.97  # 4 chained ops, each within 1
    n = 24000
    order, _ = op.params(np.random.default_rng(5), n, 8, 8)
    _, counts = np.unique(order, axis=0, return_counts=True)
    assert len(counts) == 24 and np.abs(counts - n / 24).max() < 5 * math.sqrt(n / 24)


def test_erasing_matches_torchvisions_distribution_and_normalize():
    op = B.RandomErasing(p=1.0)
    boxes, _ = op.params(np.random.default_rng(6), 5000, 40, 60)
    ref_rng = np.random.default_rng(7)
    ref = [colour.erasing_params(ref_rng, 40, 60, op.scale, op.ratio) for _ in range(5000)]
    ref_area = np.array([r[2] * r[3] for r in ref if r is not None])
    area = boxes[:, 2] * boxes[:, 3]
    grid = np.union1d(area, ref_area)
    ks = np.abs(np.searchsorted(np.sort(area), grid, "right") / len(area)
                - np.searchsorted(np.sort(ref_area), grid, "right") / len(ref_area)).max()
    assert ks < 1.63 * math.sqrt(2 / 5000)
    x = torch.full((2, 3, 4, 5), 255, dtype=torch.uint8)
    y = B.Normalize("imagenet").apply(x)
    assert torch.allclose(y[0, :, 0, 0], torch.tensor([(1 - m) / s for m, s in zip(B.IMAGENET_MEAN, B.IMAGENET_STD)]))
    erased = op.apply(y, (np.array([[1, 1, 2, 3], [0, 0, 0, 0]]), 0))
    assert (erased[0, :, 1:3, 1:4] == 0).all() and torch.equal(erased[1], y[1])
    with pytest.raises(ConfigError, match="after Normalize"):
        op.apply(x, (np.zeros((2, 4), np.int64), 0))
    with pytest.raises(ConfigError, match="before Normalize"):
        B.BatchRandAugment().apply(y, B.BatchRandAugment().params(np.random.default_rng(0), 2, 4, 5))


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("gpuaug") / "ds", n=30)


def test_batch_augment_over_a_loader_is_deterministic_and_resumes(packed: Path):
    aug = B.BatchAugment([B.BatchRandAugment(), B.BatchColorJitter(0.3, 0.3, 0.3, 0.05), B.Normalize(), B.RandomErasing(0.5)],
                         mix=Mixup(0.8, 1.0, num_classes=30))

    def run(loader, stop=None):
        out = []
        for k, (x, t) in enumerate(aug.over(loader)):
            out.append((x.clone(), t.clone()))
            if stop is not None and k + 1 == stop:
                break
        return out

    tf = [RandomResizedCrop(20)]
    full = run(Loader(packed, 6, transforms=tf, seed=2, workers=2))
    assert full[0][0].dtype == torch.float32 and full[0][0].shape == (6, 3, 20, 20)
    first = Loader(packed, 6, transforms=tf, seed=2, workers=1)
    run(first, stop=3)
    resumed = Loader(packed, 6, transforms=tf, seed=2, workers=1)
    resumed.load_state_dict(first.state_dict())
    rest = run(resumed)
    assert len(rest) == len(full) - 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[3:], rest))


def test_batch_ops_are_checked_for_order():
    with pytest.raises(ConfigError, match="put a Normalize before it"):
        B.BatchAugment([B.RandomErasing()])
    with pytest.raises(ConfigError, match="RandAugment works on uint8 images"):
        B.BatchAugment([B.Normalize(), B.BatchRandAugment()])
    with pytest.raises(ConfigError, match="not a batched op"):
        B.BatchAugment([colour.ColorJitter(0.4)])


def test_normalize_by_table_equals_the_tensor_path():
    """On a uint8 batch in host memory (NHWC like the Loader's slots, or NCHW), Normalize uses per-channel
    tables; its values are the float arithmetic's bit for bit, and its result is contiguous NCHW."""
    nhwc = torch.randint(0, 256, (3, 5, 7, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    for op in (B.Normalize("imagenet"), B.Normalize((0.2, 0.5, 0.9), (0.1, 0.3, 2.0))):
        std = torch.tensor(op.std, dtype=torch.float64)
        scale = (1.0 / std / 255.0).float().view(1, 3, 1, 1)
        shift = (torch.tensor(op.mean, dtype=torch.float64) / std).float().view(1, 3, 1, 1)
        tensor = nhwc.permute(0, 3, 1, 2).float().mul_(scale).add_(-shift)   # the arithmetic
        for memory in (nhwc.permute(0, 3, 1, 2), nhwc.permute(0, 3, 1, 2).contiguous()):
            table = op.apply(memory)
            assert table.is_contiguous() and table.dtype == torch.float32 and torch.equal(table, tensor)
        want = (nhwc.permute(0, 3, 1, 2).double() / 255 - torch.tensor(op.mean).view(1, 3, 1, 1)) \
            / torch.tensor(op.std).view(1, 3, 1, 1)
        assert torch.allclose(table.double(), want, atol=1e-5)


@pytest.mark.parametrize("op", [B.BatchColorJitter(0.4, 0.4, 0.4, 0.1), B.BatchRandAugment(num_ops=3), B.BatchTrivialAugmentWide(),
                                B.BatchAutoAugment(), B.BatchGaussianBlur(9), B.BatchRandomGrayscale(0.5), B.Normalize(),
                                B.RandomErasing(1.0)])
def test_batch_ops_on_a_device_never_block_the_host(op):
    """On a GPU the ops run on the device thread per batch: their parameters go up through pinned memory
    with non-blocking copies, and nothing reads device data back (`.item()`, bincount)."""
    from sync_helpers import HostSyncs

    dtype = torch.float32 if isinstance(op, B.RandomErasing) else torch.uint8
    x = torch.empty((64, 3, 48, 64), dtype=dtype, device="meta")
    params = op.params(np.random.default_rng(1), 64, 48, 64)
    with HostSyncs() as syncs:
        out = op.apply(x, params)
    assert syncs.seen == [] and out.shape == x.shape


def test_equalize_never_blocks_the_host():
    """torch.bincount reads its input's min and max back on CUDA; equalize's histogram must not (its values
    are checked against the per-sample op above)."""
    from sync_helpers import HostSyncs

    with HostSyncs() as syncs:
        G.equalize(torch.empty((4, 3, 16, 16), dtype=torch.uint8, device="meta"))
    assert syncs.seen == []
