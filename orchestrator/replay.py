"""Partial rollouts (Kimi k1.5 report, section 2.6.2): a replay buffer of unfinished trajectories.

One iteration::

    ReplayBuffer.plan() ──▶ RolloutPlan: continue these unfinished trajectories (oldest first)
          │                 + start this many new groups, within iteration_token_budget
          │                 (each request reserves min(segment_max_tokens, tokens it has left))
          ▼
    start_group(problem, prompt_ids, iteration) ──▶ k new trajectory ids   (new prompts)
    requests(ids) ──▶ RolloutRequest(prompt + earlier segments, max_tokens) ──▶ engine
    record_segment(id, new_token_ids, policy_version, finish_reason)
          │    "stop" / "repeat"         -> finished
          │    "length" at the response cap -> finished ("length"); below it -> continue later
          │    "abort"                   -> continue later (e.g. interrupted by a weight update)
          ▼
    pop_finished_groups() ──▶ groups whose k trajectories are all finished ──▶ trainer
          token_loss_mask(current_version, exclude_stale_segments) masks segments sampled
          by earlier policies when the config says so
    save(path) ──▶ JSON, written to a temp file then os.replace: a run killed mid-iteration
                   keeps the previous complete file
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ckpt_common.fsutil import atomic_write_text
from ckpt_common.validate import check_int

__all__ = [
    "FINISH_REASONS",
    "PartialRolloutConfig",
    "ReplayBuffer",
    "RolloutPlan",
    "RolloutRequest",
    "Segment",
    "Trajectory",
    "plan_iteration",
]

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "repeat", "abort")
_STATE_VERSION = 1


def check_rollout_fields(owner: str, config: Any) -> None:
    """The field checks PartialRolloutConfig and the job's rollout section share (``owner``: the prefix)."""
    for name in ("iteration_token_budget", "segment_max_tokens", "max_response_tokens"):
        check_int(f"{owner}.{name}", getattr(config, name))
    if config.max_new_groups_per_iteration is not None:
        check_int(f"{owner}.max_new_groups_per_iteration", config.max_new_groups_per_iteration)
    if not isinstance(config.exclude_stale_segments, bool):
        raise ValueError(f"{owner}.exclude_stale_segments={config.exclude_stale_segments!r} must be a bool")


@dataclass(frozen=True)
class PartialRolloutConfig:
    """iteration_token_budget: output tokens one iteration may generate, over all requests.
    segment_max_tokens: output tokens one request may generate in one iteration.
    max_response_tokens: cap on a whole response (all its segments).
    num_responses_per_prompt: k, trajectories per group (same prompt).
    exclude_stale_segments: leave segments sampled by earlier policies out of the loss.
    max_new_groups_per_iteration: optional cap on new groups started per iteration."""

    iteration_token_budget: int
    segment_max_tokens: int
    max_response_tokens: int
    num_responses_per_prompt: int
    exclude_stale_segments: bool = False
    max_new_groups_per_iteration: int | None = None

    def __post_init__(self) -> None:
        check_rollout_fields("PartialRolloutConfig", self)
        check_int("PartialRolloutConfig.num_responses_per_prompt", self.num_responses_per_prompt)
        if self.iteration_token_budget < self.new_group_cost_tokens:
            raise ValueError(
                f"PartialRolloutConfig.iteration_token_budget={self.iteration_token_budget} is below the cost of "
                f"one new group (num_responses_per_prompt * min(segment_max_tokens, max_response_tokens) = "
                f"{self.new_group_cost_tokens}): no new prompt could ever start"
            )

    @property
    def new_group_cost_tokens(self) -> int:
        return self.num_responses_per_prompt * min(self.segment_max_tokens, self.max_response_tokens)


