"""Imports only go down the floors (docs/ARCHITECTURE.md, "Layers").

Each project package stands on a floor; a module may import modules of its own floor or of a lower
one, never of a higher one. The edges are the ones ``test_import_graph.build_graph`` finds (every
import, lazy and type-only ones included, since a lazy upward import is still a dependency on the
floor above: it only fails later). A package inside another one may have a floor of its own; a
module's floor is that of the longest entry of FLOORS its dotted name starts with.

A new top-level package needs a floor here (the test says so); an upward edge is either fixed or,
with its reason, listed in UPWARD_HOOKS (a documented hook, kept) or KNOWN_UPWARD (a debt, to fix).
Entries that no longer exist fail the test too, so the lists only shrink with the code.
"""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_import_graph import ALLOWED_EDGES, PACKAGES, build_graph

FLOORS: dict[str, int] = {
    "ckpt_common": 0,  # helpers every package uses; imports no other project package
    "ckpt_common.layout": 0,  # the model's tensor layout (shapes, HF <-> Megatron pieces): below engine and trainer
    "checkpoint_engine": 1,  # weight sync: daemon, engines, transport, sharding plan
    # the daemon's entry point (`torchrun -m checkpoint_engine`) wires vLLM's engine adapter into the
    # daemon (checkpoint_engine.engines.adapters): the one module of the package beside vllm_ext
    "checkpoint_engine.__main__": 2,
    "sandbox": 1,  # the code sandbox service (imports only ckpt_common)
    "demo": 1,  # the demo's task and tiny model (imports only ckpt_common)
    "vllm_ext": 2,  # the inference side for vLLM, on the checkpoint engine
    "trainer": 2,  # the training side (imports checkpoint_engine for the weight handoff, demo for the demo model)
    "orchestrator": 3,  # the RL job and its commands, on all of the above
    "testing": 4,  # test and benchmark support: may start any of the above
}

# Upward edges that are part of the design, each with its reason: the compat hook MoonshotAI's README
# gives vLLM (`checkpoint_engine.worker.VllmColocateWorkerExtension`), a module `__getattr__` that
# imports vllm_ext.worker only when vLLM asks for that name. Its reason is test_import_graph's.
UPWARD_HOOKS: dict[tuple[str, str], str] = {
    edge: ALLOWED_EDGES[edge] for edge in [("checkpoint_engine.worker", "vllm_ext.worker")]
}

# Upward edges known and not fixed yet, each with its reason (none today; none may be added without one).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def floor_of(module: str, floors: dict[str, int] = FLOORS) -> int | None:
    """The floor of the longest FLOORS entry that is `module` or a package above it; None if none is."""
    parts = module.removesuffix(".__init__").split(".")
    for end in range(len(parts), 0, -1):
        floor = floors.get(".".join(parts[:end]))
        if floor is not None:
            return floor
    return None


def upward_edges(
    edges: dict[tuple[str, str], list[tuple[str, int]]],
    floors: dict[str, int] = FLOORS,
    allowed: dict[tuple[str, str], str] | None = None,
) -> list[str]:
    """`src (floor) -> dst (floor)  (file:line, ...)` for each edge to a higher floor not in `allowed`;
    a module on no floor is reported too (its package needs one)."""
    allowed = {} if allowed is None else allowed
    found = []
    for (src, dst), where in sorted(edges.items()):
        lo, hi = floor_of(src, floors), floor_of(dst, floors)
        located = ", ".join(f"{f}:{line}" for f, line in where)
        if lo is None or hi is None:
            missing = src if lo is None else dst
            found.append(f"{missing} is on no floor (add its package to FLOORS)  ({located})")
        elif hi > lo and (src, dst) not in allowed:
            found.append(f"{src} (floor {lo}) -> {dst} (floor {hi})  ({located})")
    return found


def test_every_package_has_a_floor():
    assert set(PACKAGES) <= set(FLOORS), f"packages on no floor: {sorted(set(PACKAGES) - set(FLOORS))}"


def test_every_import_goes_to_the_same_or_a_lower_floor():
    graph = build_graph()
    assert len(graph.edges) > 100  # the scan found the project
    listed = {**UPWARD_HOOKS, **KNOWN_UPWARD}
    stale = sorted(edge for edge in listed if edge not in graph.edges)
    assert not stale, f"listed upward imports that no longer exist (drop them): {stale}"
    upward = upward_edges(graph.edges, FLOORS, listed)
    assert not upward, "imports that go up a floor (fix them; see docs/ARCHITECTURE.md):\n  " + "\n  ".join(upward)


def test_an_upward_edge_is_reported_with_where_it_is(tmp_path: Path):
    """The check itself, on a planted tree: a lazy import from a low floor up is reported with its file
    and line, imports down and sideways are not, an allowed edge is not, a package's own floor counts
    for its subpackage, and a module on no floor is named."""
    (tmp_path / "low" / "inner").mkdir(parents=True)
    (tmp_path / "high").mkdir()
    (tmp_path / "stray").mkdir()
    for init in ("low", "low/inner", "high", "stray"):
        (tmp_path / init / "__init__.py").write_text("")
    (tmp_path / "low" / "a.py").write_text("import os\n\n\ndef f():\n    from high import b\n")
    (tmp_path / "low" / "inner" / "c.py").write_text("from low import a\nfrom high.b import B\n")
    (tmp_path / "high" / "b.py").write_text("from low.a import f\nB = 1\n")
    (tmp_path / "high" / "d.py").write_text("from high import b\nfrom stray import e\n")
    (tmp_path / "stray" / "e.py").write_text("")
    floors = {"low": 0, "low.inner": 1, "high": 1}
    graph = build_graph(tmp_path, ("low", "high", "stray"))
    assert upward_edges(graph.edges, floors) == [
        "stray.e is on no floor (add its package to FLOORS)  (high/d.py:2)",
        "low.a (floor 0) -> high.b (floor 1)  (low/a.py:5)",
    ]
    assert floor_of("low.inner.c", floors) == 1 and floor_of("low.__init__", floors) == 0
    assert floor_of("low.inner.__init__", floors) == 1 and floor_of("elsewhere.x", floors) is None
    assert upward_edges(graph.edges, {**floors, "stray": 0}, {("low.a", "high.b"): "planted"}) == []
