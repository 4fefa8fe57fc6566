"""Curriculum and prioritized problem sampling: table tests, determinism, JSON resume."""

from __future__ import annotations

import collections
import json
import random

import pytest

from orchestrator.sampling import (
    CurriculumConfig,
    CurriculumSampler,
    PrioritizedSampler,
    ProblemSampler,
    ProblemStats,
    weighted_sample,
)


@pytest.mark.parametrize(
    ("prior", "prior_weight", "decay", "records", "want"),
    [
        (0.5, 1.0, 1.0, [], 0.5),  # unseen: the prior
        (0.0, 1.0, 1.0, [], 0.0),
        (0.5, 1.0, 1.0, [(3, 3)], (3 + 0.5) / 4),
        (0.5, 2.0, 1.0, [(0, 4)], 1.0 / 6),
        (0.5, 1.0, 1.0, [(1, 2), (2, 2)], (3 + 0.5) / 5),
        # decay 0.5: counts (2, 4) -> (1, 2) + (0, 2) = (1, 4)
        (0.5, 1.0, 0.5, [(2, 4), (0, 2)], (1 + 0.5) / 5),
    ],
)
def test_problem_stats_table(prior, prior_weight, decay, records, want):
    stats = ProblemStats(prior_success_rate=prior, prior_weight=prior_weight, decay=decay)
    for correct, attempts in records:
        stats.record("p", correct, attempts)
    assert stats.success_rate("p") == pytest.approx(want)
    assert stats.success_rate("never-seen") == pytest.approx(prior)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.record("p", 3, 2), "num_correct"),
        (lambda s: s.record("p", -1, 2), "num_correct"),
        (lambda s: s.record("p", 0, 0), "num_attempts"),
        (lambda s: s.record(7, 0, 1), "problem_id"),
    ],
)
def test_problem_stats_rejects_bad_records(call, match):
    with pytest.raises(ValueError, match=match):
        call(ProblemStats())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prior_success_rate": 1.5}, "prior_success_rate"),
        ({"prior_weight": 0.0}, "prior_weight"),
        ({"decay": 0.0}, "decay"),
        ({"decay": 1.1}, "decay"),
    ],
)
def test_problem_stats_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProblemStats(**kwargs)


DIFFICULTIES = {"a": 1, "b": 2, "c": 3, "d": 4}


@pytest.mark.parametrize(
    ("config", "iteration", "want"),
    [
        (CurriculumConfig(warmup_iterations=2, min_difficulty=3, easy_weight=0.0), 0, [1, 1, 1, 1]),
        (CurriculumConfig(warmup_iterations=2, min_difficulty=3, easy_weight=0.0), 1, [1, 1, 1, 1]),
        (CurriculumConfig(warmup_iterations=2, min_difficulty=3, easy_weight=0.0), 2, [0, 0, 1, 1]),
        (CurriculumConfig(warmup_iterations=2, min_difficulty=3, easy_weight=0.25), 9, [0.25, 0.25, 1, 1]),
        (CurriculumConfig(warmup_iterations=0, min_difficulty=2, easy_weight=0.0), 0, [0, 1, 1, 1]),
        (CurriculumConfig(warmup_iterations=0, min_difficulty=0, easy_weight=0.0), 0, [1, 1, 1, 1]),
    ],
)
def test_curriculum_weights_table(config, iteration, want):
    assert CurriculumSampler(DIFFICULTIES, config).weights(["a", "b", "c", "d"], iteration) == want


def test_curriculum_rejects_unlabelled_and_bad_config():
    cur = CurriculumSampler(DIFFICULTIES, CurriculumConfig())
    with pytest.raises(ValueError, match="no difficulty label"):
        cur.weights(["a", "zz"], 0)
    with pytest.raises(ValueError, match="easy_weight"):
        CurriculumConfig(easy_weight=1.5)
    with pytest.raises(ValueError, match="warmup_iterations"):
        CurriculumConfig(warmup_iterations=-1)
    with pytest.raises(ValueError, match="difficulty of problem"):
        CurriculumSampler({"a": "hard"}, CurriculumConfig())


@pytest.mark.parametrize(
    ("records", "epsilon", "want"),
    [
        ({}, 0.05, [0.5, 0.5]),  # unseen: 1 - prior
        ({"x": (9, 9)}, 0.05, [0.05, 0.5]),  # solved: floor epsilon (1 - 9.5/10 = 0.05)
        ({"x": (99, 99)}, 0.2, [0.2, 0.5]),
        ({"x": (0, 9), "y": (9, 9)}, 0.01, [0.95, 0.05]),
    ],
)
def test_priority_weights_table(records, epsilon, want):
    stats = ProblemStats()
    for pid, (c, n) in records.items():
        stats.record(pid, c, n)
    assert PrioritizedSampler(stats, epsilon).weights(["x", "y"]) == pytest.approx(want)


def test_weighted_sample_frequencies_follow_weights():
    rng = random.Random(0)
    weights = [1.0, 3.0, 0.0, 6.0]
    counts = collections.Counter(weighted_sample(weights, 20_000, rng, replacement=True))
    assert counts[2] == 0
    for i, w in enumerate(weights):
        assert counts[i] / 20_000 == pytest.approx(w / 10.0, abs=0.015)
    # without replacement the first pick follows the weights too
    first = collections.Counter(weighted_sample(weights, 2, rng, replacement=False)[0] for _ in range(20_000))
    assert first[2] == 0
    for i, w in enumerate(weights):
        assert first[i] / 20_000 == pytest.approx(w / 10.0, abs=0.015)


