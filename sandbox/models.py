"""Typed records of the sandbox contract: a run request, its result, judge cases and results.

These are the internal (frozen dataclass) forms; the HTTP edge (`service.py`) checks the JSON bodies
and converts them to these, and the client (`client.py`) converts the JSON answers back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

Language = Literal["python", "c", "cpp"]
LANGUAGES: tuple[str, ...] = get_args(Language)

RunStatus = Literal["ok", "runtime_error", "timeout", "memory_limit", "output_limit", "compile_error", "rejected"]
RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)

CompareMode = Literal["exact", "lines", "tokens"]
COMPARE_MODES: tuple[str, ...] = get_args(CompareMode)


@dataclass(frozen=True)
class RunRequest:
    """One program to run: source code, its stdin and its limits."""

    language: str
    code: str
    stdin: str = ""
    timeout_s: float = 2.0
    memory_mb: int = 256

    def __post_init__(self) -> None:
        if self.language not in LANGUAGES:
            raise ValueError(f"language must be one of {LANGUAGES}, got {self.language!r}")
        if not isinstance(self.code, str) or not self.code.strip():
            raise ValueError("code must be a non-empty string")
        if not isinstance(self.stdin, str):
            raise ValueError(f"stdin must be a string, got {type(self.stdin).__name__}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb <= 0:
            raise ValueError(f"memory_mb must be a positive integer, got {self.memory_mb!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunResult:
    """What happened to one run. `duration_s` is the wall time of the program itself."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    cpu_s: float | None = None

    def __post_init__(self) -> None:
        if self.status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunResult:
        return cls(
            status=data["status"],
            exit_code=data.get("exit_code"),
            stdout=data.get("stdout", ""),
            stderr=data.get("stderr", ""),
            duration_s=float(data.get("duration_s", 0.0)),
            cpu_s=data.get("cpu_s"),
        )


@dataclass(frozen=True)
class TestCase:
    """One judge case: the program's stdin and the expected stdout."""

    __test__ = False  # not a pytest class

    input: str
    output: str

    def __post_init__(self) -> None:
        if not isinstance(self.input, str) or not isinstance(self.output, str):
            raise ValueError("test case input and output must be strings")


@dataclass(frozen=True)
class CaseResult:
    """A judged case: the run's outcome plus whether the output matched."""

    index: int
    passed: bool
    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float


@dataclass(frozen=True)
class JudgeResult:
    """All cases of one submission. `status` is `compile_error` when nothing could run."""

    status: str
    passed: int
    total: int
    cases: tuple[CaseResult, ...] = field(default_factory=tuple)

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "passed": self.passed,
            "total": self.total,
            "all_passed": self.all_passed,
            "cases": [asdict(c) for c in self.cases],
        }

    @classmethod
    def from_dict(cls, data: dict) -> JudgeResult:
        cases = tuple(CaseResult(**c) for c in data.get("cases", []))
        return cls(status=data["status"], passed=int(data["passed"]), total=int(data["total"]), cases=cases)
