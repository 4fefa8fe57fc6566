"""Rewards: math verifier (math-verify + exact-match fallback), reward-model hook, combination."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from orchestrator.rewards import (
    CombinedReward,
    MathVerifyReward,
    RewardFn,
    RewardModelHook,
    extract_after_marker,
    normalize_answer,
    reference_answer,
    score_batch,
    whole_response,
)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@pytest.mark.parametrize(
    ("gold", "response", "want"),
    [
        ("1234", "12 * 100 + 34 ... answer: 1234", 1.0),
        ("1234", "answer: 1,234", 1.0),
        ("1234", "Answer:   1234.", 1.0),
        ("1234", "answer: 1235", 0.0),
        ("1234", "the result is 1234", 0.0),  # no marker: no answer given
        ("1234", "answer: 1 answer: 1234", 1.0),  # the last marker counts
        ("1234", "answer: 1234 answer: 7", 0.0),
        ("1234", "answer: 1234\nmore text", 1.0),  # rest of the line only
        ("1234", "answer:", 0.0),
        ("1/2", "answer: 0.5", 1.0),
        ("1/2", "answer: \\frac{1}{2}", 1.0),
        ("\\frac{1}{2}", "answer: 2/4", 1.0),
        ("x + 1", "answer: 1 + x", 1.0),
        ("-7", "answer: -7", 1.0),
        ("-7", "answer: 7", 0.0),
        ("12", "answer: 12.0", 1.0),
        ("933", "7+6+0=13\n4+8+1=13\n3+5+1=9\n#### 933", 1.0),  # the demo task's format
        ("933", "answer: 5\n#### 933", 1.0),  # the last marker of either kind
        ("933", "#### 933\nanswer: 5", 0.0),
    ],
)
def test_math_reward_table(gold, response, want):
    assert MathVerifyReward()(Problem("q", gold), response) == want


def test_exact_match_fallback_when_parsing_fails(monkeypatch):
    import math_verify

    monkeypatch.setattr(math_verify, "parse", lambda *a, **k: [])
    reward = MathVerifyReward()
    assert reward(Problem("q", "Yes"), "answer: yes.") == 1.0
    assert reward(Problem("q", "1/2"), "answer: 0.5") == 0.0  # needs math-verify, which "failed"
    assert reward(Problem("q", "1234"), "answer: 1,234") == 1.0  # normalised exact match


@pytest.mark.parametrize(
    ("text", "want"),
    [(" 1,234 ", "1234"), ("$x+1$", "x+1"), ("Yes.", "yes"), ("1,2", "1,2"), ("-12,345.5", "-12345.5")],
)
def test_normalize_answer_table(text, want):
    assert normalize_answer(text) == want


def test_custom_extractor_and_rewards():
    reward = MathVerifyReward(lambda text: text.rsplit("=", 1)[-1], correct_reward=2.0, wrong_reward=-1.0)
    assert reward({"answer": "42"}, "6*7=42") == 2.0
    assert reward({"answer": "42"}, "6*7=41") == -1.0
    boxed = MathVerifyReward(whole_response)
    assert boxed(Problem("q", "42"), "so the result is $\\boxed{42}$") == 1.0
    assert boxed(Problem("q", "42"), "   ") == 0.0
    only_hashes = MathVerifyReward(extract_after_marker("####"))
    assert only_hashes(Problem("q", "5"), "2+3\n#### 5") == 1.0
    assert only_hashes(Problem("q", "5"), "answer: 5") == 0.0


def test_custom_reference_getter():
    reward = MathVerifyReward(reference_of=lambda p: p[1])
    assert reward(("q", "9"), "answer: 9") == 1.0


def test_works_off_the_main_thread():
    results = []
    t = threading.Thread(target=lambda: results.append(MathVerifyReward()(Problem("q", "1/2"), "answer: 0.5")))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    assert results == [1.0]


def test_reference_answer_sources():
    assert reference_answer(Problem("q", "3")) == "3"
    assert reference_answer({"answer": 3}) == "3"
    with pytest.raises(ValueError, match="no 'answer'"):
        reference_answer({"solution": 3})


def test_math_reward_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifyReward(timeout_s=0)
    with pytest.raises(ValueError, match="markers"):
        extract_after_marker("")


def test_reward_model_hook_batches_in_one_call():
    calls = []

    def model(problems, texts):
        calls.append(len(texts))
        return [float(len(t)) for t in texts]

    hook = RewardModelHook(model)
    assert isinstance(hook, RewardFn)
    assert score_batch(hook, [1, 2, 3], ["a", "bb", "ccc"]) == [1.0, 2.0, 3.0]
    assert calls == [3]
    assert hook(None, "abcd") == 4.0


@pytest.mark.parametrize(
    ("scores", "match"),
    [([1.0], "returned 1 scores for 2"), ([1.0, float("nan")], "non-finite")],
)
def test_reward_model_hook_checks_its_output(scores, match):
    with pytest.raises(RuntimeError, match=match):
        RewardModelHook(lambda p, t: scores).score_batch([0, 1], ["a", "b"])


def test_score_batch_plain_function_and_length_check():
    assert score_batch(lambda p, t: float(p == t), ["x", "y"], ["x", "z"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="differ in length"):
        score_batch(lambda p, t: 0.0, [1], ["a", "b"])


def test_combined_reward():
    math_reward = MathVerifyReward()
    style = RewardModelHook(lambda problems, texts: [-0.1 * t.count("!") for t in texts])
    combined = CombinedReward([(math_reward, 1.0), (style, 0.5)])
    problems = [Problem("q", "4"), Problem("q", "4")]
    got = score_batch(combined, problems, ["answer: 4!!", "answer: 5"])
    assert got == pytest.approx([1.0 - 0.1, 0.0])
    with pytest.raises(ValueError, match="at least one"):
        CombinedReward([])
    with pytest.raises(ValueError, match=r"parts\[0\] weight"):
        CombinedReward([(math_reward, float("inf"))])