@pytest.mark.parametrize(
    ("weights", "num", "replacement", "match"),
    [
        ([0.0, 0.0], 1, True, "every weight is 0"),
        ([1.0, 0.0], 2, False, "only 1 have weight"),
        ([1.0, -1.0], 1, False, r"weights\[1\]"),
        ([1.0], -1, False, "num"),
    ],
)
def test_weighted_sample_errors(weights, num, replacement, match):
    with pytest.raises(ValueError, match=match):
        weighted_sample(weights, num, random.Random(0), replacement=replacement)


def test_weighted_sample_without_replacement_is_distinct():
    picks = weighted_sample([1, 2, 3, 4, 5], 5, random.Random(3), replacement=False)
    assert sorted(picks) == [0, 1, 2, 3, 4]


def _sampler(seed: int, *, warmup: int = 1) -> ProblemSampler:
    ids = [f"p{i}" for i in range(20)]
    curriculum = CurriculumSampler(
        {pid: i % 4 for i, pid in enumerate(ids)},
        CurriculumConfig(warmup_iterations=warmup, min_difficulty=2, easy_weight=0.0),
    )
    return ProblemSampler(ids, curriculum=curriculum, prioritized=PrioritizedSampler(ProblemStats(), 0.02), seed=seed)


def test_combined_curriculum_filters_then_priority_weights():
    sampler = _sampler(1)
    warm = collections.Counter()
    for _ in range(200):
        warm.update(sampler.sample(4, iteration=0))
    assert len(warm) == 20  # warm-up: every problem, easy ones included
    stats = sampler.prioritized.stats
    for i in range(20):
        stats.record(f"p{i}", 8 if i in (2, 3) else 0, 8)  # p2, p3 (hard) are solved
    after = collections.Counter()
    for _ in range(2000):
        after.update(sampler.sample(2, iteration=1))
    assert all(int(pid[1:]) % 4 >= 2 for pid in after)  # only the hard problems
    assert len(after) == 10
    # solved hard problems: weight max(1 - 8.5/9, 0.02) ~ 0.056 vs ~0.94 for unsolved ones
    unsolved_mean = sum(after[f"p{i}"] for i in (6, 7, 10, 11, 14, 15, 18, 19)) / 8
    assert after["p2"] < 0.2 * unsolved_mean and after["p3"] < 0.2 * unsolved_mean
    assert after["p2"] > 0 or after["p3"] > 0  # the floor keeps solved problems revisited


def test_fewer_problems_than_asked_start_fewer_groups_said_once(caplog):
    sampler = _sampler(2)  # after the warm-up, 10 of the 20 problems are open
    with caplog.at_level("WARNING", logger="orchestrator.sampling"):
        picks = sampler.sample(15, iteration=1)
        again = sampler.sample(12, iteration=1)
    assert len(picks) == len(set(picks)) == 10 and all(int(pid[1:]) % 4 >= 2 for pid in picks)
    assert len(again) == 10
    said = (
        "iteration 1 asks for 15 new problems but only 10 can be drawn (the training set or the curriculum's "
        "open levels): it starts 10 groups (said once)"
    )
    assert [r.getMessage() for r in caplog.records] == [said]
    assert len(ProblemSampler(["a", "b"], seed=0).sample(5, 0, replacement=True)) == 5  # with replacement: as asked


def test_same_seed_same_draws_and_different_seed_differs():
    a, b, c = _sampler(5), _sampler(5), _sampler(6)
    seq_a = [a.sample(3, it) for it in range(5)]
    assert seq_a == [b.sample(3, it) for it in range(5)]
    assert seq_a != [c.sample(3, it) for it in range(5)]


def test_state_roundtrips_through_json_for_resume():
    original = _sampler(9)
    original.sample(3, 0)
    original.prioritized.stats.record("p3", 2, 4)
    original.prioritized.stats.record("p7", 0, 4)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = _sampler(0)  # different seed: state must override it
    stats_ref = resumed.prioritized.stats  # e.g. held by the loop to record results
    resumed.load_state_dict(state)
    assert stats_ref.success_rate("p7") == pytest.approx(original.prioritized.stats.success_rate("p7"))
    assert resumed.prioritized.stats.success_rate("p3") == pytest.approx(original.prioritized.stats.success_rate("p3"))
    assert [resumed.sample(4, it) for it in range(1, 6)] == [original.sample(4, it) for it in range(1, 6)]


def test_state_with_stats_needs_prioritized_sampler():
    state = _sampler(1).state_dict()
    plain = ProblemSampler(["p0", "p1"], seed=1)
    with pytest.raises(ValueError, match="PrioritizedSampler"):
        plain.load_state_dict(state)


def test_sampler_rejects_duplicate_or_empty_ids():
    with pytest.raises(ValueError, match="unique"):
        ProblemSampler(["a", "a"])
    with pytest.raises(ValueError, match="empty"):
        ProblemSampler([])
