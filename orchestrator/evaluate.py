"""Held-out evaluation on the rollout engine (vLLM, fast): greedy accuracy and sampled pass@1.

::

    Evaluator(engine, encode, decode, is_correct, max_tokens)
      .greedy(held-out) ──encode──▶ engine.generate(temperature 0) ──decode──▶ is_correct ──▶ accuracy
                                                                                (+ per level)
      .sampled(subset, k) ────────▶ engine.generate(temperature T) ──────────▶ mean correct ──▶ pass@1
                                                                               any correct  ──▶ pass@k

pass@1 over k samples is the unbiased estimate (mean correctness of the k samples per problem,
averaged over problems). ``compare_with_reference`` checks vLLM's greedy accuracy of the SFT
model against transformers' (from the SFT summary): a wrong weight sync shows up as a gap.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orchestrator.engine_pool.base import GenRequest, RolloutEngine, SamplingSettings

logger = logging.getLogger(__name__)

IsCorrect = Callable[[Any, str], bool]


@dataclasses.dataclass(frozen=True)
class GreedyEval:
    accuracy: float
    accuracy_by_level: dict[int, float]
    mean_response_tokens: float
    num_problems: int
    correct: tuple[bool, ...] = ()  # per problem, in the order given


@dataclasses.dataclass(frozen=True)
class SampledEval:
    pass_at_1: float
    pass_at_k: float
    k: int
    num_problems: int


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """An engine and how to ask it (encode a problem, decode and judge an answer, the token cap)."""

    engine: RolloutEngine
    encode: Callable[[Any], list[int]]
    decode: Callable[[Sequence[int]], str]
    is_correct: IsCorrect
    max_tokens: int
    timeout_s: float = 900.0

    def _judge(self, problems: Sequence[Any], sampling: SamplingSettings, copies: int) -> tuple[list, list[bool]]:
        """``copies`` answers per problem (in order: problem by problem) and whether each is correct."""
        requests = [
            GenRequest(f"eval-{i}-{c}", tuple(self.encode(p)), self.max_tokens)
            for i, p in enumerate(problems)
            for c in range(copies)
        ]
        results = self.engine.generate(requests, sampling, timeout_s=self.timeout_s)
        owners = [p for p in problems for _ in range(copies)]
        return results, [bool(self.is_correct(p, self.decode(r.token_ids))) for p, r in zip(owners, results)]

    def greedy(self, problems: Sequence[Any], level_of: Callable[[Any], int] = lambda p: p.level) -> GreedyEval:
        """Accuracy of greedy (temperature 0) answers, overall and per difficulty level."""
        if not problems:
            raise ValueError("no problems to evaluate")
        results, correct = self._judge(problems, SamplingSettings(temperature=0.0), 1)
        return GreedyEval(
            accuracy=sum(correct) / len(problems),
            accuracy_by_level=accuracy_by_level(problems, correct, level_of),
            mean_response_tokens=sum(len(r.token_ids) for r in results) / len(results),
            num_problems=len(problems),
            correct=tuple(correct),
        )

    def sampled(self, problems: Sequence[Any], k: int, sampling: SamplingSettings) -> SampledEval:
        """pass@1 (mean over k samples) and pass@k (any of k correct), averaged over problems."""
        if not problems or k < 1:
            raise ValueError(f"need problems and k >= 1 (got {len(problems)} problems, k={k})")
        _, correct = self._judge(problems, sampling, k)
        groups = [correct[i * k : (i + 1) * k] for i in range(len(problems))]
        pass1 = sum(sum(g) / k for g in groups)
        passk = sum(any(g) for g in groups)
        return SampledEval(
            pass_at_1=pass1 / len(problems), pass_at_k=passk / len(problems), k=k, num_problems=len(problems)
        )


def accuracy_by_level(
    problems: Sequence[Any], correct: Sequence[bool], level_of: Callable[[Any], int], max_per_level: int | None = None
) -> dict[int, float]:
    """Accuracy per level, optionally over only the first ``max_per_level`` problems of each level."""
    by_level: dict[int, list[int]] = {}
    for problem, ok in zip(problems, correct):
        bucket = by_level.setdefault(level_of(problem), [])
        if max_per_level is None or len(bucket) < max_per_level:
            bucket.append(int(ok))
    return {lvl: sum(v) / len(v) for lvl, v in sorted(by_level.items())}


def compare_with_reference(
    measured_by_level: Mapping[int, float], reference_by_level: Mapping[Any, float], tolerance: float
) -> tuple[bool, float]:
    """(within tolerance?, largest per-level gap) over the levels both evaluations have."""
    reference = {int(k): float(v) for k, v in reference_by_level.items()}
    common = [lvl for lvl in measured_by_level if lvl in reference]
    if not common:
        return True, 0.0
    gap = max(abs(measured_by_level[lvl] - reference[lvl]) for lvl in common)
    return gap <= tolerance, gap
