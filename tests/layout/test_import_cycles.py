"""No import circle: the modules of ``pipeswift_lab`` import one another as a graph without a strongly connected
component of more than one module. Every import counts, ``TYPE_CHECKING`` and function-level (lazy) ones included:
a lazy import only hides a circle until someone moves it to the top of the file.

How an import becomes an edge of the graph (:func:`import_graph`):

* ``import a.b`` and ``from a.b import name`` are edges to the module ``a.b``; a package is its ``__init__.py``;
* ``from a import b``, where ``b`` is a submodule of ``a``, is an edge to ``a.b`` alone;
* the packages Python runs on the way to a module (``a/__init__.py`` before ``a.b``) are not edges: every module
  of a package would otherwise make a circle with the ``__init__`` that re-exports it;
* so a name taken from a package's ``__init__`` (a re-export) is an edge to that ``__init__``, and through it to
  everything it re-exports. A module inside a package therefore imports the module that defines a name, never the
  package it is part of nor any package above it (``from .. import __version__``):
  :func:`test_no_module_imports_a_package_it_is_inside`;
* ``importlib.import_module`` with a computed name (the lazy faces of ``pipeswift_lab/__init__.py``) is not read.

The stage builders, in particular, do not import the spec that uses them: ``runner.spec`` → ``stages.shapes`` →
``stages.traced`` once led back to ``runner.spec``.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

import pipeswift_lab

PACKAGE = Path(pipeswift_lab.__file__).parent

#: The imports allowed to close a circle, with why. A value type writes itself through its own serializer, which
#: reads it back into the type: ``RunResult.save`` imports ``result_files.save_result`` inside the method, and
#: ``result_files`` imports ``RunResult`` (and, for a torchrun directory, ``assembly``, which makes RunResults).
#: It must stay a function-level import (:func:`test_the_allowed_import_is_lazy_and_still_there`).
ALLOWED = {
    ("pipeswift_lab.runner.result", "pipeswift_lab.runner.result_files"): (
        "RunResult.save() calls result_files.save_result, its serializer, which builds RunResults when it loads"
    ),
    ("pipeswift_lab.core.schedule", "pipeswift_lab.core.schedule_orders"): (
        "Schedule.of() reads a built-in schedule's orders from torch through schedule_orders, which (through the "
        "vocabulary) accepts a Schedule wherever it accepts a name"
    ),
}


def imports_of(path: Path) -> set[str]:
    """The ``pipeswift_lab`` modules and names ``path`` imports anywhere in it, as dotted names."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("pipeswift_lab")}


def test_no_stage_builder_imports_the_spec_module():
    stages = sorted((PACKAGE / "runner" / "stages").glob("*.py")) + [PACKAGE / "runner" / "weights.py"]
    offenders = {
        path.name: sorted(name for name in imports_of(path) if name.startswith("pipeswift_lab.runner.spec"))
        for path in stages
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_spec_module_reaches_the_stage_builders():
    """The test above would pass on an empty folder: make sure it reads the imports that exist."""
    assert "pipeswift_lab.runner.stages.shapes.stage_shapes" in imports_of(PACKAGE / "runner" / "spec.py")
    assert "pipeswift_lab.runner.stages.traced" in imports_of(PACKAGE / "runner" / "stages" / "shapes.py")


# --------------------------------------------------------------------------- the module graph


@dataclass(frozen=True)
class Edge:
    """One import statement of a module of the package."""

    line: int
    """Its line in the importing file."""
    lazy: bool
    """Inside a function (run when the function is called, not when the module is imported)."""


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name, for its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def module_imports(name: str, path: Path, known: set[str]) -> dict[str, list[Edge]]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports, each with its import statements."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: dict[str, list[Edge]] = {}

    def add(target: str, node: ast.stmt, lazy: bool) -> None:
        edges = found.setdefault(target, []) if target in known and target != name else None
        if edges is not None and all(e.line != node.lineno for e in edges):  # one edge per statement
            edges.append(Edge(node.lineno, lazy))

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, lazy)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                add(submodule if submodule in known else target, node, lazy)
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def import_graph() -> dict[str, dict[str, list[Edge]]]:
    """Every module of the package and the modules of the package it imports (see the module docstring)."""
    found = modules()
    return {name: module_imports(name, path, set(found)) for name, path in found.items()}


def circles(graph: dict[str, dict[str, list[Edge]]] | dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def _describe(circle: list[str], graph: dict[str, dict[str, list[Edge]]]) -> str:
    """A circle's modules and the imports between them, with their lines."""
    inside = set(circle)
    lines = [f"import circle of {len(circle)} modules:"]
    for module in circle:
        for target, edges in sorted(graph[module].items()):
            if target in inside:
                where = ", ".join(f"line {e.line}{' (lazy)' if e.lazy else ''}" for e in edges)
                lines.append(f"  {module} -> {target} ({where})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the tests


def test_the_package_has_no_import_circle():
    graph = import_graph()
    kept = {src: {dst for dst in targets if (src, dst) not in ALLOWED} for src, targets in graph.items()}
    found = circles(kept)
    assert found == [], "\n\n".join(_describe(circle, graph) for circle in found)


def test_the_allowed_import_is_lazy_and_still_there():
    """The allowed import stays inside a function (importing either module never runs into the other half-made),
    and an allowance nobody needs any more is taken out of :data:`ALLOWED`."""
    graph = import_graph()
    for (src, dst), why in ALLOWED.items():
        assert dst in graph[src], f"{src} no longer imports {dst}: remove the allowance ({why})"
        assert all(e.lazy for e in graph[src][dst]), f"{src} imports {dst} at module level: {graph[src][dst]}"


def test_no_module_imports_a_package_it_is_inside():
    """``from .. import __version__`` in ``runner/spec.py`` made ``pipeswift_lab`` (which imports the runner) and
    the runner one circle; so does a module taking a name from its own package's ``__init__``."""
    offenders = [
        f"{name} imports {target} (line {edges[0].line})"
        for name, targets in import_graph().items()
        for target, edges in targets.items()
        if name.startswith(target + ".")
    ]
    assert offenders == []


def test_the_graph_reader_reads_the_imports_that_exist():
    """The tests above would pass on an empty graph: make sure it holds every module and every kind of import."""
    graph = import_graph()
    assert set(graph) == set(modules()) and len(graph) > 150
    assert sum(len(targets) for targets in graph.values()) > 500
    expected = {
        ("pipeswift_lab.runner.assembly", "pipeswift_lab.runner.result"): False,  # from .result import RunResult
        ("pipeswift_lab.runner.rank.train_loop", "pipeswift_lab.runner.checkpoint"): False,  # from .. import checkpoint
        ("pipeswift_lab.runner.rank.stage_build", "pipeswift_lab.runner.spec"): False,  # under TYPE_CHECKING
        ("pipeswift_lab.simulation.timeline", "pipeswift_lab.simulation.trace_import"): True,  # in from_profiler
        ("pipeswift_lab", "pipeswift_lab.simulation"): False,  # a package's __init__
    }
    for (src, dst), lazy in expected.items():
        assert dst in graph[src], f"{src} -> {dst} not read"
        assert graph[src][dst][0].lazy == lazy, (src, dst, graph[src][dst])
    assert "pipeswift_lab.runner" not in graph["pipeswift_lab.runner.rank.train_loop"]  # the submodule, not the package


def test_a_circle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
