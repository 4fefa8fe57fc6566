"""Rule-based math reward: extract the final answer, compare it with the reference.

::

    response_text ──extract_answer──▶ predicted answer text (None: no answer given -> wrong)
    problem ──────reference_of──────▶ reference answer text
         normalised strings equal?  ──yes──▶ correct
         math_verify.parse both (plain, then wrapped in $...$); both parsed?
              ──▶ math_verify.verify(gold, pred)      (1/2 == 0.5, 1,234 == 1234, \\frac{1}{2} ...)
         otherwise (parsing failed) ──▶ the normalised exact match decides (i.e. wrong)

The default extractor takes the text after the last ``answer:`` or ``####`` marker (the demo
task ends with ``#### 1234``); any ``Callable[[str], str | None]`` can replace it
(``whole_response`` lets math-verify find a ``\\boxed{}`` or last number by itself).

math-verify bounds its parsing with ``signal.alarm``, which only works in the main thread; off
the main thread this reward runs it without a time limit (inputs are short answer strings).
``math_verify`` is imported on first use so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from orchestrator.rewards.base import reference_answer

__all__ = ["DEFAULT_MARKERS", "MathVerifyReward", "extract_after_marker", "normalize_answer", "whole_response"]

logger = logging.getLogger(__name__)

AnswerExtractor = Callable[[str], "str | None"]


DEFAULT_MARKERS = ("answer:", "####")


def extract_after_marker(*markers: str) -> AnswerExtractor:
    """Extractor: the rest of the line after the LAST of any ``markers`` (case-insensitive), or None.

    With no markers given it uses ``DEFAULT_MARKERS``: ``answer:`` and ``####`` (the demo
    arithmetic task ends with ``#### 933``).
    """
    markers = markers or DEFAULT_MARKERS
    if not all(isinstance(m, str) and m for m in markers):
        raise ValueError(f"markers must be non-empty strings, got {markers!r}")
    pattern = re.compile("|".join(re.escape(m) for m in markers), re.IGNORECASE)

    def extract(text: str) -> str | None:
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        answer = text[matches[-1].end() :].split("\n", 1)[0].strip()
        return answer or None

    return extract


def whole_response(text: str) -> str | None:
    """Extractor that hands the whole response to math-verify."""
    return text if text.strip() else None


def normalize_answer(text: str) -> str:
    """For exact matching: drop whitespace, surrounding ``$``, a trailing period; lower-case."""
    s = "".join(text.split()).strip("$").rstrip(".").lower()
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,234,567 -> 1234567
        s = s.replace(",", "")
    return s


class MathVerifyReward:
    """RewardFn: ``correct_reward`` if the extracted answer equals the reference, else ``wrong_reward``."""

    def __init__(
        self,
        extract_answer: AnswerExtractor | None = None,
        *,
        reference_of: Callable[[Any], str] = reference_answer,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        timeout_s: int | None = 5,
    ) -> None:
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1):
            raise ValueError(f"timeout_s must be None or an int >= 1 (whole seconds), got {timeout_s!r}")
        self.extract_answer = extract_answer if extract_answer is not None else extract_after_marker()
        self.reference_of = reference_of
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        self.timeout_s = timeout_s

    def __call__(self, problem: Any, response_text: str) -> float:
        return self.correct_reward if self.is_correct(problem, response_text) else self.wrong_reward

    def is_correct(self, problem: Any, response_text: str) -> bool:
        predicted = self.extract_answer(response_text)
        if predicted is None:
            return False
        gold = self.reference_of(problem)
        if normalize_answer(predicted) == normalize_answer(gold):
            return True
        gold_parsed = self._parse(gold)
        pred_parsed = self._parse(predicted)
        if not gold_parsed or not pred_parsed:
            return False  # parsing failed: the exact match above was the fallback
        from math_verify import verify

        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=self._timeout()))

    def _timeout(self) -> int | None:
        return self.timeout_s if threading.current_thread() is threading.main_thread() else None

    def _parse(self, text: str) -> list:
        from math_verify import parse

        timeout = self._timeout()
        parsed = parse(text, parsing_timeout=timeout)
        if not parsed and "$" not in text:
            parsed = parse(f"${text}$", parsing_timeout=timeout)
        return parsed
