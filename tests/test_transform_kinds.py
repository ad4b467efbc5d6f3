"""Transforms declare what they are (`stage`, `moves_pixels`): an op stoker has never seen, defined
here and nowhere else, runs in its stage of the Pipeline and the Loader, and boxes follow it when it
says it moves no pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.errors import ConfigError
from stoker.loader import Loader
from stoker.loader.options import Targets
from stoker.packing import PackOptions, pack
from stoker.transforms import Normalize, Pipeline, Resize
from stoker.transforms.batch_ops import BatchAugment
from test_augment_coco import make_coco


class Invert:
    """A colour op per sample: one class, declared."""

    stage = "sample"
    moves_pixels = False

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        return 255 - img


class BatchInvert:
    """The same colour op on whole uint8 batches."""

    stage = "batch"
    takes = "uint8"
    moves_pixels = False

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> None:
        return None

    def apply(self, x: torch.Tensor, params: None) -> torch.Tensor:
        return 255 - x


class Shift:
    """A per-sample op that moves pixels (and says so)."""

    stage = "sample"
    moves_pixels = True

    def __call__(self, img: np.ndarray) -> np.ndarray:
        return np.roll(img, 3, axis=1)


class TopHalf:
    """Planned geometry: keep the top half of the image (no draws)."""

    stage = "plan"
    moves_pixels = True
    draws = 0

    def plan(self, state, u: np.ndarray) -> None:
        half = state.lh // 2
        zero = np.zeros(state.n, np.int64)
        state.crop(zero, zero, half, state.lw, half, state.lw)

    def fixed_size(self, size):
        return None if size is None else (size[0] // 2, size[1])


class AfterNormalize:
    """A batch op that takes the normalized float batch."""

    stage = "batch"
    takes = "float"
    moves_pixels = False

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> None:
        return None

    def apply(self, x: torch.Tensor, params: None) -> torch.Tensor:
        return x * 2


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kinds")
    out = root / "packed"
    pack(make_coco(root, n=6), out, root=root / "images", options=PackOptions(max_side=96, workers=1),
         progress=False)
    return out


def nchw(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 3, 1, 2) if x.shape[-1] == 3 and x.shape[1] != 3 else x


def epoch(loader: Loader) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    images, boxes = [], []
    for batch in loader:
        images.append(nchw(batch[0]).clone())
        boxes += [np.array(b) for b in batch[2]["boxes"]]
    return images, boxes


@pytest.mark.parametrize("op", [Invert(), BatchInvert()], ids=["per-sample", "batch"])
def test_a_colour_op_declared_in_its_class_runs_with_boxes_kept(packed: Path, op) -> None:
    plain = Loader(packed, 3, transforms=[Resize((48, 64))], targets=Targets(boxes="boxes"), seed=2, workers=1)
    inverted = Loader(packed, 3, transforms=[Resize((48, 64)), op], targets=Targets(boxes="boxes"), seed=2, workers=1)
    (x0, b0), (x1, b1) = epoch(plain), epoch(inverted)
    assert len(x1) == 2 and all(torch.equal(a, 255 - b) for a, b in zip(x0, x1))
    assert len(b1) == 6 and all(np.array_equal(a, b) for a, b in zip(b0, b1))
    assert Pipeline([Resize(8), op]).pixel_movers() == []


def test_ops_that_move_pixels_or_do_not_say_are_refused_with_boxes(packed: Path) -> None:
    with pytest.raises(ConfigError, match="Shift would move pixels"):
        Loader(packed, 3, transforms=[Resize((48, 64)), Shift()], targets=Targets(boxes="boxes"))
    def roll(img: np.ndarray) -> np.ndarray:
        return np.roll(img, 1)

    with pytest.raises(ConfigError, match="roll would move pixels.*moves_pixels = False"):   # undeclared
        Loader(packed, 3, transforms=[Resize((48, 64)), roll], targets=Targets(boxes="boxes"))
    pipe = Pipeline([Resize(8), Invert(), TopHalf()])   # planned geometry after a callable: not planned
    assert pipe.pixel_movers() == ["TopHalf"]


def test_a_declared_geometric_op_is_planned_and_fused() -> None:
    img = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    pipe = Pipeline([Resize((64, 64)), TopHalf()])
    assert pipe.prefix == pipe.ops and pipe.fixed_size == (32, 64) and pipe.output_size(300, 200) == (32, 64)
    # the fused path resamples the source's top half once; a 2x area shrink of aligned blocks is exact
    assert np.array_equal(pipe.apply(img), Pipeline([Resize((64, 64))]).apply(img)[:32])
    plan = pipe.plan(np.array([128]), np.array([100]), np.zeros((1, 1)))
    assert plan.box[0].tolist() == [0.0, 0.0, 64.0, 100.0] and plan.size[0].tolist() == [32, 64]


def test_batch_ops_declare_what_they_take() -> None:
    with pytest.raises(ConfigError, match="AfterNormalize .*put a Normalize before it"):
        BatchAugment([AfterNormalize()])
    with pytest.raises(ConfigError, match="BatchInvert works on uint8 images: put it before Normalize"):
        BatchAugment([Normalize(), BatchInvert()])
    x = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    out = BatchAugment([BatchInvert(), Normalize((0.0,) * 3, (1.0,) * 3), AfterNormalize()])(x)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros_like(out))
    assert Pipeline([BatchInvert(), Normalize()]).normalizes and not Pipeline([BatchInvert()]).normalizes


def test_an_unknown_stage_is_named() -> None:
    class Odd(Invert):
        stage = "later"

    with pytest.raises(ConfigError, match="stage='later'"):
        Pipeline([Odd()])
