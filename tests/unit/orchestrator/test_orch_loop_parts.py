"""Pure parts of the RL loop: group rewards, minibatch planning, data pool, metrics, resume state."""

import json
import os
import pathlib

import pytest

from demo import task
from orchestrator import checkpointing, data
from orchestrator.config import DataConfig, RewardConfig
from orchestrator.evaluate import compare_with_reference
from orchestrator.length_penalty import LengthPenaltyConfig
from orchestrator.metrics_log import MetricsLog, plot_metrics, read_jsonl, summary_line
from orchestrator.repeat import RepeatConfig
from orchestrator.replay import PartialRolloutConfig, ReplayBuffer
from orchestrator.scoring import Score, group_rewards, make_reward_fn, score_response
from trainer.policy import TrainBatch, batch_from_groups, split_minibatches, uniform_groups

OK, WRONG = Score(1.0, True), Score(0.0, False)
LP = LengthPenaltyConfig(weight=0.5, warmup_iterations=2)
REP = RepeatConfig(penalty=0.25)


@pytest.mark.parametrize(
    "scores, lengths, repeated, iteration, expected",
    [
        # warm-up: only the task reward (and the repeat penalty)
        ([OK, WRONG], [10, 20], [False, False], 0, [1.0, 0.0]),
        ([OK, WRONG], [10, 20], [False, True], 1, [1.0, -0.25]),
        # after warm-up: short correct +0.5*0.5, long wrong 0.5*min(0, -0.5)
        ([OK, WRONG], [10, 20], [False, False], 2, [1.25, -0.25]),
        # all the same length: no length signal
        ([OK, OK], [7, 7], [False, False], 5, [1.0, 1.0]),
        # short wrong answers are not rewarded for being short
        ([WRONG, OK, OK], [10, 15, 20], [False, False, False], 3, [0.0, 1.0, 0.75]),
        # repeat penalty and length penalty add up
        ([WRONG, WRONG], [10, 30], [False, True], 2, [0.0, -0.5]),
    ],
)
def test_group_rewards(scores, lengths, repeated, iteration, expected):
    assert group_rewards(scores, lengths, repeated, iteration, LP, REP) == pytest.approx(expected)


def test_group_rewards_rejects_ragged_input():
    with pytest.raises(ValueError, match="same length"):
        group_rewards([OK], [1, 2], [False], 0, LP, REP)


@pytest.mark.parametrize(
    "response, correct",
    [
        ("4+3+0=7\n#### 7", True),
        ("#### 07", True),
        ("4+3+0=7\n#### 8", False),
        ("no answer", False),
    ],
)
def test_math_reward_on_the_task(response, correct):
    problem = task.make_problem("add", [4, 3], level=1)
    score = score_response(make_reward_fn(RewardConfig()), problem, response, 0.5)
    assert score.correct is correct and score.correct == task.is_correct(problem, response)


@pytest.mark.parametrize(
    "n, parts, expected",
    [
        (5, 2, [[0, 1], [2, 3, 4]]),
        (4, 4, [[0], [1], [2], [3]]),
        (2, 4, [[0], [1]]),
        (0, 3, []),
        (6, 1, [[0, 1, 2, 3, 4, 5]]),
    ],
)
def test_split_minibatches(n, parts, expected):
    out = split_minibatches(list(range(n)), parts)
    assert [len(p) for p in out] == [len(p) for p in expected] and sum(out, []) == list(range(n))


@pytest.mark.parametrize(
    "rewards, expected",
    [
        ([[1, 1], [0, 1], [0, 0]], [0, 2]),
        ([[0.5, 0.5 + 1e-12]], [0]),
        ([[0.2, 0.3]], []),
    ],
)
def test_uniform_groups(rewards, expected):
    assert uniform_groups(rewards) == expected


def test_batch_from_groups_masks_stale_segments():
    config = PartialRolloutConfig(
        iteration_token_budget=64,
        segment_max_tokens=2,
        max_response_tokens=8,
        num_responses_per_prompt=2,
        exclude_stale_segments=True,
    )
    buf = ReplayBuffer(config)
    a, b = buf.start_group("p", [1, 5], iteration=0)
    buf.record_segment(a, [6, 7], policy_version=0, finish_reason="length")
    buf.record_segment(a, [2], policy_version=1, finish_reason="stop")
    buf.record_segment(b, [8, 2], policy_version=0, finish_reason="stop")
    (group,) = buf.pop_finished_groups()
    batch = batch_from_groups([group], [[1.0, 0.0]], current_policy_version=1, exclude_stale=True)
    assert batch.response_ids == ((6, 7, 2), (8, 2))
    assert batch.response_masks == ((0, 0, 1), (0, 0))
    assert batch.prompt_ids == ((1, 5), (1, 5)) and batch.rows([0]) == [0, 1]
    kept = batch_from_groups([group], [[1.0, 0.0]], current_policy_version=1, exclude_stale=False)
    assert kept.response_masks == ((1, 1, 1), (1, 1))


def test_train_batch_checks_shapes():
    with pytest.raises(ValueError, match="do not match"):
        TrainBatch(((1,),), ((2,),), ((1,),), rewards=((1.0, 0.0),))


