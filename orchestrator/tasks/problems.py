"""Problem files: the JSONL format of "RL on your own prompts", read and validated, and written.

One JSON object per line, of either kind (a file may mix them)::

    math: {"id"?: str, "prompt" | "messages": ..., "answer": str,
           "difficulty"?: number, "pass_rate"?: number}
    code: {"id"?: str, "prompt" | "messages": ..., "tests": [{"input": str, "output": str}, ...],
           "difficulty"?: number, "pass_rate"?: number}

- exactly one of ``prompt`` (a non-empty string) and ``messages`` (a non-empty list of
  ``{"role": "system" | "user" | "assistant", "content": str}``, the last one from the user);
- exactly one of ``answer`` (a non-empty string: the reference final answer) and ``tests`` (a
  non-empty list of ``{"input": str, "output": str}``: stdin given, stdout expected);
- ``id``: a non-empty string, unique in the file; when absent, a stable id is derived from the
  content: the first 16 hex digits of the sha256 of the canonical JSON of ``{"prompt": ...}`` or
  ``{"messages": [...]}`` (sorted keys, no spaces), so the same problem gets the same id in every file;
- ``difficulty``: a number in [0, 1], 0 the easiest and 1 the hardest (for instance 1 - pass rate of
  a reference model); the curriculum sorts by it. Absent means unknown (the RL job counts it as hard).
- ``pass_rate``: a number in [0, 1], the share of a reference model's samples that solved it (what
  ``python -m orchestrator.curation --problems-out`` writes); the prioritized sampler starts from it
  as the problem's success rate. Absent: the sampler's ``prior_success_rate``.

Blank lines are skipped; any other field is an error. ``read_problems`` checks every line before it
returns (a file is read whole or not at all): each error names ``path:line``, the field and what was
expected (``train.jsonl:7: field "answer": expected a non-empty string, got 42 (int)``), the first 20
are listed in one ``ProblemFileError``. Two lines with the same id, or the same prompt/messages, are
errors naming both lines. ``check_disjoint`` keeps a held-out file apart from its training file; ``split_heldout``
holds out a seeded share of one file instead (``data.heldout_fraction``, ``data.split_seed``);
``write_problems`` writes the same format back (fields in a fixed order, None fields left out), atomically.
SFT files (``trainer.sft_file``) are checked the same way: with the JSONL reading and value checks of
``ckpt_common.records`` (``parse_messages``, and a ``Collector`` that raises ``ProblemFileError``;
defined there, below both readers, and importable from here and ``orchestrator.tasks`` too).

The RL job takes these files through ``orchestrator.tasks.file_task.FileTask`` (``data.train_path``,
``data.heldout_path``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from ckpt_common.fsutil import atomic_write_text
from ckpt_common.records import (
    Collector,
    ColumnNames,
    Issue,
    IssueSink,
    ProblemFileError,
    got,
    is_text,
    json_object_lines,
    parse_messages,
)
from ckpt_common.tables import Table, TableError, read_table, table_name
from orchestrator.tasks.fields import FieldsConfig, map_row

logger = logging.getLogger(__name__)

FIELDS: tuple[str, ...] = (
    "id",
    "prompt",
    "messages",
    "answer",
    "tests",
    "difficulty",
    "pass_rate",
)  # also the write order
TEST_FIELDS: tuple[str, ...] = ("input", "output")
ID_HEX_DIGITS = 16

ProblemKind = Literal["math", "code"]


@dataclasses.dataclass(frozen=True)
class CodeTest:
    """One test of a code problem: the program reads ``input`` on stdin and must print ``output``."""

    input: str
    output: str


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem of a problem file (see the module docstring for the rules on each field).

    ``line`` is where it was read (1-based; None when built in code); it is not part of equality.
    ``messages`` holds plain dicts, so a Problem that has them cannot be hashed.
    """

    id: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    answer: str | None = None
    tests: tuple[CodeTest, ...] | None = None
    difficulty: float | None = None
    pass_rate: float | None = None
    line: int | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"problem {self.id!r}: exactly one of prompt and messages must be given")
        if (self.answer is None) == (self.tests is None):
            raise ValueError(f"problem {self.id!r}: exactly one of answer and tests must be given")
        if self.difficulty is not None and not 0.0 <= self.difficulty <= 1.0:
            raise ValueError(f"problem {self.id!r}: difficulty={self.difficulty!r} must be in [0, 1]")
        if self.pass_rate is not None and not 0.0 <= self.pass_rate <= 1.0:
            raise ValueError(f"problem {self.id!r}: pass_rate={self.pass_rate!r} must be in [0, 1]")

    @property
    def kind(self) -> ProblemKind:
        """ "math" (checked against ``answer``) or "code" (run against ``tests``)."""
        return "math" if self.answer is not None else "code"

    def content_key(self) -> str:
        """The canonical JSON of the prompt or messages: two problems with the same key are the same problem."""
        return _content_key(self.prompt, self.messages)

    def to_record(self) -> dict[str, Any]:
        """The JSON object of this problem, fields in ``FIELDS`` order, None fields left out."""
        record: dict[str, Any] = {"id": self.id}
        if self.prompt is not None:
            record["prompt"] = self.prompt
        if self.messages is not None:
            record["messages"] = [{"role": m["role"], "content": m["content"]} for m in self.messages]
        if self.answer is not None:
            record["answer"] = self.answer
        if self.tests is not None:
            record["tests"] = [{"input": t.input, "output": t.output} for t in self.tests]
        if self.difficulty is not None:
            record["difficulty"] = self.difficulty
        if self.pass_rate is not None:
            record["pass_rate"] = self.pass_rate
        return record


