"""Translated torchvision transforms and stoker's kernels against torchvision 0.28 itself: interpolation and
antialias kept, ToDtype's scaling, the policies' magnitude tables, sharpness on flat patches, and v2's
MixUp / CutMix (and RandomChoice of them) with torchvision's own lam distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stoker
from stoker.errors import ConfigError
from stoker.transforms import Pipeline, batch_ops, gpu, pixels, policy
from stoker.transforms.adapt import as_ops
from stoker.transforms.mixing import Mixup, batch_rng
from torchvision_helpers import chw, differing, hwc, v2, v2_functional
from test_torchvision_pixels import corpus_photos, ks_pvalue  # noqa: F401 (a fixture)


@pytest.mark.parametrize("interpolation", ["NEAREST", "NEAREST_EXACT", "BILINEAR", "BICUBIC"])
@pytest.mark.parametrize("antialias", [True, False])
def test_translated_resizes_keep_interpolation_and_antialias(corpus_photos: dict, interpolation: str,
                                                             antialias: bool) -> None:
    tv = v2()
    mode = getattr(tv.InterpolationMode, interpolation)
    img = corpus_photos["flower.jpg"]
    for ref in (tv.Compose([tv.Resize(200, mode, antialias=antialias), tv.CenterCrop(180)]),
                tv.Resize((120, 150), mode, antialias=antialias)):
        ops, _ = as_ops(ref)
        worst, share = differing(Pipeline(ops).apply(img), hwc(ref(chw(img))))
        assert share <= 0.001, f"{ref}: {share:.3%} of values off by more than 1 (max {worst})"
    rrc = as_ops(tv.RandomResizedCrop(64, interpolation=mode, antialias=antialias))[0][0]
    assert (rrc.interpolation, rrc.antialias) == (mode.value, antialias)


def test_filters_stoker_lacks_are_refused_not_swapped() -> None:
    tv = v2()
    for t in (tv.Resize(64, tv.InterpolationMode.LANCZOS), tv.RandomResizedCrop(64, interpolation=tv.InterpolationMode.BOX),
              tv.RandAugment(interpolation=tv.InterpolationMode.BICUBIC)):
        with pytest.raises(ConfigError, match="interpolation"):
            as_ops(t)


@pytest.mark.parametrize("scale", [False, True])
def test_to_dtype_without_scale_keeps_normalize_in_its_units(scale: bool) -> None:
    """v2.ToDtype(torch.float32) leaves 0..255 values: a Normalize written in those units must see them."""
    tv = v2()
    mean, std = ([123.7, 116.3, 103.5], [58.4, 57.1, 57.4]) if not scale else ([0.485, 0.456, 0.406],
                                                                               [0.229, 0.224, 0.225])
    ref = tv.Compose([tv.ToImage(), tv.ToDtype(torch.float32, scale=scale), tv.Normalize(mean, std)])
    _, batch = as_ops(ref)
    assert len(batch) == 1 and isinstance(batch[0], batch_ops.Normalize)
    x = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    theirs = torch.stack([ref(img) for img in x])
    assert torch.allclose(batch[0].apply(x), theirs, atol=1e-4)


def test_to_dtype_dict_form_and_convert_image_dtype() -> None:
    tv = v2()
    from torchvision import tv_tensors

    unscaled = tv.ToDtype({tv_tensors.Image: torch.float32, "others": None})
    (norm,) = as_ops([unscaled, tv.Normalize([100.0] * 3, [50.0] * 3)])[1]
    assert norm.mean == pytest.approx((100 / 255,) * 3)
    (norm,) = as_ops([unscaled, tv.ConvertImageDtype(torch.float32), tv.Normalize([0.5] * 3, [0.2] * 3)])[1]
    assert norm.mean == pytest.approx((0.5,) * 3)


@pytest.mark.parametrize("kind,cls", [("randaugment", "RandAugment"), ("trivialaugmentwide", "TrivialAugmentWide"),
                                      ("autoaugment", "AutoAugment")])
def test_policy_magnitudes_are_torchvisions_own(kind: str, cls: str) -> None:
    """Bit for bit (TrivialAugmentWide's TranslateX at bin 15 is 15.999999: a 15-pixel shift)."""
    t = getattr(v2(), cls)()
    bins, h, w = 31, 224, 200
    theirs = t._AUGMENTATION_SPACE
    ours = policy.augmentation_space(kind, bins, h, w)
    assert set(ours) == set(theirs)
    for name, (fn, signed) in theirs.items():
        mags = fn(bins, h, w)
        mine, my_signed = ours[name]
        assert my_signed == signed, name
        if mags is None or mags.ndim == 0:
            assert mine is None, name
            continue
        assert np.array_equal(np.asarray(mine, mags.numpy().dtype), mags.numpy()), (name, mine, mags)
    if kind == "trivialaugmentwide":
        img = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
        mag = float(ours["TranslateX"][0][15])
        ref = v2_functional().affine(chw(img), angle=0.0, translate=[int(mag), 0], scale=1.0, shear=[0.0, 0.0])
        assert np.array_equal(policy.apply_op(img, "TranslateX", mag), hwc(ref))


def test_sharpness_leaves_flat_patches_unchanged_as_torchvision() -> None:
    F = v2_functional()
    values = torch.arange(256, dtype=torch.uint8)
    flat = values.view(256, 1, 1, 1).expand(256, 3, 6, 6).contiguous()
    factors = np.linspace(0.0, 2.0, 41)
    for f in factors:
        theirs = F.adjust_sharpness(flat, float(f))
        assert torch.equal(theirs, flat)  # what torchvision does: nothing
        ours = np.stack([pixels.adjust_sharpness(hwc(im), float(f)) for im in flat])
        assert np.array_equal(ours, flat.permute(0, 2, 3, 1).numpy()), f"factor {f}"
        batched = gpu.adjust_sharpness(flat, torch.full((256,), float(f)))
        assert torch.equal(batched, flat), f"factor {f} (batched)"
    img = torch.randint(0, 256, (3, 20, 24), dtype=torch.uint8)
    for f in (0.1, 0.5, 1.7):
        worst, share = differing(pixels.adjust_sharpness(hwc(img), f), hwc(F.adjust_sharpness(img, f)))
        assert worst <= 1


def test_v2_mixup_and_cutmix_translate_to_stokers() -> None:
    tv = v2()
    _, (mix,) = as_ops([tv.ToImage(), tv.MixUp(alpha=0.4, num_classes=10)])
    assert mix == stoker.MixUp(0.4, num_classes=10)
    assert (mix.mixup_alpha, mix.cutmix_alpha, mix.label_smoothing) == (0.4, 0.0, 0.0)
    _, (cut,) = as_ops(tv.CutMix(alpha=1.0, num_classes=10))
    assert cut == stoker.CutMix(1.0, num_classes=10) and cut.mixup_alpha == 0.0
    _, (both,) = as_ops(tv.RandomChoice([tv.MixUp(alpha=0.8, num_classes=7),
                                               tv.CutMix(alpha=1.0, num_classes=7)], p=[1.0, 3.0]))
    assert isinstance(both, Mixup)
    assert (both.mixup_alpha, both.cutmix_alpha, both.switch_prob, both.num_classes) == (0.8, 1.0, 0.75, 7)
    with pytest.raises(ConfigError, match="num_classes"):
        as_ops(tv.MixUp(alpha=0.4))


def test_cutmix_lam_has_torchvisions_distribution() -> None:
    """The box (half-sides int(sqrt(1 - lam) / 2 * size)) and the corrected lam, against v2.CutMix itself."""
    tv = v2()
    h, w, n = 31, 47, 3000
    torch.manual_seed(0)
    cutmix = tv.CutMix(alpha=1.0, num_classes=4)
    images, labels = torch.zeros(4, 3, h, w), torch.arange(4)
    theirs = np.array([float(cutmix(images, labels)[1][0, 0]) for _ in range(n)])
    ours_op = stoker.CutMix(1.0, num_classes=4)
    ours = np.array([float(ours_op.params(batch_rng(1, 0, b), 4, h, w).lam[0]) for b in range(n)])
    assert ks_pvalue(ours, theirs) > 0.01
