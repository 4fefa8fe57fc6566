"""Reward interface, batching helper, reward-model adapter and weighted sum (see package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["CombinedReward", "RewardFn", "RewardModelHook", "reference_answer", "score_batch"]


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, problem: Any, response_text: str) -> float: ...


def reference_answer(problem: Any) -> str:
    """The reference answer of a problem: its ``answer`` attribute or ``"answer"`` key."""
    if isinstance(problem, Mapping):
        if "answer" in problem:
            return str(problem["answer"])
    elif hasattr(problem, "answer"):
        return str(problem.answer)
    raise ValueError(f"problem has no 'answer' attribute or key: {type(problem).__name__}")


def _checked_scores(scores: Sequence[float], expected: int, who: str) -> list[float]:
    out = [float(s) for s in scores]
    if len(out) != expected:
        raise RuntimeError(f"{who} returned {len(out)} scores for {expected} responses")
    bad = [s for s in out if not math.isfinite(s)]
    if bad:
        raise RuntimeError(f"{who} returned non-finite scores {bad[:3]!r}")
    return out


def score_batch(reward_fn: RewardFn, problems: Sequence[Any], response_texts: Sequence[str]) -> list[float]:
    """Score many responses; ``problems[i]`` is the problem of ``response_texts[i]``."""
    if len(problems) != len(response_texts):
        raise ValueError(f"problems ({len(problems)}) and response_texts ({len(response_texts)}) differ in length")
    batched = getattr(reward_fn, "score_batch", None)
    if callable(batched):
        scores = batched(problems, response_texts)
    else:
        scores = [reward_fn(p, t) for p, t in zip(problems, response_texts)]
    return _checked_scores(scores, len(response_texts), type(reward_fn).__name__)


class RewardModelHook:
    """Adapts ``fn(problems, response_texts) -> scores`` (e.g. a reward-model client) to RewardFn."""

    def __init__(
        self, fn: Callable[[Sequence[Any], Sequence[str]], Sequence[float]], name: str = "reward_model"
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        self.fn = fn
        self.name = name

    def __call__(self, problem: Any, response_text: str) -> float:
        return self.score_batch([problem], [response_text])[0]

    def score_batch(self, problems: Sequence[Any], response_texts: Sequence[str]) -> list[float]:
        return _checked_scores(self.fn(problems, response_texts), len(response_texts), self.name)


class CombinedReward:
    """``sum_i weight_i * reward_i(problem, response)``; batches each part when it can."""

    def __init__(self, parts: Sequence[tuple[RewardFn, float]]) -> None:
        if not parts:
            raise ValueError("CombinedReward needs at least one (reward_fn, weight) part")
        for i, (fn, weight) in enumerate(parts):
            if not callable(fn):
                raise ValueError(f"parts[{i}] reward_fn must be callable, got {fn!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"parts[{i}] weight must be a finite number, got {weight!r}")
        self.parts = list(parts)

    def __call__(self, problem: Any, response_text: str) -> float:
        return self.score_batch([problem], [response_text])[0]

    def score_batch(self, problems: Sequence[Any], response_texts: Sequence[str]) -> list[float]:
        total = [0.0] * len(response_texts)
        for fn, weight in self.parts:
            for i, s in enumerate(score_batch(fn, problems, response_texts)):
                total[i] += weight * s
        return total
