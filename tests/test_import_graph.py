"""The package's import graph: the pipeline's stages import only the stages below them, no
cycle among imports, and JAX's internals (``jax._src``) read in one compatibility module
only, so that a JAX release that moves them breaks one file.

The stage check and one cycle check read every import: in functions and under
``if TYPE_CHECKING:`` too (an import a function makes, or a type-only one, still ties two
modules together, whatever order they load in); a second cycle check reads the
module-level imports alone, those that run when a module loads.
``from jaxmem.plans import plan`` is an edge to ``jaxmem.plans.plan``, not to the package.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterable

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


def _edges(tree: ast.Module, name: str, path: pathlib.Path, modules: Iterable[str],
           everywhere: bool) -> set[str]:
    """The modules of ``modules`` that module ``name`` (parsed into ``tree``) imports: at module
    level, or ``everywhere`` (in functions and under ``if TYPE_CHECKING:`` too)."""
    known = set(modules)
    edges: set[str] = set()
    for node in ast.walk(tree) if everywhere else tree.body:
        names = _imported(node, name, path)
        submodules = {n for n in names if n in known and n != name}
        # `from jaxmem.plans import plan` names the module jaxmem.plans.plan, not the package
        edges |= {n for n in submodules if not any(
            other.startswith(n + ".") for other in submodules)}
    return edges


def _graph(everywhere: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports: at module level, or ``everywhere`` (see ``_edges``)."""
    modules = _modules()
    return {name: _edges(ast.parse(path.read_text()), name, path, modules, everywhere)
            for name, path in modules.items()}


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


# The stages, lowest first (docs/architecture.md): a module may import its own stage's modules
# and those of any stage below. A module is in the stage of its longest listed prefix.
STAGES = (
    ("base", ("jaxmem._compat", "jaxmem._startup", "jaxmem.targets", "jaxmem.units",
              "jaxmem.errors", "jaxmem.level")),
    ("tracing", ("jaxmem.tracing",)),
    ("analysis", ("jaxmem.analysis",)),
    ("plans", ("jaxmem.plans",)),
    ("emit", ("jaxmem.emit",)),
    ("cost", ("jaxmem.cost",)),
    ("planners", ("jaxmem.planners",)),
    ("config", ("jaxmem.config",)),
    ("verify", ("jaxmem.verify",)),
    ("zoo", ("jaxmem.models",)),  # example models for the bench and tests; only the CLI reads it
    ("api", ("jaxmem", "jaxmem.optimize", "jaxmem._arguments", "jaxmem.pareto", "jaxmem.cli",
             "jaxmem.__main__")),
)


def _stage(module: str) -> int:
    found = [(len(prefix), rank) for rank, (_, prefixes) in enumerate(STAGES)
             for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    assert found, f"{module} is in no stage: add it to STAGES"
    return max(found)[1]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({STAGES[_stage(m)][0]}) imports {n} ({STAGES[_stage(n)][0]})"
                  for m, edges in graph.items() for n in edges if _stage(n) > _stage(m))


def test_every_module_is_in_a_stage():
    for module in _modules():
        _stage(module)


def test_no_stage_imports_a_stage_above_it():
    graph = _graph(everywhere=True)
    assert sum(map(len, graph.values())) > sum(map(len, _graph().values()))  # functions read
    assert _upward(graph) == []


def test_the_stage_check_finds_an_upward_import():
    assert _upward({"jaxmem.analysis.graph": {"jaxmem.plans.plan"}}) == [
        "jaxmem.analysis.graph (analysis) imports jaxmem.plans.plan (plans)"]


def test_the_module_level_imports_have_no_cycle():
    graph = _graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 40  # the graph was read
    assert _cycles(graph) == []


def test_the_planners_have_no_cycle_counting_every_import():
    """Imports in functions and under ``TYPE_CHECKING`` included: a type two planner modules
    share lives in a module both import (``_cpsat_progress.Objective``)."""
    graph = _graph(everywhere=True)
    planners = {m: {n for n in edges if n.startswith("jaxmem.planners")}
                for m, edges in graph.items() if m.startswith("jaxmem.planners")}
    assert "jaxmem.planners._cpsat_progress" in planners["jaxmem.planners._cpsat_model"]
    assert _cycles(planners) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _described(graph: dict[str, set[str]], cycle: list[str]) -> str:
    """A cycle's imports, one by one: ``a imports b; b imports a``."""
    return "; ".join(f"{m} imports {n}" for m in cycle for n in sorted(graph[m]) if n in cycle)


def test_no_cycle_counting_every_import():
    graph = _graph(everywhere=True)
    cycles = _cycles(graph)
    assert not cycles, (
        "import cycles, counting imports in functions and under TYPE_CHECKING (move what both "
        "modules need into a module below them, or the caller's side into the module above):\n"
        + "\n".join(_described(graph, c) for c in cycles))


def test_the_everywhere_graph_reads_imports_in_functions_and_under_type_checking():
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n"
                     "    from jaxmem.plans.plan import Plan\n"
                     "def f():\n"
                     "    from jaxmem.plans import report\n")
    name, path = "jaxmem.plans.schedule", PACKAGES["jaxmem"] / "plans" / "schedule.py"
    assert _edges(tree, name, path, _modules(), everywhere=True) == {
        "jaxmem.plans.plan", "jaxmem.plans.report"}
    assert _edges(tree, name, path, _modules(), everywhere=False) == set()


def test_a_cycle_is_described_by_its_imports():
    graph = {"a": {"b", "c"}, "b": {"a"}, "c": set()}
    assert _described(graph, _cycles(graph)[0]) == "a imports b; b imports a"


def test_jax_internals_are_read_in_the_compatibility_module_only():
    readers = sorted(
        str(path.relative_to(ROOT)) for folder in (*PACKAGES.values(), ROOT / "bench")
        for path in folder.rglob("*.py")
        if "jax._src" in path.read_text() and path != PACKAGES["jaxmem"] / "_compat.py")
    assert readers == []
