"""The job's task from its config: problem files when ``data.train_path`` is set, else the demo.

::

    JobConfig.data.train_path set ──▶ FileTask.from_config(data, reward)   (orchestrator.tasks.file_task)
                              unset ──▶ DemoTask(data)                      (orchestrator.tasks.demo_task)

Each implementation is imported only when chosen. ``check_data_files`` is what the entry point runs
after ``load_config``: building the file task reads and checks every line (and the train/held-out
overlap), and so does reading the SFT file (``sft.data_path``), so a bad file is an error before
anything starts.

The commands around the job (``python -m orchestrator.long2short``, ``python -m orchestrator.curation``)
name a task the way the job does, with the same helpers::

    add_task_args(parser)  ──▶ --config JOB.json, --set KEY=VALUE (repeatable): add_job_config_args, the RL job's own
    job_sections(config, overrides[, problems_path]) ──▶ (DataConfig, RewardConfig): only those two
        sections are read (problems_path: a command's own file stands for data.train_path)
    file_task_from_sections(data, reward[, problems_path]) ──▶ FileTask of data.train_path (and its
        held-out file or share), or of the one file ``problems_path`` whole (curation's input)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.config import DataConfig, JobConfig, RewardConfig
    from orchestrator.tasks.base import Task
    from orchestrator.tasks.file_task import FileTask

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

        read_sft_examples(config.sft.data_path, config.sft.data_fields, config.sft.data_split)


# -- the task of a command around the job (long2short, curation) -------------------------------------


def add_job_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, example: str) -> None:
    """``--config`` (``args.config``: the job config file, None for the defaults) and ``--set KEY=VALUE``
    (``args.overrides``, repeatable), what ``orchestrator.config.load_config`` and ``job_sections`` take:
    the RL job's flags (``python -m orchestrator``) and the task flags of the commands around it
    (``add_task_args``), defined here once. ``example``: the override --help shows."""
    parser.add_argument("--config", default=None, help="RL job config, a JSON file (default: built-in defaults)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config value, e.g. --set {example} (value parsed as JSON, else taken as a "
        "string); repeatable",
    )


def add_task_args(
    parser: argparse.ArgumentParser, description: str, example: str = "data.train_path=train.jsonl"
) -> None:
    """The task's flags, the RL job's (``add_job_config_args``): a job config (``args.config``) and its
    overrides (``args.overrides``; ``example``: the one --help shows), of which only the data and reward
    sections are read (``job_sections``)."""
    g = parser.add_argument_group(
        "task (problem files)", f"{description}; of the job config only the data and reward sections are read"
    )
    add_job_config_args(g, example)


def job_sections(
    path: str | None, overrides: Sequence[str], problems_path: str | os.PathLike[str] | None = None
) -> tuple[DataConfig, RewardConfig]:
    """The job config's data and reward sections (``orchestrator.config.load_config``'s defaults, file
    and ``--set`` overrides, each section validated), without the job's checks across sections (the
    RL curriculum's, say), which do not concern the commands around the job. ValueError for a file
    that is not JSON or a bad value.

    ``problems_path``: a command's own problem file (curation's input) stands for ``data.train_path``,
    so the section is checked as a problem file task's (its template, chat template and answer markers
    allowed); the held-out fields, which ``file_task_from_sections(..., problems_path)`` does not use,
    default to that file."""
    from ckpt_common.dictconfig import apply_overrides, from_dict, merge, to_dict
    from orchestrator.config import DataConfig, JobConfig, RewardConfig

    tree = to_dict(JobConfig())
    if path is not None:
        try:
            tree = merge(tree, json.loads(pathlib.Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path!r} is not valid JSON: {e}") from None
    tree = apply_overrides(tree, overrides)
    if problems_path is not None:
        data = {**tree["data"], "train_path": os.fspath(problems_path)}
        if data.get("heldout_path") is None and data.get("heldout_fraction") is None:
            data["heldout_path"] = data["train_path"]
        tree = {**tree, "data": data}
    return from_dict(DataConfig, tree["data"], "data"), from_dict(RewardConfig, tree["reward"], "reward")


def file_task_from_sections(
    data: DataConfig, reward: RewardConfig, problems_path: str | os.PathLike[str] | None = None
) -> FileTask:
    """The problem file task of a job's data and reward sections: of ``data.train_path`` and its
    held-out file or share (``FileTask.from_config``), or, given ``problems_path``, of that one file whole
    with the data section's template, chat template and answer markers (``FileTask.of_file``).
    ProblemFileError (a ValueError naming ``file:line``) for a bad file; ValueError when no file is named."""
    from orchestrator.tasks.file_task import FileTask

    if problems_path is not None:
        return FileTask.of_file(problems_path, data, reward)
    if data.train_path is None:
        raise ValueError("the job config names no problem files (data.train_path)")
    return FileTask.from_config(data, reward)
