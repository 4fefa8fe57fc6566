"""Which column of a user's problem set holds each part of a problem (``data.fields``), and the answer
and test formats data sets use.

::

    a row of the user's table ──map_row(row, fields)──▶ a record of this project's format
        {fields.prompt | fields.messages: ..., fields.answer | fields.tests: ..., fields.id, ...}
            answer_format  "plain":  the column as it is (a number becomes its text)
                           "gsm8k":  the text after the last "####" of a worked solution
                           "boxed":  the contents of the last \\boxed{...} (MATH; nested braces kept)
            tests          a list of {"input", "output"} (this project's), or an ``input_output``
                           JSON string or object with parallel "inputs"/"outputs" lists (APPS, TACO)
            difficulty, pass_rate: numbers, or their text (a CSV's cells)
        ──orchestrator.tasks.problems' checks──▶ Problem; an error names the user's column

A column name may be a dotted path into nested objects (``reward_model.ground_truth``,
``extra_info.index``: verl's parquet layout). ``None`` (JSON null) for a field: the set has no such
column. The defaults are this project's own record format, read strictly from JSONL (any other field
is an error); with any other source or mapping, columns the mapping does not name are left alone.
``bad_rows="skip"`` drops rows that fail a check and counts them, where "error" (the default) refuses
the file. ``system_prompt``: a system turn put before every conversation (it needs the model's chat
template, ``data.chat_template=true``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from ckpt_common.records import IssueSink, got, is_text
from ckpt_common.tables import MISSING, column_value

ANSWER_FORMATS: tuple[str, ...] = ("plain", "gsm8k", "boxed")
BAD_ROWS: tuple[str, ...] = ("error", "skip")
MAPPED: tuple[str, ...] = ("id", "prompt", "messages", "answer", "tests", "difficulty", "pass_rate")
GSM8K_MARKER = "####"
BOXED = ("\\boxed{", "\\fbox{")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


@dataclasses.dataclass(frozen=True)
class FieldsConfig:
    """Where each part of a problem is in the user's rows (``data.fields``; the module docstring)."""

    prompt: str | None = "prompt"
    messages: str | None = "messages"
    answer: str | None = "answer"
    tests: str | None = "tests"
    id: str | None = "id"
    difficulty: str | None = "difficulty"
    pass_rate: str | None = "pass_rate"
    answer_format: Literal["plain", "gsm8k", "boxed"] = "plain"
    system_prompt: str | None = None
    bad_rows: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        for name in MAPPED:
            value = getattr(self, name)
            if value is not None and not is_text(value):
                raise ValueError(
                    f"data.fields.{name}={value!r} must be a column name (a string) or null (no such column)"
                )
        if self.prompt is None and self.messages is None:
            raise ValueError("data.fields.prompt and data.fields.messages are both null: name the prompt's column")
        if self.answer is None and self.tests is None:
            raise ValueError(
                "data.fields.answer and data.fields.tests are both null: name the answer's or tests' column"
            )
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"data.fields.answer_format={self.answer_format!r} must be one of {list(ANSWER_FORMATS)}")
        if self.bad_rows not in BAD_ROWS:
            raise ValueError(f"data.fields.bad_rows={self.bad_rows!r} must be one of {list(BAD_ROWS)}")
        if self.system_prompt is not None and not is_text(self.system_prompt):
            raise ValueError(f"data.fields.system_prompt={self.system_prompt!r} must be a non-empty string or null")

    @property
    def is_default(self) -> bool:
        """This project's own record format (read strictly from JSONL)."""
        return self == FieldsConfig()

    def column(self, field: str) -> str:
        """The user's column of one of this project's fields (how an error names it)."""
        return getattr(self, field) or field


def map_row(row: dict[str, Any], fields: FieldsConfig, line: int, errors: IssueSink) -> dict[str, Any] | None:
    """The record (this project's field names) of one row, or None after adding its errors (each names
    the user's column)."""
    record: dict[str, Any] = {}
    ok = True
    for field in MAPPED:
        column = getattr(fields, field)
        if column is None:
            continue
        value = column_value(row, column)
        if value is MISSING:
            continue
        if field == "answer":
            value = answer_text(value, fields.answer_format, column, line, errors)
        elif field == "tests":
            value = code_tests(value, column, line, errors)
        elif field in ("difficulty", "pass_rate") and isinstance(value, str):
            value = _number_text(value)
        elif field == "id" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # verl's extra_info.index is a number
        if value is None:
            ok = False
            continue
        record[field] = value
    return record if ok else None


