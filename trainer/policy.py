"""One iteration of policy optimization (k1.5 eq. 3, or a baseline) on the finished groups of an iteration.

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

The loss is chosen in one place, ``make_objective`` keyed by ``TrainConfig.algorithm`` (the
``rl.algorithm`` Literal); everything else (batch, skipping, optimizer reset, minibatches, epochs)
is shared, so the algorithms compare at equal rollouts and steps::

    k15        logp_ref = sequence log-probs at the iteration start ──▶ k15_policy_loss (eq. 3)
    reinforce  no reference ──▶ reinforce_policy_loss (group-mean baseline)
    grpo       token log-probs at the iteration start (old) and of the initial policy (init,
               ``initial_policy``, when kl_coef > 0) ──▶ grpo_policy_loss (clip + k3 KL)
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch

from trainer.base import Trainer, pad_sequences
from trainer.loss import grpo_policy_loss_with_stats, k15_policy_loss_with_stats, reinforce_policy_loss
from trainer.loss import token_logprobs as _masked_token_logprobs

Algorithm = Literal["k15", "grpo", "reinforce"]

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
            raise ValueError(
                f"batch rows ({len(self.prompt_ids)}, {len(self.response_ids)}, "
                f"{len(self.response_masks)}) do not match {len(self.rewards)} groups of {k}"
            )

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
    algorithm: Algorithm = "k15"
    clip_eps: float = 0.2  # grpo
    kl_coef: float = 0.0  # grpo: weight of the k3 KL to the initial policy (needs initial_policy if > 0)


def uniform_groups(rewards: Sequence[Sequence[float]], atol: float = 1e-9) -> list[int]:
    """Indices of groups whose rewards are all (nearly) equal: zero advantage everywhere."""
    return [i for i, r in enumerate(rewards) if max(r) - min(r) <= atol]


def split_minibatches(indices: Sequence[int], num_minibatches: int) -> list[list[int]]:
    """Split into at most ``num_minibatches`` contiguous, near-equal, non-empty parts."""
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches={num_minibatches!r} must be >= 1")
    n = min(num_minibatches, len(indices))
    bounds = [round(i * len(indices) / n) for i in range(n + 1)] if n else [0]
    return [list(indices[bounds[i] : bounds[i + 1]]) for i in range(n)]


def _logprobs(trainer: Trainer, batch: TrainBatch, rows: Sequence[int]) -> torch.Tensor:
    return trainer.sequence_logprobs(
        [batch.prompt_ids[r] for r in rows],
        [batch.response_ids[r] for r in rows],
        [batch.response_masks[r] for r in rows],
    )


def reference_logprobs(trainer: Trainer, batch: TrainBatch, chunk_rows: int = 128) -> torch.Tensor:
    """[num_groups, k] log-probs under the trainer's current weights, without grad."""
    rows = list(range(batch.num_groups * batch.k))
    with torch.no_grad():
        parts = [_logprobs(trainer, batch, rows[i : i + chunk_rows]).detach() for i in range(0, len(rows), chunk_rows)]
    return torch.cat(parts).view(batch.num_groups, batch.k)


def token_logprobs(trainer: Any, batch: TrainBatch, rows: Sequence[int], width: int) -> torch.Tensor:
    """[len(rows), width] log-probs of each response token (response-aligned, zero past the end).

    Uses ``trainer.token_logprobs(prompts, responses, masks)`` when the trainer has it, else the
    trainer's HF model directly (``model``, ``pad_id``, ``dtype_choice`` of ``HFTrainer``).
    """
    prompts = [batch.prompt_ids[r] for r in rows]
    responses = [batch.response_ids[r] for r in rows]
    masks = [batch.response_masks[r] for r in rows]
    method = getattr(trainer, "token_logprobs", None)
    out = (
        method(prompts, responses, masks)
        if method is not None
        else _hf_token_logprobs(trainer, prompts, responses, masks)
    )
    if out.shape[1] > width:
        raise ValueError(f"token log-probs are {out.shape[1]} wide, more than width={width}")
    return torch.nn.functional.pad(out, (0, width - out.shape[1]))


