"""`stoker bench --recipe`: each recipe's baseline and stoker pipeline run side by side, in process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.errors import ConfigError
from stoker.tools.baseline_recipes import _PILRandAugment, recipe_transform
from stoker.tools.bench import run_bench
from test_bench import _check_ran   # the tiny_root fixture is conftest's


@pytest.mark.parametrize("recipe", ["randaug", "deit"])
def test_recipe_runs_baseline_stoker_and_ceiling(tiny_root: Path, tmp_path: Path, recipe: str) -> None:  # noqa: F811
    result = run_bench(tiny_root, batch_size=16, rounds=1, workers=2, isolate=False, out_dir=tmp_path, recipe=recipe)
    assert [p.name for p in result.pipelines] == [f"baseline-{recipe}", f"stoker-{recipe}", "ceiling"]
    for p in result.pipelines:
        _check_ran(p, 64)
    stoker = result.get(f"stoker-{recipe}")
    assert stoker.ratio_to == f"baseline-{recipe}" and stoker.ratio > 0  # type: ignore[union-attr,operator]
    assert "RandAugment" in stoker.description  # type: ignore[union-attr]


def test_recipe_arguments_are_checked(tiny_root: Path) -> None:  # noqa: F811
    with pytest.raises(ConfigError, match="recipe must be one of"):
        run_bench(tiny_root, recipe="rsb")
    with pytest.raises(ConfigError, match="picks the CPU bench"):
        run_bench(tiny_root, recipe="deit", pipelines=("baseline",))


def test_baseline_recipe_transforms_give_normalized_tensors() -> None:
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (240, 300, 3), dtype=np.uint8))
    torch.manual_seed(0)
    for recipe in ("basic", "randaug", "deit"):
        t, what = recipe_transform(recipe)
        out = t(img)
        assert out.shape == (3, 224, 224) and out.dtype == torch.float32 and "torchvision" in what
    ra = _PILRandAugment()
    outs = {np.asarray(ra(img)).tobytes() for _ in range(8)}
    assert len(outs) > 1  # ops are drawn, not fixed