def _content_key(prompt: str | None, messages: Sequence[dict] | None) -> str:
    content: dict[str, Any] = {"prompt": prompt} if prompt is not None else {"messages": list(messages or ())}
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stable_id(prompt: str | None = None, messages: Sequence[dict] | None = None) -> str:
    """The id of a problem that has none: first 16 hex digits of the sha256 of its canonical content."""
    return hashlib.sha256(_content_key(prompt, messages).encode()).hexdigest()[:ID_HEX_DIGITS]


def _parse_tests(value: Any, line: int, errors: Collector) -> tuple[CodeTest, ...] | None:
    if not isinstance(value, list) or not value:
        errors.add(line, "tests", f'expected a non-empty list of {{"input": str, "output": str}}, {got(value)}')
        return None
    ok = True
    tests = []
    for i, test in enumerate(value):
        where = f"tests[{i}]"
        if not isinstance(test, dict):
            errors.add(line, where, f'expected an object {{"input": str, "output": str}}, {got(test)}')
            ok = False
            continue
        unknown = sorted(set(test) - set(TEST_FIELDS))
        if unknown:
            errors.add(line, where, f"unknown field(s) {unknown}; allowed: {list(TEST_FIELDS)}")
            ok = False
        for name in TEST_FIELDS:
            if not isinstance(test.get(name), str):
                missing = name not in test
                errors.add(
                    line,
                    f"{where}.{name}",
                    "missing, expected a string" if missing else f"expected a string, {got(test[name])}",
                )
                ok = False
        if ok:
            tests.append(CodeTest(test["input"], test["output"]))
    return tuple(tests) if ok else None


def _parse_record(record: dict[str, Any], line: int, errors: Collector) -> Problem | None:
    """The Problem of one JSON object, or None after adding its errors."""
    before = errors.count
    unknown = [key for key in record if key not in FIELDS]
    if unknown:
        errors.add(line, unknown[0], f"unknown field(s) {unknown}; allowed: {list(FIELDS)}")

    problem_id = record.get("id")
    if "id" in record and not is_text(problem_id):
        errors.add(line, "id", f"expected a non-empty string, {got(problem_id)}")

    prompt = messages = None
    if "prompt" in record and "messages" in record:
        errors.add(line, "prompt", 'expected exactly one of "prompt" and "messages", got both')
    elif "prompt" in record:
        prompt = record["prompt"]
        if not is_text(prompt):
            errors.add(line, "prompt", f"expected a non-empty string, {got(prompt)}")
    elif "messages" in record:
        messages = parse_messages(record["messages"], line, errors)
    else:
        errors.add(line, "prompt", 'missing: expected "prompt" (a string) or "messages" (a list)')

    answer = tests = None
    if "answer" in record and "tests" in record:
        errors.add(line, "answer", 'expected exactly one of "answer" (math) and "tests" (code), got both')
    elif "answer" in record:
        answer = record["answer"]
        if not is_text(answer):
            errors.add(line, "answer", f"expected a non-empty string, {got(answer)}")
    elif "tests" in record:
        tests = _parse_tests(record["tests"], line, errors)
    else:
        errors.add(line, "answer", 'missing: expected "answer" (a string, math) or "tests" (a list, code)')

    difficulty = _unit_number(record, "difficulty", "0 easiest, 1 hardest", line, errors)
    pass_rate = _unit_number(record, "pass_rate", "the share of samples that solved it", line, errors)

    if errors.count > before:
        return None
    if problem_id is None:
        problem_id = stable_id(prompt, messages)
    return Problem(problem_id, prompt, messages, answer, tests, difficulty, pass_rate, line=line)


