"""The console scripts of setup.py: each names a main() that exists, is installed beside this
interpreter, and answers ``--help`` with exit code 0 without importing a heavy library (torch, vLLM,
transformers, megatron): instant, checked without a clock (a timed check fails on a loaded machine).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
HEAVY = {"torch", "vllm", "transformers", "megatron"}


def console_scripts() -> dict[str, tuple[str, str]]:
    """{script: (module, function)} as setup.py declares them (read with ast: setup.py is not run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            entry_points = ast.literal_eval(node.value)
            scripts = {}
            for line in entry_points["console_scripts"]:
                name, target = (part.strip() for part in line.split("="))
                module, function = target.split(":")
                scripts[name] = (module, function)
            return scripts
    raise AssertionError("setup.py declares no entry_points")


SCRIPTS = console_scripts()


def test_the_user_facing_commands_have_console_scripts():
    assert set(SCRIPTS) == {
        "ckpt-rl",
        "ckpt-long2short",
        "ckpt-curate",
        "ckpt-sandbox",
        "ckpt-vllm-launch",
        "ckpt-vllm-push",
    }


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_script_names_a_main_that_exists(script):
    module, function = SCRIPTS[script]
    path = REPO / pathlib.Path(*module.split("."))
    source = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
    assert source.exists(), f"{script}: no module {module} ({source})"
    defined = {n.name for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert function in defined, f"{script}: {module} defines no {function}()"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_installed_script_answers_help_without_heavy_imports(script):
    installed = pathlib.Path(sys.executable).parent / script
    assert installed.exists(), f"{installed} is missing: run `bash scripts/setup.sh` (it installs the project)"
    # the installed wrapper run by this interpreter, so that -X importtime lists what it imports
    out = subprocess.run(
        [sys.executable, "-X", "importtime", str(installed), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout, out.stdout[:500]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & HEAVY, f"{script} --help imports {sorted(imported & HEAVY)}"
