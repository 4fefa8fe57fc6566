"""The stages of one RL iteration between rollout and weight sync: rewards, training, the rollout's record.

::

    finished groups of k ──iteration_rewards──▶ task reward - repeat penalty + length penalty
        ──train_on_groups──▶ trainer.policy.train_iteration (rl.algorithm's loss, minibatches, epochs)
    rollout_record: the metrics of the iteration's rollouts and rewards
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from orchestrator.config import JobConfig
from orchestrator.scoring import group_rewards


def iteration_rewards(groups: Sequence[Any], iteration: int, c: JobConfig) -> list[list[float]]:
    return [
        group_rewards(
            g.scores,
            [t.num_response_tokens for t in g.trajectories],
            [t.finish_reason == "repeat" for t in g.trajectories],
            iteration,
            c.length_penalty,
            c.repeat,
        )
        for g in groups
    ]


def train_on_groups(
    trainer: Any, initial_policy: Any, groups: Sequence[Any], rewards: list[list[float]], iteration: int, c: JobConfig
) -> dict[str, Any]:
    """One iteration's training on the finished groups (none: no step)."""
    from trainer.policy import TrainConfig, batch_from_groups, train_iteration

    if not groups:
        return {"num_train_groups": 0, "num_skipped_groups": 0, "num_steps": 0}
    batch = batch_from_groups(
        [g.trajectories for g in groups],
        rewards,
        current_policy_version=iteration,
        exclude_stale=c.rollout.exclude_stale_segments,
    )
    rng = random.Random(f"{c.rl.seed}/{iteration}")
    return train_iteration(
        trainer,
        batch,
        TrainConfig(
            tau=c.rl.tau,
            lr=c.rl.lr_at(iteration),
            num_minibatches=c.rl.num_minibatches,
            num_epochs=c.rl.num_epochs,
            algorithm=c.rl.algorithm,
            clip_eps=c.rl.clip_eps,
            kl_coef=c.rl.kl_coef,
        ),
        rng,
        initial_policy=initial_policy,
    )


def rollout_record(groups: Sequence[Any], rewards: list[list[float]], stats: Any, iteration: int, c: JobConfig) -> dict:
    """The metrics record's fields about the iteration's rollouts (``stats``: ``Rollout.run``'s) and rewards."""
    scores = [s for g in groups for s in g.scores]
    lengths = [t.num_response_tokens for g in groups for t in g.trajectories]
    flat = [r for rs in rewards for r in rs]
    return {
        "mean_reward": sum(flat) / len(flat) if flat else None,
        "mean_task_reward": sum(s.task_reward for s in scores) / len(scores) if scores else None,
        "train_pass_at_1": sum(s.correct for s in scores) / len(scores) if scores else None,
        "mean_response_tokens": sum(lengths) / len(lengths) if lengths else None,
        "length_penalty_active": c.length_penalty.is_active(iteration),
        "num_groups": len(groups),
        "num_requests": stats.num_requests,
        "num_new_groups": stats.num_new_groups,
        "num_continued": stats.num_continued,
        "num_unfinished": stats.num_unfinished_trajectories,
        "num_repeat_stops": stats.num_repeat_stops,
        "num_output_tokens": stats.num_output_tokens,
        "tokens_per_s": stats.tokens_per_s,
        "rollout_s": stats.generate_s,
        "score_wait_s": stats.score_wait_s,
        **({"rollout_weight_versions": stats.outputs_by_weight_version} if stats.outputs_by_weight_version else {}),
    }