def test_train_pool_is_distinct_deterministic_and_never_heldout():
    config = DataConfig(train_levels=(1, 3), num_train_problems=300, num_heldout_per_level=8)
    pool = data.train_pool(config)
    assert len(pool) == 300 and len({p.id for p in pool}) == 300
    assert [p.id for p in pool] == [p.id for p in data.train_pool(config)]
    assert not any(task.is_heldout(p) for p in pool) and {p.level for p in pool} == {1, 3}
    heldout = data.heldout_set(config)
    assert len(heldout) == 8 * len(config.heldout_levels) and all(task.is_heldout(p) for p in heldout)
    assert data.difficulties(pool)[pool[0].id] == pool[0].level


def test_train_pool_too_large_for_its_levels():
    with pytest.raises(ValueError, match="num_train_problems"):
        data.train_pool(DataConfig(train_levels=(1,), num_train_problems=20000))


@pytest.mark.parametrize(
    "measured, reference, tol, ok, gap",
    [
        ({3: 0.5, 5: 0.2}, {"3": 0.5, "5": 0.25, "1": 0.9}, 0.1, True, 0.05),
        ({3: 0.5}, {"3": 0.3}, 0.1, False, 0.2),
        ({3: 0.5}, {"6": 0.3}, 0.1, True, 0.0),
    ],
)
def test_compare_with_reference(measured, reference, tol, ok, gap):
    got_ok, got_gap = compare_with_reference(measured, reference, tol)
    assert got_ok is ok and got_gap == pytest.approx(gap)


def _record(i, **extra):
    return {
        "iteration": i,
        "heldout_accuracy": 0.1 * i,
        "mean_reward": 0.5,
        "mean_response_tokens": 30.0,
        "weight_sync_s": 0.1,
        "evaluated": i % 2 == 0,
        **extra,
    }


def test_metrics_log_requires_keys_and_truncates_after_a_checkpoint(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="weight_sync_s"):
        log.append({"iteration": 1, "heldout_accuracy": 0, "mean_reward": 0, "mean_response_tokens": 0})
    for i in range(1, 5):
        log.append(_record(i))
    with open(log.path, "a") as f:
        f.write('{"iteration": 5, "heldo')  # torn by a kill
    assert [r["iteration"] for r in log.records()] == [1, 2, 3, 4]
    assert log.truncate_after(2) == 2
    assert [r["iteration"] for r in read_jsonl(log.path)] == [1, 2]
    assert log.path.read_text().endswith("\n")


def test_plot_writes_a_png(tmp_path):
    records = [_record(i, heldout_pass_at_1=0.05 * i if i % 2 == 0 else None, train_pass_at_1=0.3) for i in range(1, 7)]
    records[0]["mean_reward"] = None  # an iteration with no finished group
    plot_metrics(records, tmp_path / "m.png", before_accuracy=0.05)
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_line():
    assert summary_line(0.31, 0.585, 14.2, 0.004) == (
        "held-out accuracy 31.0% -> 58.5% (+27.5 points) in 14.2 min; weight sync 0.4% of iteration time"
    )


def _buffer():
    config = PartialRolloutConfig(
        iteration_token_budget=64, segment_max_tokens=4, max_response_tokens=8, num_responses_per_prompt=2
    )
    buf = ReplayBuffer(config)
    ids = buf.start_group("7+5", [1, 9, 9], iteration=0)
    buf.record_segment(ids[0], [3, 4], policy_version=0, finish_reason="length")
    return config, buf


def _save_model(path: pathlib.Path) -> None:
    path.mkdir()
    (path / "weights.bin").write_bytes(b"w")


def test_save_and_load_state_round_trip(tmp_path):
    config, buf = _buffer()
    assert checkpointing.load_latest(tmp_path / "state") is None
    for iteration in (1, 2, 3):
        checkpointing.save_state(
            tmp_path / "state",
            iteration,
            _save_model,
            {"rng": iteration},
            buf,
            {"before": {"heldout_accuracy": 0.25}},
            keep_last=2,
        )
    saved = checkpointing.load_latest(tmp_path / "state")
    assert saved.iteration == 3 and saved.sampler_state == {"rng": 3}
    assert saved.progress["before"]["heldout_accuracy"] == 0.25
    assert (saved.model_dir / "weights.bin").exists()
    assert saved.replay_buffer(config).to_json_dict() == buf.to_json_dict()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["LATEST", "ckpt-000002", "ckpt-000003"]


def test_a_save_killed_midway_keeps_the_previous_checkpoint(tmp_path):
    config, buf = _buffer()
    checkpointing.save_state(tmp_path / "state", 1, _save_model, {}, buf, {})

    def dies(path):
        path.mkdir()
        raise KeyboardInterrupt("killed while writing the model")

    with pytest.raises(KeyboardInterrupt):
        checkpointing.save_state(tmp_path / "state", 2, dies, {}, buf, {})
    saved = checkpointing.load_latest(tmp_path / "state")
    assert saved.iteration == 1 and len(saved.replay_buffer(config)) == 2
    assert not [p for p in os.listdir(tmp_path / "state") if p.startswith(".tmp-")]


def test_latest_pointing_nowhere_is_an_error(tmp_path):
    (tmp_path / "LATEST").write_text("ckpt-000009\n")
    with pytest.raises(RuntimeError, match="ckpt-000009"):
        checkpointing.load_latest(tmp_path)


def test_progress_json_is_plain_json(tmp_path):
    _, buf = _buffer()
    path = checkpointing.save_state(tmp_path, 4, _save_model, {}, buf, {"x": [1, 2]})
    assert json.loads((path / "progress.json").read_text()) == {"x": [1, 2], "iteration": 4}
