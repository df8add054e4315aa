"""The README and ``docs/*.md`` checked against the repository and the package, so that the documentation cannot
drift from the code unnoticed.

* the README stays short (at most :data:`MAX_README_LINES` lines) and keeps CI's test command as written;
* every relative Markdown link points to an existing file, and an ``#anchor`` to an existing heading (GitHub's
  slugs);
* every ``psl.NAME`` / ``psl.a.b`` resolves by ``getattr`` on ``import pipeswift_lab as psl`` (lazy attributes such
  as ``psl.widgets`` included), every ``pipeswift_lab.x.y`` path and ``from pipeswift_lab... import X`` line resolves,
  and in code (spans and blocks) every ``Type.attr`` of a top-level type and ``room.name`` of a top-level module;
* every keyword a documented call passes (``psl.run(..., checkpoint=...)``, ``plan(..., objective=...)``) is a
  parameter of the function it calls, so an example written for an older signature fails here;
* every docs page is linked from the README's documentation map;
* every repository path named (``benchmarks/*.py``, ``notebooks/*.ipynb``, ``tests/...``, ``pipeswift_lab/...``)
  and every notebook named by its stem (``05_real_pipeline_run``) exists.

Each check returns the problems it found as ``"page:line: what"`` strings; the tests print them all at once.
``test_the_checks_can_fail`` feeds the checks a page with one of each mistake.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import pipeswift_lab as psl

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 200

#: Public top-level attributes of the package that are classes (``RunResult``) or modules (``runner``): in code, a
#: dotted name headed by one of them is checked as ``psl.<name>``.
CLASS_HEADS = {name for name in psl.__all__ if inspect.isclass(getattr(psl, name))}
MODULE_HEADS = {
    name
    for name in dir(psl)
    if isinstance(module := getattr(psl, name, None), ModuleType) and module.__name__.startswith("pipeswift_lab.")
} | {"widgets", "report"}
#: Top-level functions whose bare calls in code (``run(..., split="manual")``) have their keywords checked.
FUNCTION_HEADS = {name for name in psl.__all__ if inspect.isfunction(getattr(psl, name))}
#: A dotted token ending in one of these is a file name (``models.py``, ``result.json``), not an attribute.
FILE_SUFFIXES = {"py", "md", "csv", "json", "pt", "ipynb", "bin", "pkl", "gz", "html", "toml", "txt", "safetensors"}
#: Top-level folders whose paths, wherever a page names them, must exist.
REPO_DIRS = ("benchmarks", "notebooks", "tests", "examples", "docs", "data", "pipeswift_lab", ".ci")

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PSL_NAME = re.compile(r"(?<![\w.])psl((?:\.[A-Za-z_]\w*)+)")
PACKAGE_PATH = re.compile(r"(?<![\w./])pipeswift_lab((?:\.[A-Za-z_]\w*)+)")
FROM_IMPORT = re.compile(r"^\s*from\s+(pipeswift_lab[\w.]*)\s+import\s+\(?([\w\s,]+)\)?\s*(?:#.*)?$")
DOTTED = re.compile(r"(?<![\w./])([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(re.escape(d) for d in REPO_DIRS) + r")/[\w./-]*\w)")
NOTEBOOK_STEM = re.compile(r"^\d\d_[a-z0-9_]+$")
KEYWORD = re.compile(r"(?<![\w.=!<>*])([A-Za-z_]\w*)\s*=(?!=)")


@dataclasses.dataclass
class Page:
    """A Markdown page split into what the checks read, each piece with the line it starts on: prose paragraphs
    (code spans blanked), code spans, fenced blocks, and the headings."""

    path: Path
    text: str
    paragraphs: list[tuple[int, str]]
    code: list[tuple[int, str]]
    blocks: list[tuple[int, str]]
    headings: list[str]

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else self.path.name

    @property
    def prose(self) -> list[tuple[int, str]]:
        """The prose line by line."""
        return [(start + i, line) for start, text in self.paragraphs for i, line in enumerate(text.split("\n"))]


def read_page(path: Path, text: str | None = None) -> Page:
    """Split a page into fenced blocks and paragraphs (runs of non-blank lines, where a code span or a link may
    cross a line end, as in Markdown), then each paragraph into its code spans and its prose."""
    text = path.read_text(encoding="utf-8") if text is None else text
    paragraphs, code, blocks, headings = [], [], [], []
    block: list[str] | None = None
    lines: list[str] = []
    start = 0

    def flush() -> None:
        if lines:
            joined = "\n".join(lines)
            for m in CODE_SPAN.finditer(joined):
                code.append((start + joined.count("\n", 0, m.start()), m.group(2).replace("\n", " ")))
            blanked = CODE_SPAN.sub(lambda m: " " + "\n" * m.group(0).count("\n"), joined)
            paragraphs.append((start, blanked))
            lines.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            if block is None:
                flush()
                block, start = [], number + 1
            else:
                blocks.append((start, "\n".join(block)))
                block = None
            continue
        if block is not None:
            block.append(line)
            continue
        heading = re.match(r"^#{1,6}\s", line)
        if not line.strip() or heading:
            flush()
        if heading:
            headings.append(line.lstrip("#").strip())
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
            if heading:
                flush()
    flush()
    return Page(path, text, paragraphs, code, blocks, headings)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation dropped (``_`` and ``-``
    kept), spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Page) -> set[str]:
    """Every heading's anchor, a repeated one numbered ``-1``, ``-2``, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in page.headings:
        base = slug(heading)
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def lines_of(page: Page) -> Iterator[tuple[int, str]]:
    """Every piece of a page with its line: prose, code spans, and each line of each block."""
    yield from page.prose
    yield from page.code
    for start, block in page.blocks:
        for offset, line in enumerate(block.splitlines()):
            yield start + offset, line