def answer_text(value: Any, answer_format: str, column: str, line: int, errors: IssueSink) -> str | None:
    """The reference answer of a cell in ``answer_format``; None after adding an error naming ``column``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and answer_format == "plain":
        return str(value)
    if not is_text(value):
        errors.add(line, column, f"expected a non-empty string, {got(value)}")
        return None
    if answer_format == "plain":
        return value
    if answer_format == "gsm8k":
        head, marker, tail = value.rpartition(GSM8K_MARKER)
        answer = tail.strip()
        if not marker or not answer:
            errors.add(
                line,
                column,
                f'expected a worked solution ending "{GSM8K_MARKER} <answer>" (data.fields.answer_format=gsm8k), '
                f"{got(value[-60:])}",
            )
            return None
        return answer.replace(",", "") if _THOUSANDS.match(answer) else answer  # "1,000" -> "1000"
    answer = last_boxed(value)
    if answer is None:
        errors.add(
            line,
            column,
            "expected a solution with a final \\boxed{...} (data.fields.answer_format=boxed), "
            f"{'an unclosed brace after the last' if _has_boxed(value) else 'none found in'} {got(value[-60:])}",
        )
        return None
    return answer


def _has_boxed(text: str) -> bool:
    return any(opener in text for opener in BOXED)


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, nested braces matched
    (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); None when there is none, or it is not closed or empty."""
    start = max(text.rfind(opener) + len(opener) if opener in text else -1 for opener in BOXED)
    if start < 0:
        return None
    depth = 1
    for i in range(start, len(text)):
        char = text[i]
        if char == "{" and text[i - 1] != "\\":
            depth += 1
        elif char == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                inner = text[start:i].strip()
                return inner or None
    return None


def code_tests(value: Any, column: str, line: int, errors: IssueSink) -> list[dict[str, str]] | None:
    """A code problem's tests as this project's list of {"input", "output"}: from that list as it is,
    or from an ``input_output`` JSON string/object of parallel ``inputs``/``outputs`` (APPS, TACO).
    None after adding an error naming ``column``."""
    if isinstance(value, list):
        return value  # this project's shape, checked field by field by orchestrator.tasks.problems
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            errors.add(line, column, f'expected tests: an "input_output" JSON string, but it does not parse ({e})')
            return None
    if not isinstance(value, dict) or "inputs" not in value or "outputs" not in value:
        errors.add(
            line,
            column,
            'expected tests: a list of {"input", "output"}, or an object with "inputs" and "outputs" lists '
            f"(APPS' input_output), {got(value)}",
        )
        return None
    if value.get("fn_name"):
        errors.add(
            line,
            column,
            f"call-based tests (fn_name {value['fn_name']!r}) are not supported: the sandbox runs a program "
            "on stdin and checks its stdout",
        )
        return None
    inputs, outputs = value["inputs"], value["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        errors.add(
            line,
            column,
            f'expected "inputs" and "outputs": non-empty lists of the same length, got {_length(inputs)} and '
            f"{_length(outputs)}",
        )
        return None
    tests = []
    for i, (given, expected) in enumerate(zip(inputs, outputs)):
        given, expected = _stream(given), _stream(expected)
        if given is None or expected is None:
            which = "inputs" if given is None else "outputs"
            errors.add(
                line, f"{column}.{which}[{i}]", f"expected a string (or a list of lines), {got(value[which][i])}"
            )
            return None
        tests.append({"input": given, "output": expected})
    return tests


def _stream(value: Any) -> str | None:
    """A test's stdin or stdout: a string, or a list of lines joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, str) for part in value):
        return "".join(part if part.endswith("\n") else part + "\n" for part in value)
    return None


def _length(value: Any) -> str:
    return f"{len(value)} items" if isinstance(value, list) else got(value)


def _number_text(value: str) -> Any:
    try:
        return float(value)
    except ValueError:
        return value  # the problem file's check names the column and the value
