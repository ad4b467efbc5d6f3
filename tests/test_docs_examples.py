"""Every Python and shell example in README.md and docs/*.md runs as written, on small generated data.

Each fenced block whose info string starts with `python`, `bash`, `sh` or `shell` is one test. A
file's blocks run in order, in one working folder per file (the Python blocks in one namespace, as a
reader pastes them into one interpreter; the shell blocks through bash with `stoker` and `python` on PATH).
The folder starts with generated data under the names the docs use: `imgs/` (an ImageFolder of
ImageNet-like JPEGs), `packed/` (it, packed), `data/train`, `data/val` (the same images) and
`data/train-packed`, `data/val-packed`.

A block that cannot run here carries an HTML comment on the line before its fence (invisible when the
page is rendered), with one or more directives separated by `;`:

    <!-- example: gpu -->                       runs only where CUDA is available (else skipped, saying so)
    <!-- example: skip REASON -->               never runs here; REASON (the rest of the comment) is the
                                                skip's reason: a cluster, the network, your own data,
                                                minutes of benchmark
    <!-- example: replace OLD NEW -->           runs with OLD replaced by NEW (shell-quoted when they hold
                                                spaces), e.g. a 5,000-image count by 40

Any other fence needs a non-runnable info string (`text` for output and listings, `json`, `csv`):
an unlabelled fence fails here, so no example goes unchecked by accident. README.md's Development
section documents the same convention.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
PLAIN = {"text", "json", "csv", "toml", "yaml", "ini", "diff", "console", "output", "c", "cpp", "cuda"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!--\s*example:\s*(.*?)\s*-->\s*$")
SHELL_TIMEOUT_S = 240


@dataclass
class Block:
    page: Path
    line: int            # of the opening fence, 1-based
    kind: str            # "python" or "shell"
    code: str
    directives: list[list[str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{shown(self.page)}:{self.line}"

    def skip_reason(self) -> str | None:
        for words in self.directives:
            if words[0] == "skip":
                return words[1] or "marked skip"
            if words[0] == "gpu":
                import torch

                if not torch.cuda.is_available():
                    return "needs a CUDA GPU (marked gpu)"
        return None

    def runnable_code(self) -> str:
        code = self.code
        for words in self.directives:
            if words[0] == "replace":
                old, new = words[1], words[2]
                assert old in code, f"{self.name}: `replace {old} {new}` but the block has no {old!r}"
                code = code.replace(old, new)
        return code


def shown(page: Path) -> str:
    """`page` as the tests name it: relative to the checkout where it is inside it."""
    try:
        return page.relative_to(ROOT).as_posix()
    except ValueError:
        return page.name


def parse_directives(text: str, where: str) -> list[list[str]]:
    out = []
    parts = text.split(";")
    for k, part in enumerate(parts):
        if part.split()[:1] == ["skip"]:   # the reason is the rest of the comment, semicolons and all
            out.append(["skip", ";".join(parts[k:]).strip()[len("skip"):].strip()])
            break
        words = shlex.split(part)
        if not words:
            continue
        if words[0] not in ("skip", "gpu", "replace") or (words[0] == "replace" and len(words) != 3):
            raise AssertionError(f"{where}: unknown example directive {part.strip()!r}; expected 'gpu', "
                                 "'skip REASON' or 'replace OLD NEW' (tests/test_docs_examples.py)")
        out.append(words)
    return out


def blocks_of(page: Path) -> tuple[list[Block], list[str]]:
    """The runnable blocks of `page`, and a list of problems (unlabelled fences, unknown languages)."""
    text = page.read_text(encoding="utf-8")
    blocks, problems = [], []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        info = m.group(1).strip()
        lang = info.split()[0].lower() if info else ""
        where = f"{shown(page)}:{line}"
        if lang in RUNNABLE:
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            directives = parse_directives(mark.group(1), where) if mark else []
            blocks.append(Block(page, line, RUNNABLE[lang], m.group(2), directives))
        elif lang not in PLAIN:
            problems.append(f"{where}: fence with info string {info!r}; label it python/bash (it runs) or "
                            f"text/json/csv (it does not)")
    return blocks, problems


ALL = [b for page in PAGES for b in blocks_of(page)[0]]


# ---------------------------------------------------------------- the working folder per page

@pytest.fixture(scope="session")
def example_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated data every page's folder starts with (made once, copied per page)."""
    import stoker
    from stoker.tools.synth import make_imagenet_like

    base = tmp_path_factory.mktemp("example-data")
    make_imagenet_like(base / "imgs", 96, classes=4, seed=0, workers=1)   # the doctor: 3 batches of 32
    cwd = Path.cwd()
    os.chdir(base)   # packed as README packs it, `stoker.pack("imgs", "packed")`: its rerun reuses this one
    try:
        stoker.pack("imgs", "packed", progress=False)
    finally:
        os.chdir(cwd)
    return base