@dataclass
class Segment:
    token_ids: list[int]
    policy_version: int


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    problem_id: str
    prompt_token_ids: list[int]
    start_iteration: int
    segments: list[Segment] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def response_token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def continuation_prompt(self) -> list[int]:
        """What the engine is given to continue: the prompt plus every earlier segment."""
        return list(self.prompt_token_ids) + self.response_token_ids()

    def segment_loss_mask(self, current_policy_version: int, exclude_stale: bool) -> list[bool]:
        """Per segment: whether it counts in the loss (stale = sampled by an older policy)."""
        if not exclude_stale:
            return [True] * len(self.segments)
        return [s.policy_version >= current_policy_version for s in self.segments]

    def token_loss_mask(self, current_policy_version: int, exclude_stale: bool) -> list[int]:
        """Per response token: 1 if it counts in the loss, else 0."""
        mask = self.segment_loss_mask(current_policy_version, exclude_stale)
        return [int(keep) for keep, s in zip(mask, self.segments) for _ in s.token_ids]


@dataclass(frozen=True)
class RolloutRequest:
    trajectory_id: str
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class RolloutPlan:
    continue_ids: tuple[str, ...]  # unfinished trajectories to continue, oldest first
    num_new_groups: int
    reserved_tokens: int  # worst-case output tokens of the planned requests


def plan_iteration(remaining_tokens: Sequence[int], config: PartialRolloutConfig) -> tuple[list[int], int, int]:
    """Pure planning: which unfinished trajectories to continue and how many groups to start.

    remaining_tokens: for each unfinished trajectory, oldest first, the output tokens it may
        still generate (max_response_tokens minus what it has).
    Each request reserves ``min(segment_max_tokens, remaining)``; trajectories are taken oldest
    first while they fit in the budget (first fit), then new groups of k fill what is left.
    Returns (indices to continue, number of new groups, reserved tokens).
    """
    budget = config.iteration_token_budget
    chosen: list[int] = []
    reserved = 0
    for i, remaining in enumerate(remaining_tokens):
        if remaining < 1:
            raise ValueError(f"remaining_tokens[{i}] must be >= 1 for an unfinished trajectory, got {remaining!r}")
        cost = min(config.segment_max_tokens, remaining)
        if reserved + cost <= budget:
            chosen.append(i)
            reserved += cost
    num_new = (budget - reserved) // config.new_group_cost_tokens
    if config.max_new_groups_per_iteration is not None:
        num_new = min(num_new, config.max_new_groups_per_iteration)
    return chosen, num_new, reserved + num_new * config.new_group_cost_tokens


