"""Test-case generation as in Kimi k1.5, through the sandbox.

    problem.generator (cyaron) ──stdin "SEED COUNT"──▶ JSON list of COUNT inputs   (1 sandbox run)
    each input × each reference solution ──▶ outputs matrix [solution][case]        (sandbox runs)
    select_cases:   keep a case when >= min_case_agreement outputs agree (7 of 10); its output
                    is the agreed one
    decide_problem: keep the problem when >= min_solutions_passing solutions (9 of 10) pass
                    every kept case

Problem file format (JSON; a file holds one problem object or {"problems": [...]}, a directory
holds *.json files):

    {"name": "sum_list", "statement": "...", "language": "python",
     "generator": "<python source using cyaron: reads 'SEED COUNT', prints a JSON list of inputs>",
     "solutions": [{"name": "builtin", "code": "..."},
                   {"name": "abs_bug", "code": "...", "planted_wrong": true}, ...]}

CLI: python -m sandbox.testgen --problems DIR_OR_FILE [...] [--out DIR]
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from ckpt_common.cli_config import meta
from ckpt_common.validate import check_int

from .judge import normalize_output
from .models import COMPARE_MODES, RunRequest, RunResult, TestCase


@dataclass(frozen=True)
class TestGenConfig:
    """Thresholds of k1.5's recipe (defaults: 50 inputs, 7 of 10 agree, 9 of 10 pass); each field is
    a flag of `python -m sandbox.testgen`."""

    __test__ = False

    num_inputs: int = field(default=50, metadata=meta("inputs the generator makes per problem"))
    min_case_agreement: int = field(default=7, metadata=meta("solutions whose outputs must agree to keep a case"))
    min_solutions_passing: int = field(
        default=9, metadata=meta("solutions that must pass every kept case to keep the problem")
    )
    seed: int = field(default=0, metadata=meta("the generator's seed"))
    generator_timeout_s: float = field(default=20.0, metadata=meta("wall time of one generator run"))
    solution_timeout_s: float = field(default=2.0, metadata=meta("wall time of one solution run"))
    memory_mb: int = field(default=256, metadata=meta("memory of each run"))
    compare: str = field(default="lines", metadata=meta("how outputs are compared", choices=COMPARE_MODES))

    def __post_init__(self) -> None:
        for name in ("num_inputs", "min_case_agreement", "min_solutions_passing", "memory_mb"):
            check_int(name, getattr(self, name))
        for name in ("generator_timeout_s", "solution_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.compare not in COMPARE_MODES:
            raise ValueError(f"compare must be one of {COMPARE_MODES}, got {self.compare!r}")


@dataclass(frozen=True)
class Solution:
    name: str
    code: str
    language: str = "python"
    planted_wrong: bool = False


@dataclass(frozen=True)
class Problem:
    name: str
    generator: str
    solutions: tuple[Solution, ...]
    statement: str = ""
    generator_language: str = "python"

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"problem name must be a non-empty file-name-safe string, got {self.name!r}")
        if not self.generator.strip():
            raise ValueError(f"problem {self.name}: generator is empty")
        if not self.solutions:
            raise ValueError(f"problem {self.name}: solutions is empty")


@dataclass(frozen=True)
class CaseDecision:
    index: int
    kept: bool
    agreement: int  # how many solutions produced the most common output
    reason: str


@dataclass(frozen=True)
class SolutionReport:
    name: str
    planted_wrong: bool
    passes_all_kept: bool
    failed_cases: tuple[int, ...]
    statuses: dict[str, int]


@dataclass(frozen=True)
class ProblemReport:
    name: str
    kept: bool
    reason: str
    test_cases: tuple[TestCase, ...] = ()
    cases: tuple[CaseDecision, ...] = ()
    solutions: tuple[SolutionReport, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


class Runner(Protocol):
    """`executor.Sandbox` (in process) and `client.SandboxClient` (over HTTP) both fit."""

    def run(self, request: RunRequest) -> RunResult: ...


# ------------------------------------------------------------------------------- pure logic
def majority_output(outputs: Sequence[str | None], compare: str = "lines") -> tuple[int, int]:
    """(index of a solution holding the most common output, how many agree on it); failed runs
    (None) never agree with anything. (-1, 0) when every run failed."""
    keys = [None if o is None else normalize_output(o, compare) for o in outputs]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return -1, 0
    best_key, best_count = counts.most_common(1)[0]
    return keys.index(best_key), best_count


def select_cases(
    inputs: Sequence[str], outputs: Sequence[Sequence[str | None]], cfg: TestGenConfig
) -> tuple[list[TestCase], list[CaseDecision], list[int]]:
    """Kept test cases, a decision per input, and the input index of each kept case.

    outputs[s][c] is solution s's stdout on input c, None when that run did not end `ok`."""
    kept, decisions, kept_index = [], [], []
    first_seen: dict[str, int] = {}
    for c, stdin in enumerate(inputs):
        if stdin in first_seen:
            decisions.append(CaseDecision(c, False, 0, f"duplicate of input {first_seen[stdin]}"))
            continue
        first_seen[stdin] = c
        column = [row[c] for row in outputs]
        holder, agreement = majority_output(column, cfg.compare)
        if agreement >= cfg.min_case_agreement:
            kept.append(TestCase(stdin, column[holder]))
            kept_index.append(c)
            decisions.append(CaseDecision(c, True, agreement, f"{agreement} of {len(column)} outputs agree"))
        else:
            decisions.append(
                CaseDecision(
                    c,
                    False,
                    agreement,
                    f"only {agreement} of {len(column)} outputs agree (need {cfg.min_case_agreement})",
                )
            )
    return kept, decisions, kept_index


