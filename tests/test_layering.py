"""The package's layers, read from the source with `ast` (every import, including those inside
functions and under TYPE_CHECKING): the core never imports the tools or the CLI; of the three wings
that make batches, `loader` (options in, batches out) builds on `loading` (the CPU workers) and
`device` (the GPU side), `device` builds on `loading`, and `loading` imports neither; no module
imports, directly or through others, a module that imports it; and no folder does either (a
subpackage counts as one, each top-level module as itself)."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "stoker"
#: beside the core: nothing in the core may import these
BESIDE = ("stoker.tools", "stoker.cli")

#: wing -> the wings it must never import (the flow reads top-down: loader -> device -> loading)
WINGS = {
    "stoker.loading": ("stoker.device", "stoker.loader"),
    "stoker.device": ("stoker.loader",),
}

#: Import edges (importer, imported) that close a circle in the core today. Each is removed by the
#: restructure of render/slots/reader; delete it here when that lands. Nothing may be added.
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The stoker modules `name` imports anywhere in its source, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            # `from pkg import mod` imports the submodule; `from mod import name` the module itself
            targets = [f"{base_name}.{alias.name}" if f"{base_name}.{alias.name}" in known else base_name
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:   # `import stoker.tools.bench.x` -> the deepest module
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


@functools.lru_cache(maxsize=1)
def _parsed_graph() -> tuple[tuple[str, frozenset[str]], ...]:
    modules = _modules()
    known = set(modules)
    return tuple((name, frozenset(_imports(name, path, known))) for name, path in modules.items())


def _graph() -> dict[str, set[str]]:
    """module -> the stoker modules it imports (a fresh copy each call; the source is parsed once)."""
    return {name: set(dsts) for name, dsts in _parsed_graph()}


def _is_beside(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in BESIDE)


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = _graph()
    assert "stoker.tools.bench_gpu" in graph["stoker.tools.bench"]     # `from . import bench_gpu`
    assert "stoker.tools.bench" in graph["stoker.cli"]                 # inside a function
    assert "stoker.codecs" in graph["stoker.tools.bench"]              # `from .. import codecs`, in a function


def test_the_core_never_imports_the_tools_or_the_cli() -> None:
    graph = _graph()
    offending = sorted(f"{src} imports {dst}" for src, dsts in graph.items() if not _is_beside(src)
                       for dst in dsts if _is_beside(dst))
    assert not offending, "the core must read on its own:\n" + "\n".join(offending)


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_wings_import_only_downstream() -> None:
    graph = _graph()
    offending = sorted(f"{src} imports {dst}" for wing, banned in WINGS.items()
                       for src, dsts in graph.items() if _under(src, wing)
                       for dst in dsts if any(_under(dst, b) for b in banned))
    assert not offending, "a wing imports one that builds on it:\n" + "\n".join(offending)


#: CUDA names the loading wing may use: registering host memory as pinned (process mode's shared
#: slots) makes no device work, no stream and no context query
HOST_ONLY_CUDA = {"torch.cuda.cudart"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _cuda_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each `torch.cuda.*` outside HOST_ONLY_CUDA and each `.cuda` attribute."""
    uses = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        dotted = _dotted(node)
        if node.attr != "cuda" and ".cuda." not in dotted + ".":
            continue
        if any(dotted == d or d.startswith(dotted + ".") for d in HOST_ONLY_CUDA):
            continue   # the allowed name itself, or its `torch.cuda` prefix
        uses.append((node.lineno, dotted))
    return uses


def test_the_loading_wing_makes_no_cuda_call() -> None:
    """The workers never touch the GPU (the device thread is the one CUDA actor): no `torch.cuda.*`
    (bar host pinning) and no `.cuda()` anywhere in the loading wing's code."""
    found = [f"{path.name}:{line} {dotted}" for name, path in _modules().items() if _under(name, "stoker.loading")
             for line, dotted in _cuda_uses(ast.parse(path.read_text(), str(path)))]
    assert not found, "CUDA in the loading wing: " + ", ".join(found)


