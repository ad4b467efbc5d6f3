"""Token budgets (`stoker.TokenBudget`, NaFlex): each image's grid as timm's own `get_image_size_for_seq`
computes it (timm pinned in the test-torchvision extra), its pixels as timm's ResizeToSequence + patchify
give them from the same decoded image, the patch coordinates and validity mask, resume, and the hostile
cases refused naming the option."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import stoker
from stoker import Loader, TokenBudget
from stoker.errors import ConfigError
from stoker.loading.tokens import patches, token_grid
from test_buckets import make
from torchvision_helpers import timm_data


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make(tmp_path_factory.mktemp("tokens"), n=24)


@pytest.mark.parametrize("patch, budget, ratio", [(16, 256, None), (14, 64, None), ((8, 16), 100, 1.0), (32, 9, None)])
def test_each_grid_is_timms(patch, budget, ratio) -> None:
    naflex = timm_data().naflex_transforms
    rng = np.random.default_rng(0)
    h, w = rng.integers(1, 4000, 600), rng.integers(1, 4000, 600)
    h[:50], w[50:100] = rng.integers(1, 20, 50), h[50:100] * 30
    pair = (patch, patch) if isinstance(patch, int) else patch
    th, tw = token_grid(h, w, pair, budget, ratio)
    for i in range(len(h)):
        _, want = naflex.get_image_size_for_seq((int(h[i]), int(w[i])), pair, budget, max_ratio=ratio)
        assert (int(th[i]), int(tw[i])) == want, (h[i], w[i])
        assert (th[i] // pair[0]) * (tw[i] // pair[1]) <= budget


def test_the_patches_are_timms_from_the_same_image(pack: Path) -> None:
    """stoker's batch against timm's ResizeToSequence(interpolation='bilinear') + patchify_image on the image
    as Pillow decodes it (the default decode_quality="exact" resamples torchvision's pixels)."""
    naflex = timm_data().naflex_transforms
    budget = TokenBudget(16, 48)
    with Loader(pack, 6, transforms=[budget], order="sequential") as ld:
        x, _, extras = next(iter(ld))
        for row in range(6):
            s = ld.dataset.sample(row)
            img = torch.from_numpy(np.array(Image.open(io.BytesIO(bytes(s.data))).convert("RGB")))
            resized = naflex.ResizeToSequence(16, 48, interpolation="bilinear")(img.permute(2, 0, 1))
            want, coord, valid = naflex.patchify_image(resized, (16, 16))
            n = len(want)
            got = patches(x, 16)[row]
            assert torch.equal(extras["patch_valid"][row], torch.arange(48) < n)
            assert torch.equal(extras["patch_coord"][row][:n], coord.to(torch.int64))
            diff = (got[:n].to(torch.int16) - want.to(torch.int16)).abs()
            assert int(diff.max()) <= 1 and not got[n:].any(), (row, int(diff.max()))


def test_timms_naflex_loader_and_vit_take_it_as_their_own(pack: Path) -> None:
    """The batch against what timm's own NaFlex loader (`create_naflex_loader`, its eval resize, normalized by
    its prefetcher) hands out for the same images, key by key; and a NaFlexVit's features from both the same
    (up to the 1-level pixel difference), whatever the padding holds."""
    data = timm_data()
    from timm.models.naflexvit import NaFlexVit

    theirs = data.create_naflex_loader(data.ImageDataset(str(pack.parent / "src")), patch_size=16, max_seq_len=48,
                                       batch_size=12, num_workers=0, device=torch.device("cpu"), pin_memory=False)
    want, want_labels = next(iter(theirs))
    with Loader(pack, 12, transforms=[TokenBudget(16, 48)], order="sequential",
                device=stoker.DeviceOptions("cpu", normalize="imagenet", memory_format="channels_last")) as ld:
        x, labels, extras = next(iter(ld))
        got = {"patches": patches(x, 16), "patch_coord": extras["patch_coord"], "patch_valid": extras["patch_valid"]}
        assert got["patches"].data_ptr() == x.data_ptr()   # channels_last floats: the patches are a view
        got = {k: v.clone() for k, v in got.items()}
    assert torch.equal(labels, want_labels)
    for k, v in got.items():
        assert (v.shape, v.dtype) == (want[k].shape, want[k].dtype), k
    assert torch.equal(got["patch_coord"], want["patch_coord"]) and torch.equal(got["patch_valid"], want["patch_valid"])
    level = 1 / (255 * 0.224)   # one uint8 level after ImageNet normalization (its smallest std, 0.224)
    assert float((got["patches"] - want["patches"]).abs().max()) <= 1.001 * level
    valid = got["patch_valid"]
    torch.manual_seed(0)
    vit = NaFlexVit(num_classes=0, embed_dim=32, depth=2, num_heads=2, global_pool="avg").eval()
    with torch.no_grad():
        mine, timms = vit(got), vit(want)
        junk = vit({**got, "patches": torch.where(valid[..., None], got["patches"], 7.0)})
    assert mine.shape == (12, 32)
    assert float((mine - timms).abs().max()) < 0.02 * float(timms.abs().mean())
    assert torch.equal(mine, junk)


def test_a_resume_and_the_route(pack: Path) -> None:
    make_ld = lambda: Loader(pack, 4, transforms=[TokenBudget(16, 32), stoker.RandomHorizontalFlip()], seed=3)  # noqa: E731
    with make_ld() as ld:
        assert ld.route.cpu == "python" and "token budgets" in ld.route.python[0]
        whole = [x.clone() for x, _, _ in ld]
    with make_ld() as ld:
        it = iter(ld)
        next(it)
        next(it)
        state = ld.state_dict()
        it.close()
    with make_ld() as ld:
        ld.load_state_dict(state)
        rest = [x.clone() for x, _, _ in ld]
    assert len(rest) == len(whole) - 2 and all(torch.equal(a, b) for a, b in zip(rest, whole[2:]))
    with Loader(pack, 4, transforms=[TokenBudget(16, 16)]) as other, pytest.raises(ConfigError, match="tokens"):
        other.load_state_dict(state)


@pytest.mark.parametrize("make_it, match", [
    (lambda p: TokenBudget(16, 0), "max_tokens must be at least one patch"),
    (lambda p: TokenBudget(0, 16), "patch must be a positive int"),
    (lambda p: Loader(p, 4, transforms=[stoker.RandomResizedCrop(64), TokenBudget(16, 16)]), "other ops that size"),
    (lambda p: Loader(p, 4, transforms=[TokenBudget(16, 16)], targets=stoker.Targets(pad=True)), "drop pad=True"),
    (lambda p: Loader(p.parent / "src", 4, transforms=[TokenBudget(16, 16)]), "pack the data first"),
])
def test_what_token_budgets_cannot_do_is_refused(pack: Path, make_it, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_it(pack)


@pytest.mark.parametrize("mode", ["buckets", "tokens"])
def test_doctor_and_bench_take_the_variable_resolution_modes(pack: Path, tiny_root: Path, tmp_path: Path,
                                                             mode: str) -> None:
    from stoker.tools.bench import run_bench
    from stoker.tools.doctor import run_doctor

    report = run_doctor(pack, batch_size=4, steps=3, size=64, transforms=mode, device="cpu", progress=False)
    assert report.loader_images_per_s > 0 and ("cpu python" if mode == "tokens" else "cpu") in report.route
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path,
                       pipelines=("stoker-train", f"stoker-{mode}"))
    got = result.get(f"stoker-{mode}")
    assert got is not None and got.skipped is None and got.images == 64 and got.ratio_to == "stoker-train"
