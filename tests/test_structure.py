"""The import structure the docs promise: no import cycles; lower layers never import upper ones.

Reads the source with `ast` (imports inside functions count too: a lazy import is still a
dependency), so nothing is imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "bridgecache": ROOT / "bridgecache",
    "bridgecache.kernels": ROOT / "kernels",
    "tokenalign": ROOT / "tokenalign",
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module we ship (packages by their __init__)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The shipped modules that module `name` imports (`from a import b` counts a.b if a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a package counts as what its __init__ imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_kernels_and_tokenalign_never_import_bridgecache():
    for name, imported in _graph().items():
        if name.startswith(("bridgecache.kernels", "tokenalign")):
            upper = {
                m for m in imported if m.startswith("bridgecache") and not m.startswith("bridgecache.kernels")
            }
            assert not upper, f"{name} imports {sorted(upper)}"


def test_the_graph_sees_lazy_imports():
    graph = _graph()
    assert "bridgecache.fitting.fit" in graph["bridgecache.fitting"]  # a package re-export
    assert "bridgecache.evaluation.builtin" in graph["bridgecache.evaluation.data"]
    assert "bridgecache.models.zoo" in graph["bridgecache.cli.evaluate"]  # imported inside a function
