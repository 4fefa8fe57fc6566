"""k1.5 test-case generation through a real (in-process) sandbox, on the shipped tiny problems
with planted wrong reference solutions, and the CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sandbox.bwrap import DEFAULT_PYTHON_PACKAGES, python_package_binds
from sandbox.config import SandboxConfig
from sandbox.executor import Sandbox
from sandbox.judge import judge_submission
from sandbox.testgen import Problem, Solution, TestGenConfig, build_problem, load_problems

from .conftest import REPO

pytestmark = pytest.mark.sandbox
PROBLEMS = REPO / "sandbox" / "problems"


@pytest.fixture(scope="module")
def sandbox(bwrap_ok):
    sb = Sandbox(
        SandboxConfig(python_lib_binds=python_package_binds(DEFAULT_PYTHON_PACKAGES, required=True), pool_size=4)
    )
    yield sb
    sb.close()


@pytest.fixture(scope="module")
def reports(sandbox):
    cfg = TestGenConfig(num_inputs=12, seed=3)
    return {p.name: build_problem(sandbox, p, cfg, num_threads=2) for p in load_problems([str(PROBLEMS)])}


def failing(report) -> dict[str, bool]:
    """name -> planted_wrong, for the solutions that fail kept cases."""
    return {s.name: s.planted_wrong for s in report.solutions if not s.passes_all_kept}


def test_one_planted_wrong_solution_is_caught_and_the_problem_kept(reports):
    rep = reports["sum_list"]
    assert rep.kept, rep.reason
    assert len(rep.test_cases) == 12 and failing(rep) == {"abs_bug": True}
    rep = reports["reverse_string"]
    assert rep.kept, rep.reason
    assert failing(rep) == {"truncates_long": True}


def test_two_planted_wrong_solutions_drop_the_problem(reports):
    rep = reports["max_list"]
    assert not rep.kept
    assert "only 8 of 10 reference solutions pass" in rep.reason
    assert failing(rep) == {"zero_init": True, "max_as_string": True}
    assert rep.test_cases == ()


def test_cases_without_agreement_are_dropped(reports):
    rep = reports["any_max_index"]
    assert rep.kept, rep.reason
    dropped = [d for d in rep.cases if not d.kept]
    assert dropped and len(rep.test_cases) == 12 - len(dropped) > 0
    assert all(d.agreement < 7 or "duplicate" in d.reason for d in dropped)
    assert failing(rep) == {}


def test_kept_cases_judge_the_reference_solutions(sandbox, reports):
    problem = {p.name: p for p in load_problems([str(PROBLEMS)])}["sum_list"]
    cases = reports["sum_list"].test_cases
    good = next(s for s in problem.solutions if not s.planted_wrong)
    wrong = next(s for s in problem.solutions if s.planted_wrong)
    assert judge_submission(sandbox, "python", good.code, cases).all_passed
    assert not judge_submission(sandbox, "python", wrong.code, cases).all_passed


def test_a_failing_generator_drops_the_problem(sandbox):
    problem = Problem(
        name="broken", generator="import cyaron\nprint('not json')", solutions=(Solution("s", "print(1)"),)
    )
    rep = build_problem(sandbox, problem, TestGenConfig(num_inputs=3))
    assert not rep.kept and "generator failed" in rep.reason and "not JSON" in rep.reason


def test_cli_reports_and_writes_kept_cases(bwrap_ok, tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sandbox.testgen",
            "--problems",
            str(PROBLEMS / "sum_list.json"),
            str(PROBLEMS / "max_list.json"),
            "--num-inputs",
            "8",
            "--out",
            str(out_dir),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["problems"] == 2 and summary["kept"] == 1
    assert summary["num_cases"] == {"sum_list": 8} and "max_list" in summary["dropped"]
    assert any(line.startswith("KEEP sum_list") for line in lines)
    assert any("abs_bug (planted wrong)" in line for line in lines)
    kept = json.loads((out_dir / "sum_list.json").read_text())
    assert len(kept["test_cases"]) == 8 and not (out_dir / "max_list.json").exists()
    assert len(json.loads((out_dir / "report.json").read_text())) == 2
