"""`stoker.Mix`: packed datasets read as one in set proportions. Labels join by class name, an
epoch's composition is counted against the weights, each batch names its samples' sources, the
batches are the same for any thread count, a state resumes mid-epoch (on another world size too),
ranks split the epoch evenly, and transforms, targets, staging and the process mode work on a mix."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from stoker.errors import ConfigError
from stoker.loader import Loader
from stoker.mix import Mix, apportion
from stoker.loader.options import Sampling, Storage, Workers
from stoker.packing import PackOptions, pack
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

from conftest import make_image_folder

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [RandomResizedCrop(16), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """web: 24 images of classes a, b; curated: 8 images of b, c (so b is shared)."""
    root = tmp_path_factory.mktemp("mix")
    web = make_image_folder(root / "web-imgs", n_per_class=12, classes=("a", "b"), seed=1)
    curated = make_image_folder(root / "cur-imgs", n_per_class=4, classes=("b", "c"), seed=2)
    pack(web, root / "web", options=PackOptions(shard_size=20_000), progress=False)
    pack(curated, root / "curated", progress=False)
    return {"web": root / "web", "curated": root / "curated"}


def _epoch(loader: Loader) -> tuple[list[int], list[str]]:
    labels, sources = [], []
    for _, y, extras in loader:
        labels += y.tolist()
        sources += list(extras["source"])
    return labels, sources


def test_apportion_is_exact_when_weights_divide() -> None:
    assert apportion(100, [3, 1]).tolist() == [75, 25]
    assert apportion(10, [1, 1, 1]).tolist() == [4, 3, 3] and apportion(7, [2, 5]).sum() == 7


def test_union_of_class_names_and_the_source_of_each_sample(packs: dict[str, Path]) -> None:
    loader = Loader(Mix(packs), 4, transforms=TRAIN, columns=["source"], workers=1)
    assert loader.classes == ["a", "b", "c"]
    ds = loader.dataset
    for i in range(len(ds)):
        s = ds.sample(i)
        name = ds.extra(i, "source")
        assert s.shard.startswith(f"{name}/") and loader.classes[s.label] == s.key.split("/")[0]
    labels, sources = _epoch(loader)
    assert Counter(sources) == {"web": 24, "curated": 8}   # no weights: sizes, each sample once
    assert sorted(labels) == sorted(ds.labels.tolist())
    loader.close()


@pytest.mark.parametrize("replacement", [False, True])
def test_an_epoch_follows_the_weights(packs: dict[str, Path], replacement: bool) -> None:
    mix = Mix(packs, weights={"web": 3, "curated": 1}, replacement=replacement, epoch_size=40)
    loader = Loader(mix, 8, transforms=TRAIN, columns=["source"], workers=2, seed=3)
    for epoch in range(2):
        loader.set_epoch(epoch)
        _, sources = _epoch(loader)
        assert Counter(sources) == {"web": 30, "curated": 10}   # 3:1 of 40, exactly
        idx = loader.epoch_indices(epoch)
        web = idx[idx < 24]
        if not replacement:   # web holds 24 and is asked for 30: one whole round, then 6 of the next
            assert len(set(web.tolist())) == 24
            counts = Counter(idx[idx >= 24].tolist())   # curated holds 8, asked for 10
            assert sorted(counts.values()) == [1] * 6 + [2] * 2
    first_half = loader.epoch_indices(0)[:20]   # shuffled together: both sources early in the epoch
    assert (first_half < 24).any() and (first_half >= 24).any()
    loader.close()


def test_proportions_within_two_percent_when_weights_do_not_divide(packs: dict[str, Path]) -> None:
    loader = Loader(Mix(packs, weights={"web": 0.7, "curated": 0.3}, epoch_size=1001, replacement=True), 7,
                    transforms=TRAIN, workers=1)
    idx = loader.epoch_indices(0)
    share = float((idx < 24).mean())
    assert abs(share - 0.7) <= 0.02 and len(idx) == 1001
    loader.close()


def test_same_batches_for_any_thread_count(packs: dict[str, Path]) -> None:
    runs = []
    for threads in (1, 3):
        loader = Loader(Mix(packs, weights={"web": 1, "curated": 1}), 5, transforms=TRAIN, columns=["source"],
                        workers=threads, seed=11)
        runs.append([(x.clone(), y.tolist(), list(e["source"])) for x, y, e in loader])
        loader.close()
    assert len(runs[0]) == len(runs[1])
    for (xa, ya, sa), (xb, yb, sb) in zip(*runs):
        assert xa.equal(xb) and ya == yb and sa == sb


def test_resume_mid_epoch_and_on_another_world_size(packs: dict[str, Path]) -> None:
    mix = Mix(packs, weights={"web": 2, "curated": 1}, epoch_size=30)
    whole = Loader(mix, 4, transforms=TRAIN, columns=["source"], workers=1, seed=5)
    expect = [y.tolist() for _, y, _ in whole]
    cut = Loader(mix, 4, transforms=TRAIN, columns=["source"], workers=1, seed=5)
    head = []
    for k, (_, y, _) in enumerate(cut):
        head.append(y.tolist())
        if k == 2:
            break
    state = cut.state_dict()
    again = Loader(mix, 4, transforms=TRAIN, columns=["source"], workers=1, seed=5)
    again.load_state_dict(state)
    assert head + [y.tolist() for _, y, _ in again] == expect
    # the same state on two ranks: the rest of the epoch, once across them
    drawn = whole.epoch_indices(0)
    ranks = [Loader(mix, 4, transforms=TRAIN, workers=1, seed=5, sampling=Sampling(rank=r, world_size=2))
             for r in range(2)]
    rest = []
    for ld in ranks:
        ld.load_state_dict(state)
        rest += ld.epoch_indices(0).tolist()
    assert Counter(rest) == Counter(drawn[12:].tolist())
    with pytest.raises(ConfigError, match="does not match"):   # another mix is another epoch
        Loader(Mix(packs, weights={"web": 1, "curated": 1}, epoch_size=30), 4, transforms=TRAIN,
               workers=1, seed=5).load_state_dict(state)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_a_mix_evenly(packs: dict[str, Path], world: int) -> None:
    mix = Mix(packs, weights={"web": 3, "curated": 1}, epoch_size=48)
    loaders = [Loader(mix, 4, transforms=TRAIN, workers=1, seed=2, sampling=Sampling(rank=r, world_size=world))
               for r in range(world)]
    parts = [ld.epoch_indices(0) for ld in loaders]
    assert len({len(p) for p in parts}) == 1 and len({len(ld) for ld in loaders}) == 1
    whole = Loader(mix, 4, transforms=TRAIN, workers=1, seed=2).epoch_indices(0)
    assert Counter(np.concatenate(parts).tolist()) - Counter(whole.tolist()) == Counter() or world == 3
    for p in parts:   # every rank's share holds both sources in about the set proportion
        assert 0.45 <= float((p < 24).mean()) <= 0.95


def test_staging_and_the_process_mode_on_a_mix(packs: dict[str, Path], tmp_path: Path) -> None:
    mix = Mix(packs, weights={"web": 1, "curated": 1}, epoch_size=16)
    plain = Loader(mix, 4, transforms=TRAIN, columns=["source"], workers=1, seed=4)
    expect = [(x.clone(), y.tolist(), list(e["source"])) for x, y, e in plain]
    staged = Loader(mix, 4, transforms=TRAIN, columns=["source"], workers=1, seed=4,
                    storage=Storage(stage=tmp_path / "shm"))
    got = [(x.clone(), y.tolist(), list(e["source"])) for x, y, e in staged]
    staged.close()
    process = Loader(mix, 4, transforms=TRAIN, columns=["source"], seed=4,
                     workers=Workers(num_threads=1, processes=1))
    got_p = [(x.clone(), y.tolist(), list(e["source"])) for x, y, e in process]
    process.close()
    for run in (got, got_p):
        assert [(y, s) for _, y, s in run] == [(y, s) for _, y, s in expect]
        assert all(a.equal(b) for (a, _, _), (b, _, _) in zip(run, expect))


def test_a_mix_is_checked(packs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="one weight per source"):
        Mix(packs, weights={"web": 1})
    with pytest.raises(ConfigError, match="positive finite number"):
        Mix(packs, weights={"web": 1, "curated": 0})
    with pytest.raises(ConfigError, match="draws each epoch from its sources"):
        Loader(Mix(packs), 4, transforms=TRAIN, sampling=Sampling(order="sequential"))


def test_loader_md_example_runs(packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = (ROOT / "docs" / "loader.md").read_text(encoding="utf-8")
    section = text[text.index("## Mixing datasets"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    (tmp_path / "packs").mkdir()
    for name, path in packs.items():
        (tmp_path / "packs" / name).symlink_to(path)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/loader.md", "exec"), scope)
    assert scope["counts"] == {"web": 24, "curated": 8}


def test_a_source_in_object_storage(packs: dict[str, Path], tmp_path: Path) -> None:
    """web from S3 (through the cache, each source in a folder of its own), curated local: the batches
    of the all-local mix."""
    pytest.importorskip("moto", reason="the S3 tests need moto: pip install 'stoker[test]'")
    from s3_helpers import S3Server, upload_pack

    server = S3Server()
    try:
        url = upload_pack(server, packs["web"], "mix")
        storage = Storage(cache_dir=tmp_path / "cache", storage_options=server.storage_options())
        mix = Mix({"web": url, "curated": str(packs["curated"])}, weights={"web": 2, "curated": 1})
        remote = Loader(mix, 4, transforms=TRAIN, columns=["source"], workers=2, seed=8, storage=storage)
        local = Loader(Mix(packs, weights={"web": 2, "curated": 1}), 4, transforms=TRAIN, columns=["source"],
                       workers=2, seed=8)
        for _ in range(2):
            got = [(x.clone(), y.tolist(), list(e["source"])) for x, y, e in remote]
            want = [(x.clone(), y.tolist(), list(e["source"])) for x, y, e in local]
            assert [(y, s) for _, y, s in got] == [(y, s) for _, y, s in want]
            assert all(a.equal(b) for (a, _, _), (b, _, _) in zip(got, want))
        assert (tmp_path / "cache" / "web").is_dir()
        remote.close()
        local.close()
    finally:
        server.stop()


@pytest.mark.parametrize("weights", [{"web": 1e308, "curated": 1e308}, {"web": 3e307, "curated": 1e307}])
def test_weights_near_the_float_limit_give_the_same_epoch_as_their_ratio(packs: dict[str, Path],
                                                                         weights: dict[str, float]) -> None:
    """Weights whose sum overflows a float: the epoch is their ratio's (it was empty, and len() and
    state_dict() raised a raw ValueError)."""
    ratio = {k: v / max(weights.values()) for k, v in weights.items()}
    big = Loader(Mix(packs, weights=weights, epoch_size=40), 8, transforms=TRAIN, columns=["source"], seed=3)
    small = Loader(Mix(packs, weights=ratio, epoch_size=40), 8, transforms=TRAIN, columns=["source"], seed=3)
    assert len(big) == len(small) == 5 and big.state_dict()["epoch"] == 0
    assert np.array_equal(big.epoch_indices(0), small.epoch_indices(0))
    assert Counter(_epoch(big)[1]) == Counter(_epoch(small)[1])
    big.close(), small.close()


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), -1.0, 0, True, "3"])
def test_a_weight_that_is_no_positive_finite_number_is_refused(packs: dict[str, Path], weight: object) -> None:
    with pytest.raises(ConfigError, match="weight of 'web' must be a positive finite number"):
        Mix(packs, weights={"web": weight, "curated": 1})


def test_numpy_numbers_are_numbers(packs: dict[str, Path]) -> None:
    """np.float32 and np.int64 weights and an np.int64 epoch_size mean what the Python numbers mean (they
    were refused as 'must be a positive number'); so do NumPy ints for Workers' counts."""
    mix = Mix(packs, weights={"web": np.float32(3.0), "curated": np.int64(1)}, epoch_size=np.int64(40))
    plain = Mix(packs, weights={"web": 3.0, "curated": 1}, epoch_size=40)
    assert mix.epoch_size == 40 and type(mix.epoch_size) is int and mix.weights == plain.weights
    a = Loader(mix, 8, transforms=TRAIN, seed=3, workers=Workers(num_threads=np.int64(2), prefetch=np.int64(2),
                                                                    timeout=np.float32(30)))
    b = Loader(plain, 8, transforms=TRAIN, seed=3, workers=np.int64(2))
    assert np.array_equal(a.epoch_indices(0), b.epoch_indices(0))
    a.close(), b.close()
