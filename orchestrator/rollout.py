"""One iteration's rollouts: plan within the token budget, generate, score as results arrive.

::

    ReplayBuffer.plan() ──▶ continue these unfinished trajectories + start N new groups of k
    sample_problems(N) ──▶ start_group(problem, prompt ids) x N
    requests (prompt + earlier segments) ──▶ RolloutEngine.generate(...) (all in flight at once)
        on_result (engine thread, as each request ends):
            record_segment(tokens, policy_version, finish)   "repeat" when the stream was cut
            finished? ──▶ scoring pool: decode, RewardFn ──▶ Score   (overlaps generation)
    wait for scores ──▶ pop_finished_groups() ──▶ FinishedGroup(trajectories, scores)
                        (a finished trajectory scored in an earlier run is rescored: the cache
                         of scores is not part of the saved state; rewards are deterministic)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orchestrator import phases
from orchestrator.engine_pool.base import GenRequest, GenResult, RolloutEngine, SamplingSettings
from orchestrator.repeat import RepeatConfig
from orchestrator.replay import ReplayBuffer, Trajectory
from orchestrator.rewards import RewardFn
from orchestrator.scoring import Score, score_response

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FinishedGroup:
    problem_id: str
    trajectories: tuple[Trajectory, ...]
    scores: tuple[Score, ...]


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    num_requests: int
    num_new_groups: int
    num_continued: int
    num_output_tokens: int
    num_repeat_stops: int
    num_finished_groups: int
    num_unfinished_trajectories: int
    generate_s: float
    score_wait_s: float
    # results by the weight version that sampled them (engines that report versions), "mixed" for a
    # result whose version changed mid-request: rollouts of one iteration all come from one version
    outputs_by_weight_version: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.generate_s if self.generate_s > 0 else 0.0


def outputs_by_weight_version(results: Sequence[GenResult]) -> dict[str, int]:
    """How many results each weight version sampled ("mixed": more than one; results without spans,
    e.g. from an engine that reports none, are not counted)."""
    counts: dict[str, int] = {}
    for r in results:
        if r.weight_versions:
            versions = {v for v, _, _ in r.weight_versions}
            key = versions.pop() if len(versions) == 1 else "mixed"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


class Rollout:
    """Drives the engine for one iteration and keeps the scores of finished trajectories."""

    def __init__(
        self,
        engine: RolloutEngine,
        buffer: ReplayBuffer,
        problems: Mapping[str, Any],
        encode: Callable[[Any], list[int]],
        decode: Callable[[Sequence[int]], str],
        reward_fn: RewardFn,
        correct_threshold: float,
        repeat: RepeatConfig,
        sampling: SamplingSettings,
        num_scoring_workers: int = 1,
        timeout_s: float = 900.0,
    ) -> None:
        self.engine = engine
        self.buffer = buffer
        self.problems = problems
        self.encode = encode
        self.decode = decode
        self.reward_fn = reward_fn
        self.correct_threshold = correct_threshold
        self.repeat = repeat
        self.sampling = sampling
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(num_scoring_workers, thread_name_prefix="score")
        self._lock = threading.Lock()
        self._scores: dict[str, concurrent.futures.Future[Score]] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _score(self, trajectory: Trajectory) -> Score:
        text = self.decode(trajectory.response_token_ids())
        return score_response(self.reward_fn, self.problems[trajectory.problem_id], text, self.correct_threshold)

    def _on_result(self, result: GenResult, policy_version: int) -> None:
        # a point inside the rollout, other requests still in flight (a test can stop the job here)
        phases.reached("rollout result")
        with self._lock:
            trajectory = self.buffer.record_segment(
                result.request_id,
                list(result.token_ids),
                policy_version=policy_version,
                finish_reason=result.finish_reason,
            )
            if trajectory.finished:
                self._scores[trajectory.trajectory_id] = self._pool.submit(self._score, trajectory)

    def start_groups(self, problem_ids: Sequence[str], iteration: int) -> list[str]:
        ids: list[str] = []
        for problem_id in problem_ids:
            ids += self.buffer.start_group(problem_id, self.encode(self.problems[problem_id]), iteration)
        return ids

    def run(
        self, iteration: int, policy_version: int, sample_problems: Callable[[int], list[str]]
    ) -> tuple[list[FinishedGroup], RolloutStats]:
        """Generate this iteration's segments; return the groups now complete (removed from the buffer)."""
        plan = self.buffer.plan()
        new_ids = self.start_groups(sample_problems(plan.num_new_groups), iteration) if plan.num_new_groups else []
        requests = []
        for rollout_request in self.buffer.requests(list(plan.continue_ids) + new_ids):
            trajectory = self.buffer.get(rollout_request.trajectory_id)
            requests.append(
                GenRequest(
                    rollout_request.trajectory_id,
                    tuple(rollout_request.prompt_token_ids),
                    rollout_request.max_tokens,
                    tuple(trajectory.response_token_ids()),
                )
            )
        start = time.monotonic()
        results = self.engine.generate(
            requests,
            self.sampling,
            repeat=self.repeat,
            timeout_s=self.timeout_s,
            on_result=lambda r: self._on_result(r, policy_version),
        )
        generate_s = time.monotonic() - start
        groups = self.buffer.pop_finished_groups()
        finished = [self._finish_group(group) for group in groups]
        stats = RolloutStats(
            num_requests=len(requests),
            num_new_groups=plan.num_new_groups,
            num_continued=len(plan.continue_ids),
            num_output_tokens=sum(len(r.token_ids) for r in results),
            num_repeat_stops=sum(r.finish_reason == "repeat" for r in results),
            num_finished_groups=len(finished),
            num_unfinished_trajectories=len(self.buffer.unfinished()),
            generate_s=generate_s,
            score_wait_s=time.monotonic() - start - generate_s,
            outputs_by_weight_version=outputs_by_weight_version(results),
        )
        return finished, stats

    def _finish_group(self, group: Sequence[Trajectory]) -> FinishedGroup:
        scores = []
        for trajectory in group:
            future = self._scores.pop(trajectory.trajectory_id, None)
            scores.append(future.result(timeout=self.timeout_s) if future is not None else self._score(trajectory))
        return FinishedGroup(group[0].problem_id, tuple(group), tuple(scores))