def _unit_number(record: dict, field: str, meaning: str, line: int, errors: Any) -> float | None:
    """``record[field]`` as a float in [0, 1], None when absent; an error naming the field otherwise."""
    if field not in record:
        return None
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        errors.add(line, field, f"expected a number in [0, 1] ({meaning}), {got(value)}")
        return None
    return float(value)


def parse_problem_lines(lines: Iterable[str], path: str | os.PathLike[str] = "<problems>") -> list[Problem]:
    """The problems of a JSONL text given as lines (line 1 first); raises ProblemFileError listing every
    error (up to MAX_ERRORS) if any line is not valid. ``path`` only names the source in errors."""
    errors = Collector(os.fspath(path))
    return parse_problem_rows(json_object_lines(lines, errors), errors)


def parse_problem_rows(
    rows: Iterable[tuple[int, dict[str, Any]]],
    errors: Collector,
    fields: FieldsConfig | None = None,
    strict: bool = True,
) -> list[Problem]:
    """The problems of numbered rows, mapped by ``fields`` (None: this project's format), every error
    added to ``errors`` (whose path names the source) and raised as one ProblemFileError. ``strict``:
    a column the format does not know is an error (this project's JSONL); otherwise it is ignored.
    With ``fields.bad_rows == "skip"`` a row that fails a check is dropped and counted instead (logged;
    ``errors.skipped``), unless every row does."""
    fields = fields or FieldsConfig()
    skip = fields.bad_rows == "skip"
    problems: list[Problem] = []
    id_lines: dict[str, int] = {}
    content_lines: dict[str, int] = {}
    skipped: list[Issue] = []
    columns = {f: fields.column(f) for f in FIELDS if getattr(fields, f, None) not in (None, f)}
    for line_number, row in rows:
        sink = Collector(errors.path) if skip else errors
        problem, explicit_id = _problem_of_row(row, line_number, fields, strict, ColumnNames(sink, columns))
        if problem is not None:
            content = problem.content_key()
            content_field = fields.column("prompt" if problem.prompt is not None else "messages")
            same_content = content_lines.get(content)
            if same_content is not None:
                sink.add(
                    line_number, content_field, f"the same {content_field} as line {same_content} (a duplicate problem)"
                )
            same_id = id_lines.get(problem.id)
            if same_id is not None and (explicit_id or same_content is None):
                sink.add(line_number, fields.column("id"), f'id "{problem.id}" is already used on line {same_id}')
        if skip and sink.count:
            skipped.extend(sink.issues[:1])
            continue
        if problem is None:
            continue
        content_lines.setdefault(problem.content_key(), line_number)
        id_lines.setdefault(problem.id, line_number)
        problems.append(problem)
    errors.skipped = len(skipped)
    if skipped:
        logger.warning(
            "%s: skipped %d row(s) that fail a check (data.fields.bad_rows=skip); the first: %s",
            errors.path,
            len(skipped),
            "; ".join(str(issue) for issue in skipped[:3]),
        )
    if not problems and not errors.count:
        what = f"all {len(skipped)} rows were skipped (data.fields.bad_rows=skip)" if skipped else "the file is empty"
        errors.add(None, None, f"no problems: {what} (a problem file needs at least one)")
    errors.raise_if_any()
    return problems


def _problem_of_row(
    row: dict[str, Any], line: int, fields: FieldsConfig, strict: bool, errors: IssueSink
) -> tuple[Problem | None, bool]:
    """(the Problem of one row or None after adding its errors, whether the row gave its id)."""
    if fields.is_default and strict:
        return _parse_record(row, line, errors), "id" in row
    record = map_row(row, fields, line, errors)
    if record is None:
        return None, False
    return _parse_record(record, line, errors), "id" in record


def read_problems(
    path: str | os.PathLike[str], fields: FieldsConfig | None = None, split: str | None = None
) -> list[Problem]:
    """Every problem of a problem set, in its order: this project's JSONL, or any table ``read_table``
    reads (parquet, CSV, JSON, Arrow, a ``save_to_disk`` folder; ``split`` where it has several), its
    columns mapped by ``fields``. Raises ProblemFileError (nothing is returned) if any row is not valid;
    a row's number is its line in JSONL, its 1-based row elsewhere."""
    name = table_name(path, split)
    errors = Collector(name)
    try:
        table = read_table(path, errors, split)
    except TableError as e:
        raise ProblemFileError([Issue(e.name, None, None, str(e)[len(e.name) + 2 :])]) from None
    fields = fields or FieldsConfig()
    strict = table.kind == "jsonl" and fields.is_default
    if not strict:
        _check_columns(table, fields, errors)
    return parse_problem_rows(table.rows, errors, fields, strict)


