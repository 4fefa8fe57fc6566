"""Length penalty of the Kimi k1.5 report (section 2.3.3), per group of k responses to one prompt.

::

    lengths [k] ─┐   lambda_j = 0.5 - (len_j - min_len) / (max_len - min_len)
    correct [k] ─┴─▶ len_reward_j = lambda_j            if response j is correct
                                    min(0, lambda_j)    otherwise
    rewards [k] ───▶ rewards_j + weight * len_reward_j   once iteration >= warmup_iterations

Shorter correct answers are rewarded and longer ones penalised; wrong answers are only ever
penalised (never rewarded for being short). When every response in the group has the same
length (max_len == min_len) the formula divides by zero; we define lambda = 0 for all of them
(no length signal inside such a group).

Warm-up: the report trains without the penalty first and then turns it on at a constant weight;
``iteration`` is 0-based, so the penalty is off for iterations 0 .. warmup_iterations-1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LengthPenaltyConfig", "length_lambdas", "length_penalty"]

logger = logging.getLogger(__name__)


def length_lambdas(lengths: Sequence[int]) -> list[float]:
    """``0.5 - (len - min_len) / (max_len - min_len)`` per response; all 0.0 if max == min."""
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"lengths[{i}] must be a non-negative int (a token count), got {n!r}")
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    return [0.5 - (n - lo) / (hi - lo) for n in lengths]


def length_penalty(lengths: Sequence[int], correct: Sequence[bool]) -> list[float]:
    """Length reward per response of one group: ``lambda`` if correct, ``min(0, lambda)`` if not."""
    if len(lengths) != len(correct):
        raise ValueError(f"lengths ({len(lengths)}) and correct ({len(correct)}) must have the same length")
    return [lam if ok else min(0.0, lam) for lam, ok in zip(length_lambdas(lengths), correct)]


@dataclass(frozen=True)
class LengthPenaltyConfig:
    """weight: multiplier of the length reward added to the task reward (>= 0; 0 disables).
    warmup_iterations: number of initial (0-based) iterations without the penalty (>= 0)."""

    weight: float = 1.0
    warmup_iterations: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not self.weight >= 0:
            raise ValueError(f"LengthPenaltyConfig.weight must be a number >= 0, got {self.weight!r}")
        w = self.warmup_iterations
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"LengthPenaltyConfig.warmup_iterations must be an int >= 0, got {w!r}")

    def is_active(self, iteration: int) -> bool:
        """Whether the penalty applies at this 0-based iteration."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration!r}")
        return self.weight > 0 and iteration >= self.warmup_iterations

    def apply(
        self, rewards: Sequence[float], lengths: Sequence[int], correct: Sequence[bool], iteration: int
    ) -> list[float]:
        """Rewards of one group with ``weight * length_penalty`` added (unchanged during warm-up)."""
        if len(rewards) != len(lengths):
            raise ValueError(f"rewards ({len(rewards)}) and lengths ({len(lengths)}) must have the same length")
        bonus = length_penalty(lengths, correct)  # validates even while inactive
        if not self.is_active(iteration):
            return [float(r) for r in rewards]
        return [float(r) + self.weight * b for r, b in zip(rewards, bonus)]
