"""Rewards behind one interface.

::

    (problem, response_text) ──▶ RewardFn.__call__ ──▶ float
    ([problems], [texts])    ──▶ score_batch(reward_fn, ...) ──▶ [float]
                                   uses reward_fn.score_batch when it has one (a reward model
                                   scores a whole batch in one call), else calls it per sample

    MathVerifyReward   rule-based math verifier (math-verify), exact-match fallback
    RewardModelHook    adapter for any batched callable (a reward model served elsewhere)
    CombinedReward     weighted sum of rewards
    CodeSandboxReward  code (orchestrator.rewards.code_sandbox, over the sandbox service, sandbox/)

The interface is per sample on purpose: rule-based verifiers and sandboxes score one response
at a time, and a per-sample signature is the easiest to implement and test. Batching is an
optional extra method, ``score_batch(problems, response_texts) -> list[float]``.

``problem`` is whatever the task hands out; rewards that need the reference answer read it with
:func:`reference_answer` (an ``answer`` attribute or an ``"answer"`` key) unless given a getter.
"""

from orchestrator.rewards.base import CombinedReward, RewardFn, RewardModelHook, reference_answer, score_batch
from orchestrator.rewards.math_verify_reward import (
    MathVerifyReward,
    extract_after_marker,
    normalize_answer,
    whole_response,
)

__all__ = [
    "CombinedReward",
    "MathVerifyReward",
    "RewardFn",
    "RewardModelHook",
    "extract_after_marker",
    "normalize_answer",
    "reference_answer",
    "score_batch",
    "whole_response",
]
