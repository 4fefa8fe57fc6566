"""Rollouts over a scripted engine: partial rollouts across iterations, scoring off the engine thread,
repeat stops; and the streaming repeat cut used by the vLLM engine."""

import threading

import pytest

from demo import task
from orchestrator.engine_pool.base import GenResult, SamplingSettings
from orchestrator.engine_pool.vllm_async import _StreamStopper
from orchestrator.repeat import RepeatConfig
from orchestrator.replay import PartialRolloutConfig, ReplayBuffer
from orchestrator.rewards import MathVerifyReward
from orchestrator.rollout import Rollout

EOS = 2


def encode(problem):
    return [1] + [ord(c) for c in problem.prompt]


def decode(ids):
    return "".join(chr(t) for t in ids if t != EOS)


class ScriptedEngine:
    """Answers each trajectory with a fixed full response, handing out what max_tokens allows."""

    def __init__(self, responses, loop_forever=()):
        self.responses = responses  # problem prompt -> list of k response strings (by trajectory index)
        self.loop_forever = set(loop_forever)
        self.requests = []

    def full_response(self, request):
        prompt = decode(request.prompt_token_ids[1 : len(request.prompt_token_ids) - len(request.earlier_response_ids)])
        index = int(request.request_id.rsplit(".", 1)[1])
        if request.request_id in self.loop_forever:
            return [ord(c) for c in "1+1+0=2\n" * 20]
        return [ord(c) for c in self.responses[prompt][index]] + [EOS]

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        self.requests.append(list(requests))
        results = []
        for request in requests:
            full = self.full_response(request)
            done = len(request.earlier_response_ids)
            assert list(request.earlier_response_ids) == full[:done]  # continued from its own prefix
            new = full[done : done + request.max_tokens]
            finish = "stop" if done + len(new) == len(full) else "length"
            keep = _StreamStopper(repeat, request.earlier_response_ids).push(new, 0)
            if keep is not None:
                new, finish = new[:keep], "repeat"
            result = GenResult(request.request_id, tuple(new), finish)
            on_result(result)
            results.append(result)
        return results


class ThreadRecordingReward(MathVerifyReward):
    def __init__(self):
        super().__init__()
        self.threads = set()

    def __call__(self, problem, response_text):
        self.threads.add(threading.current_thread().name)
        return super().__call__(problem, response_text)


def setup(segment_max_tokens, k=2, budget=64, loop_forever=()):
    problems = [task.make_problem("add", [3, 4], level=1), task.make_problem("add", [25, 38], level=1)]
    responses = {p.prompt: [task.solution_text(p), task.solution_text(p).replace("#### ", "#### 1")] for p in problems}
    engine = ScriptedEngine(responses, loop_forever)
    config = PartialRolloutConfig(
        iteration_token_budget=budget,
        segment_max_tokens=segment_max_tokens,
        max_response_tokens=200,
        num_responses_per_prompt=k,
    )
    reward = ThreadRecordingReward()
    rollout = Rollout(
        engine,
        ReplayBuffer(config),
        {p.id: p for p in problems},
        encode,
        decode,
        reward,
        0.5,
        RepeatConfig(min_ngram=1, max_ngram=16, min_repeats=4, min_tail_tokens=16),
        SamplingSettings(),
    )
    queue = [p.id for p in problems]
    return rollout, engine, reward, lambda n: [queue.pop(0) for _ in range(min(n, len(queue)))]


def test_partial_rollouts_continue_across_iterations_and_finish_scored():
    rollout, engine, reward, sample = setup(segment_max_tokens=8, budget=16)
    finished_all = []
    for iteration in range(12):
        finished, stats = rollout.run(iteration, policy_version=iteration, sample_problems=sample)
        finished_all += finished
        assert stats.num_output_tokens <= 16
    rollout.close()
    assert len(finished_all) == 2
    for group in finished_all:
        assert [s.correct for s in group.scores] == [True, False]
        assert all(t.finished and t.finish_reason == "stop" for t in group.trajectories)
        assert all(len(t.segments) > 1 for t in group.trajectories)  # really produced in several segments
        versions = [s.policy_version for s in group.trajectories[0].segments]
        assert versions == sorted(versions) and len(set(versions)) > 1
    assert any(len(batch) and any(r.earlier_response_ids for r in batch) for batch in engine.requests)
    assert reward.threads and not any(name == threading.current_thread().name for name in reward.threads)


