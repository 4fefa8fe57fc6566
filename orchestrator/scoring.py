"""From a response to its training reward: task reward, repeat penalty, length penalty.

::

    (problem, response text) ──RewardFn (math verifier | code sandbox [+ reward model])──▶ task reward
    task reward >= correct_threshold ──▶ correct (success stats, pass@1, length penalty)
    per group of k:  task reward - repeat penalty (if stopped for repeating)
                     + weight * length reward (k1.5 sec. 2.3.3, after its warm-up) ──▶ rewards [k]
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from ckpt_common.validate import import_qualname
from orchestrator.config import RewardConfig
from orchestrator.length_penalty import LengthPenaltyConfig
from orchestrator.repeat import RepeatConfig
from orchestrator.rewards import CombinedReward, MathVerifyReward, RewardFn, RewardModelHook

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Score:
    """What the reward function said about one finished response."""

    task_reward: float
    correct: bool


def group_rewards(
    scores: Sequence[Score],
    lengths: Sequence[int],
    repeated: Sequence[bool],
    iteration: int,
    length_penalty: LengthPenaltyConfig,
    repeat: RepeatConfig,
) -> list[float]:
    """Training rewards of one group of k responses to the same prompt."""
    if not len(scores) == len(lengths) == len(repeated):
        raise ValueError(
            f"scores ({len(scores)}), lengths ({len(lengths)}) and repeated ({len(repeated)}) must have the same length"
        )
    rewards = [repeat.apply(s.task_reward, r) for s, r in zip(scores, repeated)]
    return length_penalty.apply(rewards, list(lengths), [s.correct for s in scores], iteration)


def make_reward_fn(config: RewardConfig) -> RewardFn:
    """The reward ``config`` describes (the code sandbox is imported only when chosen)."""
    if config.type == "math_verify":
        base: RewardFn = MathVerifyReward()
    elif config.type == "code_sandbox":
        from orchestrator.rewards.code_sandbox import CodeSandboxReward

        base = CodeSandboxReward(str(config.sandbox_url), config.code)
    else:
        raise ValueError(f"reward.type={config.type!r} is not supported")
    if config.reward_model is None:
        return base
    hook = RewardModelHook(import_qualname("reward.reward_model", config.reward_model)(), name=config.reward_model)
    return CombinedReward([(base, 1.0), (hook, config.reward_model_weight)])


def score_response(reward_fn: RewardFn, problem: Any, response_text: str, correct_threshold: float) -> Score:
    reward = float(reward_fn(problem, response_text))
    return Score(task_reward=reward, correct=reward >= correct_threshold)