def code_of(page: Page) -> Iterator[tuple[int, str]]:
    """The page's code: spans, then each fenced block whole (a call may span lines)."""
    yield from page.code
    yield from page.blocks


# --- resolving names ---------------------------------------------------------------------------------------------


def attribute(obj: Any, name: str) -> Any:
    """``obj.name``, where a module may also hold ``name`` as a submodule not yet imported, and a dataclass as a
    field without a default; raises ``AttributeError`` otherwise."""
    try:
        return getattr(obj, name)
    except AttributeError:
        if isinstance(obj, ModuleType):
            try:
                return importlib.import_module(f"{obj.__name__}.{name}")
            except ModuleNotFoundError:
                pass
        if inspect.isclass(obj):
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            if name in fields or name in getattr(obj, "__annotations__", {}):
                return None
        raise


def resolve(root: Any, parts: list[str], *, strict: bool = False) -> str | None:
    """Walk ``parts`` from ``root``; ``None`` when every step resolves, else what failed. ``strict`` (for ``psl.``
    names, as a user types them) allows no submodule import along the way, only ``getattr``."""
    obj, walked = root, []
    for part in parts:
        walked.append(part)
        try:
            obj = getattr(obj, part) if strict and isinstance(obj, ModuleType) else attribute(obj, part)
        except AttributeError:
            return ".".join(walked)
    return None


def callable_at(root: Any, parts: list[str]) -> Any:
    """The object at ``parts`` from ``root``, or ``None`` when it does not resolve."""
    obj = root
    for part in parts:
        try:
            obj = attribute(obj, part)
        except AttributeError:
            return None
    return obj


def call_arguments(text: str, open_paren: int) -> str:
    """The text between ``text[open_paren]`` (a ``(``) and its closing parenthesis at depth 1 only: nested brackets,
    strings and comments are blanked, so a keyword found in it belongs to this call."""
    depth, out, i, quote = 0, [], open_paren, ""
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
            out.append(" ")
        elif ch in "\"'":
            quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else ch
            i += len(quote) - 1
            out.append(" ")
        elif ch == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        elif ch in "([{":
            depth += 1
            out.append(ch if depth == 1 else " ")
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return "".join(out[1:])
            out.append(" ")
        else:
            out.append(ch if depth == 1 else " ")
        i += 1
    return "".join(out[1:])


