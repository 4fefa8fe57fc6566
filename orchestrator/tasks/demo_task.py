"""The demo's arithmetic as a Task: the problems the project makes itself (``demo.task``).

::

    DataConfig (levels, sizes, seeds) ──orchestrator.data.train_pool / heldout_set──▶ demo.task.Problem
    prompt: the expression as written ("347+586\\n"); reference: the answer; reward: reward.type's
    (math-verify reads the number after "#### "); level: the task level (1-7); difficulty: the level
    on the [0, 1] scale of every task's curriculum, (level - 1) / 6

Behaviour is the RL job's before tasks existed: the same pool, held-out set, prompts and reward, and
the same curriculum (its labels rescaled with ``sampling.curriculum.min_difficulty``'s default).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from demo import task as demo
from orchestrator.tasks.base import Task

if TYPE_CHECKING:
    from orchestrator.config import DataConfig, RewardConfig
    from orchestrator.rewards import RewardFn

logger = logging.getLogger(__name__)


def demo_difficulty(level: int) -> float:
    """A demo level (1-7) on the curriculum's [0, 1] scale: (level - 1) / (7 - 1)."""
    low, high = min(demo.LEVELS), max(demo.LEVELS)
    return (level - low) / (high - low)


class DemoTask(Task):
    """The arithmetic task of ``demo.task`` under the ``data`` section's levels, sizes and seeds."""

    name = "demo"
    compares_with_sft = True  # the held-out draw is the SFT evaluation's (same seed and levels)
    direct_answer_prefix = demo.ANSWER_PREFIX

    def __init__(self, data: DataConfig) -> None:
        self.data = data
        self._train: list[demo.Problem] | None = None
        self._heldout: list[demo.Problem] | None = None

    def train_problems(self) -> Sequence[demo.Problem]:
        if self._train is None:
            from orchestrator.data import train_pool

            self._train = train_pool(self.data)
        return self._train

    def heldout_problems(self) -> Sequence[demo.Problem]:
        if self._heldout is None:
            from orchestrator.data import heldout_set

            self._heldout = heldout_set(self.data)
        return self._heldout

    def prompt_text(self, problem: demo.Problem, tokenizer=None) -> str:
        return problem.prompt

    def reference(self, problem: demo.Problem) -> str:
        return problem.answer

    def difficulty(self, problem: demo.Problem) -> float:
        """The level on the [0, 1] scale every task's curriculum uses: (level - 1) / 6."""
        return demo_difficulty(problem.level)

    def level_of(self, problem: demo.Problem) -> int:
        return problem.level

    def make_reward_fn(self, reward: RewardConfig) -> RewardFn:
        from orchestrator.scoring import make_reward_fn

        return make_reward_fn(reward)
