"""The CUDA tests, checked on every machine: they skip without a GPU, so an API change that breaks them
(a removed keyword, a renamed import) would otherwise surface only on the first GPU run."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ROOT / "tests" / "cuda"


def test_the_cuda_tests_collect_without_a_gpu() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(CUDA_TESTS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"^\d+ tests? collected", out, re.M) and "error" not in out.lower(), out[-4000:]


def _signatures() -> dict[str, set[str] | None]:
    """Keyword names each public entry point takes (None: it takes **kwargs, anything goes)."""
    from stoker.device.stage import DeviceOptions
    from stoker.loader.loader import Loader
    from stoker.device.prefetcher import prefetch

    out: dict[str, set[str] | None] = {}
    for name, fn in (("Loader", Loader), ("DeviceOptions", DeviceOptions), ("prefetch", prefetch)):
        params = inspect.signature(fn).parameters.values()
        out[name] = None if any(p.kind is p.VAR_KEYWORD for p in params) else {p.name for p in params}
    return out


def _forwarders(tree: ast.AST, known: dict[str, set[str] | None]) -> dict[str, set[str] | None]:
    """A test helper that passes its **kw on to one of the entry points (`cpu_batches(packed, **kw)`)
    takes that entry point's keywords, plus its own parameters."""
    out: dict[str, set[str] | None] = {}
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.args.kwarg is not None):
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            target = _called(call)
            if target in known and known[target] is not None and any(kw.arg is None for kw in call.keywords):
                own = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
                out[fn.name] = known[target] | own
    return out


def _called(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def _bad_keywords(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    known = _signatures()
    known.update(_forwarders(tree, known))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or known.get(_called(node)) is None:
            continue
        allowed = known[_called(node)]
        bad += [f"{path.name}:{node.lineno} {_called(node)}({kw.arg}=)" for kw in node.keywords
                if kw.arg is not None and kw.arg not in allowed]
    return bad


@pytest.mark.parametrize("path", sorted(CUDA_TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_the_cuda_tests_call_loader_and_options_with_keywords_they_take(path: Path) -> None:
    """Collection does not call anything: a keyword the Loader dropped fails only when the test runs.
    Read the calls instead."""
    assert _bad_keywords(path) == []