class ReplayBuffer:
    """Holds every trajectory that is not yet trained on; the unit of resume."""

    def __init__(self, config: PartialRolloutConfig) -> None:
        self.config = config
        self._trajectories: dict[str, Trajectory] = {}  # insertion order = creation order
        self._next_group = 0

    def __len__(self) -> int:
        return len(self._trajectories)

    def get(self, trajectory_id: str) -> Trajectory:
        try:
            return self._trajectories[trajectory_id]
        except KeyError:
            raise ValueError(f"unknown trajectory_id {trajectory_id!r}") from None

    def unfinished(self) -> list[Trajectory]:
        """Unfinished trajectories, oldest first (start iteration, then creation order)."""
        live = [t for t in self._trajectories.values() if not t.finished]
        return sorted(live, key=lambda t: t.start_iteration)  # stable: keeps creation order

    def remaining_tokens(self, trajectory: Trajectory) -> int:
        return self.config.max_response_tokens - trajectory.num_response_tokens

    def plan(self) -> RolloutPlan:
        live = self.unfinished()
        chosen, num_new, reserved = plan_iteration([self.remaining_tokens(t) for t in live], self.config)
        return RolloutPlan(tuple(live[i].trajectory_id for i in chosen), num_new, reserved)

    def start_group(self, problem_id: str, prompt_token_ids: Sequence[int], iteration: int) -> list[str]:
        """Create the k trajectories of one new prompt; returns their ids."""
        if not prompt_token_ids:
            raise ValueError(f"prompt_token_ids of problem {problem_id!r} must not be empty")
        group_id = f"g{self._next_group}"
        self._next_group += 1
        ids = []
        for j in range(self.config.num_responses_per_prompt):
            tid = f"{group_id}.{j}"
            prompt = [int(t) for t in prompt_token_ids]
            self._trajectories[tid] = Trajectory(tid, group_id, str(problem_id), prompt, iteration)
            ids.append(tid)
        return ids

    def request(self, trajectory_id: str) -> RolloutRequest:
        traj = self.get(trajectory_id)
        if traj.finished:
            raise ValueError(f"trajectory {trajectory_id!r} is already finished ({traj.finish_reason})")
        max_tokens = min(self.config.segment_max_tokens, self.remaining_tokens(traj))
        return RolloutRequest(trajectory_id, traj.continuation_prompt(), max_tokens)

    def requests(self, trajectory_ids: Sequence[str]) -> list[RolloutRequest]:
        return [self.request(tid) for tid in trajectory_ids]

    def record_segment(
        self, trajectory_id: str, token_ids: Sequence[int], *, policy_version: int, finish_reason: str
    ) -> Trajectory:
        """Append what the engine produced for one request and update the finished state."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
        traj = self.get(trajectory_id)
        if traj.finished:
            raise ValueError(f"trajectory {trajectory_id!r} is already finished ({traj.finish_reason})")
        limit = min(self.config.segment_max_tokens, self.remaining_tokens(traj))
        if len(token_ids) > limit:
            raise ValueError(f"segment of {len(token_ids)} tokens for {trajectory_id!r} exceeds its max_tokens {limit}")
        if token_ids:
            traj.segments.append(Segment([int(t) for t in token_ids], int(policy_version)))
        if finish_reason in ("stop", "repeat"):
            traj.finished, traj.finish_reason = True, finish_reason
        elif self.remaining_tokens(traj) == 0:
            traj.finished, traj.finish_reason = True, "length"
        return traj

    def token_loss_mask(self, trajectory: Trajectory, current_policy_version: int) -> list[int]:
        """Per response token of ``trajectory``: 1 if it counts in the loss under this config."""
        return trajectory.token_loss_mask(current_policy_version, self.config.exclude_stale_segments)

    def pop_finished_groups(self) -> list[list[Trajectory]]:
        """Remove and return the groups whose k trajectories are all finished (oldest first)."""
        groups: dict[str, list[Trajectory]] = {}
        for traj in self._trajectories.values():
            groups.setdefault(traj.group_id, []).append(traj)
        done = [g for g in groups.values() if all(t.finished for t in g)]
        for group in done:
            for traj in group:
                del self._trajectories[traj.trajectory_id]
        return done

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "next_group": self._next_group,
            "num_responses_per_prompt": self.config.num_responses_per_prompt,
            "trajectories": [asdict(t) for t in self._trajectories.values()],
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any], config: PartialRolloutConfig) -> ReplayBuffer:
        if data.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported replay buffer state version {data.get('version')!r}")
        if data["num_responses_per_prompt"] != config.num_responses_per_prompt:
            raise ValueError(
                f"saved buffer has num_responses_per_prompt={data['num_responses_per_prompt']}, "
                f"config has {config.num_responses_per_prompt}"
            )
        buf = cls(config)
        buf._next_group = int(data["next_group"])
        for raw in data["trajectories"]:
            segments = [Segment(list(s["token_ids"]), int(s["policy_version"])) for s in raw["segments"]]
            traj = Trajectory(**{**raw, "segments": segments})
            buf._trajectories[traj.trajectory_id] = traj
        return buf

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (``fsutil.atomic_write_text``): a crash leaves the old or the new file."""
        atomic_write_text(path, json.dumps(self.to_json_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike[str], config: PartialRolloutConfig) -> ReplayBuffer:
        with open(path) as f:
            return cls.from_json_dict(json.load(f), config)
