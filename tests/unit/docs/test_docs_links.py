"""The user docs point at things that exist.

Checked in README.md, tests/README.md and every docs/*.md:

- every relative Markdown link and image (``[text](path)``, ``![alt](path)``, ``[ref]: path``) names an
  existing file or folder, and every ``#anchor`` into a Markdown file (or within the same file) matches
  one of its headings, slugged as GitHub does (lowercase, punctuation dropped, spaces to '-', a repeated
  heading gets -1, -2, ...);
- every ``python -m MODULE`` (and ``torchrun ... -m MODULE``) in code, fenced or inline, names a module
  that can run: ``MODULE.py`` or ``MODULE/__main__.py`` under the repository for the project's own
  packages, else inside an installed top-level package found with ``importlib.util.find_spec`` on its
  top-level name only (nothing is imported);
- every repository path in code (a token with a '/' ending in .py, .json, .md, .sh or .yaml whose first
  folder is one of the repository's own) exists;
- README.md stays short.

A failure names the file, the line and the broken target.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
README_MAX_LINES = 250

# Top-level folders that runs create (git-ignored): paths under them are outputs, not repository files.
OUTPUT_ROOTS = frozenset({"runs", ".cache", "out", ".venv", ".whl", "build", "dist"})
PATH_SUFFIXES = (".py", ".json", ".md", ".sh", ".yaml")

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
PYTHON_M = re.compile(r"(?:^|[\s/\"'(])python3?(?:\.\d+)?\s+(?:-\w+\s+)*?-m\s+([A-Za-z_][\w.]*)")
TORCHRUN_M = re.compile(r"(?:^|[\s/\"'(])torchrun\b[^|;&]*?\s-m\s+([A-Za-z_][\w.]*)")
PATH_TOKEN = re.compile(r"^[\w.\-/]+$")


@dataclass(frozen=True)
class Line:
    number: int
    text: str  # the line as written
    prose: str  # outside code: inline code spans blanked
    code: tuple[str, ...]  # the code on the line: the whole line in a fence, else its inline spans
    in_fence: bool


def doc_files() -> list[pathlib.Path]:
    return [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def rel(path: pathlib.Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def lines_of(text: str) -> Iterator[Line]:
    fence: str | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        m = FENCE.match(raw)
        if fence is not None:
            if m and m.group(1) == fence:
                fence = None
            else:
                yield Line(number, raw, "", (raw,), True)
            continue
        if m:
            fence = m.group(1)
            continue
        spans = tuple(s.group(2) for s in INLINE_CODE.finditer(raw))
        prose = INLINE_CODE.sub(lambda s: " " * len(s.group(0)), raw)
        yield Line(number, raw, prose, spans, False)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path, cache: dict[pathlib.Path, set[str]]) -> set[str]:
    if path not in cache:
        seen: dict[str, int] = {}
        found: set[str] = set()
        for line in lines_of(path.read_text(encoding="utf-8")):
            m = None if line.in_fence else HEADING.match(line.text)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def link_targets(line: Line) -> Iterator[str]:
    if line.in_fence:
        return
    for m in LINK.finditer(line.prose):
        yield m.group(1)
    m = REF_DEF.match(line.prose)
    if m:
        yield m.group(1)


def check_links(doc: pathlib.Path, cache: dict[pathlib.Path, set[str]] | None = None) -> list[str]:
    cache = {} if cache is None else cache
    problems = []
    for line in lines_of(doc.read_text(encoding="utf-8")):
        for target in link_targets(line):
            if re.match(r"^[a-zA-Z][\w+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            where = f"{rel(doc)}:{line.number}"
            dest = doc if not path_part else (doc.parent / path_part).resolve()
            if not dest.exists():
                problems.append(f"{where}: link to {target!r}: no such file ({rel(dest)})")
                continue
            if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest, cache):
                known = ", ".join(sorted(anchors(dest, cache)))
                problems.append(f"{where}: link to {target!r}: no heading '#{anchor}' in {rel(dest)} (known: {known})")
    return problems


def module_runs(name: str) -> bool:
    """Whether ``python -m name`` finds something to run, without importing anything."""
    parts = name.split(".")
    own = REPO / parts[0]
    if (own / "__init__.py").is_file() or own.with_suffix(".py").is_file():
        base = REPO.joinpath(*parts)
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    spec = importlib.util.find_spec(parts[0])  # a top-level name: no parent package is imported
    if spec is None:
        return False
    if len(parts) == 1:
        return True
    for location in spec.submodule_search_locations or ():
        base = pathlib.Path(location).joinpath(*parts[1:])
        if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
            return True
    return False


def check_modules(doc: pathlib.Path) -> list[str]:
    problems = []
    for line in lines_of(doc.read_text(encoding="utf-8")):
        for code in line.code:
            for pattern in (PYTHON_M, TORCHRUN_M):
                for m in pattern.finditer(code):
                    name = m.group(1).rstrip(".")
                    if not module_runs(name):
                        problems.append(f"{rel(doc)}:{line.number}: `python -m {name}`: no such module")
    return problems


def repo_paths(code: str) -> Iterator[str]:
    for token in re.split(r"[\s=,;|<>]+", code):
        token = token.split("::", 1)[0].strip("\"'()[]{}.,:;`*")
        if "/" not in token or not token.endswith(PATH_SUFFIXES) or not PATH_TOKEN.match(token):
            continue
        token = token.removeprefix("./")
        first = token.split("/", 1)[0]
        if first in OUTPUT_ROOTS or first in ("", "~", "..") or not (REPO / first).exists():
            continue
        yield token


def check_paths(doc: pathlib.Path) -> list[str]:
    problems = []
    for line in lines_of(doc.read_text(encoding="utf-8")):
        for code in line.code:
            for path in repo_paths(code):
                if not (REPO / path).exists():
                    problems.append(f"{rel(doc)}:{line.number}: path `{path}` does not exist in the repository")
    return problems


DOCS = doc_files()
IDS = [rel(d) for d in DOCS]


def test_every_doc_file_is_found():
    assert (REPO / "README.md").is_file()
    assert len(DOCS) >= 3, DOCS


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_links_and_anchors_resolve(doc):
    problems = check_links(doc)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_python_m_modules_exist(doc):
    problems = check_modules(doc)
    assert not problems, "modules that do not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_quoted_repository_paths_exist(doc):
    problems = check_paths(doc)
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def test_readme_is_short():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md: {n} lines, at most {README_MAX_LINES} (move detail into docs/)"


def test_the_checks_report_broken_targets(tmp_path):
    """The checker itself: each kind of broken target is reported with file and line; good ones are not."""
    (tmp_path / "other.md").write_text("# A Title: with `code`, punctuation!\n## Twice\n## Twice\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n"
        "[ok](other.md#a-title-with-code-punctuation) [ok2](other.md#twice-1) [self](#doc) ![img](other.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [web](https://example.com/x.md)\n"
        "```bash\n"
        "python -m checkpoint_engine --help   # [not a link](nowhere.md)\n"
        ".venv/bin/python -m no_such_package_xyz.sub\n"
        "torchrun --nproc-per-node 2 -m checkpoint_engine.nothing_here --port 1\n"
        "python benchmarks/no_such_bench.py --out runs/demo/summary.json\n"
        "```\n"
        "`python -m pytest` `configs/demo.json` `configs/nope.json` `runs/x/metrics.json`\n"
    )
    links = check_links(doc)
    assert len(links) == 2, links
    assert links[0].startswith(f"{doc}:3: link to 'missing.md'")
    assert "no heading '#nope'" in links[1]
    modules = check_modules(doc)
    assert [m.split(": ", 1)[1] for m in modules] == [
        "`python -m no_such_package_xyz.sub`: no such module",
        "`python -m checkpoint_engine.nothing_here`: no such module",
    ]
    assert modules[0].startswith(f"{doc}:6:")
    paths = check_paths(doc)
    assert [p.split(": ", 1)[0] for p in paths] == [f"{doc}:8", f"{doc}:10"]
    assert "benchmarks/no_such_bench.py" in paths[0] and "configs/nope.json" in paths[1]
