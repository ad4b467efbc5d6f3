"""Targets are one protocol with one class per kind: a kind stoker has never seen (keypoints), defined
here and nowhere else, is read, placed through each sample's crop and flip, replaced with its sample
under on_error="skip" and batched, by the same Filler that renders boxes, masks and label maps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from stoker.loading.handout import batch_extras
from stoker.order import replacement_index
from stoker.loading.render import Filler
from stoker.transforms import CenterCrop, RandomHorizontalFlip
from stoker.transforms.targets import Boxes, Placement
from test_render import SIZES, MemoryDataset, render_batch, spec


@dataclass(frozen=True)
class Keypoints:
    """Points (x, y as fractions of the stored image) in the output's pixels, a batch as one tensor."""

    column: str

    def read(self, ds: Any, index: int) -> Any:
        return ds.extra(index, self.column)

    def place(self, raw: Any, ds: Any, index: int, at: Placement) -> np.ndarray:
        x = np.asarray(raw[0::2], np.float64) * at.width - at.box[1]
        y = np.asarray(raw[1::2], np.float64) * at.height - at.box[0]
        x, y = x * at.size[1] / at.box[3], y * at.size[0] / at.box[2]
        return np.stack([at.size[1] - x if at.flip else x, y], 1).astype(np.float32)

    def collate(self, rows: list[Any]) -> torch.Tensor:
        return torch.from_numpy(np.stack(rows))


class PointsDataset(MemoryDataset):
    """Each sample has two keypoints, at 40% and 60% of its width and height, and a box between them."""

    def extra(self, i: int, name: str) -> object:
        if name == "points":
            return [0.4, 0.4, 0.6, 0.6]
        return [0.4, 0.4, 0.6, 0.6] if name == "box" else super().extra(i, name)


def expected(idx: int) -> np.ndarray:
    """The two points after CenterCrop(20) and a certain flip, in output pixels."""
    h, w = SIZES[idx]
    top, left = round((h - 20) / 2), round((w - 20) / 2)
    xs, ys = np.array([0.4, 0.6]) * w - left, np.array([0.4, 0.6]) * h - top
    return np.stack([20 - xs, ys], 1).astype(np.float32)


def test_a_new_target_kind_is_one_class() -> None:
    ds = PointsDataset()
    made = replace(spec(ds, [CenterCrop(20), RandomHorizontalFlip(1.0)], (20, 20)), box_columns=("box",),
                   targets=(Keypoints("points"),))
    indices = np.array([4, 2, 0, 5, 1, 3])
    slot, _ = render_batch(Filler(made, ds, 0, indices, 0), 0, 4, (20, 20))
    extras = batch_extras(slot)
    assert list(extras) == ["note", "box", "points"]  # the spec's columns, then the targets' own
    assert extras["points"].shape == (4, 2, 2)
    for row, idx in enumerate(indices[:4]):
        assert np.allclose(extras["points"][row].numpy(), expected(idx), atol=1e-4), idx
        # boxes through the same placement: the two points are the box's corners, mirrored
        box = extras["box"][row]
        assert np.allclose(box, [[expected(idx)[1, 0], expected(idx)[0, 1], expected(idx)[0, 0],
                                  expected(idx)[1, 1]]], atol=1e-4)


def test_a_new_target_kind_follows_the_stand_in_under_skip() -> None:
    ds = PointsDataset(broken=frozenset({2}))
    made = replace(spec(ds, [CenterCrop(20), RandomHorizontalFlip(1.0)], (20, 20), on_error="skip", seed=5),
                   targets=(Keypoints("points"), Boxes("box")))
    slot, times = render_batch(Filler(made, ds, 1, np.arange(6), 0), 0, 4, (20, 20))
    stand_in = replacement_index(5, 1, 2, 0, len(ds))
    if stand_in == 2:
        stand_in = replacement_index(5, 1, 2, 1, len(ds))
    assert times.skipped == 1
    assert np.allclose(slot.extras["points"][2], expected(stand_in), atol=1e-4)
    assert slot.extras["points"].raw[2] == [0.4, 0.4, 0.6, 0.6]
