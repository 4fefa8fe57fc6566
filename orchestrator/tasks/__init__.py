"""Tasks from users' own files ("RL on your own prompts"): the JSONL problem format, read, validated
and written (``orchestrator.tasks.problems``). The RL job does not read these files yet."""

from orchestrator.tasks.problems import (
    FIELDS,
    MAX_ERRORS,
    ROLES,
    CodeTest,
    Issue,
    Problem,
    ProblemFileError,
    check_disjoint,
    parse_problem_lines,
    read_problems,
    stable_id,
    write_problems,
)

__all__ = [
    "FIELDS",
    "MAX_ERRORS",
    "ROLES",
    "CodeTest",
    "Issue",
    "Problem",
    "ProblemFileError",
    "check_disjoint",
    "parse_problem_lines",
    "read_problems",
    "stable_id",
    "write_problems",
]
