"""The job's task from its config: problem files when ``data.train_path`` is set, else the demo.

::

    JobConfig.data.train_path set ──▶ FileTask.from_config(data, reward)   (orchestrator.tasks.file_task)
                              unset ──▶ DemoTask(data)                      (orchestrator.tasks.demo_task)

Each implementation is imported only when chosen. ``check_data_files`` is what the entry point runs
after ``load_config``: building the file task reads and checks every line (and the train/held-out
overlap), and so does reading the SFT file (``sft.data_path``), so a bad file is an error before
anything starts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.config import JobConfig
    from orchestrator.tasks.base import Task

logger = logging.getLogger(__name__)

TASK_KINDS: tuple[str, ...] = ("demo", "file")


def task_kind(config: JobConfig) -> str:
    """ "file" when the config names problem files, else "demo"."""
    return "file" if config.data.train_path is not None else "demo"


def make_task(config: JobConfig) -> Task:
    """The task ``config`` describes; a file task raises ProblemFileError (``path:line: field ...``) for a bad file."""
    kind = task_kind(config)
    if kind == "file":
        from orchestrator.tasks.file_task import FileTask

        return FileTask.from_config(config.data, config.reward)
    if kind == "demo":
        from orchestrator.tasks.demo_task import DemoTask

        return DemoTask(config.data)
    raise ValueError(f"unknown task kind {kind!r}; known: {list(TASK_KINDS)}")


def check_data_files(config: JobConfig) -> None:
    """Read and check the config's problem files (nothing to do for the demo) and its SFT file
    (``sft.data_path``, ``trainer.sft_file``): raises ProblemFileError."""
    if task_kind(config) == "file":
        make_task(config)
    if config.sft.data_path is not None:
        from trainer.sft_file import read_sft_examples

        read_sft_examples(config.sft.data_path)
