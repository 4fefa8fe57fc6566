"""No import loops between the project's own modules, helpers below everything, and folders of a
size a newcomer can read.

Every ``.py`` file of the project packages is parsed with ``ast`` (nothing is imported) and each
import between two project modules becomes an edge: top-level imports and the ones inside
functions (lazy imports) alike, since a lazy import that closes a loop is still a loop, it only
fails later, and the ones under ``if TYPE_CHECKING:``: they never run, but two modules that name
each other's types still cannot be read, tested or moved apart (and a type-only import becomes a
runtime one as soon as the name is needed at run time). Relative imports are
resolved, ``from pkg import name`` is an edge to ``pkg.name`` when that is a module and to
``pkg/__init__`` when ``name`` is a name defined (or exported) there. A package's ``__init__`` is a
module like any other: its own imports are edges too. The implicit import of the parent packages
(``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first) is not an edge.

The strongly connected components of that graph are the loops; the test fails naming each one as
a chain ``a -> b -> c -> a`` with the file and line of every import in it.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("checkpoint_engine", "ckpt_common", "vllm_ext", "orchestrator", "trainer", "demo", "sandbox", "testing")

# (importing module, imported module) edges that may close a loop, each with the reason.
ALLOWED_EDGES: dict[tuple[str, str], str] = {
    # The documented compat hook: MoonshotAI's checkpoint-engine tells users to pass
    # `--worker-extension-cls checkpoint_engine.worker.VllmColocateWorkerExtension` to vLLM. The class
    # lives on the vLLM side (vllm_ext.worker, whose receiver uses checkpoint_engine.worker's
    # update_weights_from_ipc), so checkpoint_engine.worker's module `__getattr__` imports it only when
    # that name is asked for (vLLM resolves the flag with import_module + getattr). It is the engine
    # core's only reference upward; importing checkpoint_engine.worker never imports vllm_ext or vLLM.
    ("checkpoint_engine.worker", "vllm_ext.worker"): "lazy hook: checkpoint_engine.worker.VllmColocateWorkerExtension",
}


@dataclass
class Graph:
    files: dict[str, Path] = field(default_factory=dict)  # module -> file
    # (src, dst) -> [(file, line), ...] in source order
    edges: dict[tuple[str, str], list[tuple[str, int]]] = field(default_factory=dict)

    def successors(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {m: [] for m in self.files}
        for src, dst in self.edges:
            out[src].append(dst)
        for targets in out.values():
            targets.sort()
        return out


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts)  # a package's __init__ stays "pkg.__init__": an edge to it is an edge to that file


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in the file: module level, functions, TYPE_CHECKING blocks."""
    found = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    found.sort(key=lambda n: n.lineno)
    return found


def build_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> Graph:
    graph = Graph()
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            graph.files[module_name(path, root)] = path
    modules = set(graph.files)

    def node_of(dotted: str) -> str | None:
        """The file a dotted module name runs: `pkg` -> `pkg.__init__`."""
        if dotted in modules:
            return dotted
        if f"{dotted}.__init__" in modules:
            return f"{dotted}.__init__"
        return None

    for mod, path in graph.files.items():
        is_init = mod.endswith(".__init__")
        package = mod[: -len(".__init__")] if is_init else mod.rpartition(".")[0]
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)

        def add(dst: str | None, line: int, mod: str = mod, rel: str = rel) -> None:
            if dst is not None and (rel, line) not in (where := graph.edges.setdefault((mod, dst), [])):
                where.append((rel, line))

        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(node_of(alias.name), node.lineno)
                continue
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(p for p in [*base_parts, node.module or ""] if p)
            else:
                base = node.module or ""
            for alias in node.names:
                target = node_of(f"{base}.{alias.name}") if alias.name != "*" else None
                add(target or node_of(base), node.lineno)
    return graph


