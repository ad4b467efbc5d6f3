"""Every command in README's "Use" section runs as written, in order, on the data `stoker synth`
makes there: the shell lines through the CLI, the Python blocks in one namespace (with a stand-in
model and training step). Blocks that need CUDA (or torchvision) run only where it is present; the
detection example, which needs COCO, runs on a COCO file written here with its paths pointed at it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_augment_coco import make_coco
from test_label_maps import assert_aligned, write_dataset

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NEEDS_COCO = "coco/annotations"   # section 5 (tested below on a COCO file made here)
NEEDS_SEGMENTATION = "ade20k/train.csv"   # section 5's label maps (tested below on data made here)


def _use_section() -> list[tuple[str, str]]:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Use\n")
    section = text[start:text.index("\n## ", start + 1)]   # to the next section (the cloud one: test_remote.py)
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def _torchvision_works() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:   # where it is broken it raises RuntimeError, not ImportError
        return False
    return True


def _shell_lines() -> list[str]:
    lines = []
    for lang, body in _use_section():
        if lang == "bash":
            lines += [line.split("  #")[0].strip() for line in body.splitlines() if line.startswith("stoker ")]
    return lines


def test_the_use_section_has_what_a_newcomer_runs_first() -> None:
    commands = [line.split()[1] for line in _shell_lines()]
    assert commands[:4] == ["synth", "pack", "info", "verify"]


def test_readme_use_section_runs_as_written(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for line in _shell_lines():
        # a torchvision model runs where torchvision imports, on a GPU: a ResNet-50 step on two CPU cores
        # takes seconds, the doctor's dozens of them minutes
        if "torchvision" in line and not (_torchvision_works() and torch.cuda.is_available()):
            continue
        argv = shlex.split(line)
        done = subprocess.run([sys.executable, "-m", "stoker.cli", *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    weights = torch.linspace(-1, 1, 3 * 1000).view(3, 1000)
    namespace = {"step": lambda images, labels: None,              # the user's training step
                 "model": lambda x: x.mean(dim=(2, 3)) @ weights}   # and model (section 4)
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        for lang, body in _use_section():
            if lang != "python":
                continue
            if 'DeviceOptions("cuda"' in body and not torch.cuda.is_available():   # section 3
                continue
            if NEEDS_COCO in body or NEEDS_SEGMENTATION in body:
                continue
            namespace.setdefault("loader", namespace.get("train"))   # "keeping your own DataLoader"
            exec(compile(body, "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    assert isinstance(namespace["train"], __import__("stoker").Loader) and len(namespace["val"]) == 8
    images, targets, loss = namespace["images"], namespace["targets"], namespace["loss"]   # section 4, DeiT
    assert images.shape[1:] == (3, 224, 224) and images.dtype == torch.float32
    assert targets.shape == (images.shape[0], 1000) and torch.allclose(targets.sum(1), torch.ones(len(targets)))
    assert torch.isfinite(loss)


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


def test_readme_detection_example_runs(tmp_path: Path) -> None:
    ann = make_coco(tmp_path)
    code = snippet("### 5.", {'"coco/annotations/instances_train2017.json"': repr(str(ann)),
                              '"coco/train2017"': repr(str(tmp_path / "images")),
                              '"coco-train-packed"': repr(str(tmp_path / "packed"))})
    scope: dict = {}
    exec(compile(code, "README.md section 5", "exec"), scope)
    images, targets = scope["images"], scope["targets"]
    assert images.shape[1:] == (3, 512, 512) and len(targets) == images.shape[0]
    for t in targets:
        k = len(t["labels"])
        assert t["boxes"].shape == (k, 4) and t["masks"].shape == (k, 512, 512) and k >= 1


def test_readme_segmentation_example_runs(tmp_path: Path) -> None:
    listing = write_dataset(tmp_path / "ade", labels=False)
    code = snippet("#### Semantic segmentation", {'"ade20k/train.csv"': repr(str(listing)),
                                                  '"ade20k-train-packed"': repr(str(tmp_path / "packed"))})
    scope: dict = {}
    exec(compile(code, "README.md section 5, label maps", "exec"), scope)
    images, masks = scope["images"], scope["masks"]
    assert masks.shape == (images.shape[0], *images.shape[2:]) == (10, 512, 512) and masks.dtype == torch.uint8
    for image, ids in zip(images.permute(0, 2, 3, 1).numpy(), masks.numpy()):
        assert_aligned(image, ids, width=20, cover=0.15)   # crops enlarged up to ~18x: wide blends
