"""Checking the records of a JSONL file: the pieces problem files and SFT files share.

Both formats are one JSON object a line, read whole and checked field by field before anything uses
them, with every error naming the line, the field and what was expected
(``train.jsonl:7: field "answer": expected a non-empty string, got 42 (int)``):

- problem files (``orchestrator.tasks.problems``): the RL job's prompts and references;
- SFT files (``trainer.sft_file``): prompts or conversations and the responses to learn.

Here is what both readers do alike, so that their errors read alike: ``json_object_lines`` (the
objects of a JSONL text: blank lines skipped; invalid JSON, a field given twice and a value that is not
an object reported by line), ``is_text`` (a non-empty string) and ``got`` (how an error shows the value
it found). Errors go to an ``IssueSink``: ``orchestrator.tasks.problems.Collector``, which both readers
use, and which raises ``ProblemFileError`` listing them. Nothing here knows either format's fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Protocol


class IssueSink(Protocol):
    """Where a check reports an error: ``line`` None for the whole file, ``field`` None for the whole line."""

    def add(self, line: int | None, field: str | None, message: str) -> None: ...


class ColumnNames:
    """An IssueSink that names the user's columns where a check names one of the record's fields:
    ``columns`` maps a field to its column (``answer`` -> ``reward_model.ground_truth``, so
    ``tests[2].input`` -> ``input_output[2].input``); ``count`` is the wrapped sink's."""

    def __init__(self, sink: Any, columns: dict[str, str]) -> None:
        self.sink, self.columns = sink, columns

    @property
    def count(self) -> int:
        return self.sink.count

    def add(self, line: int | None, field: str | None, message: str) -> None:
        if field is not None:
            head = field.split("[", 1)[0]
            if head in self.columns:
                field = self.columns[head] + field[len(head) :]
        self.sink.add(line, field, message)


def got(value: Any) -> str:
    """How an error shows the value it found: ``got 42 (int)``, ``got "" (string)`` (cut at 60 characters)."""
    text = json.dumps(value, ensure_ascii=False) if _is_json(value) else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"got {text} ({_type_name(value)})"


def is_text(value: Any) -> bool:
    """A string with something besides white space."""
    return isinstance(value, str) and value.strip() != ""


def json_object_lines(lines: Iterable[str], errors: IssueSink) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL text that is one JSON object (a field
    given twice is invalid); every other line goes to ``errors`` and is skipped."""
    for line_number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except ValueError as e:  # json.JSONDecodeError, or a field given twice
            errors.add(line_number, None, f"invalid JSON: {e}")
            continue
        if not isinstance(record, dict):
            errors.add(line_number, None, f"expected a JSON object {{...}}, {got(record)}")
            continue
        yield line_number, record


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _type_name(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "bool", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f'field "{key}" appears twice')
        out[key] = value
    return out
