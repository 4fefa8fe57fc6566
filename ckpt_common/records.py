"""Checking the records of a JSONL file: the pieces problem files and SFT files share.

Both formats are one JSON object a line, read whole and checked field by field before anything uses
them, with every error naming the line, the field and what was expected
(``train.jsonl:7: field "answer": expected a non-empty string, got 42 (int)``):

- problem files (``orchestrator.tasks.problems``): the RL job's prompts and references;
- SFT files (``trainer.sft_file``): prompts or conversations and the responses to learn.

Here is what both readers do alike, so that their errors read alike: ``json_object_lines`` (the
objects of a JSONL text: blank lines skipped; invalid JSON, a field given twice and a value that is not
an object reported by line), ``is_text`` (a non-empty string), ``got`` (how an error shows the value
it found) and ``parse_messages`` (a conversation, ``messages``, which both formats accept). Errors go
to an ``IssueSink``: ``Collector``, which both readers use, keeps them as ``Issue``s and raises
``ProblemFileError`` listing them. Nothing here knows either format's other fields.

It lives here, below both readers, because the trainer (SFT files) may not import the orchestrator
(problem files); ``orchestrator.tasks`` re-exports these names for its callers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

ROLES: tuple[str, ...] = ("system", "user", "assistant")  # the roles of a conversation's turns
MESSAGE_FIELDS: tuple[str, ...] = ("role", "content")  # the fields of one turn
MAX_ERRORS = 20  # errors listed in one ProblemFileError (the rest are counted)


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


class Issue(NamedTuple):
    """One error of a problem or SFT file; ``line`` is None for the whole file, ``field`` None for the whole line."""

    path: str
    line: int | None
    field: str | None
    message: str

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        what = self.message if self.field is None else f'field "{self.field}": {self.message}'
        return f"{where}: {what}"


class ProblemFileError(ValueError):
    """A problem file (or a pair of them), or an SFT file, is not valid: the one error type of both
    readers. ``path``, ``line`` and ``field`` are the first error's (``line``/``field`` None where it
    concerns the whole file/line); ``errors`` lists every error shown (at most ``MAX_ERRORS``),
    ``num_errors`` counts all of them."""

    def __init__(self, issues: Sequence[Issue], num_errors: int | None = None) -> None:
        if not issues:
            raise ValueError("ProblemFileError needs at least one issue")
        self.issues = tuple(issues[:MAX_ERRORS])
        self.num_errors = max(num_errors or 0, len(issues))
        first = self.issues[0]
        self.path, self.line, self.field = first.path, first.line, first.field
        self.errors = tuple(str(issue) for issue in self.issues)
        if self.num_errors == 1:
            message = self.errors[0]
        else:
            more = self.num_errors - len(self.issues)
            lines = [f"{first.path}: {self.num_errors} errors", *(f"  {e}" for e in self.errors)]
            if more:
                lines.append(f"  ... and {more} more")
            message = "\n".join(lines)
        super().__init__(message)


class Collector:
    """Issues of one file, the first MAX_ERRORS kept, all counted; ``raise_if_any`` raises them as one
    ProblemFileError. The ``IssueSink`` of problem files and SFT files alike."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.issues: list[Issue] = []
        self.count = 0
        self.skipped = 0  # rows dropped (data.fields.bad_rows=skip)

    def add(self, line: int | None, field: str | None, message: str) -> None:
        self.count += 1
        if len(self.issues) < MAX_ERRORS:
            self.issues.append(Issue(self.path, line, field, message))

    def raise_if_any(self) -> None:
        if self.count:
            raise ProblemFileError(self.issues, self.count)


def parse_messages(value: Any, line: int, errors: IssueSink, last_role: str = "user") -> tuple[dict, ...] | None:
    """The messages of a record, or None after adding their errors; the last one must be from ``last_role``
    (a problem's conversation ends with the user's turn; an SFT record's, ``trainer.sft_file``, with the
    assistant's answer)."""
    if not isinstance(value, list) or not value:
        errors.add(line, "messages", f"expected a non-empty list of {{role, content}} objects, {got(value)}")
        return None
    ok = True
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            errors.add(line, where, f'expected an object {{"role": ..., "content": ...}}, {got(message)}')
            ok = False
            continue
        unknown = sorted(set(message) - set(MESSAGE_FIELDS))
        if unknown:
            errors.add(line, where, f"unknown field(s) {unknown}; allowed: {list(MESSAGE_FIELDS)}")
            ok = False
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            errors.add(line, f"{where}.role", f"expected one of {list(ROLES)}, {got(role)}")
            ok = False
        if not is_text(content):
            errors.add(line, f"{where}.content", f"expected a non-empty string, {got(content)}")
            ok = False
        messages.append({"role": role, "content": content})
    if ok and messages[-1]["role"] != last_role:
        last = len(messages) - 1
        errors.add(
            line,
            f"messages[{last}].role",
            f'expected the last message to be from "{last_role}", got "{messages[last]["role"]}"',
        )
        ok = False
    return tuple(messages) if ok else None


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
