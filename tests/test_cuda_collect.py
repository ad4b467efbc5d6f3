"""The CUDA tests, checked on every machine: without a GPU they run only up to their first CUDA call
(tests/cuda_rehearsal.py), so a keyword stoker no longer takes in a call after that point would surface
only on the first GPU run. These read every call instead.

The keyword check resolves each called name (stoker's classes and functions, the test helpers a test
module defines or imports, scripts a test runs in a child process) to what it takes: its signature, and
for `**kwargs` what they are forwarded to: a helper's `**kw` passed on to the Loader takes the Loader's
keywords; the Loader's `**dataloader` is read by its DataLoader-keyword router (habits.py), which takes
exactly `DATALOADER_KEYWORDS`. A stoker callable whose `**kwargs` it cannot resolve fails the check
rather than passing as "anything goes"."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CUDA_TESTS = TESTS / "cuda"
#: the functions a stoker callable may pass its **kwargs dict to, with the name of the set of keywords
#: each accepts in its own module
ROUTERS = {"dataloader_keywords": "DATALOADER_KEYWORDS"}
# Callees handed the **kwargs dict only to refuse, with a better message, what the spread callees do not
# take (`pack` checks its keywords against `open_source`'s before spreading them there): they add no names.
VALIDATORS = {"pack_keywords"}


def test_the_cuda_tests_collect_without_a_gpu() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(CUDA_TESTS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"^\d+ tests? collected", out, re.M) and "error" not in out.lower(), out[-4000:]


class Unresolved(Exception):
    """A stoker callable takes **kwargs and the checker cannot tell which names they accept."""


ANYTHING = None   # a third-party callable with **kwargs: not this check's business


def _own(args: ast.arguments) -> set[str]:
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}


def _forwarded_to(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[ast.expr], list[ast.expr]]:
    """The callees `fn` passes its **kwargs to: spread (`f(**kw)`) and as a dict (`router(kw)`)."""
    name = fn.args.kwarg.arg
    spread, routed = [], []
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        if any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == name for k in call.keywords):
            spread.append(call.func)
        if any(isinstance(a, ast.Name) and a.id == name for a in call.args):
            routed.append(call.func)
    return spread, routed


class Scope:
    """The names of one module's source: its own functions (read from the AST) and what it imports
    (resolved by importing it), as what each call to them may pass by keyword."""

    def __init__(self, tree: ast.Module, where: str, lookup: Callable[[str], Any] | None = None) -> None:
        self.where = where
        self.local = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.imported: dict[str, Any] = {}
        self.lookup = lookup
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.partition(".")[0]
                    self.imported[alias.asname or top] = (alias.asname and alias.name or top, None)

    def resolve(self, func: ast.expr) -> Any:
        """The object or local function a call's `func` names, or None where it is not statically known
        (a method of a value, a local variable)."""
        if isinstance(func, ast.Name):
            if func.id in self.local:
                return self.local[func.id]
            if func.id in self.imported:
                module, attr = self.imported[func.id]
                obj = importlib.import_module(module)
                if attr is None:
                    return obj
                return getattr(obj, attr) if hasattr(obj, attr) else importlib.import_module(f"{module}.{attr}")
            return self.lookup(func.id) if self.lookup else None
        if isinstance(func, ast.Attribute):
            base = self.resolve(func.value)
            if isinstance(base, types.ModuleType):
                return getattr(base, func.attr, None) or importlib.import_module(f"{base.__name__}.{func.attr}")
            if isinstance(base, type) and isinstance(inspect.getattr_static(base, func.attr, None),
                                                     (staticmethod, classmethod)):
                return getattr(base, func.attr)
        return None

    def accepts(self, target: Any, seen: frozenset = frozenset()) -> set[str] | None:
        """The keyword names a call to `target` may pass (None: anything, a non-stoker **kwargs)."""
        if isinstance(target, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _accepts_ast(target, self, seen)
        if target is None or isinstance(target, types.ModuleType) or not callable(target):
            return ANYTHING
        return _accepts_object(target, seen)


def _accepts_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef, scope: Scope, seen: frozenset) -> set[str] | None:
    own = _own(fn.args)
    if fn.args.kwarg is None:
        return own
    if id(fn) in seen:
        return ANYTHING
    spread, routed = _forwarded_to(fn)
    allowed: set[str] | None = ANYTHING
    for func in spread:
        callee = scope.resolve(func)
        more = scope.accepts(callee, seen | {id(fn)})
        if more is not ANYTHING:
            allowed = more if allowed is ANYTHING else allowed & more   # every callee gets each keyword
    for func in routed:
        if isinstance(func, ast.Name) and func.id in VALIDATORS:
            continue
        names = _router_names(scope.resolve(func), where=f"{scope.where}: {fn.name}(**{fn.args.kwarg.arg})")
        allowed = names if allowed is ANYTHING else allowed & names
    return ANYTHING if allowed is ANYTHING else own | allowed


def _router_names(router: Any, where: str) -> set[str]:
    name = getattr(router, "__name__", None)
    if name not in ROUTERS:
        raise Unresolved(f"{where} passes its keywords to {name or router!r}, which the checker does not know: "
                         f"add it to ROUTERS with the set of names it accepts")
    return set(getattr(sys.modules[router.__module__], ROUTERS[name]))


def _accepts_object(target: Any, seen: frozenset) -> set[str] | None:
    fn = target.__init__ if isinstance(target, type) else target
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return ANYTHING
    own = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return own
    module = getattr(target, "__module__", "") or ""
    path = Path(getattr(sys.modules.get(module), "__file__", None) or "/")
    ours = module == "stoker" or module.startswith("stoker.")
    if not ours and TESTS not in path.resolve().parents:
        return ANYTHING   # torch, numpy, ...
    fn = inspect.unwrap(fn)
    if getattr(fn, "__code__", None) is None or id(fn) in seen:
        raise Unresolved(f"{module}.{getattr(target, '__qualname__', target)} takes **kwargs the checker cannot read")
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    scope = Scope(ast.parse(""), module, lookup=lambda name: fn.__globals__.get(name, getattr(
        __builtins__, name, None) if not isinstance(__builtins__, dict) else __builtins__.get(name)))
    allowed = _accepts_ast(node, scope, seen | {id(fn)})
    if allowed is ANYTHING and ours:
        raise Unresolved(f"{module}.{target.__qualname__}(**{node.args.kwarg.arg}): the checker finds no callee or "
                         f"router for these keywords")
    return allowed if allowed is ANYTHING else allowed - ({"self"} if isinstance(target, type) else set())


def _scripts(tree: ast.Module) -> list[tuple[int, ast.Module]]:
    """Python scripts a test module holds as strings (run in a child process) that use stoker."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "stoker" in node.value:
            try:
                script = ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in script.body):
                out.append((node.lineno, script))
    return out