def keyword_problems(where: str, call: str, target: Any, arguments: str) -> list[str]:
    """The keywords of ``arguments`` that ``target``'s signature does not take."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    parameters = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return []
    accepted = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [
        f"{where}: {call}(..., {kw}=) — {call} takes no keyword {kw!r}"
        for kw in dict.fromkeys(KEYWORD.findall(arguments))
        if kw not in accepted
    ]


# --- the checks ----------------------------------------------------------------------------------------------------


def link_problems(page: Page) -> list[str]:
    """Relative links to missing files or headings."""
    problems = []
    for start, paragraph in page.paragraphs:
        for match in LINK.finditer(paragraph):
            target = match.group(1)
            number = start + paragraph.count("\n", 0, match.start())
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            path = (page.path.parent / file_part).resolve() if file_part else page.path
            where = f"{page.name}:{number}"
            if not path.exists():
                problems.append(f"{where}: link {target!r} points to {file_part!r}, which does not exist")
                continue
            if not path.resolve().is_relative_to(ROOT.resolve()) and page.path.is_relative_to(ROOT):
                problems.append(f"{where}: link {target!r} leaves the repository")
            if anchor:
                if path.suffix != ".md":
                    problems.append(f"{where}: link {target!r} has an anchor into a file that is not Markdown")
                elif anchor not in anchors(read_page(path) if path != page.path else page):
                    problems.append(
                        f"{where}: link {target!r}: no heading of {path.name} has the anchor #{anchor} "
                        f"(its anchors: {sorted(anchors(read_page(path) if path != page.path else page))})"
                    )
    return problems


def name_problems(page: Page) -> list[str]:
    """``psl.`` names, ``pipeswift_lab.`` paths, ``from pipeswift_lab... import`` lines and, in code, ``Type.attr``
    and ``room.name`` that do not resolve."""
    problems = []
    package = importlib.import_module("pipeswift_lab")
    for number, line in lines_of(page):
        where = f"{page.name}:{number}"
        for match in PSL_NAME.finditer(line):
            parts = match.group(1).split(".")[1:]
            failed = resolve(psl, parts, strict=True)
            if failed:
                problems.append(f"{where}: psl.{'.'.join(parts)} does not resolve (psl.{failed} is missing)")
        for match in PACKAGE_PATH.finditer(line):
            parts = match.group(1).split(".")[1:]
            if parts[-1] in FILE_SUFFIXES:
                continue
            failed = resolve(package, parts)
            if failed:
                problems.append(f"{where}: pipeswift_lab.{'.'.join(parts)} does not resolve (at {failed})")
    for number, code in code_of(page):
        for offset, line in enumerate(code.splitlines()):
            where = f"{page.name}:{number + offset}"
            imported = FROM_IMPORT.match(line)
            if imported:
                module_name, names = imported.groups()
                try:
                    module = importlib.import_module(module_name)
                except ModuleNotFoundError:
                    problems.append(f"{where}: from {module_name} import ...: no module {module_name}")
                    continue
                for name in (n.split(" as ")[0].strip() for n in names.split(",")):
                    if name and resolve(module, [name]):
                        problems.append(f"{where}: from {module_name} import {name}: {module_name} has no {name}")
            for match in DOTTED.finditer(line):
                head, parts = match.group(1), match.group(2).split(".")[1:]
                if head not in CLASS_HEADS | MODULE_HEADS or parts[-1] in FILE_SUFFIXES:
                    continue
                failed = resolve(getattr(psl, head), parts)
                if failed:
                    problems.append(f"{where}: {head}.{'.'.join(parts)} does not resolve ({head}.{failed} is missing)")
    return problems


def call_problems(page: Page) -> list[str]:
    """Keywords a documented call passes that the called function does not take: ``psl.<dotted>(``, and in code
    ``room.name(``, ``Type.method(`` and the bare top-level functions (``run(``, ``plan(``, ...)."""
    problems = []
    call = re.compile(r"(?<![\w.])((?:psl\.)?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*\(")
    for number, code in code_of(page):
        for match in call.finditer(code):
            dotted = match.group(1).split(".")
            if dotted[0] == "psl":
                dotted = dotted[1:]
            elif not (dotted[0] in CLASS_HEADS | MODULE_HEADS or (len(dotted) == 1 and dotted[0] in FUNCTION_HEADS)):
                continue
            target = callable_at(psl, dotted)
            if target is None or not callable(target):
                continue  # an unresolved name is name_problems' to report
            line = number + code.count("\n", 0, match.start())
            arguments = call_arguments(code, match.end() - 1)
            problems += keyword_problems(f"{page.name}:{line}", match.group(1), target, arguments)
    return problems


def path_problems(page: Page) -> list[str]:
    """Repository paths and notebook stems that do not exist."""
    problems = []
    for number, line in lines_of(page):
        for match in REPO_PATH.finditer(line):
            path = match.group(1)
            if not (ROOT / path).exists():
                problems.append(f"{page.name}:{number}: {path} does not exist")
    for number, span in page.code:
        if NOTEBOOK_STEM.match(span) and not (ROOT / "notebooks" / f"{span}.ipynb").exists():
            problems.append(f"{page.name}:{number}: no notebook notebooks/{span}.ipynb")
    return problems


def report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


# --- the tests -----------------------------------------------------------------------------------------------------


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, more than {MAX_README_LINES}: move reference and how-to material to a "
        "page in docs/ and link it from the README's documentation map"
    )


def test_readme_keeps_the_test_command_ci_runs():
    """``.ci/run`` ends with the README's test command as written: the README must keep it verbatim."""
    command = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1].strip()
    assert command in README.read_text(encoding="utf-8"), f"README.md no longer holds CI's command {command!r}"


def test_there_are_docs():
    assert DOCS, "docs/ holds no .md page"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(path):
    problems = link_problems(read_page(path))
    assert not problems, report(problems)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_names_resolve(path):
    problems = name_problems(read_page(path))
    assert not problems, report(problems)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_calls_use_current_keywords(path):
    problems = call_problems(read_page(path))
    assert not problems, report(problems)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_exist(path):
    problems = path_problems(read_page(path))
    assert not problems, report(problems)


def test_every_docs_page_is_in_the_readme_map():
    readme = read_page(README)
    section = re.search(r"^## Documentation\n(.*?)(?=^## |\Z)", readme.text, flags=re.M | re.S)
    assert section, "README.md has no '## Documentation' section (the map of docs/)"
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(section.group(1))}
    missing = [p.relative_to(ROOT).as_posix() for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages missing from the README's documentation map: {missing}"


def test_the_box_names_resolve():
    """The bare names in the entry-points column of the README's "What is in the box" table (``run``,
    ``Checkpointing``) are attributes of ``psl``; its dotted ones are checked with every other name."""
    readme = read_page(README)
    section = re.search(r"^## What is in the box\n(.*?)(?=^## |\Z)", readme.text, flags=re.M | re.S)
    assert section, "README.md has no '## What is in the box' section"
    entry_points = " ".join(row.split("|")[2] for row in section.group(1).splitlines() if row.count("|") >= 4)
    names = {m.group(2) for m in CODE_SPAN.finditer(entry_points) if re.fullmatch(r"[A-Za-z_]\w*", m.group(2))}
    missing = sorted(name for name in names if not hasattr(psl, name))
    assert names and not missing, f"names in the README's table that psl does not have: {missing}"


def test_the_checks_can_fail(tmp_path):
    """A page with one of each mistake: every check reports it."""
    bad = tmp_path / "bad.md"
    bad.write_text(
        "# Bad page\n\n"
        "[gone](no_such_page.md) and [no anchor](#not-a-heading) and [ok](#bad-page)\n\n"
        "`psl.no_such_function, a span that crosses\na line end` and `psl.runner.no_such_name` and "
        "`pipeswift_lab.no_such_module`\n"
        "`RunResult.no_such_field` and `benchmarks/bench_nothing.py` and `99_no_notebook`\n\n"
        "```python\n"
        "from pipeswift_lab.core.costs import AssemblyModel, NoSuchModel\n"
        'psl.run(model, data, loss_fn, part, 4, checkpoint_dir="ckpt",\n'
        '        launch=psl.Launch(timeout_s=10, start_method="subprocess"))\n'
        "psl.plan(prof, 8, 64, 100, quantile=0.95)  # keyword=in_a_comment is not one\n"
        "```\n",
        encoding="utf-8",
    )
    page = read_page(bad)
    links = link_problems(page)
    assert len(links) == 2 and "no_such_page.md" in links[0] and "#not-a-heading" in links[1], links
    names = name_problems(page)
    for expected in (
        "psl.no_such_function",
        "psl.runner.no_such_name",
        "no_such_module",
        "RunResult.no_such_field",
        "NoSuchModel",
    ):
        assert any(expected in p for p in names), (expected, names)
    assert len(names) == 5, names
    calls = call_problems(page)
    assert sorted(p.split("— ")[1] for p in calls) == [
        "psl.plan takes no keyword 'quantile'",
        "psl.run takes no keyword 'checkpoint_dir'",
    ], calls
    paths = path_problems(page)
    assert len(paths) == 2 and "bench_nothing" in paths[0] and "99_no_notebook" in paths[1], paths


def test_slugs_follow_github():
    assert slug("Data-parallel replicas: P stages × D replicas") == "data-parallel-replicas-p-stages--d-replicas"
    assert slug('The tail: `objective="p95"`') == "the-tail-objectivep95"
    assert slug("Measured: `benchmarks/bench_cluster.py`") == "measured-benchmarksbench_clusterpy"
    page = read_page(Path("x.md"), "# A\n## A\n## A\n")
    assert anchors(page) == {"a", "a-1", "a-2"}
