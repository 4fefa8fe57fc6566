"""Each name is imported from the module that defines it: no re-export webs.

`from a.b import Name` anywhere in the repository (the packages, tests, benchmarks, examples,
scripts) must name a module `a.b` that defines `Name` at its top level (a function, a class, an
assignment, also under a top-level `if`/`try`) or has a submodule `Name`. Importing a name through a
module that only imports it itself gives that name a second import path, which breaks silently when
the middle module stops needing it. A package's `__init__` may export its public surface, and a
module with a module-level `__getattr__` (the documented compat hooks) resolves names itself: both are
exempt. Parsed with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("checkpoint_engine", "ckpt_common", "vllm_ext", "orchestrator", "trainer", "demo", "sandbox", "testing")
SCANNED = (*PACKAGES, "tests", "benchmarks", "examples", "scripts")


def _module_files(root: Path) -> dict[str, Path]:
    files = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body)
            stack.extend(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                stack.extend(handler.body)
            stack.extend(getattr(node, "finalbody", []))
    return names


def reexported_imports(root: Path = REPO, scanned: tuple[str, ...] = SCANNED) -> list[str]:
    """`file:line: from a import N (N is defined elsewhere)` for each import through a re-export."""
    files = _module_files(root)
    defined: dict[str, set[str] | None] = {}  # None: exempt (package __init__, module __getattr__)
    for module, path in files.items():
        names = _top_level_names(ast.parse(path.read_text(encoding="utf-8")))
        exempt = path.name == "__init__.py" or "__getattr__" in names
        defined[module] = None if exempt else names
    found = []
    for top in scanned:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            package = ".".join(rel.with_suffix("").parts[:-1])
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], node.module or ""]).strip(".")
                else:
                    base = node.module or ""
                names = defined.get(base)
                if names is None:
                    continue
                for alias in node.names:
                    if alias.name != "*" and alias.name not in names and f"{base}.{alias.name}" not in files:
                        found.append(f"{rel}:{node.lineno}: from {base} import {alias.name} (not defined there)")
    return found


def test_every_name_is_imported_from_the_module_that_defines_it():
    found = reexported_imports()
    assert not found, "import these from the module that defines them:\n  " + "\n  ".join(found)


def test_the_scan_finds_an_import_through_a_re_export(tmp_path: Path):
    pkg = tmp_path / "checkpoint_engine"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from checkpoint_engine.a import A\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("A = 1\nif True:\n    B = 2\n\n\ndef f():\n    pass\n")
    (pkg / "b.py").write_text("from checkpoint_engine.a import A, B, f\n")  # defined there: fine
    (pkg / "c.py").write_text("from checkpoint_engine.b import A\nfrom checkpoint_engine import A as X\n")
    (pkg / "sub" / "d.py").write_text("from ..b import f\nfrom checkpoint_engine import sub\n")
    found = reexported_imports(tmp_path, ("checkpoint_engine",))
    assert found == [
        "checkpoint_engine/c.py:1: from checkpoint_engine.b import A (not defined there)",
        "checkpoint_engine/sub/d.py:1: from checkpoint_engine.b import f (not defined there)",
    ]
