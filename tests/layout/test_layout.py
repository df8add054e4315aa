"""The package layout docs/development.md describes, checked: rooms whose imports point down, no
package attribute that shadows a submodule, small modules, and no ``_x.py`` satellites."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import pipeswift_lab

PACKAGE = Path(pipeswift_lab.__file__).parent

#: Each room's layer: a module may import its own room and the rooms of lower layers, never a room of its own layer
#: or above. fidelity, planning and the runner share a layer: they take each other's results as values.
LAYERS = {
    "core": 0,
    "data": 1,
    "models": 1,
    "profiling": 1,
    "partitioning": 2,
    "simulation": 3,
    "schedules": 3,
    "frameworks": 3.5,  # a plan in the frameworks' terms: it knows schedules and shapes, not plans; planning uses it
    "fidelity": 4,
    "planning": 4,
    "runner": 4,
    "cluster": 5,
    "faces": 6,
}


def _modules() -> list[tuple[str, Path]]:
    """``(dotted name, path)`` of every module of the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in the file, those inside functions included."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # ``from . import x``: x may itself be a module of another room
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return [(line, mod) for line, mod in found if mod.split(".")[0] == "pipeswift_lab"]


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_lives_in_a_room():
    outside = [
        name for name, path in _modules() if name.count(".") >= 1 and _room(name) is None and path.parent != PACKAGE
    ]
    assert outside == []
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 8, top
    assert set(top) <= {f"{room}.py" for room in LAYERS}, top


def test_imports_point_down():
    wrong = []
    for name, path in _modules():
        room = _room(name)
        if room is None:  # the top-level __init__ and __main__ gather every room
            continue
        for line, target in _imports(name, path):
            other = _room(target)
            if other is None:
                if target not in ("pipeswift_lab", "pipeswift_lab.__version__"):
                    wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {target} (outside every room)")
                continue
            if other != room and LAYERS[other] >= LAYERS[room]:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} ({room}) imports {target} ({other})")
    assert wrong == []


def test_no_package_attribute_shadows_a_submodule():
    shadowed = []
    for name, path in _modules():
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(name)
        for info in pkgutil.iter_modules(package.__path__):
            value = package.__dict__.get(info.name)
            full = f"{name}.{info.name}"
            if value is not None and getattr(value, "__name__", None) != full:
                shadowed.append(f"{name}.{info.name} is {value!r}, not the module {full}")
    assert shadowed == []


@pytest.mark.parametrize("name,path", _modules(), ids=[name for name, _ in _modules()])
def test_module_is_small_and_named_without_underscore(name, path):
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 500
    assert not path.name.startswith("_") or path.name in ("__init__.py", "__main__.py")


def test_every_package_says_what_it_reads_and_returns():
    for name, path in _modules():
        if path.name == "__init__.py":
            package = importlib.import_module(name)
            assert package.__doc__ and len(package.__doc__.strip()) > 80, name
            assert isinstance(getattr(package, "__all__", None), list), name


#: ``pipeswift_lab.__all__`` before the rooms (less ``plot_sweep``, which gave way to ``Sweep.plot``), and the
#: ``report`` and ``runner`` attributes: every name stays importable from the top level.
PUBLIC_BEFORE_THE_ROOMS = (
    "SCHEDULES Checkpoint Comparison ClusterResult JCT Link Partition Plan Profile RunError RunResult ScheduleDeadlock "
    "Timeline Calibration activation_memory_bytes bubble_overhead bubble_ratio cluster calibrate compare costs data "
    "inflight_microbatches latest_checkpoint load_checkpoint models precision partition plan profile profile_step run "
    "simulate step_ms sweep widgets report runner"
).split()


def test_the_public_surface_stays():
    import pipeswift_lab as psl

    missing = [name for name in PUBLIC_BEFORE_THE_ROOMS if not hasattr(psl, name)]
    assert missing == []
    assert set(psl.__all__) <= set(dir(psl))
    assert callable(psl.simulate) and callable(psl.cluster.simulate) and callable(psl.fidelity.compare)
    assert psl.widgets.__name__ == "pipeswift_lab.faces.widgets" and psl.report.__name__ == "pipeswift_lab.faces.report"
