"""The JSONL problem format (orchestrator.tasks.problems) and the demo's export in it
(python -m orchestrator.tasks.demo_export)."""

from __future__ import annotations

import hashlib
import json
import types

import pytest

from orchestrator.tasks import (
    MAX_ERRORS,
    CodeTest,
    Problem,
    ProblemFileError,
    check_disjoint,
    read_problems,
    stable_id,
    write_problems,
)

GOOD = '{"prompt": "1+1\\n", "answer": "2"}'

# (name, file lines, line of the first error, its field): every error names the file, the line, the field
MALFORMED = [
    ("bad json", [GOOD, '{"prompt": "2+2", "answer": '], 2, None),
    ("not an object", [GOOD, GOOD.replace("1+1", "3+3"), "[1, 2]"], 3, None),
    ("missing answer", ['{"prompt": "x"}'], 1, "answer"),
    ("missing prompt", ['{"answer": "4"}'], 1, "prompt"),
    (
        "prompt and messages",
        ['{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "answer": "1"}'],
        1,
        "prompt",
    ),
    ("answer and tests", ['{"prompt": "x", "answer": "1", "tests": [{"input": "", "output": "1"}]}'], 1, "answer"),
    ("wrong type", [GOOD, "", '{"prompt": "x", "answer": 42}'], 3, "answer"),
    ("empty string", ['{"prompt": "  ", "answer": "1"}'], 1, "prompt"),
    ("unknown field", ['{"prompt": "x", "answer": "1", "solution": "s"}'], 1, "solution"),
    ("bad role", ['{"messages": [{"role": "bot", "content": "hi"}], "answer": "1"}'], 1, "messages[0].role"),
    (
        "content not a string",
        ['{"messages": [{"role": "user", "content": 3}], "answer": "1"}'],
        1,
        "messages[0].content",
    ),
    (
        "last message not from the user",
        ['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "answer": "1"}'],
        1,
        "messages[1].role",
    ),
    ("empty tests", ['{"prompt": "x", "tests": []}'], 1, "tests"),
    ("test output not a string", ['{"prompt": "x", "tests": [{"input": "", "output": 1}]}'], 1, "tests[0].output"),
    ("difficulty 1.5", ['{"prompt": "x", "answer": "1", "difficulty": 1.5}'], 1, "difficulty"),
    ("difficulty true", ['{"prompt": "x", "answer": "1", "difficulty": true}'], 1, "difficulty"),
    ("pass_rate -0.1", ['{"prompt": "x", "answer": "1", "pass_rate": -0.1}'], 1, "pass_rate"),
    ("pass_rate a string", ['{"prompt": "x", "answer": "1", "pass_rate": "0.5"}'], 1, "pass_rate"),
    (
        "duplicate id",
        ['{"id": "a", "prompt": "x", "answer": "1"}', '{"id": "a", "prompt": "y", "answer": "1"}'],
        2,
        "id",
    ),
    ("duplicate prompt", [GOOD, '{"id": "b", "prompt": "1+1\\n", "answer": "2"}'], 2, "prompt"),
]


@pytest.mark.parametrize("lines,line,field", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_line_names_file_line_and_field(tmp_path, lines, line, field):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProblemFileError) as err:
        read_problems(path)
    e = err.value
    assert (e.path, e.line, e.field) == (str(path), line, field)
    assert f"{path}:{line}: " in str(e)
    if field is not None:
        assert f'field "{field}"' in str(e)


def test_error_message_says_what_was_expected(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "x", "answer": 42}\n')
    with pytest.raises(
        ProblemFileError, match=r'train\.jsonl:1: field "answer": expected a non-empty string, got 42 \(int\)'
    ):
        read_problems(path)
    path.write_text('{"prompt": "x", "answer": "1", "solution": "s"}\n')
    with pytest.raises(ProblemFileError, match=r"unknown field\(s\) \['solution'\]; allowed: \['id', 'prompt'"):
        read_problems(path)


def test_duplicates_name_both_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        GOOD + "\n" + '{"id": "x", "prompt": "5", "answer": "5"}\n{"id": "x", "prompt": "1+1\\n", "answer": "2"}\n'
    )
    with pytest.raises(ProblemFileError) as err:
        read_problems(path)
    assert err.value.num_errors == 2
    assert "the same prompt as line 1" in str(err.value) and "already used on line 2" in str(err.value)


def test_every_line_is_checked_and_errors_are_capped(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}", "answer": {i}}}\n' for i in range(MAX_ERRORS + 5)))
    with pytest.raises(ProblemFileError) as err:
        read_problems(path)
    assert err.value.num_errors == MAX_ERRORS + 5 and len(err.value.errors) == MAX_ERRORS
    assert err.value.line == 1 and "and 5 more" in str(err.value)