def _hf_token_logprobs(trainer: Any, prompts, responses, masks) -> torch.Tensor:
    ids, attention, loss_mask = pad_sequences(prompts, responses, masks, trainer.pad_id)
    choice = getattr(trainer, "dtype_choice", None)
    bf16 = choice is not None and choice.chosen == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = trainer.model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    per_token = _masked_token_logprobs(logits[:, :-1], ids[:, 1:], loss_mask)  # [B, seq - 1]
    width = max(1, max(len(r) for r in responses))
    starts = torch.tensor([len(p) - 1 for p in prompts]).unsqueeze(1)
    index = (starts + torch.arange(width).unsqueeze(0)).clamp(max=per_token.shape[1] - 1)
    inside = torch.arange(width).unsqueeze(0) < torch.tensor([len(r) for r in responses]).unsqueeze(1)
    return per_token.gather(1, index) * inside


def token_masks(batch: TrainBatch, width: int) -> torch.Tensor:
    """[rows, width] float masks of the response tokens that count (0 past each response's end)."""
    out = torch.zeros(len(batch.response_masks), width)
    for i, mask in enumerate(batch.response_masks):
        out[i, : len(mask)] = torch.tensor([float(m) for m in mask])
    return out


class Objective(Protocol):
    """One algorithm's loss over the minibatches of an iteration."""

    def prepare(self, trainer: Trainer, batch: TrainBatch) -> None:
        """Constants of the iteration (reference log-probs), before the first step."""

    def loss(
        self, trainer: Trainer, batch: TrainBatch, groups: list[int], rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The minibatch ``groups``' scalar loss and its stats (including "loss")."""


class K15Objective:
    """Eq. (3): squared log-ratio to the iteration-start policy, group-mean baseline."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.logp_ref: torch.Tensor | None = None

    def prepare(self, trainer: Trainer, batch: TrainBatch) -> None:
        self.logp_ref = reference_logprobs(trainer, batch, self.config.ref_chunk_rows)

    def loss(self, trainer, batch, groups, rewards):
        logp = _logprobs(trainer, batch, batch.rows(groups)).view(len(groups), batch.k)
        loss, stats = k15_policy_loss_with_stats(logp, self.logp_ref[groups], rewards[groups], self.config.tau)
        return loss, {"loss": stats.loss, "half_sq_log_ratio": stats.mean_half_sq_log_ratio}


class ReinforceObjective:
    """REINFORCE with the group-mean baseline: no reference, no clipping."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    def prepare(self, trainer: Trainer, batch: TrainBatch) -> None:
        pass

    def loss(self, trainer, batch, groups, rewards):
        logp = _logprobs(trainer, batch, batch.rows(groups)).view(len(groups), batch.k)
        loss = reinforce_policy_loss(logp, rewards[groups])
        return loss, {"loss": float(loss.detach())}


class GrpoObjective:
    """GRPO: normalised group advantage, per-token clipped ratio to the rollout policy, k3 KL to the initial one."""

    def __init__(self, config: TrainConfig, initial_policy: Trainer | None) -> None:
        if config.kl_coef > 0 and initial_policy is None:
            raise ValueError("grpo with kl_coef > 0 needs the initial policy (initial_policy=...)")
        self.config = config
        self.initial_policy = initial_policy if config.kl_coef > 0 else None

    def _constant(self, model: Any, batch: TrainBatch) -> torch.Tensor:
        rows = list(range(batch.num_groups * batch.k))
        chunk = self.config.ref_chunk_rows
        with torch.no_grad():
            parts = [
                token_logprobs(model, batch, rows[i : i + chunk], self.width).detach()
                for i in range(0, len(rows), chunk)
            ]
        return torch.cat(parts).view(batch.num_groups, batch.k, self.width)

    def prepare(self, trainer: Trainer, batch: TrainBatch) -> None:
        self.width = max(1, max(len(r) for r in batch.response_ids))
        self.mask = token_masks(batch, self.width).view(batch.num_groups, batch.k, self.width)
        self.logp_old = self._constant(trainer, batch)
        self.logp_init = None if self.initial_policy is None else self._constant(self.initial_policy, batch)

    def loss(self, trainer, batch, groups, rewards):
        logp = token_logprobs(trainer, batch, batch.rows(groups), self.width).view(len(groups), batch.k, self.width)
        init = None if self.logp_init is None else self.logp_init[groups]
        loss, stats = grpo_policy_loss_with_stats(
            logp,
            self.logp_old[groups],
            init,
            self.mask[groups],
            rewards[groups],
            self.config.clip_eps,
            self.config.kl_coef,
        )
        return loss, {
            "loss": stats.loss,
            "clip_fraction": stats.clip_fraction,
            "kl_to_initial": stats.mean_kl,
            "mean_ratio": stats.mean_ratio,
        }


_OBJECTIVES: dict[str, Callable[[TrainConfig, Trainer | None], Objective]] = {
    "k15": lambda config, initial: K15Objective(config),
    "reinforce": lambda config, initial: ReinforceObjective(config),
    "grpo": GrpoObjective,
}


def make_objective(config: TrainConfig, initial_policy: Trainer | None = None) -> Objective:
    """The objective of ``config.algorithm`` (the one place the algorithm is switched on)."""
    try:
        factory = _OBJECTIVES[config.algorithm]
    except KeyError:
        raise ValueError(f"algorithm={config.algorithm!r} must be one of {sorted(_OBJECTIVES)}") from None
    return factory(config, initial_policy)


def train_iteration(
    trainer: Trainer, batch: TrainBatch, config: TrainConfig, rng: random.Random, initial_policy: Trainer | None = None
) -> dict:
    """Reset the optimizer, take the reference log-probs, then the minibatch steps; return stats.

    ``initial_policy``: the policy RL started from (GRPO's KL reference); other algorithms ignore it.
    """
    objective = make_objective(config, initial_policy)
    trainer.reset_optimizer()
    trainer.set_lr(config.lr)
    skipped = set(uniform_groups(batch.rewards)) if config.skip_uniform_groups else set()
    active = [g for g in range(batch.num_groups) if g not in skipped]
    stats: dict = {"num_train_groups": len(active), "num_skipped_groups": len(skipped), "num_steps": 0, "lr": config.lr}
    if not active:
        return stats
    sub = TrainBatch(
        *(
            tuple(getattr(batch, f)[r] for r in batch.rows(active))
            for f in ("prompt_ids", "response_ids", "response_masks")
        ),
        rewards=tuple(batch.rewards[g] for g in active),
    )
    objective.prepare(trainer, sub)
    rewards = torch.tensor(sub.rewards, dtype=torch.float32)
    step_stats: dict[str, list[float]] = {}
    grad_norms = []
    for _ in range(config.num_epochs):
        order = list(range(sub.num_groups))
        rng.shuffle(order)
        for groups in split_minibatches(order, config.num_minibatches):
            loss, loss_stats = objective.loss(trainer, sub, groups, rewards)
            step = trainer.step(loss)
            for key, value in loss_stats.items():
                step_stats.setdefault(key, []).append(value)
            grad_norms.append(step["grad_norm"])
    stats.update(
        num_steps=len(grad_norms),
        grad_norm=max(grad_norms),
        **{key: sum(values) / len(values) for key, values in step_stats.items()},
    )
    return stats


def batch_from_groups(
    groups: Sequence[Sequence], rewards: Sequence[Sequence[float]], *, current_policy_version: int, exclude_stale: bool
) -> TrainBatch:
    """A TrainBatch from finished groups of replay-buffer trajectories and their rewards."""
    if len(groups) != len(rewards):
        raise ValueError(f"{len(groups)} groups but {len(rewards)} reward lists")
    rows = [t for group in groups for t in group]
    return TrainBatch(
        prompt_ids=tuple(tuple(t.prompt_token_ids) for t in rows),
        response_ids=tuple(tuple(t.response_token_ids()) for t in rows),
        response_masks=tuple(tuple(t.token_loss_mask(current_policy_version, exclude_stale)) for t in rows),
        rewards=tuple(tuple(float(r) for r in rs) for rs in rewards),
    )
