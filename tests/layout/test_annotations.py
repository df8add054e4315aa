"""At least 90% of the package's public functions and methods (names without a leading underscore, nested ones
included) annotate every argument and the return."""

from __future__ import annotations

import ast
from pathlib import Path

import pipeswift_lab

PACKAGE = Path(pipeswift_lab.__file__).parent
THRESHOLD = 0.90


def _public_functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                found.append((f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}", node))
    return found


def _fully_annotated(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = node.args
    named = args.posonlyargs + args.args + args.kwonlyargs
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    star = [a for a in (args.vararg, args.kwarg) if a is not None]
    return node.returns is not None and all(a.annotation is not None for a in named + star)


def coverage() -> tuple[float, list[str]]:
    """The annotated share of public functions, and the names of those that are not."""
    functions = _public_functions()
    missing = [where for where, node in functions if not _fully_annotated(node)]
    return 1 - len(missing) / len(functions), missing


def test_the_counter_sees_annotations():
    tree = ast.parse("def f(a: int, *, b: str = 'x') -> int: ...\ndef g(self, a) -> None: ...\ndef h(x: int): ...")
    annotated = [_fully_annotated(node) for node in tree.body]
    assert annotated == [True, False, False]


def test_public_functions_are_annotated():
    share, missing = coverage()
    assert share >= THRESHOLD, f"{share:.0%} annotated; not annotated:\n" + "\n".join(missing)


if __name__ == "__main__":
    share, missing = coverage()
    print(f"{share:.1%} of {len(_public_functions())} public functions annotated")
    print("\n".join(missing))
