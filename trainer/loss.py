"""Policy losses: Kimi k1.5's eq. (3) (the default), and the baselines it is compared with (GRPO,
REINFORCE with a mean baseline), plus DPO (k1.5 long2short). All are pure functions on tensors.

Kimi k1.5 policy loss (report section 2.3, eq. 3): online mirror descent, no value network.

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

Baselines (``rl.algorithm``; same rollouts, rewards and steps, only the loss differs)::

    reinforce: L = -mean_ij[ logp_ij * (r_ij - mean_j r_ij) ]           sequence level, no reference
    grpo:      per response token t of response ij (mask m_ijt: stale segments/padding are 0)
               A_ij    = (r_ij - mean_j r_ij) / (std_j r_ij + adv_eps)       (population std)
               rho     = exp(logp_ijt - logp_old_ijt)                      old = rollout policy
               surr    = min(rho * A_ij, clip(rho, 1 - clip_eps, 1 + clip_eps) * A_ij)
               kl      = exp(logp_init - logp) - (logp_init - logp) - 1    k3 estimator, init = SFT
               L = -mean_ij[ sum_t m_ijt (surr - kl_coef * kl) / max(1, sum_t m_ijt) ]
    dpo:       L = -mean_n log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l)))   sequence log-probs
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "GrpoStats",
    "LossConfig",
    "LossStats",
    "dpo_loss",
    "group_advantages",
    "grpo_policy_loss",
    "grpo_policy_loss_with_stats",
    "k15_policy_loss",
    "k15_policy_loss_with_stats",
    "normalized_group_advantages",
    "reinforce_policy_loss",
    "sequence_logprobs",
    "token_logprobs",
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


def k15_policy_loss(logp: torch.Tensor, logp_ref: torch.Tensor, rewards: torch.Tensor, tau: float) -> torch.Tensor:
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
    return token_logprobs(logits, target_ids, loss_mask).sum(dim=-1)


def token_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Masked token log-probs [batch, seq] (the terms :func:`sequence_logprobs` sums)."""
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
    return token_logp


# -- baselines ------------------------------------------------------------------------------------


def normalized_group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's ``(r_ij - mean_j r_ij) / (std_j r_ij + eps)`` over [num_prompts, k] (population std)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_prompts, k], got {tuple(rewards.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    rewards = rewards.detach()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


def reinforce_policy_loss(logp: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the group-mean baseline: ``-mean_ij[logp_ij * (r_ij - mean_j r_ij)]``.

    logp: [num_prompts, k] sequence log-probs (differentiable); rewards: same shape (constant).
    No reference policy, no clipping: eq. (3) with tau = 0.
    """
    _check_shapes(logp, logp, rewards)
    advantages = group_advantages(rewards).to(logp.dtype)
    return -(logp * advantages).mean()


@dataclass(frozen=True)
class GrpoStats:
    """Diagnostics of one GRPO loss evaluation (over counted tokens)."""

    loss: float
    mean_reward: float
    mean_abs_advantage: float
    clip_fraction: float  # share of counted tokens whose clipped term was the smaller one (no gradient)
    mean_kl: float  # k3 estimate of KL(policy || initial) per counted token
    mean_ratio: float
    num_tokens: int


def _grpo_terms(logp, logp_old, logp_init, mask, rewards, clip_eps, kl_coef, adv_eps):
    if logp.dim() != 3:
        raise ValueError(f"logp must have shape [num_prompts, k, num_tokens], got {tuple(logp.shape)}")
    for name, t in (("logp_old", logp_old), ("mask", mask)) + (
        (("logp_init", logp_init),) if logp_init is not None else ()
    ):
        if t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if rewards.shape != logp.shape[:2]:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} != logp shape[:2] {tuple(logp.shape[:2])}")
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps!r}")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
    if kl_coef > 0 and logp_init is None:
        raise ValueError("kl_coef > 0 needs logp_init (the initial policy's token log-probs)")
    counted = mask.detach().to(logp.dtype) > 0
    zero = torch.zeros((), dtype=logp.dtype)
    advantages = normalized_group_advantages(rewards, adv_eps).to(logp.dtype).unsqueeze(-1)
    # masked positions get a log-ratio of 0 (ratio 1, kl 0): padding never reaches exp()
    log_ratio = torch.where(counted, logp - logp_old.detach().to(logp.dtype), zero)
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if logp_init is not None:
        init_log_ratio = torch.where(counted, logp_init.detach().to(logp.dtype) - logp, zero)
        kl = init_log_ratio.exp() - init_log_ratio - 1
    else:
        kl = torch.zeros_like(logp)
    per_token = (surrogate - kl_coef * kl) * counted
    num_counted = counted.sum(dim=-1).clamp(min=1).to(logp.dtype)
    loss = -(per_token.sum(dim=-1) / num_counted).mean()
    return loss, counted, advantages, ratio, unclipped, clipped, kl


def grpo_policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_init: torch.Tensor | None,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    clip_eps: float = 0.2,
    kl_coef: float = 0.04,
    adv_eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO surrogate (module docstring) over token log-probs of shape [num_prompts, k, num_tokens].

    logp: current policy (differentiable); logp_old: the policy that sampled the responses (the
    iteration start), constant; logp_init: the initial (SFT) policy, constant, or None when
    kl_coef is 0; mask: 1 for counted response tokens; rewards: [num_prompts, k].
    """
    return _grpo_terms(logp, logp_old, logp_init, mask, rewards, clip_eps, kl_coef, adv_eps)[0]


def grpo_policy_loss_with_stats(
    logp, logp_old, logp_init, mask, rewards, clip_eps: float = 0.2, kl_coef: float = 0.04, adv_eps: float = 1e-4
) -> tuple[torch.Tensor, GrpoStats]:
    """:func:`grpo_policy_loss` plus :class:`GrpoStats`."""
    loss, counted, advantages, ratio, unclipped, clipped, kl = _grpo_terms(
        logp, logp_old, logp_init, mask, rewards, clip_eps, kl_coef, adv_eps
    )
    with torch.no_grad():
        n = int(counted.sum())
        denominator = max(n, 1)
        stats = GrpoStats(
            loss=float(loss.detach()),
            mean_reward=float(rewards.detach().double().mean()),
            mean_abs_advantage=float(advantages.double().abs().mean()),
            clip_fraction=float(((clipped < unclipped) & counted).sum()) / denominator,
            mean_kl=float((kl.detach().double() * counted).sum()) / denominator,
            mean_ratio=float((ratio.detach().double() * counted).sum()) / denominator,
            num_tokens=n,
        )
    return loss, stats


# -- DPO (k1.5 long2short) ------------------------------------------------------------------------


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """``-mean log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l)))`` over [num_pairs] sequence log-probs.

    The reference log-probs are constants (detached here).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    shapes = {tuple(t.shape) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or policy_chosen.dim() != 1 or policy_chosen.numel() == 0:
        raise ValueError(f"DPO log-probs must be four non-empty [num_pairs] tensors, got shapes {sorted(shapes)}")
    margin = (policy_chosen - ref_chosen.detach()) - (policy_rejected - ref_rejected.detach())
    return -torch.nn.functional.logsigmoid(beta * margin).mean()
