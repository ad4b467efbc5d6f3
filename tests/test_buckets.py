"""Aspect-ratio buckets (`stoker.AspectBuckets`, `Sampling(buckets=)`): every batch from one bucket, each
image resized to cover it and cropped by the native engine (the Python path's pixels, bit for bit), the
stored size and crop corner handed out, deterministic at any thread count, split over ranks, resumable
on the same and on another world size, and the hostile cases refused naming the option or sample."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import stoker
from stoker import AspectBuckets, DeviceOptions, Loader, Mix, Sampling, Workers, native
from gpu_standin import FixedRateDecoder
from stoker.buckets import assign, bucket_batches
from stoker.errors import ConfigError
from stoker.transforms import ColorJitter, CoverCrop, Normalize, RandomHorizontalFlip, Resize

SHAPES = [(64, 256), (256, 64), (128, 128), (96, 160), (160, 96), (70, 200)]
BUCKETS = AspectBuckets(area=128 * 128, multiple=32, max_ratio=4.0)


def make(root: Path, n: int = 60, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    src = root / "src"
    for i in range(n):
        h, w = SHAPES[i % len(SHAPES)]
        h, w = h + int(rng.integers(0, 24)), w + int(rng.integers(0, 24))
        y, x = np.mgrid[0:h, 0:w]
        rgb = np.stack([(x * 255 // w), (y * 255 // h), ((x + y + i * 7) % 256)], -1).astype(np.uint8)
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb).save(src / f"c{i % 3}" / f"{i:03d}.jpg", quality=90)
    stoker.pack(str(src), str(root / "ds"), progress=False)
    return root / "ds"


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make(tmp_path_factory.mktemp("buckets"))


def epoch(path: Path, **kw) -> list[tuple]:
    kw.setdefault("sampling", Sampling(buckets=BUCKETS, seed=3))
    kw.setdefault("transforms", [RandomHorizontalFlip()])
    with Loader(path, 4, **kw) as ld:
        return [(np.asarray(x).copy(), np.asarray(y).copy(), {k: np.asarray(v).copy() for k, v in e.items()})
                for x, y, e in ld]


# ---- the buckets ---------------------------------------------------------------------------------------------------

def test_the_buckets_keep_their_area_multiple_and_ratio() -> None:
    sizes = AspectBuckets().resolutions()
    assert (1024, 1024) in sizes and (832, 1216) in sizes and (1216, 832) in sizes
    for h, w in sizes:
        assert h % 64 == 0 and w % 64 == 0 and h * w <= 1024 ** 2 and max(h / w, w / h) <= 4.0
    assert {(w, h) for h, w in sizes} == set(sizes)   # each shape and its transpose
    assert [w / h for h, w in sizes] == sorted(w / h for h, w in sizes)
    assert AspectBuckets(sizes=[(64, 32), (32, 64), (64, 32)]).resolutions() == ((64, 32), (32, 64))


@pytest.mark.parametrize("kw, match", [
    ({"sizes": []}, "is empty"), ({"sizes": [(0, 5)]}, "positive ints"), ({"sizes": [(1.5, 4)]}, "positive ints"),
    ({"crop": "left"}, "crop must be"), ({"area": 100, "multiple": 64}, "holds no bucket"),
    ({"max_ratio": 0.5}, "max_ratio"), ({"multiple": 0}, "multiple must be"),
])
def test_bad_buckets_are_refused_naming_the_field(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AspectBuckets(**kw)


def test_each_sample_goes_to_the_bucket_nearest_its_aspect() -> None:
    sizes = ((256, 64), (128, 128), (64, 256))
    got = assign(np.array([300, 100, 90, 50, 120]), np.array([80, 100, 400, 160, 110]), sizes)
    assert got.tolist() == [0, 1, 2, 2, 1]
    with pytest.raises(ConfigError, match="sample 'img/7' has the stored size 0x10"):
        assign(np.array([5, 10]), np.array([5, 0]), sizes, keys=lambda i: "'img/7'")
    with pytest.raises(ConfigError, match="fit none of the 2 samples"):
        assign(np.array([10, 10]), np.array([400, 500]), ((256, 64),))


def test_an_epoch_layout_is_whole_batches_of_one_bucket_balanced_over_ranks() -> None:
    order = np.random.default_rng(0).permutation(50)
    of = (np.arange(50) % 3).astype(np.int32)
    for drop_last in (False, True):
        got = bucket_batches(order, of, 4, drop_last, 3, lambda g: np.random.default_rng(1).permutation(g))
        assert len(got) % 3 == 0 and all(len(set(of[b].tolist())) == 1 for b in got)
        seen = Counter(got.reshape(-1).tolist())
        if drop_last:
            assert max(seen.values()) == 1
        else:
            assert set(seen) == set(range(50))


# ---- the Loader ----------------------------------------------------------------------------------------------------

def test_every_batch_is_one_bucket_with_its_conditioning(pack: Path) -> None:
    with Loader(pack, 4, sampling=Sampling(buckets=BUCKETS, seed=3), transforms=[RandomHorizontalFlip()]) as ld:
        sizes = ld.plan.spec.buckets.sizes
        heights, widths = ld.dataset.heights, ld.dataset.widths
        assert ld.output_size == max(sizes, key=lambda s: s[0] * s[1]) and len(ld) == len(list(ld)) > 0
        seen: Counter = Counter()
        order = ld.epoch_indices()   # the epoch this pass reads (the one after list(ld)'s)
        for k, (x, y, extras) in enumerate(ld):
            bh, bw = x.shape[2:]
            assert (bh, bw) in sizes and x.dtype == torch.uint8 and y.shape == (4,)
            idx = order[4 * k:4 * k + 4]
            seen.update(idx.tolist())
            assert extras["original_size"].tolist() == [[int(heights[i]), int(widths[i])] for i in idx]
            top, left = extras["crop_top_left"].T.tolist()
            for i, t, l in zip(idx, top, left):   # the crop lies inside the image resized to cover the bucket
                scale = max(bh / heights[i], bw / widths[i])
                assert 0 <= t <= round(heights[i] * scale) - bh and 0 <= l <= round(widths[i] * scale) - bw
        assert set(seen) == set(range(len(ld.dataset)))   # every sample, some twice (a bucket's last batch)
        assert "cpu native" in repr(ld) or not native.engine_available()


def test_the_same_batches_at_any_thread_count_and_on_either_path(pack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one = epoch(pack, workers=Workers(num_threads=1))
    two = epoch(pack, workers=Workers(num_threads=2))
    monkeypatch.setenv("STOKER_ENGINE", "off")
    python = epoch(pack, workers=Workers(num_threads=2))
    for a, b, c in zip(one, two, python):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[0], c[0]) and np.array_equal(a[1], c[1])
        assert all(np.array_equal(a[2][k], c[2][k]) for k in a[2])
    assert len(one) == len(python)
    other = epoch(pack, sampling=Sampling(buckets=BUCKETS, seed=4))
    assert any(a[0].shape != b[0].shape or not np.array_equal(a[0], b[0]) for a, b in zip(one, other))


def test_center_crops_are_the_centre_of_the_covering_resize(pack: Path) -> None:
    buckets = AspectBuckets(area=128 * 128, multiple=32, crop="center")
    for x, _, extras in epoch(pack, sampling=Sampling(buckets=buckets), transforms=[]):
        bh, bw = x.shape[2:]
        for (h, w), (t, l) in zip(extras["original_size"].tolist(), extras["crop_top_left"].tolist()):
            scale = max(bh / h, bw / w)
            assert (t, l) == ((max(bh, round(h * scale)) - bh) // 2, (max(bw, round(w * scale)) - bw) // 2)


def test_drop_last_reads_each_sample_at_most_once(pack: Path) -> None:
    batches = epoch(pack, sampling=Sampling(buckets=BUCKETS, drop_last=True))
    with Loader(pack, 4, sampling=Sampling(buckets=BUCKETS, drop_last=True)) as ld:
        idx = ld.epoch_indices(0)
    assert len(idx) == 4 * len(batches) and len(set(idx.tolist())) == len(idx)


def test_ranks_read_disjoint_whole_batches_of_the_same_layout(pack: Path) -> None:
    ranks = [Loader(pack, 4, sampling=Sampling(buckets=BUCKETS, rank=r, world_size=2, seed=1)) for r in range(2)]
    one = Loader(pack, 4, sampling=Sampling(buckets=BUCKETS, seed=1))
    try:
        parts = [ld.epoch_indices(2).reshape(-1, 4) for ld in ranks]
        assert len(parts[0]) == len(parts[1]) == len(ranks[0])
        whole = one.epoch_indices(2).reshape(-1, 4)
        interleaved = np.stack(parts, 1).reshape(-1, 4)   # rank r takes batches r, r + 2, ...
        assert np.array_equal(interleaved[:len(whole)], whole[:len(interleaved)])
    finally:
        for ld in (*ranks, one):
            ld.close()


def _read(ld: Loader, k: int | None = None) -> list[list[int]]:
    out = []
    for b, (_, y, extras) in enumerate(ld):
        out.append(extras["original_size"].tolist())
        if k is not None and b + 1 == k:
            break
    return out


def test_a_resume_mid_epoch_gives_the_rest_of_it(pack: Path) -> None:
    make_ld = lambda: Loader(pack, 4, sampling=Sampling(buckets=BUCKETS, seed=5), columns=(), device="numpy")  # noqa: E731
    with make_ld() as ld:
        whole = [e["original_size"].tolist() + [x.shape[1:3]] for x, _, e in ld]
    with make_ld() as ld:
        it = iter(ld)
        for _ in range(3):
            next(it)
        state = ld.state_dict()
        it.close()
    with make_ld() as ld:
        ld.load_state_dict(state)
        rest = [e["original_size"].tolist() + [x.shape[1:3]] for x, _, e in ld]
    assert rest == whole[3:]
    with make_ld() as ld, pytest.raises(ConfigError, match="buckets"):
        bad = dict(state, buckets="((1, 1),)")
        ld.load_state_dict(bad)


def test_an_elastic_resume_reads_what_no_rank_had_read(pack: Path) -> None:
    def loaders(world: int) -> list[Loader]:
        return [Loader(pack, 4, sampling=Sampling(buckets=BUCKETS, rank=r, world_size=world, seed=2)) for r in range(world)]

    two = loaders(2)
    read: Counter = Counter()
    for ld in two:
        for b in ld.epoch_indices(0).reshape(-1, 4)[:2]:
            read.update(b.tolist())
        it = iter(ld)
        next(it)
        next(it)
    states = [ld.state_dict() for ld in two]
    for ld in two:
        ld.close()
    three = loaders(3)
    for ld in three:
        ld.load_state_dict(states[0])
        batches = ld.epoch_indices(0).reshape(-1, 4)
        assert all(len(set(ld.plan.spec.buckets.of[b].tolist())) == 1 for b in batches)
        read.update(batches.reshape(-1).tolist())
        assert len(batches) == len(three[0].epoch_indices(0)) // 4
        ld.close()
    assert set(read) == set(range(60))   # every sample: before the save on two ranks, or after it on three


def test_a_mix_numpy_output_and_the_device_stage_per_bucket(pack: Path, tmp_path: Path) -> None:
    other = make(tmp_path / "other", n=24, seed=9)
    mix = Mix({"a": pack, "b": other}, weights={"a": 1.0, "b": 1.0})
    with Loader(mix, 4, sampling=Sampling(buckets=BUCKETS), device="numpy") as ld:
        shapes = {x.shape[1:] for x, _, _ in ld}
        assert len(shapes) > 2 and all(isinstance(x, np.ndarray) for x, _, _ in [next(iter(ld))])
    dev = DeviceOptions("cpu", normalize="imagenet")
    with Loader(pack, 4, sampling=Sampling(buckets=BUCKETS), device=dev) as ld:
        got = [(x.shape, x.dtype) for x, _, _ in ld]
    assert {d for _, d in got} == {torch.float32} and len({s for s, _ in got}) > 2
    with Loader(pack, 4, sampling=Sampling(buckets=BUCKETS), transforms=[Normalize("imagenet")]) as ld:
        assert all(x.dtype == torch.float32 and x.shape[1] == 3 for x, _, _ in ld)


def test_worker_processes_give_the_threads_batches(pack: Path) -> None:
    threads = epoch(pack, workers=Workers(num_threads=2), device="numpy")
    for processes in (1, 2):
        got = epoch(pack, workers=Workers(num_threads=2, processes=processes), device="numpy")
        assert len(got) == len(threads)
        for a, b in zip(threads, got):
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
            assert all(np.array_equal(a[2][k], b[2][k]) for k in a[2])
    torch_out = epoch(pack, workers=Workers(num_threads=2, processes=2))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(threads, torch_out))


def test_batches_the_caller_keeps_stay_as_they_were(pack: Path) -> None:
    with Loader(pack, 4, sampling=Sampling(buckets=BUCKETS, seed=8), workers=Workers(prefetch=1)) as ld:
        kept = list(ld)
        ld.set_epoch(0)
        again = [x.clone() for x, _, _ in ld]
    assert all(torch.equal(a[0], b) for a, b in zip(kept, again))


@pytest.mark.parametrize("kw, match", [
    ({"transforms": [Resize(64)]}, "also size it"),
    ({"device": DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder())}, "aspect buckets"),
])
def test_what_buckets_cannot_do_is_refused(pack: Path, kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Loader(pack, 4, sampling=Sampling(buckets=BUCKETS), **kw)


def test_a_column_named_as_an_extra_is_refused(pack: Path, tmp_path: Path) -> None:
    src = pack.parent / "src"
    rows = ["path,label,original_size"] + [f"{p},{p.parent.name},x" for p in sorted(src.rglob("*.jpg"))]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    stoker.pack(str(tmp_path / "list.csv"), str(tmp_path / "csv"), progress=False)
    with pytest.raises(ConfigError, match="would hide the column"):
        Loader(tmp_path / "csv", 4, sampling=Sampling(buckets=BUCKETS), columns=["original_size"])


def test_a_loose_folder_and_per_sample_ops(pack: Path) -> None:
    with pytest.raises(ConfigError, match="packed dataset"):
        Loader(pack.parent / "src", 4, sampling=Sampling(buckets=BUCKETS))
    batches = epoch(pack, transforms=[RandomHorizontalFlip(), ColorJitter(0.3)])
    assert all(x.shape[2:] in BUCKETS.resolutions() for x, _, _ in batches)


def test_cover_crop_alone_is_a_planned_op() -> None:
    pipe = stoker.Pipeline([CoverCrop((32, 64), crop="center")])
    geo = pipe.plan(np.array([100, 64]), np.array([100, 256]), np.zeros((2, 2)))
    assert geo.size.tolist() == [[32, 64], [32, 64]]
    with pytest.raises(ConfigError, match="crop must be"):
        CoverCrop(32, crop="top")
