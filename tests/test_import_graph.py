"""The package's import graph: no cycle among module-level imports, and JAX's internals
(``jax._src``) read in one compatibility module only, so that a JAX release that moves them
breaks one file.

Module-level imports only: an import inside a function runs when the function does, after
every module is loaded. ``from jaxmem import plan`` is an edge to ``jaxmem.plan``, not to the
package, whose ``__init__`` re-exports the public API.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each package's modules live (pyproject.toml's package-dir).
PACKAGES = {"jaxmem": ROOT / "jaxmem", "jaxmem.planners": ROOT / "planners",
            "jaxmem.models": ROOT / "models"}
COMPAT = "jaxmem._compat"


def _modules() -> dict[str, pathlib.Path]:
    def name(pkg: str, folder: pathlib.Path, f: pathlib.Path) -> str:
        parts = [pkg, *f.relative_to(folder).with_suffix("").parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    return {name(pkg, folder, f): f for pkg, folder in PACKAGES.items()
            for f in sorted(folder.rglob("*.py"))}


def _imported(node: ast.AST, name: str, path: pathlib.Path) -> set[str]:
    """The names an import statement brings in, as dotted module names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    return {base} | {f"{base}.{a.name}" for a in node.names}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.parse(path.read_text()).body:  # module level only
            names = _imported(node, name, path)
            submodules = {n for n in names if n in modules and n != name}
            # `from jaxmem import plan` names the module jaxmem.plan, not the package
            edges |= {n for n in submodules if not any(
                other.startswith(n + ".") for other in submodules)}
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_module_level_imports_have_no_cycle():
    graph = _graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 40  # the graph was read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_jax_internals_are_read_in_the_compatibility_module_only():
    readers = sorted(
        str(path.relative_to(ROOT)) for folder in (*PACKAGES.values(), ROOT / "bench")
        for path in folder.glob("*.py")
        if "jax._src" in path.read_text() and path != PACKAGES["jaxmem"] / "_compat.py")
    assert readers == []
