"""Pure helpers for talking to the in-sandbox supervisor (`runner.py`) and judging what it said.

    service ──header+payload──▶ request fd ─▶ runner ── fork ─▶ program (rlimits applied)
    service ◀──ready/start/exit────────── status fd ◀─┘
    service ◀──stdout/stderr (byte budgets)──────────── program

`classify` turns the observations of one run into the contract's status.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

from .runner import MEMORY_EXIT_CODE, SYNTAX_EXIT_CODE

MIB = 1 << 20
_MEMORY_HINTS = (b"std::bad_alloc", b"Cannot allocate memory", b"out of memory")


@dataclass(frozen=True)
class Limits:
    """rlimits applied to the program (or compiler) inside the sandbox."""

    cpu_s: int
    memory_bytes: int
    nproc: int
    fsize_bytes: int
    nofile: int

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_bytes", "nproc", "fsize_bytes", "nofile"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def cpu_limit_s(timeout_s: float) -> int:
    """CPU-seconds rlimit for a wall timeout: whole seconds, at least 1."""
    return max(1, math.ceil(timeout_s))


def encode_request(mode: str, limits: Limits, payload: bytes, **extra: str) -> bytes:
    """One header line of TAB-separated key=value pairs, a newline, the payload."""
    fields = {
        "mode": mode,
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_bytes,
        "nproc": limits.nproc,
        "fsize_bytes": limits.fsize_bytes,
        "nofile": limits.nofile,
        **extra,
    }
    parts = []
    for key, value in fields.items():
        text = str(value)
        if "\t" in text or "\n" in text or "=" in key:
            raise ValueError(f"header field {key}={text!r} holds a separator")
        parts.append(f"{key}={text}")
    return "\t".join(parts).encode("ascii") + b"\n" + payload


@dataclass(frozen=True)
class ExitReport:
    """The supervisor's `exit` line: exit code (None when killed by a signal) and usage."""

    exit_code: int | None
    signal: int
    cpu_s: float
    wall_s: float
    max_rss_bytes: int


def parse_exit(lines: list[str]) -> ExitReport | None:
    """The exit report among the supervisor's status lines, None when it never reported."""
    report = None
    for line in lines:
        parts = line.split()
        if len(parts) == 6 and parts[0] == "exit":
            code, sig = int(parts[1]), int(parts[2])
            report = ExitReport(
                exit_code=None if code < 0 else code,
                signal=sig,
                cpu_s=float(parts[3]),
                wall_s=float(parts[4]),
                max_rss_bytes=int(parts[5]) * 1024,
            )
    return report


@dataclass(frozen=True)
class Observation:
    """Everything the service saw of one run, the input of `classify`."""

    mode: str  # python | binary | compile
    report: ExitReport | None  # None: the supervisor died before reporting
    timed_out: bool = False  # the wall deadline passed
    output_exceeded: bool = False
    oom_killed: bool = False  # the cgroup's memory.max killed it (cgroup v2 hosts only)
    memory_bytes: int = 0
    cpu_limit_s: int = 1
    stderr_tail: bytes = b""


def classify(obs: Observation) -> tuple[str, int | None]:
    """(status, exit_code) of a run. exit_code is negative (-signal) when a signal killed it."""
    report = obs.report
    exit_code = None
    if report is not None:
        exit_code = report.exit_code if report.signal == 0 else -report.signal
    if obs.output_exceeded:
        return "output_limit", exit_code
    if obs.timed_out:
        return "timeout", exit_code
    if obs.oom_killed:
        return "memory_limit", exit_code
    if report is None:
        return "runtime_error", exit_code
    if report.signal == signal.SIGXCPU or (report.signal == signal.SIGKILL and report.cpu_s >= obs.cpu_limit_s - 0.05):
        return "timeout", exit_code
    if obs.mode == "compile":
        return ("ok" if exit_code == 0 else "compile_error"), exit_code
    if obs.mode == "python" and report.exit_code == MEMORY_EXIT_CODE:
        return "memory_limit", exit_code
    if obs.mode == "python" and report.exit_code == SYNTAX_EXIT_CODE:
        return "compile_error", exit_code
    if exit_code != 0 and obs.mode == "binary" and _looks_out_of_memory(obs):
        return "memory_limit", exit_code
    return ("ok" if exit_code == 0 else "runtime_error"), exit_code


def _looks_out_of_memory(obs: Observation) -> bool:
    """A compiled program that failed either said so, or used nearly all of its address space."""
    if any(hint in obs.stderr_tail for hint in _MEMORY_HINTS):
        return True
    report = obs.report
    return report is not None and obs.memory_bytes > 0 and report.max_rss_bytes >= 0.9 * obs.memory_bytes
