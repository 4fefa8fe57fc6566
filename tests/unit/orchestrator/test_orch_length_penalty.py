"""Length penalty (k1.5 section 2.3.3): table tests."""

from __future__ import annotations

import pytest

from orchestrator.length_penalty import LengthPenaltyConfig, length_lambdas, length_penalty


@pytest.mark.parametrize(
    ("lengths", "correct", "want"),
    [
        # min 10, max 30: lambda = 0.5, 0, -0.5
        ([10, 20, 30], [True, True, True], [0.5, 0.0, -0.5]),
        ([10, 20, 30], [False, False, False], [0.0, 0.0, -0.5]),
        ([10, 20, 30], [True, False, False], [0.5, 0.0, -0.5]),
        ([30, 10, 20], [False, True, True], [-0.5, 0.5, 0.0]),
        # lambda = 0.5 - (n - 0) / 100
        ([0, 25, 75, 100], [True, False, True, False], [0.5, 0.0, -0.25, -0.5]),
        # max == min: defined as lambda 0 everywhere
        ([7, 7, 7], [True, False, True], [0.0, 0.0, 0.0]),
        ([5], [True], [0.0]),
        ([], [], []),
    ],
)
def test_length_penalty_table(lengths, correct, want):
    assert length_penalty(lengths, correct) == pytest.approx(want)


def test_lambdas_span_half_to_minus_half():
    lams = length_lambdas([3, 9, 4, 100, 50])
    assert max(lams) == pytest.approx(0.5) and min(lams) == pytest.approx(-0.5)


@pytest.mark.parametrize(
    ("lengths", "correct", "match"),
    [
        ([1, 2], [True], "same length"),
        ([1, -2], [True, True], r"lengths\[1\]"),
        ([1, 2.5], [True, True], r"lengths\[1\]"),
    ],
)
def test_length_penalty_rejects_bad_input(lengths, correct, match):
    with pytest.raises(ValueError, match=match):
        length_penalty(lengths, correct)


@pytest.mark.parametrize(
    ("weight", "warmup", "iteration", "want"),
    [
        (0.5, 0, 0, [1.25, 0.0, -0.25]),  # active from the start
        (0.5, 3, 0, [1.0, 0.0, 0.0]),  # warm-up: untouched
        (0.5, 3, 2, [1.0, 0.0, 0.0]),  # last warm-up iteration
        (0.5, 3, 3, [1.25, 0.0, -0.25]),  # first active iteration
        (0.5, 3, 100, [1.25, 0.0, -0.25]),  # constant afterwards
        (0.0, 0, 5, [1.0, 0.0, 0.0]),  # weight 0 disables
        (2.0, 1, 1, [2.0, 0.0, -1.0]),
    ],
)
def test_apply_with_warmup_table(weight, warmup, iteration, want):
    cfg = LengthPenaltyConfig(weight=weight, warmup_iterations=warmup)
    # lengths 10, 20, 30 -> lambdas 0.5, 0, -0.5; response 1 correct, 2 and 3 wrong
    got = cfg.apply([1.0, 0.0, 0.0], [10, 20, 30], [True, False, False], iteration)
    assert got == pytest.approx(want)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight": -0.1}, "weight"),
        ({"weight": float("nan")}, "weight"),
        ({"warmup_iterations": -1}, "warmup_iterations"),
        ({"warmup_iterations": 1.5}, "warmup_iterations"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthPenaltyConfig(**kwargs)


def test_apply_rejects_mismatch_and_negative_iteration():
    cfg = LengthPenaltyConfig(weight=1.0, warmup_iterations=0)
    with pytest.raises(ValueError, match="rewards"):
        cfg.apply([1.0], [1, 2], [True, True], 0)
    with pytest.raises(ValueError, match="iteration"):
        cfg.apply([1.0, 1.0], [1, 2], [True, True], -1)
