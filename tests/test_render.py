"""Decode + augment on its own: a Filler over a small in-memory dataset, given a RenderSpec, writes each
sample into its row of a ring slot exactly as the reference crop, and handles failures per on_error."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from stoker.errors import SampleError
from stoker.order import replacement_index, sample_keys, uniforms
from stoker.dataset import Sample
from stoker.loading.render import Filler, RenderSpec
from stoker.loading.slots import BatchRing, Slot
from stoker.loading.stats import WorkerTimes
from stoker.transforms import CenterCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop

SIZES = [(40, 50), (36, 30), (48, 48), (30, 44), (44, 36), (32, 40)]  # (height, width), pixels


def image(k: int, h: int, w: int) -> np.ndarray:
    """A deterministic image whose every pixel is distinct enough to show a misplaced crop."""
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([(yy * 5 + k * 17) % 256, (xx * 3 + k * 29) % 256, (yy * xx + k) % 256], -1).astype(np.uint8)


def png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")  # lossless: decoded pixels equal the source
    return buf.getvalue()


class MemoryDataset:
    """The reader interface the Filler uses, over images held in memory."""

    def __init__(self, broken: frozenset[int] = frozenset()) -> None:
        self.images = [image(k, h, w) for k, (h, w) in enumerate(SIZES)]
        self.blobs = [b"not an image at all" if k in broken else png(img) for k, img in enumerate(self.images)]
        self.labels = np.arange(len(SIZES), dtype=np.int64) * 10

    def __len__(self) -> int:
        return len(self.images)

    def sample(self, i: int) -> Sample:
        h, w = SIZES[i]
        return Sample(i, f"mem/{i}.png", self.blobs[i], "png", h, w, int(self.labels[i]), "memory", i)

    def location(self, i: int) -> tuple[str, int]:
        return "memory", i

    def extra(self, i: int, name: str) -> object:
        return f"{name}-{i}"


def spec(ds: MemoryDataset, transforms: list, size: tuple[int, int], *, on_error: str = "raise",
         batch: int = 4, seed: int = 3, known_sizes: bool = True) -> RenderSpec:
    heights = np.array([h for h, _ in SIZES]) if known_sizes else None
    widths = np.array([w for _, w in SIZES]) if known_sizes else None
    return RenderSpec(batch, size, Pipeline(transforms), seed, on_error, ("note",), ds.labels, heights, widths)


def render_batch(filler: Filler, b: int, n: int, size: tuple[int, int]) -> tuple[Slot, WorkerTimes]:
    slot = BatchRing(1, filler.batch_size, size[0], size[1], label_dtype=np.dtype(np.int64),
                     pin_memory=False).slots[0]
    slot.batch, slot.size = b, n
    slot.plan = filler.prepare(b, slot)
    times, scratch = WorkerTimes(), {}
    for row in range(n):
        filler.fill(slot.plan, row, slot, scratch, times)
    return slot, times


def test_each_sample_lands_in_its_row_as_the_reference_crop() -> None:
    ds = MemoryDataset()
    indices = np.array([4, 2, 0, 5, 1, 3])
    filler = Filler(spec(ds, [CenterCrop(20), RandomHorizontalFlip(1.0)], (20, 20)), ds, 0, indices, 0)
    slot, times = render_batch(filler, 1, 2, (20, 20))  # batch 1: positions 4 and 5
    for row, idx in enumerate(indices[4:6]):
        h, w = SIZES[idx]
        top, left = round((h - 20) / 2), round((w - 20) / 2)
        want = ds.images[idx][top:top + 20, left:left + 20][:, ::-1]  # centre crop, mirrored
        assert np.array_equal(slot.images_np[row], want), f"row {row} (sample {idx})"
    assert slot.labels_np[:2].tolist() == ds.labels[indices[4:6]].tolist()
    assert slot.extras == {"note": [f"note-{i}" for i in indices[4:6]]}
    assert times.decode > 0 and times.augment > 0 and times.skipped == 0


def test_random_crops_follow_the_samples_own_draws() -> None:
    """Planned per batch, a row equals the one-sample preview with that sample's (seed, epoch, index) draws."""
    ds = MemoryDataset()
    ops = [RandomResizedCrop(16, scale=(0.3, 1.0)), RandomHorizontalFlip()]
    indices = np.arange(len(SIZES))[::-1].copy()
    filler = Filler(spec(ds, ops, (16, 16), seed=11), ds, 2, indices, 0)
    slot, _ = render_batch(filler, 0, 4, (16, 16))
    pipe = Pipeline(ops)
    for row, idx in enumerate(indices[:4]):
        key = sample_keys(11, 2, np.array([idx]))
        want = pipe.apply(ds.images[idx], uniforms(key, pipe.draws)[0], int(key[0]))
        assert np.array_equal(slot.images_np[row], want)


def test_on_error_raise_names_the_sample_and_keeps_the_cause() -> None:
    ds = MemoryDataset(broken=frozenset({2}))
    filler = Filler(spec(ds, [CenterCrop(20)], (20, 20)), ds, 0, np.arange(6), 0)
    with pytest.raises(SampleError, match=r"sample 'mem/2.png' \(shard memory, row 2, index 2\) failed") as info:
        render_batch(filler, 0, 4, (20, 20))
    err = info.value
    assert (err.key, err.index) == ("mem/2.png", 2) and err.__cause__ is not None
    assert "on_error='skip'" in str(err)


