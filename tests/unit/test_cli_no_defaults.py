"""No command line restates a default: every entry point's flags come from config dataclasses
(ckpt_common.cli_config) or name a constant defined once (`add_log_level_flag`, `DEFAULT_CACHE_DIR`);
no argparse call writes a literal value as a default (None and empty containers say "no value").

A new entry point joins ENTRY_POINTS."""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ENTRY_POINTS = (
    "checkpoint_engine/__main__.py",
    "vllm_ext/push.py",
    "vllm_ext/launch.py",
    "orchestrator/__main__.py",
    "orchestrator/curation.py",
    "orchestrator/long2short/cli.py",
    "sandbox/__main__.py",
    "sandbox/testgen.py",
    "orchestrator/tasks/demo_export.py",
    "trainer/sft.py",
)


def _literal(node: ast.expr) -> bool:
    """A value written in place (8400, "INFO", [1]); not None, an empty container or a named constant."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return bool(node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    return isinstance(node, (ast.UnaryOp, ast.BinOp)) and all(
        _literal(n) for n in ast.iter_child_nodes(node) if isinstance(n, ast.expr)
    )


def argparse_defaults(source: str, name: str) -> list[str]:
    """`name:line` of every argparse call in `source` that writes a literal default: `add_argument(...,
    default=8400)`, `set_defaults(port=1)`, `ArgumentParser(argument_default=0)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = getattr(node.func, "attr", getattr(node.func, "id", ""))
        literal = {k.arg for k in node.keywords if _literal(k.value)}
        if (
            (func == "add_argument" and "default" in literal)
            or (func == "set_defaults" and literal)
            or (func == "ArgumentParser" and "argument_default" in literal)
        ):
            found.append(f"{name}:{node.lineno}")
    return found


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_the_entry_point_restates_no_default(path):
    assert argparse_defaults((REPO / path).read_text(), path) == []


def test_the_scan_finds_each_way_of_writing_a_default():
    source = (
        "import argparse\np = argparse.ArgumentParser(argument_default=0)\n"
        "p.add_argument('--port', type=int, default=8400)\np.set_defaults(port=1)\np.add_argument('--uds')\n"
        "p.add_argument('--level', default='INFO')\np.add_argument('--x', default=-1.5)\n"
        "p.add_argument('--y', default=None)\np.add_argument('--z', default=[])\np.add_argument('--w', default=PORT)\n"
    )
    assert argparse_defaults(source, "x.py") == ["x.py:2", "x.py:3", "x.py:4", "x.py:6", "x.py:7"]