def decide_problem(
    name: str,
    solutions: Sequence[Solution],
    inputs: Sequence[str],
    outputs: Sequence[Sequence[str | None]],
    statuses: Sequence[Sequence[str]],
    cfg: TestGenConfig,
) -> ProblemReport:
    """Apply both k1.5 filters to one problem's outputs matrix."""
    kept, decisions, kept_index = select_cases(inputs, outputs, cfg)
    reports = []
    for s, solution in enumerate(solutions):
        failed = tuple(
            c
            for case, c in zip(kept, kept_index)
            if outputs[s][c] is None
            or normalize_output(outputs[s][c], cfg.compare) != normalize_output(case.output, cfg.compare)
        )
        reports.append(
            SolutionReport(solution.name, solution.planted_wrong, not failed, failed, dict(Counter(statuses[s])))
        )
    num_passing = sum(r.passes_all_kept for r in reports)
    if not kept:
        reason = f"no case reached agreement ({cfg.min_case_agreement} of {len(solutions)} outputs)"
        return ProblemReport(name, False, reason, (), tuple(decisions), tuple(reports))
    if num_passing < cfg.min_solutions_passing:
        reason = (
            f"only {num_passing} of {len(solutions)} reference solutions pass all "
            f"{len(kept)} kept cases (need {cfg.min_solutions_passing})"
        )
        return ProblemReport(name, False, reason, (), tuple(decisions), tuple(reports))
    reason = (
        f"kept {len(kept)} of {len(inputs)} cases; {num_passing} of {len(solutions)} "
        f"reference solutions pass all of them"
    )
    return ProblemReport(name, True, reason, tuple(kept), tuple(decisions), tuple(reports))