def test_on_error_skip_puts_a_deterministic_stand_in_in_the_row() -> None:
    ds = MemoryDataset(broken=frozenset({2}))
    filler = Filler(spec(ds, [CenterCrop(20)], (20, 20), on_error="skip", seed=5), ds, 1, np.arange(6), 0)
    slot, times = render_batch(filler, 0, 4, (20, 20))
    stand_in = replacement_index(5, 1, 2, 0, len(ds))  # (seed, epoch, position, attempt, n)
    if stand_in == 2:  # the first stand-in is the broken sample itself: the next attempt is used
        stand_in = replacement_index(5, 1, 2, 1, len(ds))
    h, w = SIZES[stand_in]
    top, left = round((h - 20) / 2), round((w - 20) / 2)
    assert np.array_equal(slot.images_np[2], ds.images[stand_in][top:top + 20, left:left + 20])
    assert slot.labels_np[2] == ds.labels[stand_in] and slot.extras["note"][2] == f"note-{stand_in}"
    assert times.skipped == 1 and times.skipped_keys == ["mem/2.png"]
    again, _ = render_batch(Filler(filler.spec, ds, 1, np.arange(6), 0), 0, 4, (20, 20))
    assert np.array_equal(again.images_np, slot.images_np)  # the same stand-in every time


def test_a_user_transform_that_changes_the_shape_is_refused() -> None:
    ds = MemoryDataset()

    def shrink(img: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(img[:10])

    filler = Filler(spec(ds, [CenterCrop(20), shrink], (20, 20)), ds, 0, np.arange(6), 0)
    with pytest.raises(SampleError, match=r"shrink returned an array of shape \(10, 20, 3\); the batch needs "
                                          r"\(20, 20, 3\)"):
        render_batch(filler, 0, 1, (20, 20))


def test_sizes_known_only_after_reading_must_match_the_batch() -> None:
    """Without stored sizes (loose files) each sample is planned when read; one that comes out at
    another size than the batch is an error naming both sizes."""
    ds = MemoryDataset()
    filler = Filler(spec(ds, [RandomHorizontalFlip()], (40, 50), known_sizes=False), ds, 0, np.arange(6), 0)
    slot, _ = render_batch(filler, 0, 1, (40, 50))  # sample 0 is 40x50: fits
    flip = uniforms(sample_keys(3, 0, np.array([0])), 1)[0, 0] < 0.5
    assert np.array_equal(slot.images_np[0], ds.images[0][:, ::-1] if flip else ds.images[0])
    with pytest.raises(SampleError, match=r"transforms give 36x30 for this 36x30 image, the batch is 40x50"):
        render_batch(Filler(filler.spec, ds, 0, np.array([1]), 0), 0, 1, (40, 50))


def test_a_chain_of_epochs_gives_each_batch_its_epochs_filler() -> None:
    """`EpochChain.prepare` finds the latest epoch's Filler without a search and any earlier one's by
    one (workers may still plan the last batches of an epoch once the next was added)."""
    from types import SimpleNamespace

    from stoker.loading.render import EpochChain
    from stoker.loading.route import Route

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def prepare(self, b: int, slot: object, deferred: bool) -> SimpleNamespace:
            return SimpleNamespace(b=b, filler=None)

    chain = EpochChain(SimpleNamespace(columns=(), multi_label=None, route=Route()))
    fillers = {name: Named(name) for name in "abc"}
    chain.add(fillers["a"], 0)
    assert chain.prepare(3, None).filler is fillers["a"]
    chain.add(fillers["b"], 5)
    chain.add(fillers["c"], 9)
    for g, name, b in [(0, "a", 0), (4, "a", 4), (5, "b", 0), (8, "b", 3), (9, "c", 0), (20, "c", 11), (2, "a", 2)]:
        plan = chain.prepare(g, None)
        assert plan.filler is fillers[name] and plan.b == b, g


def test_a_batchs_positions_are_its_places_in_the_epoch() -> None:
    """A batch's positions (a read-only slice of one count shared by every epoch, not an array per batch)
    are those of its rows in the epoch's list: a resumed pass's, and the last, short batch's too."""
    from stoker.loading.render import _counting

    ds = MemoryDataset()
    indices = np.array([4, 2, 0, 5, 1, 3])
    for first, b, n, want in [(0, 0, 4, [0, 1, 2, 3]), (0, 1, 2, [4, 5]), (1, 1, 1, [5])]:
        filler = Filler(spec(ds, [CenterCrop(20)], (20, 20)), ds, 0, indices, first)
        slot, _ = render_batch(filler, b, n, (20, 20))
        assert slot.plan.positions.tolist() == want and slot.plan.indices.tolist() == indices[want].tolist()
        assert not slot.plan.positions.flags.writeable
    assert _counting(3).tolist() == [0, 1, 2] and _counting(1_000)[-1] == 999
