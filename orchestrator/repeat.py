"""Repeat detection for rollouts (Kimi k1.5 report, section 2.6.2): stop a response that loops.

::

    generated tokens ──▶ RepeatDetector.push(token) ──▶ True once the tail is one n-gram repeated
                         (O(max_ngram) per token)       (the loop then stops that request,
                                                         finish_reason "repeat")
    whole response ─────▶ detect_repeat(tokens)     ──▶ same rule on the tail, after the fact
                          first_repeat_end(tokens)  ──▶ where a streaming detector would have stopped
    reward ─────────────▶ RepeatConfig.apply(reward, repeated) ──▶ reward - penalty if repeated

The rule: for some period ``p`` in ``[min_ngram, max_ngram]`` the tail of the response is
periodic with period ``p`` over at least ``min_repeats`` whole copies of the n-gram and at
least ``min_tail_tokens`` tokens. ``min_tail_tokens`` lets short n-grams need more copies
than long ones (``0000`` in a number is fine; 32 zeros is not).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckpt_common.validate import check_int

__all__ = ["RepeatConfig", "RepeatDetector", "detect_repeat", "find_tail_repeat", "first_repeat_end"]

logger = logging.getLogger(__name__)


def _check_rule(min_ngram: int, max_ngram: int, min_repeats: int, min_tail_tokens: int) -> None:
    check_int("min_ngram", min_ngram, 1)
    check_int("max_ngram", max_ngram, 1)
    check_int("min_repeats", min_repeats, 2)
    check_int("min_tail_tokens", min_tail_tokens, 0)
    if max_ngram < min_ngram:
        raise ValueError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")


def _needed_matches(period: int, min_repeats: int, min_tail_tokens: int) -> int:
    """Trailing positions i with t[i] == t[i - period] needed for the rule to fire."""
    return max(period * (min_repeats - 1), min_tail_tokens - period)


@dataclass(frozen=True)
class RepeatConfig:
    """Detection rule plus the reward penalty (subtracted from a repeating response's reward)."""

    min_ngram: int = 1
    max_ngram: int = 64
    min_repeats: int = 4
    min_tail_tokens: int = 32
    penalty: float = 1.0
    enabled: bool = True

    def __post_init__(self) -> None:
        try:
            _check_rule(self.min_ngram, self.max_ngram, self.min_repeats, self.min_tail_tokens)
        except ValueError as e:
            raise ValueError(f"RepeatConfig.{e}") from None
        if isinstance(self.penalty, bool) or not isinstance(self.penalty, (int, float)) or not self.penalty >= 0:
            raise ValueError(f"RepeatConfig.penalty must be a number >= 0, got {self.penalty!r}")

    def detector(self) -> RepeatDetector:
        return RepeatDetector(self.min_ngram, self.max_ngram, self.min_repeats, self.min_tail_tokens)

    def detect(self, token_ids: Sequence[int]) -> bool:
        return self.enabled and detect_repeat(
            token_ids,
            min_ngram=self.min_ngram,
            min_repeats=self.min_repeats,
            max_ngram=self.max_ngram,
            min_tail_tokens=self.min_tail_tokens,
        )

    def apply(self, reward: float, repeated: bool) -> float:
        """The reward, minus ``penalty`` when the response was stopped for repeating."""
        return float(reward) - self.penalty if (repeated and self.enabled) else float(reward)


def find_tail_repeat(
    token_ids: Sequence[int], *, min_ngram: int, min_repeats: int, max_ngram: int = 64, min_tail_tokens: int = 0
) -> int | None:
    """The smallest period ``p`` whose repetition covers the tail by the rule, or None."""
    _check_rule(min_ngram, max_ngram, min_repeats, min_tail_tokens)
    tokens = list(token_ids)
    n = len(tokens)
    for p in range(min_ngram, max_ngram + 1):
        need = _needed_matches(p, min_repeats, min_tail_tokens)
        if need + p > n:
            continue
        if tokens[n - need :] == tokens[n - need - p : n - p]:
            return p
    return None


def detect_repeat(
    token_ids: Sequence[int], *, min_ngram: int, min_repeats: int, max_ngram: int = 64, min_tail_tokens: int = 0
) -> bool:
    """Whether the tail is one n-gram (length in [min_ngram, max_ngram]) repeated by the rule."""
    return (
        find_tail_repeat(
            token_ids,
            min_ngram=min_ngram,
            min_repeats=min_repeats,
            max_ngram=max_ngram,
            min_tail_tokens=min_tail_tokens,
        )
        is not None
    )


class RepeatDetector:
    """Streaming form of :func:`detect_repeat` for tokens arriving during generation.

    Keeps, per period p, the number of trailing tokens equal to the token p places earlier;
    ``push`` is O(max_ngram). Once it fires it stays fired (``triggered_at`` holds the number
    of tokens seen at that moment) until :meth:`reset`.
    """

    def __init__(self, min_ngram: int, max_ngram: int, min_repeats: int, min_tail_tokens: int = 0) -> None:
        _check_rule(min_ngram, max_ngram, min_repeats, min_tail_tokens)
        self._periods = range(min_ngram, max_ngram + 1)
        self._needed = [_needed_matches(p, min_repeats, min_tail_tokens) for p in self._periods]
        self._history: deque[int] = deque(maxlen=max_ngram)
        self._runs = [0] * len(self._periods)
        self.num_tokens = 0
        self.triggered_at: int | None = None
        self.period: int | None = None

    @property
    def triggered(self) -> bool:
        return self.triggered_at is not None

    def reset(self) -> None:
        self._history.clear()
        self._runs = [0] * len(self._periods)
        self.num_tokens = 0
        self.triggered_at = None
        self.period = None

    def push(self, token_id: int) -> bool:
        """Add one token; True if the response repeats (now or earlier)."""
        hist = self._history
        size = len(hist)
        runs = self._runs
        for idx, p in enumerate(self._periods):
            runs[idx] = runs[idx] + 1 if (p <= size and hist[size - p] == token_id) else 0
        hist.append(token_id)
        self.num_tokens += 1
        if self.triggered_at is None:
            for idx, p in enumerate(self._periods):
                if runs[idx] >= self._needed[idx]:
                    self.triggered_at, self.period = self.num_tokens, p
                    break
        return self.triggered_at is not None

    def extend(self, token_ids: Iterable[int]) -> bool:
        """Add tokens (e.g. one streamed delta); stops reading at the first trigger."""
        for token_id in token_ids:
            if self.push(token_id):
                return True
        return self.triggered


def first_repeat_end(
    token_ids: Sequence[int], *, min_ngram: int, min_repeats: int, max_ngram: int = 64, min_tail_tokens: int = 0
) -> int | None:
    """Length of the shortest prefix whose tail repeats (where a streaming check stops), or None."""
    detector = RepeatDetector(min_ngram, max_ngram, min_repeats, min_tail_tokens)
    detector.extend(token_ids)
    return detector.triggered_at