class PageRun:
    """One page's folder and Python namespace; runs its blocks in order (earlier ones first, when a
    later one is asked for alone)."""

    def __init__(self, page: Path, folder: Path, data: Path) -> None:
        self.page, self.folder, self.done = page, folder, 0
        self.blocks = [b for b in ALL if b.page == page]
        self.namespace: dict[str, Any] = {"__name__": "__main__"}
        (folder / "imgs").symlink_to(data / "imgs")   # shared by every page: the examples only read them
        (folder / "packed").symlink_to(data / "packed")
        (folder / "data").mkdir()
        for split in ("train", "val"):
            (folder / "data" / split).symlink_to(data / "imgs")
            (folder / "data" / f"{split}-packed").symlink_to(data / "packed")
        self.bin = folder / ".bin"
        self.bin.mkdir()
        for name, argv in (("stoker", f'"{sys.executable}" -m stoker.cli'), ("python", f'"{sys.executable}"'),
                           ("python3", f'"{sys.executable}"')):
            shim = self.bin / name
            shim.write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
            shim.chmod(shim.stat().st_mode | stat.S_IEXEC)

    def run_through(self, block: Block) -> None:
        for earlier in self.blocks[self.done:self.blocks.index(block) + 1]:
            self.done += 1
            if earlier.skip_reason() is None:
                self._run(earlier)

    def _run(self, block: Block) -> None:
        code = block.runnable_code()
        if block.kind == "python":
            cwd, argv = Path.cwd(), sys.argv
            os.chdir(self.folder)
            sys.argv = [block.name]   # as a script run with no arguments, not with pytest's
            try:
                exec(compile(code, block.name, "exec"), self.namespace)  # noqa: S102 - our own docs
            finally:
                os.chdir(cwd)
                sys.argv = argv
            return
        src = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": src}
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=self.folder, env=env,
                              capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
        assert done.returncode == 0, f"{block.name} failed:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


@pytest.fixture(scope="module")
def page_runs(example_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    runs: dict[Path, PageRun] = {}

    def get(page: Path) -> PageRun:
        if page not in runs:
            runs[page] = PageRun(page, tmp_path_factory.mktemp(page.stem), example_data)
        return runs[page]
    yield get
    for run in runs.values():   # close what the examples left open (loaders with threads)
        for value in list(run.namespace.values()):
            close = getattr(value, "close", None)
            if callable(close) and type(value).__module__.startswith("stoker"):
                close()


@pytest.mark.parametrize("block", ALL, ids=[b.name for b in ALL])
def test_example_runs(block: Block, page_runs: Any) -> None:
    reason = block.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    page_runs(block.page).run_through(block)


# ---------------------------------------------------------------- the convention itself

def test_every_fence_is_labelled_and_every_directive_known() -> None:
    problems = [p for page in PAGES for p in blocks_of(page)[1]]
    assert not problems, "\n".join(problems)


def test_the_convention_is_documented_where_contributors_look() -> None:
    dev = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Development\n", 1)[1]
    for directive in ("<!-- example: gpu -->", "<!-- example: skip", "<!-- example: replace"):
        assert directive in dev, directive


def test_directives_are_parsed_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- example: skip needs a Ray cluster -->\n```bash\nstoker pack a b --engine ray\n```\n\n"
                    "<!-- example: gpu; replace '5000' 40 -->\n```python\nn = 5000\n```\n\n```\nunlabelled\n```\n")
    blocks, problems = blocks_of(page)
    assert [b.kind for b in blocks] == ["shell", "python"]
    assert blocks[0].skip_reason() == "needs a Ray cluster"
    assert blocks[1].runnable_code() == "n = 40\n" and blocks[1].directives[0] == ["gpu"]
    assert len(problems) == 1 and "page.md:11:" in problems[0]
    with pytest.raises(AssertionError, match="unknown example directive"):
        parse_directives("skipp typo", "x.md:1")
