"""The README's recipes run as written: the DeiT recipe (section 4) and the detection example (section 5),
with only their data paths pointed at data built here (and a stand-in model)."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import make_image_folder
from stoker.packing import PackOptions, pack
from test_augment_coco import make_coco

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(heading: str, replacements: dict[str, str]) -> str:
    """The first Python block after the README heading starting with ``heading``, paths replaced
    (each must be there: a README edit that drops one fails here, not silently)."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}")
    code = text[start:].split("```python\n", 1)[1].split("```", 1)[0]
    for old, new in replacements.items():
        assert old in code, f"README section {heading!r} no longer mentions {old!r}"
        code = code.replace(old, new)
    return code


def test_readme_deit_recipe_runs(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "train")
    pack(tmp_path / "train", tmp_path / "packed", options=PackOptions(workers=1), progress=False)
    code = snippet("### 4.", {'"/data/imagenet-packed"': repr(str(tmp_path / "packed"))})
    weights = torch.linspace(-1, 1, 3 * 1000).view(3, 1000)
    scope: dict = {"model": lambda x: x.mean(dim=(2, 3)) @ weights}
    exec(compile(code, "README.md section 4", "exec"), scope)
    images, targets, loss = scope["images"], scope["targets"], scope["loss"]
    assert images.shape == (12, 3, 224, 224) and images.dtype == torch.float32
    assert targets.shape == (12, 1000) and torch.allclose(targets.sum(1), torch.ones(12), atol=1e-4)
    assert torch.isfinite(loss)


def test_readme_detection_example_runs(tmp_path: Path) -> None:
    ann = make_coco(tmp_path)
    code = snippet("### 5.", {'"coco/annotations/instances_train2017.json"': repr(str(ann)),
                              '"coco/train2017"': repr(str(tmp_path / "images")),
                              '"coco-train-packed"': repr(str(tmp_path / "packed"))})
    scope: dict = {}
    exec(compile(code, "README.md section 5", "exec"), scope)
    images, targets = scope["images"], scope["targets"]
    assert images.shape[1:] == (512, 512, 3) and len(targets) == images.shape[0]
    for t in targets:
        k = len(t["labels"])
        assert t["boxes"].shape == (k, 4) and t["masks"].shape == (k, 512, 512) and k >= 1