def test_the_cuda_check_sees_a_cuda_call() -> None:
    tree = ast.parse("torch.cuda.synchronize()\nx.cuda()\ntorch.cuda.cudart()\ny = torch.cuda.Event")
    assert sorted(_cuda_uses(tree)) == [(1, "torch.cuda.synchronize"), (2, "x.cuda"), (4, "torch.cuda.Event")]


def test_the_wing_checks_see_the_wings() -> None:
    graph = _graph()
    assert "stoker.loading.slots" in graph["stoker.device.feeder"]
    assert "stoker.device.feeder" in graph["stoker.loader.passes"]
    assert any(_under(m, "stoker.loading") for m in graph) and any(_under(m, "stoker.device") for m in graph)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle() -> None:
    graph = _graph()
    for src, dst in KNOWN_CYCLE_EDGES:
        assert dst in graph.get(src, set()), f"{src} no longer imports {dst}: remove it from KNOWN_CYCLE_EDGES"
        graph[src] = graph[src] - {dst}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _folder(name: str) -> str:
    """The folder a module belongs to: its subpackage of stoker (`stoker.loading` for
    `stoker.loading.slots`), or the module itself at the top level (`stoker.mix`)."""
    parts = name.split(".")
    return ".".join(parts[:2])


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the other folders its modules import."""
    folders: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        mine = _folder(src)
        folders.setdefault(mine, set()).update(_folder(d) for d in dsts if _folder(d) != mine)
    return folders


def _edges_between(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() if _folder(src) == a
                  for dst in dsts if _folder(dst) == b)


def test_no_folder_cycle() -> None:
    """Folders import one way: where a module of folder A imports one of folder B, nothing in B imports
    anything in A, directly or through other folders (`loading/` -> `mix` -> `loader/` -> `loading/` would
    fail here though no single module closes a circle)."""
    graph = _graph()
    cycle = _find_cycle(_folder_graph(graph))
    assert cycle is None, "folder cycle: " + " -> ".join(cycle or []) + "\n" + "\n".join(
        edge for a, b in zip(cycle or [], (cycle or [])[1:]) for edge in _edges_between(graph, a, b))


def test_the_folder_check_sees_a_cycle_no_module_closes() -> None:
    graph = {"stoker.loading.child": {"stoker.mix"}, "stoker.mix": {"stoker.loader.open"},
             "stoker.loader.open": {"stoker.loading.labels"}, "stoker.loading.labels": set()}
    assert _find_cycle(graph) is None
    assert _find_cycle(_folder_graph(graph)) == ["stoker.loader", "stoker.loading", "stoker.mix", "stoker.loader"]
    assert _folder("stoker.mix") == "stoker.mix" and _folder("stoker.loading.slots") == "stoker.loading"
    assert _folder("stoker") == "stoker"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _class_names(paths: dict[str, Path]) -> dict[str, list[str]]:
    """Public class name -> the modules that define a class of that name at top level, its private
    spelling (`_Name`) included."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for name, path in paths.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name.lstrip("_"), []).append((name, not node.name.startswith("_")))
    return {cls: [m for m, _ in defs] for cls, defs in found.items() if any(public for _, public in defs)}


def test_no_public_class_name_is_defined_twice() -> None:
    """One name means one thing: a public class's name is defined in one module only (a private
    `_Name` elsewhere counts too, as `Pipeline` beside `_Pipeline` would mislead a reader just the same).
    Users' names that stand for a class of another name (`stoker.batch.ColorJitter`) are imports."""
    twice = {name: modules for name, modules in _class_names(_modules()).items() if len(modules) > 1}
    assert not twice, "class names defined in more than one module: " + "; ".join(
        f"{name} in {', '.join(modules)}" for name, modules in sorted(twice.items()))


def test_the_name_check_sees_a_twin(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class Fence:\n    pass\n")
    (tmp_path / "b.py").write_text("class _Fence:\n    pass\nclass Other:\n    pass\nclass _Own:\n    pass\n")
    (tmp_path / "c.py").write_text("class _Own:\n    pass\n")
    found = _class_names({"a": tmp_path / "a.py", "b": tmp_path / "b.py", "c": tmp_path / "c.py"})
    assert found == {"Fence": ["a", "b"], "Other": ["b"]}   # two private `_Own`s are each module's own
