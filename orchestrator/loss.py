"""Kimi k1.5 policy loss (report section 2.3, eq. 3): online mirror descent, no value network.

Data flow, one training step::

    policy(theta)      ──sum of response-token log-probs──▶ logp      [num_prompts, k]  (has grad)
    policy(theta_ref)  ──same, under no_grad──────────────▶ logp_ref  [num_prompts, k]  (constant)
    verifier + length penalty ────────────────────────────▶ rewards   [num_prompts, k]
                                 │
                                 ▼
    k15_policy_loss ──▶ scalar L whose NEGATIVE gradient is eq. (3):

      -dL/dtheta = 1/P sum_i 1/k sum_j [ grad logp_ij * (r_ij - mean_j r_ij)
                                         - tau/2 * grad (logp_ij - logp_ref_ij)^2 ]

``theta_ref`` is the policy at the start of the iteration (the weights that sampled the k
responses); the trainer resets its optimizer at the start of every iteration. ``mean_j r_ij``
is the mean reward over the k responses of prompt i (the baseline replacing a value network).

The surrogate is ``L = -mean_ij[ logp_ij * A_ij - tau/2 * (logp_ij - logp_ref_ij)^2 ]`` with the
advantage ``A_ij = r_ij - mean_j r_ij`` and ``logp_ref`` treated as constants (detached here, so
a caller that forgets ``no_grad`` still gets eq. 3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "LossConfig",
    "LossStats",
    "k15_policy_loss",
    "k15_policy_loss_with_stats",
    "group_advantages",
    "sequence_logprobs",
]


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the k1.5 policy loss.

    tau: strength of the squared log-ratio regulariser that keeps the policy near the
        iteration's reference policy (eq. 3); must be > 0.
    num_responses_per_prompt: k, responses sampled per prompt (>= 2: the baseline is the
        group mean, so with k = 1 every advantage is 0).
    """

    tau: float = 0.1
    num_responses_per_prompt: int = 8

    def __post_init__(self) -> None:
        if not (isinstance(self.tau, (int, float)) and self.tau > 0):
            raise ValueError(f"LossConfig.tau must be > 0, got {self.tau!r}")
        k = self.num_responses_per_prompt
        if not isinstance(k, int) or isinstance(k, bool) or k < 2:
            raise ValueError(f"LossConfig.num_responses_per_prompt must be an int >= 2, got {k!r}")


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (plain floats, ready for a JSONL metrics line)."""

    loss: float
    mean_reward: float
    mean_abs_advantage: float
    mean_log_ratio: float  # mean of (logp - logp_ref): how far the policy moved (sequence level)
    mean_half_sq_log_ratio: float  # mean of (logp - logp_ref)^2 / 2: the regulariser, before tau
    num_prompts: int
    num_responses_per_prompt: int


def _check_shapes(logp: torch.Tensor, logp_ref: torch.Tensor, rewards: torch.Tensor) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape [num_prompts, k], got {tuple(logp.shape)}")
    if logp_ref.shape != logp.shape:
        raise ValueError(f"logp_ref shape {tuple(logp_ref.shape)} != logp shape {tuple(logp.shape)}")
    if rewards.shape != logp.shape:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} != logp shape {tuple(logp.shape)}")
    if logp.shape[0] == 0 or logp.shape[1] == 0:
        raise ValueError(f"logp must be non-empty, got shape {tuple(logp.shape)}")


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``r_ij - mean_j r_ij`` for rewards of shape [num_prompts, k] (no std normalisation)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_prompts, k], got {tuple(rewards.shape)}")
    rewards = rewards.detach()
    return rewards - rewards.mean(dim=1, keepdim=True)


def k15_policy_loss(
    logp: torch.Tensor, logp_ref: torch.Tensor, rewards: torch.Tensor, tau: float
) -> torch.Tensor:
    """Scalar surrogate whose negative gradient is eq. (3), averaged over k and over prompts.

    logp: [num_prompts, k] sum of response-token log-probs under the current policy (with
        whatever token loss mask the caller applied), differentiable.
    logp_ref: same shape, under the iteration's start weights; treated as a constant.
    rewards: same shape; treated as a constant.
    tau: regulariser strength (> 0).
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau!r}")
    _check_shapes(logp, logp_ref, rewards)
    advantages = group_advantages(rewards).to(logp.dtype)
    log_ratio = logp - logp_ref.detach().to(logp.dtype)
    per_response = logp * advantages - 0.5 * tau * log_ratio.square()
    return -per_response.mean()


def k15_policy_loss_with_stats(
    logp: torch.Tensor, logp_ref: torch.Tensor, rewards: torch.Tensor, tau: float
) -> tuple[torch.Tensor, LossStats]:
    """:func:`k15_policy_loss` plus :class:`LossStats` diagnostics (computed without grad)."""
    loss = k15_policy_loss(logp, logp_ref, rewards, tau)
    with torch.no_grad():
        advantages = group_advantages(rewards)
        log_ratio = logp.detach() - logp_ref.detach().to(logp.dtype)
        stats = LossStats(
            loss=float(loss.detach()),
            mean_reward=float(rewards.detach().double().mean()),
            mean_abs_advantage=float(advantages.double().abs().mean()),
            mean_log_ratio=float(log_ratio.double().mean()),
            mean_half_sq_log_ratio=float(0.5 * log_ratio.double().square().mean()),
            num_prompts=int(logp.shape[0]),
            num_responses_per_prompt=int(logp.shape[1]),
        )
    return loss, stats


def sequence_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of masked token log-probs per sequence.

    logits: [batch, seq, vocab], where ``logits[:, t]`` scores ``target_ids[:, t]`` (the caller
        shifts: logits of positions 0..n-2 score tokens 1..n-1).
    target_ids: [batch, seq] integer ids.
    loss_mask: [batch, seq], 1 for response tokens that count (0 for prompt, padding, or stale
        partial-rollout segments); None counts every position.
    Returns [batch] in the logits' dtype (float32 at least).
    """
    if logits.dim() != 3 or target_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits [batch, seq, vocab] and target_ids [batch, seq] do not match: "
            f"{tuple(logits.shape)} vs {tuple(target_ids.shape)}"
        )
    logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    if loss_mask is not None:
        if loss_mask.shape != target_ids.shape:
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != target_ids shape {tuple(target_ids.shape)}")
        token_logp = token_logp * loss_mask.to(token_logp.dtype)
    return token_logp.sum(dim=-1)