def test_empty_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(ProblemFileError, match="empty") as err:
        read_problems(path)
    assert err.value.path == str(path) and str(err.value).startswith(str(path))


def test_heldout_overlapping_train_names_line_and_file(tmp_path):
    train_path, heldout_path = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train_path.write_text('{"id": "t1", "prompt": "a", "answer": "1"}\n{"id": "t2", "prompt": "b", "answer": "2"}\n')
    heldout_path.write_text(
        '{"id": "h1", "prompt": "c", "answer": "3"}\n\n{"id": "h2", "prompt": "b", "answer": "2"}\n'
    )
    train, heldout = read_problems(train_path), read_problems(heldout_path)
    with pytest.raises(ProblemFileError) as err:
        check_disjoint(train, heldout, train_path, heldout_path)
    e = err.value
    assert (e.path, e.line, e.field) == (str(heldout_path), 3, "prompt")
    assert '"h2"' in str(e) and f"{train_path}:2" in str(e)
    same_id = [Problem("t1", prompt="z", answer="0")]
    with pytest.raises(ProblemFileError) as err:
        check_disjoint(train, same_id, train_path, heldout_path)
    assert (err.value.line, err.value.field) == (1, "id")
    check_disjoint(train, heldout[:1], train_path, heldout_path)


def test_good_file_round_trips(tmp_path):
    path = tmp_path / "mixed.jsonl"
    records = [
        {"id": "m1", "prompt": "What is 2+3?", "answer": "5", "difficulty": 0.25},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*6?"}], "answer": "42"},
        {
            "id": "c1",
            "prompt": "Print the sum of two ints.",
            "tests": [{"input": "1 2\n", "output": "3\n"}],
            "difficulty": 1,
        },
        {
            "messages": [{"role": "user", "content": "Echo stdin."}],
            "tests": [{"input": "", "output": ""}],
            "difficulty": 0,
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    problems = read_problems(path)
    assert [p.kind for p in problems] == ["math", "math", "code", "code"]
    assert [p.line for p in problems] == [1, 2, 3, 4]
    assert problems[2].tests == (CodeTest("1 2\n", "3\n"),) and problems[2].difficulty == 1.0
    assert problems[1].id == stable_id(messages=records[1]["messages"])
    out = tmp_path / "sub" / "out.jsonl"
    out.parent.mkdir()
    write_problems(out, problems)
    assert read_problems(out) == problems
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]  # no temp file left
    first = json.loads(out.read_text().splitlines()[0])
    assert list(first) == ["id", "prompt", "answer", "difficulty"]


def test_write_refuses_what_read_would_refuse(tmp_path):
    out = tmp_path / "dup.jsonl"
    with pytest.raises(ProblemFileError, match="already used"):
        write_problems(out, [Problem("a", prompt="x", answer="1"), Problem("a", prompt="y", answer="2")])
    assert not out.exists()


def test_stable_ids_are_stable():
    expected = hashlib.sha256(b'{"prompt":"1+1\\n"}').hexdigest()[:16]
    assert stable_id(prompt="1+1\n") == stable_id(prompt="1+1\n") == expected
    messages = [{"role": "user", "content": "hi"}]
    assert stable_id(messages=messages) == stable_id(messages=[{"content": "hi", "role": "user"}])
    assert stable_id(prompt="hi") != stable_id(messages=messages)


def test_demo_export_is_the_demos_own_split(tmp_path, capsys):
    from demo import task
    from orchestrator.config import DataConfig
    from orchestrator.data import heldout_set
    from orchestrator.tasks.demo_export import main

    assert main(["--out", str(tmp_path), "--num-train", "64", "--seed", "3"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and "train.jsonl (64" in printed[0] and "heldout.jsonl" in printed[0]
    train, heldout = read_problems(tmp_path / "train.jsonl"), read_problems(tmp_path / "heldout.jsonl")
    check_disjoint(train, heldout, tmp_path / "train.jsonl", tmp_path / "heldout.jsonl")
    assert len(train) == 64 and all(p.kind == "math" and 0 <= p.difficulty <= 1 for p in train + heldout)
    demo_heldout = heldout_set(DataConfig())
    assert [(p.prompt, p.answer) for p in heldout] == [(p.prompt, p.answer) for p in demo_heldout]
    for exported, original in zip(heldout, demo_heldout):
        assert task.is_correct(original, task.solution_text(original))
        assert exported.difficulty == (original.level - 1) / 6
    assert not any(task.is_heldout(types.SimpleNamespace(id=p.prompt.strip())) for p in train)  # the training split
