"""README's first screen holds what a newcomer needs (what stoker is, `make demo`, `make test`, one
example) and its example runs as written. Every command in the guide's "Use" section (docs/guide.md)
runs as written, in order, on the data `stoker synth` makes there: the shell lines through the CLI,
the Python blocks in one namespace. Blocks that need CUDA (or torchvision) run only where it is
present; the detection example, which needs COCO, runs on a COCO file written here with its paths
pointed at it."""

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
GUIDE = ROOT / "docs" / "guide.md"
FIRST_SCREEN = 40   # lines
NEEDS_COCO = "coco/annotations"   # section 5 (tested below on a COCO file made here)
NEEDS_SEGMENTATION = "ade20k/train.csv"   # section 5's label maps (tested below on data made here)


def test_readme_first_screen_is_what_commands_and_one_example() -> None:
    screen = "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN])
    blocks = re.findall(r"```(\w+)\n(.*?)```", screen, flags=re.S)
    assert [lang for lang, _ in blocks] == ["bash", "python"]
    commands = [line.split("#")[0].strip() for line in blocks[0][1].splitlines()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()   # what CI runs is what README says
    assert len(blocks[1][1].strip().splitlines()) <= 12 and "Keep the GPU fed" in screen


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    from stoker.tools.synth import make_imagenet_like

    code = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)[0]
    make_imagenet_like(tmp_path / "imgs", 80, classes=4, seed=0, workers=1)   # what `stoker synth imgs` writes
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    train = namespace["train"]
    assert isinstance(train, __import__("stoker").Loader) and len(train) == 2 and namespace["epoch"] == 1
    assert namespace["images"].dtype == torch.uint8 and namespace["labels"].shape == (16,)   # the last batch
    train.close()


def _use_section() -> list[tuple[str, str]]:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index("\n## Use\n")
    section = text[start:text.index("\n## ", start + 1)]   # to the next section (the cloud one: test_remote.py)
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def _torchvision_works() -> bool:
    from torchvision_helpers import torchvision_importable   # also one built for another torch

    return torchvision_importable()


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
    namespace: dict = {}   # nothing defined for the blocks: they run as a reader copies them
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
            exec(compile(body, "docs/guide.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    assert isinstance(namespace["train"], __import__("stoker").Loader) and len(namespace["val"]) == 8
    images, targets, loss = namespace["images"], namespace["targets"], namespace["loss"]   # section 4, DeiT
    assert images.shape[1:] == (3, 224, 224) and images.dtype == torch.float32
    assert targets.shape == (images.shape[0], 1000) and torch.allclose(targets.sum(1), torch.ones(len(targets)))
    assert torch.isfinite(loss)


def snippet(heading: str, replacements: dict[str, str]) -> str:
    """The first Python block after the guide's heading starting with ``heading``, paths replaced
    (each must be there: an edit that drops one fails here, not silently)."""
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}")
    code = text[start:].split("```python\n", 1)[1].split("```", 1)[0]
    for old, new in replacements.items():
        assert old in code, f"docs/guide.md section {heading!r} no longer mentions {old!r}"
        code = code.replace(old, new)
    return code


def test_readme_detection_example_runs(tmp_path: Path) -> None:
    ann = make_coco(tmp_path)
    code = snippet("### 5.", {'"coco/annotations/instances_train2017.json"': repr(str(ann)),
                              '"coco/train2017"': repr(str(tmp_path / "images")),
                              '"coco-train-packed"': repr(str(tmp_path / "packed"))})
    scope: dict = {}
    exec(compile(code, "docs/guide.md section 5", "exec"), scope)
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
    exec(compile(code, "docs/guide.md section 5, label maps", "exec"), scope)
    images, masks = scope["images"], scope["masks"]
    assert masks.shape == (images.shape[0], *images.shape[2:]) == (10, 512, 512) and masks.dtype == torch.uint8
    for image, ids in zip(images.permute(0, 2, 3, 1).numpy(), masks.numpy()):
        assert_aligned(image, ids, width=20, cover=0.15)   # crops enlarged up to ~18x: wide blends


def test_install_story_and_make_targets_match_pyproject() -> None:
    """README's extras exist, each with both spellings explained; `make demo` installs only the small
    `demo` extra (the development environment is `make test`'s)."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = README.read_text(encoding="utf-8").split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([\w-]+)` \|", install, flags=re.M)
    assert listed and set(listed) <= set(extras)
    assert "pip install '.[remote]'" in install and "pip install 'stoker[remote]'" in install
    assert extras["demo"] == ["stoker[plot]"]
    makefile = (ROOT / "Makefile").read_text()
    demo_rule = makefile.split("$(VENV)/.demo:", 1)[1].split("\n\n", 1)[0]
    assert '-e ".[demo]"' in demo_rule and "test" not in demo_rule
    assert "demo: $(VENV)/.demo" in makefile and "test: $(VENV)/.test" in makefile
