"""DataLoader habits: its keywords map to stoker's meaning or are refused naming stoker's argument,
sources stoker cannot read say how to read them, and classes= pins the labels of a split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils import data

from conftest import make_image_folder
from stoker.errors import ConfigError
from stoker.loader import Loader
from stoker.loose import open_loose
from stoker.transforms import Resize
from stoker.loader.options import Targets

SIZE = [Resize((16, 16))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("habits") / "train", n_per_class=3)


def labels_of(loader: Loader) -> list[int]:
    return torch.cat([y for _, y in loader]).tolist()


def test_samplers_map_to_stokers_sampling(folder: Path) -> None:
    n = 9
    seq = Loader(folder, 4, transforms=SIZE, sampler=data.SequentialSampler(range(n)))
    assert seq.order == "sequential" and labels_of(seq) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert Loader(folder, 4, transforms=SIZE, sampler=data.RandomSampler(range(n))).order == "random"
    with pytest.raises(ConfigError, match="pass the order once"):
        Loader(folder, 4, transforms=SIZE, order="sequential", sampler=data.RandomSampler(range(n)))
    subset = Loader(folder, 4, transforms=SIZE, sampler=data.SubsetRandomSampler([0, 1, 8]))
    assert sorted(labels_of(subset)) == [0, 0, 2] and len(subset) == 1
    weighted = Loader(folder, 4, transforms=SIZE, sampler=data.WeightedRandomSampler([0.0] * 6 + [1.0] * 3, n))
    assert labels_of(weighted) == [2] * n   # only the weighted class is drawn, with replacement
    persistent = Loader(folder, 4, transforms=SIZE, persistent_workers=True)
    assert persistent.persistent
    persistent.close()


@pytest.mark.parametrize("kwargs, names", [
    ({"sampler": data.distributed.DistributedSampler(range(9), num_replicas=2, rank=0, drop_last=True)},
     r"sampling=stoker\.Sampling\(drop_last=True\) instead"),
    ({"sampler": data.RandomSampler(range(9), replacement=True)}, "weights="),
    ({"prefetch_factor": 4}, r"workers=stoker\.Workers\(prefetch=N\)"),
    ({"generator": torch.Generator()}, "seed="),
    ({"pin_memory_device": "cuda"}, "device="),
    ({"batch_sampler": None}, r"sampling=stoker\.Sampling\(indices="),
    ({"worker_init_fn": print}, "rng="),
    ({"multiprocessing_context": "spawn"}, r"num_threads=.*Workers\(processes=1\)"),
])
def test_dataloader_keywords_stoker_has_no_use_for_name_stokers_argument(folder: Path, kwargs: dict,
                                                                         names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        Loader(folder, 4, transforms=SIZE, **kwargs)


def test_an_unknown_keyword_is_a_type_error(folder: Path) -> None:
    with pytest.raises(TypeError, match="'batchsize'.*batch_size="):
        Loader(folder, 4, transforms=SIZE, batchsize=3)


def test_torch_datasets_and_lists_of_paths_say_how_to_read_them(folder: Path) -> None:
    class Images(data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int):
            return torch.zeros(3, 8, 8), 0

    for source in (Images(), data.Subset(Images(), [0, 1])):
        with pytest.raises(ConfigError, match=r"stoker\.prefetch\(DataLoader") as info:
            Loader(source, 4)
        assert "stoker pack" in str(info.value)
    with pytest.raises(ConfigError, match="stoker pack"):
        Loader(sorted(str(p) for p in folder.rglob("*.jpg")), 4)


def test_pinned_classes_keep_labels_when_a_split_lacks_a_class(tmp_path: Path) -> None:
    classes = ["cat", "dog", "eel"]
    val = make_image_folder(tmp_path / "val", n_per_class=2, classes=("cat", "eel"))
    assert open_loose(val).class_to_idx == {"cat": 0, "eel": 1}   # the folder alone shifts eel
    loader = Loader(val, 4, transforms=SIZE, order="sequential", targets=Targets(classes=classes))
    assert labels_of(loader) == [0, 0, 2, 2]
    assert loader.class_to_idx == {"cat": 0, "dog": 1, "eel": 2} and loader.classes == classes
    with pytest.raises(ConfigError, match=r"\['eel'\] are not in the pinned list"):
        Loader(val, 4, transforms=SIZE, targets=Targets(classes=["cat", "dog"]))
    with pytest.raises(ConfigError, match="distinct class names"):
        Loader(val, 4, transforms=SIZE, targets=Targets(classes="cat"))


def test_a_distributed_sampler_is_read_and_its_set_epoch_reaches_the_loader(folder: Path) -> None:
    """DistributedSampler(num_replicas=2, rank=r) reads as Sampling(rank=r, world_size=2) (its shuffle as the
    order, a seed of its own as the seed); the script's `train_sampler.set_epoch(e)` sets the Loader's epoch
    (a resumed script that sets its start epoch only there included), a pending resume standing."""
    from stoker.loader.options import Sampling

    n = len(labels_of(Loader(folder, 4, transforms=SIZE, order="sequential")))
    for rank in (0, 1):
        sampler = data.distributed.DistributedSampler(range(n), num_replicas=2, rank=rank, seed=5)
        via = Loader(folder, 2, transforms=SIZE, sampler=sampler)
        direct = Loader(folder, 2, transforms=SIZE, sampling=Sampling(rank=rank, world_size=2, seed=5))
        assert (via.rank, via.world_size, via.order, via.seed) == (rank, 2, "random", 5)
        assert len(sampler) == len(direct.epoch_indices(0))
        sampler.set_epoch(3)   # the only call a DataLoader script makes
        assert via.epoch == 3 and sampler.epoch == 3
        direct.set_epoch(3)
        assert np.array_equal(via.epoch_indices(3), direct.epoch_indices(3))
        assert [y.tolist() for _, y in via] == [y.tolist() for _, y in direct]
        via.load_state_dict({**via.state_dict(), "epoch": 3, "sample": 2, "batch": 1})
        sampler.set_epoch(3)   # a resumed script sets its start epoch on its sampler: the resume point stands
        assert via.state_dict()["sample"] == 2
        via.close(), direct.close()
    plain = Loader(folder, 4, transforms=SIZE, sampler=data.distributed.DistributedSampler(range(n), 1, 0,
                                                                                           shuffle=False))
    assert plain.order == "sequential"
    with pytest.raises(ConfigError, match="pass the seed once"):
        Loader(folder, 4, transforms=SIZE, seed=1, sampler=data.distributed.DistributedSampler(range(n), 1, 0, seed=7))


def test_loader_sampler_answers_what_dataloader_users_read(folder: Path) -> None:
    """`loader.sampler` is what a DataLoader's sampler gives its readers: pytorch/examples' distributed
    validation reads `len(val_loader.sampler)` (this rank's samples, padded as DistributedSampler pads), a
    trainer calls `set_epoch` at every epoch start (the epoch the Loader is at stands, so a pending resume
    survives; on a restored Loader another epoch is refused with a warning, the saved position being the
    more exact word), iterating gives the epoch's indices; it never keeps a Loader alive."""
    import gc

    from stoker.loader.options import Sampling

    n = len(labels_of(Loader(folder, 4, transforms=SIZE, order="sequential")))
    for rank in (0, 1):
        ld = Loader(folder, 2, transforms=SIZE, sampling=Sampling(rank=rank, world_size=2, seed=3))
        reference = data.distributed.DistributedSampler(range(n), num_replicas=2, rank=rank)
        assert len(ld.sampler) == len(reference) == -(-n // 2)
        assert len(ld.sampler) * ld.world_size >= n   # examples' check: no sample left out of validation
        assert ld.sampler is ld.sampler
        assert list(ld.sampler) == ld.epoch_indices(0).tolist()
        ld.sampler.set_epoch(2)
        assert ld.epoch == 2 and list(ld.sampler) == ld.epoch_indices(2).tolist()
        assert [y.tolist() for _, y in ld] == [ld.dataset.labels[ld.epoch_indices(2)].tolist()[k:k + 2]
                                              for k in range(0, len(ld.sampler), 2)]
        with pytest.raises(ConfigError, match="outside epoch"):   # a refused state restores nothing (batch agrees)
            ld.load_state_dict({**ld.state_dict(), "epoch": 4, "sample": 1000, "batch": 500})
        assert not ld.restored
        ld.load_state_dict({**ld.state_dict(), "epoch": 4, "sample": 2, "batch": 1})
        ld.sampler.set_epoch(4)   # Lightning's call at the resumed epoch's start: the resume point stands
        assert ld.state_dict()["sample"] == 2
        with pytest.warns(UserWarning, match="restored stands"):   # a trainer counting epochs its own way
            ld.sampler.set_epoch(5)
        assert (ld.epoch, ld.state_dict()["sample"]) == (4, 2)
        ld.set_epoch(5)   # the Loader's own call moves it; from then on the sampler's calls do too
        ld.sampler.set_epoch(6)
        assert (ld.epoch, ld.state_dict()["sample"]) == (6, 0)
        ld.close()
    sampler = Loader(folder, 4, transforms=SIZE).sampler
    gc.collect()
    with pytest.raises(ConfigError, match="outlived its Loader"):
        len(sampler)


def test_a_mixup_collate_fn_names_stokers_batch_ops(folder: Path) -> None:
    """torchvision references' collate_fn: default_collate, then a random choice of v2.MixUp and v2.CutMix. It
    is refused naming stoker.MixUp / stoker.CutMix / stoker.Mixup, and the spelling it names loads a batch of
    soft targets."""
    import stoker
    from torchvision_helpers import v2 as import_v2

    v2 = import_v2()
    mixer = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=3), v2.CutMix(alpha=1.0, num_classes=3)])

    def collate_fn(batch):
        return mixer(*data.default_collate(batch))

    with pytest.raises(ConfigError, match=r"stoker\.MixUp\(alpha=0\.2, num_classes=N\) or stoker\.CutMix") as info:
        Loader(folder, 4, transforms=SIZE, collate_fn=collate_fn)
    assert "stoker.Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=N)" in str(info.value)
    with Loader(folder, 4, transforms=[*SIZE, stoker.Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=3)]) as ld:
        images, targets = next(iter(ld))
    assert targets.shape == (4, 3) and torch.allclose(targets.sum(1), torch.ones(4, dtype=targets.dtype))



