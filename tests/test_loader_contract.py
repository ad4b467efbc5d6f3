"""The Loader's hand-off contract, one test per loop a training script writes: a batch stays valid
as long as it is held, and every iter() is a whole pass. Each image encodes its sample index in its
pixels (raw, so exact), so a test can check every image and label it was handed."""

from __future__ import annotations

import ctypes
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import stoker.loader.passes
from stoker.loader import Loader
from stoker.shards import Manifest, ShardWriter, write_manifest
from stoker.loading.slots import KEPT_WARN
from stoker.loader.options import Workers

N, CLASSES, SIDE = 300, 10, 8


def build(out: Path, n: int = N) -> Path:
    """n samples sorted by class (30 per class), image i: red = i % 256, green = i // 256, blue = label."""
    out.mkdir(parents=True)
    w = ShardWriter(out, 0, label_type="int64")
    for i in range(n):
        label = i * CLASSES // n
        img = np.empty((SIDE, SIDE, 3), np.uint8)
        img[..., 0], img[..., 1], img[..., 2] = i % 256, i // 256, label
        w.add(f"{i:04d}.raw", img.tobytes(), "raw", SIDE, SIDE, label)
    write_manifest(out, Manifest(num_samples=n, shards=[w.finish()], classes=[f"c{k}" for k in range(CLASSES)],
                                 label_type="int64"))
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("contract") / "ds")


def index_of(images: torch.Tensor) -> torch.Tensor:
    """The sample index each image of a [B, 3, H, W] batch encodes."""
    return images[:, 0, 0, 0].long() + 256 * images[:, 1, 0, 0].long()