def strongly_connected(succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit); components with a loop only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(succ):
        if start in index:
            continue
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            targets = succ[v]
            if i < len(targets):
                work.append((v, i + 1))
                w = targets[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if work:  # v is done: fold its low-link into the caller's
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in succ[v]:
                    comps.append(sorted(comp))
    return sorted(comps)


def shortest_cycle(succ: dict[str, list[str]], start: str, members: set[str]) -> list[str]:
    """start -> ... -> start, fewest imports, staying inside the component."""
    prev: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        v = queue.popleft()
        for w in succ[v]:
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w not in seen:
                seen.add(w)
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in a component but on no cycle")


def describe_loops(graph: Graph, succ: dict[str, list[str]], comps: list[list[str]]) -> list[str]:
    """Each component as chains that together pass through all its modules, every import located."""
    out = []
    for comp in comps:
        members = set(comp)
        covered: set[str] = set()
        chains = []
        for start in comp:
            if start in covered:
                continue
            cycle = shortest_cycle(succ, start, members)
            covered.update(cycle)
            hops = [
                f"    {a} -> {b}  ({', '.join(f'{f}:{n}' for f, n in graph.edges[a, b])})"
                for a, b in itertools.pairwise(cycle)
            ]
            chains.append("  " + " -> ".join(cycle) + "\n" + "\n".join(hops))
        out.append(f"loop through {len(comp)} modules:\n" + "\n".join(chains))
    return out


def test_no_import_loops():
    graph = build_graph()
    assert len(graph.files) > 100, sorted(graph.files)  # the scan found the project
    stale = sorted(e for e in ALLOWED_EDGES if e not in graph.edges)
    assert not stale, f"allowlisted imports that no longer exist (drop them from ALLOWED_EDGES): {stale}"
    for edge in ALLOWED_EDGES:
        del graph.edges[edge]
    succ = graph.successors()
    loops = describe_loops(graph, succ, strongly_connected(succ))
    assert not loops, f"{len(loops)} import loop(s) between project modules:\n\n" + "\n\n".join(loops)


def test_the_helpers_import_no_other_project_package():
    """`ckpt_common` sits below every package: none of its modules imports the product or the RL side."""
    graph = build_graph()
    upward = sorted(
        f"{src} -> {dst}  ({', '.join(f'{f}:{line}' for f, line in where)})"
        for (src, dst), where in graph.edges.items()
        if src.startswith("ckpt_common") and not dst.startswith("ckpt_common")
    )
    assert not upward, "ckpt_common imports other project packages:\n  " + "\n  ".join(upward)


MAX_MODULES_PER_FOLDER = 20  # beyond this a folder stops saying what its modules are for: make a room


def test_no_folder_holds_more_than_twenty_modules():
    """Each package folder groups its modules by the part of the architecture they serve: at most
    MAX_MODULES_PER_FOLDER modules at one level (``__init__`` and ``__main__`` not counted)."""
    crowded = {}
    for package in PACKAGES:
        for folder in [REPO / package, *(p.parent for p in (REPO / package).rglob("*/__init__.py"))]:
            modules = [p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            if len(modules) > MAX_MODULES_PER_FOLDER:
                crowded[str(folder.relative_to(REPO))] = len(modules)
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules (group them into subpackages): {crowded}"


def test_finds_a_loop_and_resolves_imports(tmp_path: Path):
    """The scanner itself: a planted loop (relative, lazy, type-only and package imports) is found and named."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nA = 1\nif TYPE_CHECKING:\n    from pkg.sub import d\n")
    (pkg / "b.py").write_text("import os\n\ndef f():\n    from .sub import d\n")
    (pkg / "c.py").write_text("from pkg import b, A\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from .. import c\nimport pkg.sub\n")
    graph = build_graph(tmp_path, ("pkg",))
    assert graph.edges == {
        ("pkg.__init__", "pkg.a"): [("pkg/__init__.py", 1)],
        ("pkg.a", "pkg.sub.d"): [("pkg/a.py", 4)],  # type-only imports count
        ("pkg.b", "pkg.sub.d"): [("pkg/b.py", 4)],  # lazy and relative; `os` is not ours
        ("pkg.c", "pkg.b"): [("pkg/c.py", 1)],
        ("pkg.c", "pkg.__init__"): [("pkg/c.py", 1)],  # `A` is a name, not a module: pkg/__init__
        ("pkg.sub.d", "pkg.c"): [("pkg/sub/d.py", 1)],
        ("pkg.sub.d", "pkg.sub.__init__"): [("pkg/sub/d.py", 2)],
    }
    succ = graph.successors()
    comps = strongly_connected(succ)
    assert comps == [["pkg.__init__", "pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]
    (text,) = describe_loops(graph, succ, comps)
    assert "pkg.__init__ -> pkg.a -> pkg.sub.d -> pkg.c -> pkg.__init__" in text
    assert "pkg.b -> pkg.sub.d -> pkg.c -> pkg.b" in text
    assert "pkg.b -> pkg.sub.d  (pkg/b.py:4)" in text and "pkg.a -> pkg.sub.d  (pkg/a.py:4)" in text