def test_one_segment_rollouts_finish_in_the_same_iteration():
    rollout, engine, _, sample = setup(segment_max_tokens=64, budget=256)
    finished, stats = rollout.run(0, policy_version=0, sample_problems=sample)
    rollout.close()
    assert stats.num_new_groups == 2 and stats.num_finished_groups == 2 and stats.num_continued == 0
    assert len(finished) == 2 and stats.num_unfinished_trajectories == 0


def test_a_looping_response_is_cut_and_finished_as_repeat():
    rollout, engine, _, sample = setup(segment_max_tokens=64, budget=256, loop_forever={"g0.1"})
    finished, stats = rollout.run(0, policy_version=0, sample_problems=sample)
    rollout.close()
    trajectory = {t.trajectory_id: t for g in finished for t in g.trajectories}["g0.1"]
    assert trajectory.finish_reason == "repeat" and stats.num_repeat_stops == 1
    assert trajectory.num_response_tokens < 40  # cut well before the 160-token loop ended


def test_scores_of_trajectories_finished_before_a_resume_are_recomputed():
    rollout, engine, _, sample = setup(segment_max_tokens=15, budget=30)
    rollout.run(0, policy_version=0, sample_problems=sample)
    assert [rollout.buffer.get(t).finished for t in ("g0.0", "g0.1")] == [True, False]
    saved = rollout.buffer.to_json_dict()
    rollout.close()
    resumed, _, _, _ = setup(segment_max_tokens=15, budget=30)
    resumed.buffer = ReplayBuffer.from_json_dict(saved, resumed.buffer.config)
    done = []
    for iteration in range(1, 12):
        done += resumed.run(iteration, policy_version=iteration, sample_problems=lambda n: [])[0]
    resumed.close()
    assert len(done) == 1 and [s.correct for s in done[0].scores] == [True, False]


@pytest.mark.parametrize(
    "earlier, deltas, expected_keep",
    [
        ([], [[5, 6, 7], [8, 9]], [None, None]),
        ([], [[1] * 10, [1] * 10], [None, 16]),  # 16 equal tokens: period 1, min_tail_tokens 16
        ([1] * 12, [[1] * 3, [1] * 3], [None, 4]),  # earlier segments count toward the repeat
        ([3, 4] * 8, [[9, 9]], [None]),  # the earlier part repeated: start clean
    ],
)
def test_stream_stopper(earlier, deltas, expected_keep):
    stopper = _StreamStopper(RepeatConfig(min_ngram=1, max_ngram=8, min_repeats=4, min_tail_tokens=16), earlier)
    kept = 0
    got = []
    for delta in deltas:
        got.append(stopper.push(delta, kept))
        kept += len(delta)
    assert got == expected_keep


def test_stream_stopper_disabled():
    stopper = _StreamStopper(RepeatConfig(enabled=False), [])
    assert stopper.push([1] * 100, 0) is None
    assert _StreamStopper(None, []).push([1] * 100, 0) is None


@pytest.mark.parametrize(
    "spans, expected",
    [
        ([None, None], {}),  # an engine that reports no versions
        ([(("policy-v1", 0, 5),), (("policy-v1", 0, 2),)], {"policy-v1": 2}),
        ([(("policy-v1", 0, 5),), (("policy-v1", 0, 3), ("policy-v2", 3, 9))], {"mixed": 1, "policy-v1": 1}),
        ([(("policy-v2", 0, 1),), None, (("policy-v1", 0, 4),)], {"policy-v1": 1, "policy-v2": 1}),
    ],
)
def test_outputs_by_weight_version(spans, expected):
    from orchestrator.rollout import outputs_by_weight_version

    results = [GenResult(f"r{i}", (1, 2), "stop", s) for i, s in enumerate(spans)]
    assert outputs_by_weight_version(results) == expected
