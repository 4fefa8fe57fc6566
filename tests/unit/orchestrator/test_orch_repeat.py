"""Repeat detector: table tests, streaming == batch, penalty config."""

from __future__ import annotations

import random

import pytest

from orchestrator.repeat import (
    RepeatConfig,
    RepeatDetector,
    detect_repeat,
    find_tail_repeat,
    first_repeat_end,
)

PREFIX = [90, 91, 92, 93, 94]


@pytest.mark.parametrize(
    ("tokens", "kwargs", "want_period"),
    [
        (PREFIX + [1, 2, 3] * 3, dict(min_ngram=1, min_repeats=3), 3),
        (PREFIX + [1, 2, 3] * 3, dict(min_ngram=1, min_repeats=4), None),  # only 3 copies
        (PREFIX + [1, 2, 3] * 3 + [1], dict(min_ngram=1, min_repeats=3), 3),  # partial copy at the end
        (PREFIX + [1, 2, 3] * 3 + [4], dict(min_ngram=1, min_repeats=3), None),  # broken tail
        (PREFIX + [7] * 6, dict(min_ngram=1, min_repeats=6), 1),
        (PREFIX + [7] * 6, dict(min_ngram=2, min_repeats=3), 2),  # "77" three times
        (PREFIX + [7] * 6, dict(min_ngram=2, min_repeats=4), None),
        (PREFIX + [7] * 6, dict(min_ngram=1, min_repeats=2, min_tail_tokens=7), None),  # tail only 6 long
        (PREFIX + [7] * 7, dict(min_ngram=1, min_repeats=2, min_tail_tokens=7), 1),
        (PREFIX + [1, 2] * 5, dict(min_ngram=3, min_repeats=2), 4),  # period 2 too short: "1212" twice
        (PREFIX + list(range(10)) * 2, dict(min_ngram=1, min_repeats=2, max_ngram=9), None),  # period 10 > max
        (PREFIX + list(range(10)) * 2, dict(min_ngram=1, min_repeats=2, max_ngram=10), 10),
        ([], dict(min_ngram=1, min_repeats=2), None),
        ([5], dict(min_ngram=1, min_repeats=2), None),
        ([5, 5], dict(min_ngram=1, min_repeats=2), 1),
        (list(range(50)), dict(min_ngram=1, min_repeats=2), None),
    ],
)
def test_tail_repeat_table(tokens, kwargs, want_period):
    assert find_tail_repeat(tokens, **kwargs) == want_period
    assert detect_repeat(tokens, **kwargs) is (want_period is not None)
    det = RepeatDetector(
        kwargs["min_ngram"], kwargs.get("max_ngram", 64), kwargs["min_repeats"], kwargs.get("min_tail_tokens", 0)
    )
    fired = det.extend(tokens)
    if want_period is not None:
        assert fired  # whenever the tail repeats, the stream fired at or before the end


@pytest.mark.parametrize(
    ("tokens", "kwargs", "want_end"),
    [
        (PREFIX + [1, 2, 3] * 5, dict(min_ngram=1, min_repeats=3), len(PREFIX) + 9),
        (PREFIX + [8] * 20 + [1, 2, 3], dict(min_ngram=1, min_repeats=4), len(PREFIX) + 4),
        (PREFIX + [8] * 20, dict(min_ngram=1, min_repeats=2, min_tail_tokens=10), len(PREFIX) + 10),
        (list(range(40)), dict(min_ngram=1, min_repeats=2), None),
    ],
)
def test_first_repeat_end_table(tokens, kwargs, want_end):
    assert first_repeat_end(tokens, **kwargs) == want_end


@pytest.mark.parametrize("seed", range(6))
def test_streaming_matches_batch_on_random_sequences(seed):
    rng = random.Random(seed)
    kwargs = dict(
        min_ngram=rng.randint(1, 3),
        min_repeats=rng.randint(2, 4),
        max_ngram=rng.randint(4, 12),
        min_tail_tokens=rng.choice([0, 8, 20]),
    )
    tokens: list[int] = []
    while len(tokens) < 300:  # random text with injected loops
        if rng.random() < 0.3:
            gram = [rng.randrange(4) for _ in range(rng.randint(1, 8))]
            tokens += gram * rng.randint(1, 5)
        else:
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 10))]
    want = next((m for m in range(len(tokens) + 1) if detect_repeat(tokens[:m], **kwargs)), None)
    assert first_repeat_end(tokens, **kwargs) == want
    det = RepeatDetector(kwargs["min_ngram"], kwargs["max_ngram"], kwargs["min_repeats"], kwargs["min_tail_tokens"])
    for m, tok in enumerate(tokens, start=1):  # token-by-token agreement until it fires
        fired = det.push(tok)
        if want is None or m < want:
            assert not fired
        else:
            assert fired and det.triggered_at == want
    assert want is not None or not det.triggered


def test_detector_is_sticky_and_resets():
    det = RepeatDetector(1, 8, 3)
    assert not det.extend([1, 2, 1, 2])
    assert det.extend([1, 2])
    assert det.triggered_at == 6 and det.period == 2
    assert det.push(99) and det.triggered_at == 6
    det.reset()
    assert not det.triggered and det.num_tokens == 0
    assert not det.extend([1, 2, 3])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_ngram=0), "min_ngram"),
        (dict(min_repeats=1), "min_repeats"),
        (dict(min_ngram=5, max_ngram=4), "max_ngram"),
        (dict(min_tail_tokens=-1), "min_tail_tokens"),
        (dict(penalty=-0.5), "penalty"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=f"RepeatConfig.*{match}"):
        RepeatConfig(**kwargs)


@pytest.mark.parametrize(
    ("penalty", "enabled", "repeated", "reward", "want"),
    [
        (1.0, True, True, 1.0, 0.0),
        (1.0, True, False, 1.0, 1.0),
        (0.5, True, True, 0.0, -0.5),
        (0.5, False, True, 0.0, 0.0),
    ],
)
def test_penalty_table(penalty, enabled, repeated, reward, want):
    assert RepeatConfig(penalty=penalty, enabled=enabled).apply(reward, repeated) == pytest.approx(want)


def test_config_detect_and_detector_agree():
    cfg = RepeatConfig(min_ngram=1, max_ngram=16, min_repeats=3, min_tail_tokens=12)
    loop = PREFIX + [4, 5, 6, 7] * 3
    assert cfg.detect(loop)
    assert not cfg.detect(PREFIX + [4, 5, 6, 7] * 2 + [4, 5, 6])  # 11 tokens: under min_tail_tokens
    assert cfg.detector().extend(loop)
    assert not RepeatConfig(enabled=False).detect([1] * 100)
