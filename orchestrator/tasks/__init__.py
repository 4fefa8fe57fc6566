"""What the RL job trains on: the task interface and its two implementations.

- ``orchestrator.tasks.base.Task``: what the loop needs from a task (problems with stable ids, the
  rendered prompt, the reference, the reward, a difficulty);
- ``orchestrator.tasks.demo_task.DemoTask``: the demo's arithmetic (no ``data.train_path``);
- ``orchestrator.tasks.file_task.FileTask``: JSONL problem files ("RL on your own prompts"), in the
  format of ``orchestrator.tasks.problems`` (read, validated, written);
- ``orchestrator.tasks.factory.make_task``: the job config's task (each implementation imported only
  when chosen).
"""

from ckpt_common.records import MAX_ERRORS, ROLES, Issue, ProblemFileError
from orchestrator.tasks.base import Task
from orchestrator.tasks.factory import make_task
from orchestrator.tasks.problems import (
    FIELDS,
    CodeTest,
    Problem,
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
    "Task",
    "check_disjoint",
    "make_task",
    "parse_problem_lines",
    "read_problems",
    "stable_id",
    "write_problems",
]