# ------------------------------------------------------------------------------ problem files
def _problem_from_dict(data: dict, origin: str) -> Problem:
    try:
        language = data.get("language", "python")
        solutions = tuple(
            Solution(
                name=s.get("name", f"solution_{i}"),
                code=s["code"],
                language=s.get("language", language),
                planted_wrong=bool(s.get("planted_wrong", False)),
            )
            for i, s in enumerate(data["solutions"])
        )
        return Problem(
            name=data["name"],
            generator=data["generator"],
            solutions=solutions,
            statement=data.get("statement", ""),
            generator_language=data.get("generator_language", "python"),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{origin}: malformed problem ({exc!r}); see testgen's docstring") from exc


def load_problems(paths: Sequence[str]) -> list[Problem]:
    """Problems from JSON files and directories of JSON files (sorted by file name)."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json"))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"--problems {path}: no such file or directory")
    problems = []
    for file in files:
        with open(file) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}: not valid JSON: {exc}") from exc
        items = data["problems"] if isinstance(data, dict) and "problems" in data else [data]
        problems += [_problem_from_dict(item, file) for item in items]
    names = [p.name for p in problems]
    if len(set(names)) != len(names):
        raise ValueError(f"problem names must be unique, got {sorted(names)}")
    return problems


# ------------------------------------------------------------------------- through the sandbox
class GeneratorError(ValueError):
    """The problem's generator failed or printed something other than the inputs."""


def generate_inputs(runner: Runner, problem: Problem, cfg: TestGenConfig) -> list[str]:
    """Run the generator once with stdin 'SEED COUNT'; it prints a JSON list of COUNT inputs."""
    result = runner.run(
        RunRequest(
            language=problem.generator_language,
            code=problem.generator,
            stdin=f"{cfg.seed} {cfg.num_inputs}\n",
            timeout_s=cfg.generator_timeout_s,
            memory_mb=cfg.memory_mb,
        )
    )
    if result.status != "ok":
        raise GeneratorError(f"generator ended with {result.status}: {result.stderr[-500:]}")
    try:
        inputs = json.loads(result.stdout)
    except json.JSONDecodeError as exc:
        raise GeneratorError(f"generator output is not JSON: {exc}") from exc
    if not isinstance(inputs, list) or len(inputs) != cfg.num_inputs or not all(isinstance(i, str) for i in inputs):
        raise GeneratorError(f"generator must print a JSON list of {cfg.num_inputs} strings")
    return inputs


def run_matrix(
    runner: Runner, problem: Problem, inputs: Sequence[str], cfg: TestGenConfig, num_threads: int
) -> tuple[list[list[str | None]], list[list[str]]]:
    """(outputs[s][c], statuses[s][c]) of every solution on every input, runs in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(s, c) for s in range(len(problem.solutions)) for c in range(len(inputs))]

    def one(job: tuple[int, int]) -> RunResult:
        s, c = job
        solution = problem.solutions[s]
        return runner.run(
            RunRequest(
                language=solution.language,
                code=solution.code,
                stdin=inputs[c],
                timeout_s=cfg.solution_timeout_s,
                memory_mb=cfg.memory_mb,
            )
        )

    outputs: list[list[str | None]] = [[None] * len(inputs) for _ in problem.solutions]
    statuses: list[list[str]] = [[""] * len(inputs) for _ in problem.solutions]
    with ThreadPoolExecutor(max_workers=num_threads) as pool:
        for (s, c), result in zip(jobs, pool.map(one, jobs)):
            statuses[s][c] = result.status
            outputs[s][c] = result.stdout if result.status == "ok" else None
    return outputs, statuses


def build_problem(runner: Runner, problem: Problem, cfg: TestGenConfig, num_threads: int = 2) -> ProblemReport:
    """Generate, run and filter one problem; a failing generator drops the problem."""
    try:
        inputs = generate_inputs(runner, problem, cfg)
    except GeneratorError as exc:
        return ProblemReport(problem.name, False, f"generator failed: {exc}")
    outputs, statuses = run_matrix(runner, problem, inputs, cfg, num_threads)
    return decide_problem(problem.name, problem.solutions, inputs, outputs, statuses, cfg)


def describe(report: ProblemReport) -> list[str]:
    """Human-readable lines: the verdict, then every solution that failed kept cases."""
    lines = [f"{'KEEP' if report.kept else 'DROP'} {report.name}: {report.reason}"]
    dropped = [d for d in report.cases if not d.kept]
    if dropped:
        num_duplicates = sum(d.reason.startswith("duplicate") for d in dropped)
        lines.append(
            f"  dropped {len(dropped)} cases: {len(dropped) - num_duplicates} without "
            f"agreement, {num_duplicates} duplicate inputs"
        )
    for sol in report.solutions:
        if not sol.passes_all_kept:
            tag = " (planted wrong)" if sol.planted_wrong else ""
            lines.append(
                f"  solution {sol.name}{tag} fails {len(sol.failed_cases)} kept cases; run statuses {sol.statuses}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ckpt_common.cli_config import add_config_args

    p = argparse.ArgumentParser(
        prog="python -m sandbox.testgen", description="Generate and filter test cases (k1.5 recipe)."
    )
    p.add_argument("--problems", nargs="+", required=True, help="problem JSON files or dirs")
    p.add_argument("--out", help="write <name>.json test sets and report.json here")
    p.add_argument("--sandbox-url", help="use a running sandbox service (default: an in-process sandbox)")
    p.add_argument("--threads", type=int, help="runs at once (default: the usable cores)")
    spec = add_config_args(p, TestGenConfig)
    args = p.parse_args(argv)
    cfg = spec.build(args, p)  # a bad value: exit 2 naming the flag
    threads = args.threads or len(os.sched_getaffinity(0))

    from ckpt_common.logs import setup_logging

    setup_logging("INFO")
    problems = load_problems(args.problems)
    runner, close = _make_runner(args.sandbox_url, threads)
    try:
        reports = []
        for problem in problems:
            report = build_problem(runner, problem, cfg, threads)
            reports.append(report)
            print("\n".join(describe(report)), flush=True)
    finally:
        close()
    if args.out:
        _write_out(args.out, problems, reports)
    summary = {
        "problems": len(reports),
        "kept": sum(r.kept for r in reports),
        "num_cases": {r.name: len(r.test_cases) for r in reports if r.kept},
        "dropped": {r.name: r.reason for r in reports if not r.kept},
    }
    print(json.dumps(summary))
    return 0


def _make_runner(url: str | None, num_threads: int):
    if url is not None:
        from .client import SandboxClient

        client = SandboxClient(url)
        return client, client.close
    from .bwrap import DEFAULT_PYTHON_PACKAGES, probe_bwrap, python_package_binds
    from .config import SandboxConfig
    from .executor import Sandbox

    reason = probe_bwrap()
    if reason is not None:
        raise RuntimeError(f"cannot run the in-process sandbox: {reason}")
    sandbox = Sandbox(
        SandboxConfig(
            python_lib_binds=python_package_binds(DEFAULT_PYTHON_PACKAGES, required=True), pool_size=2 * num_threads
        )
    )
    return sandbox, sandbox.close


def _write_out(out_dir: str, problems: Sequence[Problem], reports: Sequence[ProblemReport]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    statements = {p.name: p.statement for p in problems}
    for report in reports:
        if report.kept:
            with open(os.path.join(out_dir, f"{report.name}.json"), "w") as f:
                json.dump(
                    {
                        "name": report.name,
                        "statement": statements[report.name],
                        "test_cases": [asdict(c) for c in report.test_cases],
                    },
                    f,
                    indent=1,
                )
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump([r.to_dict() for r in reports], f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
