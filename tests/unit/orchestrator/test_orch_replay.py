"""Partial-rollout replay buffer: planning tables, bookkeeping, loss masks, atomic JSON resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.replay import PartialRolloutConfig, ReplayBuffer, plan_iteration


def _cfg(**overrides) -> PartialRolloutConfig:
    base = dict(iteration_token_budget=100, segment_max_tokens=10, max_response_tokens=25, num_responses_per_prompt=2)
    base.update(overrides)
    return PartialRolloutConfig(**base)


@pytest.mark.parametrize(
    ("remaining", "overrides", "want"),
    [
        # empty buffer: budget 100 / group cost 2*10 = 5 new groups
        ([], {}, ([], 5, 100)),
        # three unfinished (reserve 10, 5, 10) = 25; (100-25)//20 = 3 new groups
        ([20, 5, 15], {}, ([0, 1, 2], 3, 85)),
        # budget 28: oldest two fit (10 + 10), third (10) does not; then the 5-token one fits
        ([25, 12, 11, 5], {"iteration_token_budget": 28}, ([0, 1, 3], 0, 25)),
        # cap on new groups
        ([], {"max_new_groups_per_iteration": 2}, ([], 2, 40)),
        # segment cap larger than the response cap: a group costs k * max_response_tokens
        ([], {"segment_max_tokens": 50, "iteration_token_budget": 120}, ([], 2, 100)),
        # buffer saturated: only old trajectories run, no new group
        ([25] * 12, {}, (list(range(10)), 0, 100)),
    ],
)
def test_plan_iteration_table(remaining, overrides, want):
    chosen, num_new, reserved = plan_iteration(remaining, _cfg(**overrides))
    assert (chosen, num_new, reserved) == want
    assert reserved <= _cfg(**overrides).iteration_token_budget


def test_plan_rejects_finished_trajectory():
    with pytest.raises(ValueError, match=r"remaining_tokens\[1\]"):
        plan_iteration([3, 0], _cfg())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"iteration_token_budget": 0}, "iteration_token_budget"),
        ({"segment_max_tokens": -1}, "segment_max_tokens"),
        ({"max_response_tokens": 2.5}, "max_response_tokens"),
        ({"num_responses_per_prompt": 0}, "num_responses_per_prompt"),
        ({"max_new_groups_per_iteration": 0}, "max_new_groups_per_iteration"),
        ({"exclude_stale_segments": 1}, "exclude_stale_segments"),
        ({"iteration_token_budget": 19}, "cost of one new group"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**overrides)


@pytest.mark.parametrize(
    ("segments", "want_finished", "want_reason", "want_next_max_tokens"),
    [
        ([(3, "stop")], True, "stop", None),
        ([(10, "length")], False, None, 10),  # hit the segment cap: continue
        ([(10, "length"), (10, "length")], False, None, 5),  # 20 of 25: last segment gets 5
        ([(10, "length"), (10, "length"), (5, "length")], True, "length", None),  # response cap
        ([(10, "length"), (4, "repeat")], True, "repeat", None),
        ([(6, "abort")], False, None, 10),  # interrupted: continue later
        ([(0, "abort"), (2, "stop")], True, "stop", None),  # empty segment not stored
    ],
)
def test_record_segment_transitions(segments, want_finished, want_reason, want_next_max_tokens):
    buf = ReplayBuffer(_cfg())
    tid = buf.start_group("p", [1, 2], iteration=0)[0]
    for version, (n, reason) in enumerate(segments):
        buf.record_segment(tid, list(range(n)), policy_version=version, finish_reason=reason)
    traj = buf.get(tid)
    assert (traj.finished, traj.finish_reason) == (want_finished, want_reason)
    assert traj.num_response_tokens == sum(n for n, _ in segments)
    assert all(s.token_ids for s in traj.segments)
    if want_next_max_tokens is None:
        with pytest.raises(ValueError, match="already finished"):
            buf.request(tid)
    else:
        assert buf.request(tid).max_tokens == want_next_max_tokens


def test_record_segment_rejects_bad_input():
    buf = ReplayBuffer(_cfg())
    tid = buf.start_group("p", [1], iteration=0)[0]
    with pytest.raises(ValueError, match="finish_reason"):
        buf.record_segment(tid, [1], policy_version=0, finish_reason="eos")
    with pytest.raises(ValueError, match="exceeds its max_tokens 10"):
        buf.record_segment(tid, list(range(11)), policy_version=0, finish_reason="length")
    with pytest.raises(ValueError, match="unknown trajectory_id"):
        buf.record_segment("nope", [1], policy_version=0, finish_reason="stop")
    with pytest.raises(ValueError, match="must not be empty"):
        buf.start_group("p", [], iteration=0)


def test_continuation_prompt_is_prompt_plus_earlier_segments():
    buf = ReplayBuffer(_cfg())
    tid = buf.start_group("p", [100, 101], iteration=0)[0]
    assert buf.request(tid).prompt_token_ids == [100, 101]
    buf.record_segment(tid, [1, 2, 3], policy_version=0, finish_reason="abort")
    buf.record_segment(tid, [4, 5], policy_version=1, finish_reason="abort")
    req = buf.request(tid)
    assert req.prompt_token_ids == [100, 101, 1, 2, 3, 4, 5]
    assert req.max_tokens == 10 and req.trajectory_id == tid


@pytest.mark.parametrize(
    ("versions", "current", "exclude", "want_tokens"),
    [
        ([0, 1, 2], 2, False, [1, 1, 1, 1, 1, 1]),
        ([0, 1, 2], 2, True, [0, 0, 0, 1, 1, 1]),
        ([2, 2], 2, True, [1, 1, 1]),
        ([0, 1], 2, True, [0, 0, 0]),  # finished earlier; all stale now
    ],
)
def test_token_loss_mask_table(versions, current, exclude, want_tokens):
    buf = ReplayBuffer(_cfg())
    tid = buf.start_group("p", [9], iteration=0)[0]
    for i, v in enumerate(versions):  # segment i has i+1 tokens
        buf.record_segment(tid, [7] * (i + 1), policy_version=v, finish_reason="abort")
    traj = buf.get(tid)
    assert traj.token_loss_mask(current, exclude) == want_tokens
    assert len(traj.token_loss_mask(current, exclude)) == len(traj.response_token_ids())


@pytest.mark.parametrize(("exclude", "want"), [(False, [1, 1, 1]), (True, [0, 0, 1])])
def test_buffer_loss_mask_follows_config(exclude, want):
    buf = ReplayBuffer(_cfg(exclude_stale_segments=exclude))
    tid = buf.start_group("p", [9], iteration=0)[0]
    buf.record_segment(tid, [1, 2], policy_version=3, finish_reason="length")
    buf.record_segment(tid, [3], policy_version=4, finish_reason="stop")
    assert buf.token_loss_mask(buf.get(tid), current_policy_version=4) == want


def test_groups_are_popped_only_when_all_k_finished():
    buf = ReplayBuffer(_cfg(num_responses_per_prompt=3))
    a = buf.start_group("pa", [1], iteration=0)
    b = buf.start_group("pb", [2], iteration=0)
    for tid in a[:2] + b:
        buf.record_segment(tid, [5], policy_version=0, finish_reason="stop")
    groups = buf.pop_finished_groups()
    assert [[t.trajectory_id for t in g] for g in groups] == [b]
    assert len(buf) == 3 and buf.pop_finished_groups() == []
    buf.record_segment(a[2], [5], policy_version=1, finish_reason="stop")
    assert [t.problem_id for t in buf.pop_finished_groups()[0]] == ["pa"] * 3
    assert len(buf) == 0


def _run_iterations(buf: ReplayBuffer, target_len: dict[str, int], start_it: int, num_it: int, log: list) -> None:
    """Fake engine: problem 'pN' wants N tokens per response; groups drawn in a fixed order."""
    problems = sorted(target_len)
    for it in range(start_it, start_it + num_it):
        plan = buf.plan()
        old = [t.trajectory_id for t in buf.unfinished()]
        assert list(plan.continue_ids) == old[: len(plan.continue_ids)]  # oldest first
        ids = list(plan.continue_ids)
        for g in range(plan.num_new_groups):
            pid = problems[(it * 7 + g) % len(problems)]
            ids += buf.start_group(pid, [1, 2, 3], iteration=it)
        reserved = 0
        for req in buf.requests(ids):
            traj = buf.get(req.trajectory_id)
            want = target_len[traj.problem_id] - traj.num_response_tokens
            n = min(req.max_tokens, want)
            reserved += req.max_tokens
            reason = "stop" if n == want else "length"
            buf.record_segment(req.trajectory_id, [it] * n, policy_version=it, finish_reason=reason)
        assert reserved <= buf.config.iteration_token_budget
        for group in buf.pop_finished_groups():
            log.append([(t.problem_id, t.finish_reason, t.response_token_ids()) for t in group])


def test_partial_rollout_bookkeeping_over_many_iterations():
    cfg = _cfg(iteration_token_budget=60, max_response_tokens=40)
    targets = {"p3": 3, "p12": 12, "p40": 40, "p55": 55}  # p55 is cut at the 40-token response cap
    buf, log = ReplayBuffer(cfg), []
    _run_iterations(buf, targets, 0, 30, log)
    finished = [t for g in log for t in g]
    assert len(finished) >= 20
    for problem_id, reason, tokens in finished:
        assert len(tokens) == min(targets[problem_id], 40)
        assert reason == ("length" if targets[problem_id] > 40 else "stop")
        assert tokens == sorted(tokens)  # segments appended in iteration order
    assert any(len(set(tokens)) > 1 for _, _, tokens in finished)  # spans several iterations
    assert {p for p, _, _ in finished} == set(targets)


def test_resume_from_json_matches_uninterrupted_run(tmp_path: Path):
    cfg = _cfg(iteration_token_budget=60, max_response_tokens=40)
    targets = {"p3": 3, "p12": 12, "p40": 40, "p55": 55}
    straight, log_a = ReplayBuffer(cfg), []
    _run_iterations(straight, targets, 0, 12, log_a)

    first, log_b = ReplayBuffer(cfg), []
    _run_iterations(first, targets, 0, 5, log_b)
    assert len(first.unfinished()) > 0
    first.save(tmp_path / "replay.json")
    resumed = ReplayBuffer.load(tmp_path / "replay.json", cfg)
    _run_iterations(resumed, targets, 5, 7, log_b)
    assert log_b == log_a
    assert [t.trajectory_id for t in resumed.unfinished()] == [t.trajectory_id for t in straight.unfinished()]


def test_load_rejects_mismatched_group_size(tmp_path: Path):
    buf = ReplayBuffer(_cfg())
    buf.start_group("p", [1], iteration=0)
    buf.save(tmp_path / "r.json")
    with pytest.raises(ValueError, match="num_responses_per_prompt"):
        ReplayBuffer.load(tmp_path / "r.json", _cfg(num_responses_per_prompt=3, iteration_token_budget=100))


def test_failed_save_keeps_previous_file(tmp_path: Path, monkeypatch):
    path = tmp_path / "replay.json"
    buf = ReplayBuffer(_cfg())
    buf.start_group("p-old", [1], iteration=0)
    buf.save(path)
    buf.start_group("p-new", [2], iteration=1)

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        buf.save(path)
    monkeypatch.undo()
    loaded = ReplayBuffer.load(path, _cfg())
    assert {t.problem_id for t in loaded.unfinished()} == {"p-old"}
    assert os.listdir(tmp_path) == ["replay.json"]  # temp file cleaned up


_KILLED_WRITER = textwrap.dedent(
    """
    import sys
    from orchestrator.replay import PartialRolloutConfig, ReplayBuffer
    cfg = PartialRolloutConfig(iteration_token_budget=100, segment_max_tokens=10,
                               max_response_tokens=25, num_responses_per_prompt=2)
    buf = ReplayBuffer(cfg)
    for i in range(3000):
        for tid in buf.start_group(f"p{i}", list(range(200)), iteration=0):
            buf.record_segment(tid, list(range(10)), policy_version=0, finish_reason="abort")
    buf.save(sys.argv[1])
    print("saved", flush=True)
    n = 0
    while True:  # keep rewriting until killed
        buf.save(sys.argv[1])
        n += 1
    """
)


def test_sigkill_during_save_leaves_a_loadable_file(tmp_path: Path):
    path = tmp_path / "replay.json"
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    try:
        assert proc.stdout.readline().strip() == "saved"  # then it rewrites in a loop: kill it mid-way
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        rc = proc.wait(timeout=30)
    assert rc == -signal.SIGKILL
    loaded = ReplayBuffer.load(path, _cfg())
    assert len(loaded.unfinished()) == 6000
    assert all(t.num_response_tokens == 10 for t in loaded.unfinished())
    with open(path) as f:
        json.load(f)