def check(batches: list, n: int = N) -> None:
    """`batches` (held all at once) are exactly one pass: every sample once, image and label agreeing."""
    idx = torch.cat([index_of(x) for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    assert sorted(idx.tolist()) == list(range(n))
    assert torch.equal(labels, idx * CLASSES // n)
    for x, y in batches:   # every pixel of every image, not only the first
        assert x.shape[1:] == (3, SIDE, SIDE)
        assert torch.equal(x[:, 2].amin((1, 2)), y) and torch.equal(x[:, 2].amax((1, 2)), y)


def test_labels_collected_over_an_epoch_are_the_datasets(packed: Path) -> None:
    val = Loader(packed, 32, order="sequential")
    ys = [y for _, y in val]
    assert torch.bincount(torch.cat(ys)).tolist() == [30] * CLASSES
    xs = [x for x, _ in val]   # the next epoch's images, all held
    assert torch.equal(torch.cat([index_of(x) for x in xs]), torch.arange(N))


def test_list_of_the_loader_holds_distinct_correct_batches(packed: Path) -> None:
    loader = Loader(packed, 32, seed=1)
    batches = list(loader)
    assert len({x.data_ptr() for x, _ in batches}) == len(batches) == len(loader)
    check(batches)


@pytest.mark.parametrize("persistent", [False, True])   # warm threads change nothing a pass holds
def test_peek_then_loop_reads_the_whole_epoch(packed: Path, persistent: bool) -> None:
    train = Loader(packed, 32, seed=2, persistent_workers=persistent)
    peeked = next(iter(train))
    batches = list(train)
    check(batches)
    assert torch.equal(index_of(batches[0][0]), index_of(peeked[0]))   # the same epoch, from its start
    assert train.epoch == 1


@pytest.mark.parametrize("persistent", [False, True])   # warm threads change nothing a pass holds
def test_break_then_loop_reads_the_whole_epoch(packed: Path, persistent: bool) -> None:
    train = Loader(packed, 32, seed=3, persistent_workers=persistent)
    for k, _ in enumerate(train):
        if k == 3:
            break
    check(list(train))


@pytest.mark.parametrize("persistent", [False, True])   # warm threads change nothing a pass holds
def test_exception_then_loop_reads_the_whole_epoch(packed: Path, persistent: bool) -> None:
    train = Loader(packed, 32, seed=4, persistent_workers=persistent)
    with pytest.raises(ZeroDivisionError):
        for k, _ in enumerate(train):
            if k == 2:
                1 / 0
    check(list(train))


def test_a_pass_inside_a_pass_leaves_the_outer_loop_whole(packed: Path) -> None:
    loader = Loader(packed, 32, seed=5)
    outer, inner = [], []
    for x, y in loader:
        outer.append((x, y))
        inner.append(next(iter(loader)))   # its own pass, beside the running one
    check(outer)
    # each peek: the first batch of epoch 0 (the last one came after the outer pass completed epoch 0)
    assert len({index_of(x)[0].item() for x, _ in inner[:-1]}) == 1
    assert torch.equal(inner[0][0], outer[0][0]) and loader.epoch == 1


def test_two_threads_each_get_a_whole_pass(packed: Path) -> None:
    loader = Loader(packed, 32, seed=6, workers=2)
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def read(k: int) -> None:
        try:
            got[k] = list(loader)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(got) == 2
    check(got[0]), check(got[1])


def test_a_lightning_style_sanity_check_then_a_whole_validation_epoch(packed: Path) -> None:
    """Lightning's sanity check reads a few val batches through an iterator it keeps until the next
    run; the first real validation epoch must still see every sample."""
    val = Loader(packed, 32, order="sequential")
    sanity = iter(val)
    first = [next(sanity) for _ in range(2)]
    epoch = list(val)          # `sanity` still referenced
    check(epoch)
    del sanity
    check(list(val))
    assert torch.equal(index_of(first[0][0]), torch.arange(32))


def test_lightning_sanity_check_on_a_val_loader(packed: Path) -> None:
    from torchvision_helpers import torchvision_importable

    torchvision_importable()   # Lightning imports torchvision where it is installed (on a CPU-only torch too)
    try:
        import lightning as L
    except Exception as exc:  # not installed, or built for another torch (a RuntimeError from torchvision)
        pytest.skip(f"lightning does not import here: {exc}")

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch, i):
            return (self.w * batch[0].float().mean()).sum()

        def validation_step(self, batch, i):
            self.seen.append(batch[1].clone())

        def on_validation_epoch_start(self) -> None:
            self.seen = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, num_sanity_val_steps=2, accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, Loader(packed, 32, seed=7), Loader(packed, 32, order="sequential"))
    assert torch.bincount(torch.cat(model.seen)).tolist() == [30] * CLASSES


def test_a_kept_batch_is_bit_for_bit_the_same_after_three_more_epochs(packed: Path) -> None:
    loader = Loader(packed, 32, seed=8)
    kept_x, kept_y = next(iter(loader))
    view = kept_x[3:5].permute(0, 2, 3, 1)   # a view keeps the memory too, not only the tensor handed out
    snapshot = kept_x.clone(), kept_y.clone(), view.clone()
    del kept_x
    for _ in range(3):
        check(list(loader))
    assert torch.equal(kept_y, snapshot[1]) and torch.equal(view, snapshot[2])


def test_the_common_loop_allocates_nothing_after_its_first_pass(packed: Path) -> None:
    loader = Loader(packed, 16, seed=9, workers=Workers(prefetch=3))
    for _ in loader:
        pass
    first = loader.stats.slots_allocated
    for _ in range(3):
        for x, y in loader:
            y = y + 1   # a step that keeps nothing
    assert first == loader.stats.slots_allocated == 3 + 2


def test_kept_batches_cost_fresh_memory_with_one_warning(packed: Path) -> None:
    loader = Loader(packed, 4, seed=10, workers=Workers(prefetch=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
        check(batches)
        check(list(loader))
    said = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(said) == 1 and ".clone()" in str(said[0].message) and "MiB" in str(said[0].message)
    assert len(batches) > KEPT_WARN
    assert loader.stats.slots_allocated >= len(batches)   # each kept batch in memory of its own


class _LateCopy:
    """A fence for an `images.cuda(non_blocking=True)` still queued: the first query finds it pending
    (and runs `check`, if set, while the copy would still read the batch); it is done from the next."""

    what = "a late copy"
    on_gpu = True   # the GPU's work (slots.Guard)

    def __init__(self) -> None:
        self.queried = False
        self.check = None

    def done(self) -> bool:
        if self.queried:
            return True
        self.queried = True
        if self.check is not None:
            self.check()
        return False


def test_break_then_a_queued_async_copy_still_reads_its_batch(packed: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """After a `break` the iterator is dropped, not closed: the slot of the last batch must still be
    guarded by the GPU work queued on it, or the next pass overwrites pixels the copy reads."""
    fences: list[_LateCopy] = []
    monkeypatch.setattr(stoker.loader.passes, "consumer_fence", lambda: fences.append(_LateCopy()) or fences[-1])
    loader = Loader(packed, 30, seed=11, workers=Workers(num_threads=2, prefetch=1))
    for k, (x, y) in enumerate(loader):
        if k == 2:
            break
    # one fence per step after the first (batches 0 and 1), and one at the break for batch 2
    assert len(fences) == 3
    address, expected = x.data_ptr(), x.permute(0, 2, 3, 1).flatten().clone()
    del x   # the user's reference is gone; the copy queued from it is not
    seen: list[bool] = []

    def still_there() -> None:
        raw = (ctypes.c_uint8 * expected.numel()).from_address(address)
        seen.append(torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.uint8), expected))

    fences[2].check = still_there
    check(list(loader))
    assert seen and all(seen)   # each worker that needed the slot found the batch the copy reads