def test_a_trailing_normalize_runs_after_the_copy_on_a_device(folder: Path) -> None:
    """A script's transforms ending in Normalize (torchvision's presets do) keep working unchanged on a GPU
    node: with a device stage the engine writes uint8 rows (a quarter of float32's bytes over PCIe), and the
    Normalize runs on the device after the copy, giving the host path's values."""
    import dataclasses

    import stoker
    from stoker.loader.passes import float_out

    tf = [Resize((16, 16)), stoker.transforms.Normalize()]
    with Loader(folder, 4, transforms=tf, order="sequential") as host, \
            Loader(folder, 4, transforms=tf, order="sequential", device=stoker.DeviceOptions("cpu")) as dev:
        for (a, ya), (b, yb) in zip(host, dev):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(ya, yb)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        cuda = dataclasses.replace(dev.device)
        object.__setattr__(cuda, "device", torch.device("cuda"))   # the options a CUDA node resolves
        assert float_out(dev.plan.spec, cuda) is None   # uint8 rows; the batch op normalizes on the device
        assert float_out(host.plan.spec, None) is not None   # on the host the engine writes the floats itself


def test_an_imagefolder_passed_where_dataloader_took_it_is_read_as_its_folder(folder: Path) -> None:
    """`DataLoader(train_dataset, ...)` becomes `stoker.Loader(train_dataset, ...)` and nothing else changes:
    an ImageFolder is read as its root with its transform and ImageFolder's labels (its class list pinned);
    what stoker would not do (a target_transform, an image loader of the user's own, the transforms twice) is
    refused naming the way, and a listing that differs from ImageFolder's is said."""
    import warnings

    from torchvision_helpers import v2

    tv = v2()
    import torchvision

    preset = tv.Compose([tv.Resize((16, 16)), tv.PILToTensor(), tv.ToDtype(torch.float32, scale=True)])
    dataset = torchvision.datasets.ImageFolder(str(folder), preset)
    ld = Loader(dataset, 4, sampler=data.SequentialSampler(dataset), num_workers=2,
                collate_fn=data.default_collate)   # what a script passes without a mixing collate_fn
    assert ld.classes == dataset.classes and len(ld.dataset) == len(dataset)
    images, labels = next(iter(ld))
    assert labels.tolist() == [dataset.targets[i] for i in range(4)]
    reference = torch.stack([dataset[i][0] for i in range(4)])
    assert images.dtype == torch.float32 and images.shape == reference.shape
    assert (images - reference).abs().max() <= 1.5 / 255   # the same pixels (within one level)
    ld.close()
    for bad, match in ((torchvision.datasets.ImageFolder(str(folder), preset, target_transform=int),
                        "target_transform"),
                       (torchvision.datasets.ImageFolder(str(folder), preset, loader=lambda p: p), "image loader")):
        with pytest.raises(ConfigError, match=match):
            Loader(bad, 4)
    with pytest.raises(ConfigError, match="given twice"):
        Loader(dataset, 4, transforms=SIZE)
    fewer = torchvision.datasets.ImageFolder(str(folder), preset, is_valid_file=lambda p: not p.endswith("000.jpg"))
    with pytest.warns(UserWarning, match=r"ImageFolder lists 6 images, stoker 9; only stoker's"):
        Loader(fewer, 4).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Loader(dataset, 4).close()   # the same listing: nothing said


def test_a_float_conversion_with_no_normalize_after_it_gives_dataloaders_floats(folder: Path) -> None:
    """`ToTensor()` alone (0..1) and `ToDtype(float32)` without scale (0..255) give the float32 batches a
    DataLoader gave, not stoker's uint8; `PILToTensor()` alone stays uint8, as torchvision's does."""
    from torchvision_helpers import v1, v2

    tv, old = v2(), v1()
    cases = ((old.Compose([old.Resize((16, 16)), old.ToTensor()]), torch.float32, 1.0),
             (tv.Compose([tv.Resize((16, 16)), tv.PILToTensor(), tv.ToDtype(torch.float32)]), torch.float32, 255.0),
             (tv.Compose([tv.Resize((16, 16)), tv.PILToTensor()]), torch.uint8, 255.0))
    with Loader(folder, 4, transforms=SIZE, order="sequential") as plain:
        reference = next(iter(plain))[0].float()
    for preset, dtype, top in cases:
        with Loader(folder, 4, transforms=preset, order="sequential") as ld:
            images, _ = next(iter(ld))
        assert images.dtype == dtype, preset
        torch.testing.assert_close(images.float(), reference * (top / 255.0), rtol=0, atol=1e-4 * top)
