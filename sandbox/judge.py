"""Judging one submission against test cases: output comparison (pure) and the case loop.

submission ──(c/cpp: compile once)──▶ for each case: run(stdin=case.input) ──▶ compare ──▶ JudgeResult
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .models import COMPARE_MODES, CaseResult, JudgeResult, RunRequest, RunResult, TestCase

MAX_CASE_TEXT_CHARS = 2048  # stdout/stderr kept per judged case in the answer


def normalize_output(text: str, mode: str) -> str | tuple[str, ...]:
    """The comparable form of a program's output.

    exact:  byte-for-byte; lines: trailing spaces of each line and trailing blank lines ignored
    (the usual judge rule); tokens: whitespace-separated tokens.
    """
    if mode == "exact":
        return text
    if mode == "lines":
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return "\n".join(lines)
    if mode == "tokens":
        return tuple(text.split())
    raise ValueError(f"compare must be one of {COMPARE_MODES}, got {mode!r}")


def outputs_match(expected: str, actual: str, mode: str = "lines") -> bool:
    return normalize_output(expected, mode) == normalize_output(actual, mode)


class Executor(Protocol):
    """What the judge needs from a sandbox (`executor.Sandbox` provides it)."""

    def run(self, request: RunRequest) -> RunResult: ...

    def compile(self, language: str, code: str) -> tuple[bytes | None, RunResult]: ...

    def run_binary(self, binary: bytes, stdin: str, timeout_s: float, memory_mb: int) -> RunResult: ...


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CASE_TEXT_CHARS else text[:MAX_CASE_TEXT_CHARS] + "…[truncated]"


def judge_submission(
    executor: Executor,
    language: str,
    code: str,
    cases: Sequence[TestCase],
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    compare: str = "lines",
    stop_on_first_failure: bool = False,
) -> JudgeResult:
    """Run `code` on every case; a case passes when it ran `ok` and its output matches."""
    if not cases:
        raise ValueError("test_cases must hold at least one case")
    if compare not in COMPARE_MODES:
        raise ValueError(f"compare must be one of {COMPARE_MODES}, got {compare!r}")
    binary = None
    if language in ("c", "cpp"):
        binary, compiled = executor.compile(language, code)
        if binary is None:
            failed = tuple(
                CaseResult(i, False, "compile_error", compiled.exit_code, "", _clip(compiled.stderr), 0.0)
                for i in range(len(cases))
            )
            return JudgeResult(status="compile_error", passed=0, total=len(cases), cases=failed)
    results: list[CaseResult] = []
    for index, case in enumerate(cases):
        if stop_on_first_failure and results and not results[-1].passed:
            results.append(CaseResult(index, False, "skipped", None, "", "", 0.0))
            continue
        if binary is not None:
            run = executor.run_binary(binary, case.input, timeout_s, memory_mb)
        else:
            run = executor.run(
                RunRequest(language=language, code=code, stdin=case.input, timeout_s=timeout_s, memory_mb=memory_mb)
            )
        if run.status == "compile_error":  # python that does not parse fails every case alike
            failed = tuple(
                CaseResult(i, False, "compile_error", run.exit_code, "", _clip(run.stderr), 0.0)
                for i in range(len(cases))
            )
            return JudgeResult(status="compile_error", passed=0, total=len(cases), cases=failed)
        passed = run.status == "ok" and outputs_match(case.output, run.stdout, compare)
        results.append(
            CaseResult(index, passed, run.status, run.exit_code, _clip(run.stdout), _clip(run.stderr), run.duration_s)
        )
    num_passed = sum(r.passed for r in results)
    return JudgeResult(status="ok", passed=num_passed, total=len(cases), cases=tuple(results))
