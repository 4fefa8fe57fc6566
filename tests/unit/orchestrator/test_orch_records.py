"""The record checks problem files and SFT files share (ckpt_common.records), and the job config
flags the RL job, curation and long2short share (orchestrator.tasks.factory.add_job_config_args)."""

from __future__ import annotations

import argparse

import pytest

from ckpt_common.records import Collector, ProblemFileError, got, is_text, json_object_lines
from orchestrator.tasks.factory import add_job_config_args, add_task_args


class Sink:
    def __init__(self) -> None:
        self.issues: list[tuple[int | None, str | None, str]] = []

    def add(self, line: int | None, field: str | None, message: str) -> None:
        self.issues.append((line, field, message))


def test_json_object_lines_yields_objects_and_reports_the_rest_by_line():
    sink = Sink()
    lines = ['{"a": 1}', "", "   ", "[1, 2]", "{nope", '{"a": 1, "a": 2}', '{"b": "x"}']
    assert list(json_object_lines(lines, sink)) == [(1, {"a": 1}), (7, {"b": "x"})]
    assert [(line, field) for line, field, _ in sink.issues] == [(4, None), (5, None), (6, None)]
    assert sink.issues[0][2] == "expected a JSON object {...}, got [1, 2] (list)"
    assert sink.issues[1][2].startswith("invalid JSON: ")
    assert sink.issues[2][2] == 'invalid JSON: field "a" appears twice'


def test_got_and_is_text():
    assert got(42) == "got 42 (int)"
    assert got(None) == "got null (null)"
    assert got({"k": []}) == 'got {"k": []} (object)'
    assert got(object).startswith("got <class 'object'> (")
    long = got("x" * 100)
    assert long == f'got "{"x" * 56}... (string)'
    assert is_text("a") and not is_text("  ") and not is_text("") and not is_text(3)


def test_the_collector_is_a_sink_that_raises_one_problem_file_error():
    errors = Collector("f.jsonl")
    assert list(json_object_lines(["[]", "1"], errors)) == []
    with pytest.raises(ProblemFileError) as e:
        errors.raise_if_any()
    assert e.value.errors == (
        "f.jsonl:1: expected a JSON object {...}, got [] (list)",
        "f.jsonl:2: expected a JSON object {...}, got 1 (int)",
    )


def _flag_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}


def test_the_job_config_flags_are_defined_once_for_the_job_and_the_commands_around_it():
    job = argparse.ArgumentParser()
    add_job_config_args(job, example="rl.num_iterations=40")
    command = argparse.ArgumentParser()
    add_task_args(command, "any task", example="rl.num_iterations=40")
    assert {k: v for k, v in _flag_help(job).items() if k != "-h"} == {
        k: v for k, v in _flag_help(command).items() if k != "-h"
    }
    args = command.parse_args(["--config", "job.json", "--set", "a.b=1", "--set", "c=x"])
    assert (args.config, args.overrides) == ("job.json", ["a.b=1", "c=x"])
    args = job.parse_args([])
    assert (args.config, args.overrides) == (None, [])


def test_the_rl_job_and_curation_show_the_same_flag_help(capsys):
    from orchestrator import __main__ as rl_job
    from orchestrator import curation

    def help_of(parse) -> str:
        with pytest.raises(SystemExit):
            parse(["--help"])
        return " ".join(capsys.readouterr().out.split())

    job, cur = help_of(rl_job.parse_args), help_of(curation.parse_args)
    for text in (
        "--config CONFIG RL job config, a JSON file (default: built-in defaults)",
        "(value parsed as JSON, else taken as a string); repeatable",
    ):
        assert text in job and text in cur
    assert "--set rl.num_iterations=40" in job and "--set data.chat_template=true" in cur