def _name(func: ast.expr) -> str:
    return ast.unparse(func)


def bad_keywords(source: str, name: str) -> list[str]:
    """`name:line callee(keyword=)` for each keyword a call in `source` passes that its callee does not take."""
    tree = ast.parse(source, name)
    bad: list[str] = []
    for offset, module in [(0, tree), *((line - 1, script) for line, script in _scripts(tree))]:
        scope = Scope(module, name)
        for call in (n for n in ast.walk(module) if isinstance(n, ast.Call)):
            if not any(k.arg for k in call.keywords):
                continue
            allowed = scope.accepts(scope.resolve(call.func))
            if allowed is ANYTHING:
                continue
            bad += [f"{name}:{call.lineno + offset} {_name(call.func)}({k.arg}=)" for k in call.keywords
                    if k.arg is not None and k.arg not in allowed]
    return bad


@pytest.fixture
def test_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CUDA tests import their helpers from (test_loader, cuda_helpers, ...)."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.syspath_prepend(str(CUDA_TESTS))


@pytest.mark.parametrize("path", sorted(CUDA_TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_the_cuda_tests_call_stoker_with_keywords_it_takes(path: Path, test_paths: None) -> None:
    """Collection calls nothing, and the CPU rehearsal stops at a test's first CUDA call: read the calls."""
    assert bad_keywords(path.read_text(), path.name) == []


PLANTED = '''
from stoker.loader import Loader
from stoker import DeviceOptions, Workers, pack

def cpu_batches(packed, **kw):
    return list(Loader(packed, 16, device="cpu", pin_memory=False, **kw))

def converted(packed, **conversion):
    return cpu_batches(packed, device=DeviceOptions("cpu", **conversion))

def test_planted(packed):
    Loader(packed, 8, persistent=True)
    Loader(packed, 8, prefetch=2)
    cpu_batches(packed, normalize="imagenet")
    converted(packed, normalise="imagenet")
    Loader(packed, 8, num_workers=2, shuffle=True, persistent_workers=True, drop_last=True)
    Loader(packed, 8, workers=Workers(prefetch=3, persistent=True), seed=1)
    converted(packed, normalize="imagenet", dtype="bf16")
    DeviceOptions("cuda", normalize="imagenet", dtype="bf16", memory_format="channels_last")
    pack(packed, packed, kind="folder")
    pack(packed, packed, max_side=64)

SCRIPT = """
import sys
from stoker import Loader
for x, _ in Loader(sys.argv[1], 16, num_threads=4):
    pass
"""
'''


def test_the_checker_catches_planted_bad_calls(test_paths: None) -> None:
    assert bad_keywords(PLANTED, "planted.py") == [
        "planted.py:12 Loader(persistent=)",
        "planted.py:13 Loader(prefetch=)",
        "planted.py:14 cpu_batches(normalize=)",
        "planted.py:15 converted(normalise=)",
        "planted.py:21 pack(max_side=)",
        "planted.py:26 Loader(num_threads=)",
    ]


def test_an_unknown_router_is_not_anything_goes(test_paths: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROUTERS", {})
    with pytest.raises(Unresolved, match="dataloader_keywords"):
        bad_keywords("from stoker import Loader\nLoader('x', 8, shuffle=True)\n", "planted.py")


# a value each DataLoader keyword the router maps may take
SAMPLE = {"num_workers": 2, "persistent_workers": True, "pin_memory": False, "timeout": 5.0, "drop_last": True,
          "shuffle": True, "collate_fn": None, "sampler": None}


def test_the_routers_set_is_what_the_router_reads() -> None:
    """DATALOADER_KEYWORDS (what this checker allows) against dataloader_keywords (what the Loader does)."""
    from stoker.loader import Loader

    module = sys.modules[Loader.__module__]
    router = module.dataloader_keywords
    names = set(getattr(sys.modules[router.__module__], ROUTERS[router.__name__]))
    assert names == set(SAMPLE), "give SAMPLE a value for each keyword the router takes"
    for name in names:
        router({name: SAMPLE[name]})   # routed: no error
    for name in ("persistent", "prefetch", "normalize", "num_threads", "prefetch_factor", "pad"):
        with pytest.raises(Exception):
            router({name: 1})
