"""Every command in README's "Use" section runs as written, in order, on the data `stoker synth`
makes there: the shell lines through the CLI, the Python blocks in one namespace. Blocks that need
CUDA (or torchvision) run only where it is present."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _use_section() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Use\n"):text.index("\n## Speed\n")]
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
        if "torchvision" in line and not _torchvision_works():
            continue
        argv = shlex.split(line)
        done = subprocess.run([sys.executable, "-m", "stoker.cli", *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    namespace = {"step": lambda images, labels: None}   # the user's training step
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        for lang, body in _use_section():
            if lang != "python":
                continue
            if 'DeviceOptions("cuda"' in body and not torch.cuda.is_available():   # section 3
                continue
            namespace.setdefault("loader", namespace.get("train"))   # "keeping your own DataLoader"
            exec(compile(body, "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    assert isinstance(namespace["train"], __import__("stoker").Loader) and len(namespace["val"]) == 8
