"""The stage builders do not import the spec that uses them: ``runner.spec`` → ``stages.shapes`` → ``stages.traced``
once led back to ``runner.spec``. Every import counts, ``TYPE_CHECKING`` and function-level ones included."""

import ast
from pathlib import Path

import pipeswift_lab

PACKAGE = Path(pipeswift_lab.__file__).parent


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