def _check_columns(table: Table, fields: FieldsConfig, errors: Collector) -> None:
    """A table without a column for the prompt, or for the answer or tests, is refused at once, naming
    the columns it has (one error for the file, not one per row)."""
    tops = set(table.columns)

    def present(field: str) -> bool:
        column = getattr(fields, field)
        return column is not None and (column in tops or column.split(".", 1)[0] in tops)

    for first, second in (("prompt", "messages"), ("answer", "tests")):
        if not (present(first) or present(second)):
            named = [getattr(fields, f) for f in (first, second) if getattr(fields, f) is not None]
            errors.add(
                None,
                None,
                f"no column {' or '.join(repr(n) for n in named)} (data.fields.{first}/data.fields.{second}); "
                f"its columns: {list(table.columns)}",
            )
    errors.raise_if_any()


def check_disjoint(
    train: Sequence[Problem],
    heldout: Sequence[Problem],
    train_path: str | os.PathLike[str],
    heldout_path: str | os.PathLike[str],
) -> None:
    """Raise ProblemFileError (on the held-out file's lines) when a held-out problem is also a training
    problem: the same id or the same prompt/messages."""
    train_name, heldout_name = os.fspath(train_path), os.fspath(heldout_path)
    by_id = {p.id: p for p in train}
    by_content = {p.content_key(): p for p in train}
    errors = Collector(heldout_name)
    for index, problem in enumerate(heldout):
        line = problem.line if problem.line is not None else index + 1
        same_id, same_content = by_id.get(problem.id), by_content.get(problem.content_key())
        if same_id is None and same_content is None:
            continue
        other = same_id if same_id is not None else same_content
        other_line = f"{train_name}:{other.line}" if other.line is not None else f"{train_name} (id {other.id!r})"
        if same_id is not None:
            field, how = "id", "the same id"
        else:
            field = "prompt" if problem.prompt is not None else "messages"
            how = f"the same {field}"
        errors.add(line, field, f'held-out problem "{problem.id}" is also a training problem ({how} as {other_line})')
    errors.raise_if_any()


def split_heldout(
    problems: Sequence[Problem], fraction: float, seed: int, path: str | os.PathLike[str] = "<problems>"
) -> tuple[list[Problem], list[Problem]]:
    """(training, held-out) problems of one file: ``round(fraction x len(problems))`` held out (halves
    rounded up). Which ones depends only on the ids and ``seed``: each problem is ranked by the sha256 of
    ``"<seed>:<id>"`` and the lowest ranks are held out, so the split does not change when the lines are
    reordered (or a problem's other fields edited). Both lists keep the file's order.
    ProblemFileError (naming ``path``, the fraction and the counts) when a side would be empty."""
    count = len(problems)
    num_heldout = int(fraction * count + 0.5)
    if not 1 <= num_heldout <= count - 1:
        sides = f"{count - num_heldout} training and {num_heldout} held-out"
        raise ProblemFileError(
            [
                Issue(
                    os.fspath(path),
                    None,
                    None,
                    f"data.heldout_fraction={fraction!r} of its {count} problem(s) leaves {sides} problem(s): "
                    "each side needs at least 1 (change data.heldout_fraction, or give a held-out file as "
                    "data.heldout_path)",
                )
            ]
        )

    def rank(problem: Problem) -> tuple[str, str]:
        return hashlib.sha256(f"{seed}:{problem.id}".encode()).hexdigest(), problem.id

    heldout_ids = {p.id for p in sorted(problems, key=rank)[:num_heldout]}
    return [p for p in problems if p.id not in heldout_ids], [p for p in problems if p.id in heldout_ids]


def write_problems(path: str | os.PathLike[str], problems: Sequence[Problem]) -> None:
    """Write ``problems`` as a JSONL problem file (UTF-8, one object a line, fields in ``FIELDS`` order,
    None fields left out). Checked first with the reader's rules (a file it would refuse is not written);
    atomic: a temp file in the same folder, then a rename."""
    lines = [json.dumps(p.to_record(), ensure_ascii=False) for p in problems]
    parse_problem_lines(lines, path)
    atomic_write_text(path, "".join(line + "\n" for line in lines))
