"""The demo task's problems for the RL job: a fixed training pool and the held-out evaluation set.

``orchestrator.tasks.demo_task.DemoTask`` serves them to the loop (problem files take the other
task, ``orchestrator.tasks.file_task``); ``python -m orchestrator.tasks.demo_export`` writes them as problem files.

::

    DataConfig ──▶ train_pool(): distinct problems of the training split, drawn once from a seed
               │                 (difficulty label = task level, for the curriculum)
               └─▶ heldout_set(): distinct held-out problems, the same per level as the SFT
                                  evaluation uses, so vLLM's and transformers' accuracies compare
"""

from __future__ import annotations

import logging

from demo import task
from orchestrator.config import DataConfig

logger = logging.getLogger(__name__)

_MAX_DRAW_ROUNDS = 64


def train_pool(config: DataConfig) -> list[task.Problem]:
    """``num_train_problems`` distinct training problems (never a held-out one)."""
    pool: dict[str, task.Problem] = {}
    for round_index in range(_MAX_DRAW_ROUNDS):
        missing = config.num_train_problems - len(pool)
        if missing <= 0:
            break
        drawn = task.training_problems(
            config.train_seed * 1009 + round_index,
            missing,
            levels=config.train_levels,
            weights=config.train_level_weights,
        )
        before = len(pool)
        for problem in drawn:
            pool.setdefault(problem.id, problem)
        if len(pool) == before:  # a whole draw of `missing` problems found nothing new: the levels ran out
            break
    if len(pool) < config.num_train_problems:
        raise ValueError(
            f"data.num_train_problems={config.num_train_problems} is more than the distinct "
            f"training problems of levels {list(config.train_levels)} that could be drawn "
            f"({len(pool)})"
        )
    return list(pool.values())[: config.num_train_problems]


def heldout_set(config: DataConfig) -> list[task.Problem]:
    """``num_heldout_per_level`` held-out problems of every held-out level, level by level."""
    return [
        p
        for level in config.heldout_levels
        for p in task.heldout_problems(config.heldout_seed, config.num_heldout_per_level, [level])
    ]


def difficulties(problems: list[task.Problem]) -> dict[str, float]:
    """Curriculum labels: the task level (higher is harder)."""
    return {p.id: float(p.level) for p in problems}
