"""One iteration of policy optimization (k1.5 eq. 3) on the finished groups of an iteration.

::

    groups [P x k] ──build_batch──▶ prompt ids, response ids, token masks, rewards [P, k]
                                     (masks drop stale segments when the config says so)
    trainer (weights = iteration start) ──no_grad──▶ logp_ref [P, k]   <- reference policy
    reset_optimizer()                                                  <- every iteration
    for epoch, minibatch of groups:
        logp = trainer.sequence_logprobs(...)   (grad)
        loss = k15_policy_loss(logp, logp_ref, rewards, tau) ──▶ trainer.step(loss)

The reference log-probs are computed once, before the first step, so every minibatch of the
iteration is regularised toward the same policy: the one that sampled the responses.
Groups whose k rewards are all equal carry no advantage; with ``skip_uniform_groups`` they are
left out (on a 2-core machine that halves the training time once most groups are solved).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence

import torch

from orchestrator.loss import k15_policy_loss_with_stats
from orchestrator.trainer import Trainer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Groups of k responses, flattened group-major (group i's responses are rows i*k .. i*k+k-1)."""

    prompt_ids: tuple[tuple[int, ...], ...]
    response_ids: tuple[tuple[int, ...], ...]
    response_masks: tuple[tuple[int, ...], ...]
    rewards: tuple[tuple[float, ...], ...]  # [num_groups][k]

    def __post_init__(self) -> None:
        k = len(self.rewards[0]) if self.rewards else 0
        if any(len(r) != k for r in self.rewards):
            raise ValueError("every group must have the same number of responses")
        n = len(self.rewards) * k
        if not len(self.prompt_ids) == len(self.response_ids) == len(self.response_masks) == n:
            raise ValueError(f"batch rows ({len(self.prompt_ids)}, {len(self.response_ids)}, "
                             f"{len(self.response_masks)}) do not match {len(self.rewards)} groups of {k}")

    @property
    def num_groups(self) -> int:
        return len(self.rewards)

    @property
    def k(self) -> int:
        return len(self.rewards[0]) if self.rewards else 0

    def rows(self, group_indices: Sequence[int]) -> list[int]:
        return [g * self.k + j for g in group_indices for j in range(self.k)]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    tau: float
    lr: float
    num_minibatches: int = 1
    num_epochs: int = 1
    skip_uniform_groups: bool = True
    ref_chunk_rows: int = 128


def uniform_groups(rewards: Sequence[Sequence[float]], atol: float = 1e-9) -> list[int]:
    """Indices of groups whose rewards are all (nearly) equal: zero advantage everywhere."""
    return [i for i, r in enumerate(rewards) if max(r) - min(r) <= atol]


def split_minibatches(indices: Sequence[int], num_minibatches: int) -> list[list[int]]:
    """Split into at most ``num_minibatches`` contiguous, near-equal, non-empty parts."""
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches={num_minibatches!r} must be >= 1")
    n = min(num_minibatches, len(indices))
    bounds = [round(i * len(indices) / n) for i in range(n + 1)] if n else [0]
    return [list(indices[bounds[i]:bounds[i + 1]]) for i in range(n)]


def _logprobs(trainer: Trainer, batch: TrainBatch, rows: Sequence[int]) -> torch.Tensor:
    return trainer.sequence_logprobs([batch.prompt_ids[r] for r in rows], [batch.response_ids[r] for r in rows],
                                     [batch.response_masks[r] for r in rows])


def reference_logprobs(trainer: Trainer, batch: TrainBatch, chunk_rows: int = 128) -> torch.Tensor:
    """[num_groups, k] log-probs under the trainer's current weights, without grad."""
    rows = list(range(batch.num_groups * batch.k))
    with torch.no_grad():
        parts = [_logprobs(trainer, batch, rows[i:i + chunk_rows]).detach()
                 for i in range(0, len(rows), chunk_rows)]
    return torch.cat(parts).view(batch.num_groups, batch.k)


def train_iteration(trainer: Trainer, batch: TrainBatch, config: TrainConfig, rng: random.Random) -> dict:
    """Reset the optimizer, take the reference log-probs, then the minibatch steps; return stats."""
    trainer.reset_optimizer()
    trainer.set_lr(config.lr)
    skipped = set(uniform_groups(batch.rewards)) if config.skip_uniform_groups else set()
    active = [g for g in range(batch.num_groups) if g not in skipped]
    stats: dict = {"num_train_groups": len(active), "num_skipped_groups": len(skipped), "num_steps": 0,
                   "lr": config.lr}
    if not active:
        return stats
    sub = TrainBatch(*(tuple(getattr(batch, f)[r] for r in batch.rows(active))
                       for f in ("prompt_ids", "response_ids", "response_masks")),
                     rewards=tuple(batch.rewards[g] for g in active))
    logp_ref = reference_logprobs(trainer, sub, config.ref_chunk_rows)
    rewards = torch.tensor(sub.rewards, dtype=torch.float32)
    losses, grad_norms, log_ratios = [], [], []
    for _ in range(config.num_epochs):
        order = list(range(sub.num_groups))
        rng.shuffle(order)
        for groups in split_minibatches(order, config.num_minibatches):
            logp = _logprobs(trainer, sub, sub.rows(groups)).view(len(groups), sub.k)
            loss, loss_stats = k15_policy_loss_with_stats(logp, logp_ref[groups], rewards[groups], config.tau)
            step = trainer.step(loss)
            losses.append(loss_stats.loss)
            log_ratios.append(loss_stats.mean_half_sq_log_ratio)
            grad_norms.append(step["grad_norm"])
    stats.update(num_steps=len(losses), loss=sum(losses) / len(losses), grad_norm=max(grad_norms),
                 half_sq_log_ratio=sum(log_ratios) / len(log_ratios))
    return stats


def batch_from_groups(groups: Sequence[Sequence], rewards: Sequence[Sequence[float]], *,
                      current_policy_version: int, exclude_stale: bool) -> TrainBatch:
    """A TrainBatch from finished groups of replay-buffer trajectories and their rewards."""
    if len(groups) != len(rewards):
        raise ValueError(f"{len(groups)} groups but {len(rewards)} reward lists")
    rows = [t for group in groups for t in group]
    return TrainBatch(
        prompt_ids=tuple(tuple(t.prompt_token_ids) for t in rows),
        response_ids=tuple(tuple(t.response_token_ids()) for t in rows),
        response_masks=tuple(tuple(t.token_loss_mask(current_policy_version, exclude_stale)) for t in rows),
        rewards=tuple(tuple(float(r) for r in rs) for rs in rewards))
