"""Prompt sets as RL users hold them (orchestrator.tasks.fields, ckpt_common.tables): one small file per
shape (GSM8K-style JSONL, MATH-style parquet with \\boxed{}, verl-style parquet with nested columns,
an APPS-style code set with input_output, a save_to_disk folder with splits, CSV), each read through
the job's config, mapped, and scored by the job's reward on known right and wrong answers; bad rows of
each shape refused by file:row and column."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import pytest

from ckpt_common.records import Collector
from orchestrator.config import RewardConfig, load_config
from orchestrator.tasks import ProblemFileError
from orchestrator.tasks.factory import check_data_files, make_task
from orchestrator.tasks.fields import FieldsConfig, code_tests, last_boxed
from orchestrator.tasks.file_task import FileReward
from orchestrator.tasks.problems import read_problems
from trainer.sft_file import read_sft_examples

GSM8K = [
    {"question": "Tom has 3 bags of 24 apples. How many apples?", "answer": "3 bags * 24 = <<3*24=72>>72\n#### 72"},
    {"question": "A shirt costs $1,000 plus $10. Price?", "answer": "1000 + 10 = 1010\n#### 1,010"},
    {"question": "Half of 14?", "answer": "14 / 2 = 7\n#### 7"},
]
MATH = [
    {"problem": "Simplify 2/4.", "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "What is 3^2?", "solution": "$3^2 = 9$, so the answer is $\\boxed{9}$.", "level": "Level 2"},
    {"problem": "Solve x+1=3.", "solution": "First \\boxed{1} was wrong; x = \\boxed{2}", "level": "Level 1"},
]


def _verl(index: int, question: str, answer: str | None) -> dict:
    return {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index},
    }


def _apps(question: str, input_output, fn_name: str | None = None) -> dict:
    io = (
        input_output
        if isinstance(input_output, str)
        else json.dumps({**input_output, "fn_name": fn_name} if fn_name else input_output)
    )
    return {"problem_id": question[:8], "question": question, "input_output": io, "difficulty": "interview"}


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(train: str, heldout: str, *extra: str):
    return load_config(None, [f"data.train_path={train}", f"data.heldout_path={heldout}", *extra])


class RunsPrograms:
    """The code reward's stand-in: 1.0 when the program prints each test's output on its input."""

    def __call__(self, problem, response_text):
        code = response_text.split("```python\n", 1)[1].split("```", 1)[0]
        for case in problem["test_cases"]:
            out = subprocess.run(
                [sys.executable, "-c", code], input=case["input"], capture_output=True, text=True, timeout=30
            )
            if out.stdout != case["output"]:
                return 0.0
        return 1.0


def _score(task, problem, response: str) -> float:
    return task.make_reward_fn(RewardConfig())(problem, response)


# -- each shape: read, mapped, scored ------------------------------------------------------------------


def test_a_gsm8k_style_jsonl_file_is_mapped_and_its_final_answers_scored(tmp_path):
    train, heldout = _jsonl(tmp_path / "train.jsonl", GSM8K[:2]), _jsonl(tmp_path / "test.jsonl", GSM8K[2:])
    config = _run(train, heldout, "data.fields.prompt=question", "data.fields.answer_format=gsm8k")
    task = make_task(config)
    problems = task.train_problems()
    assert [p.answer for p in problems] == ["72", "1010"]  # after "####"; "1,000"-style separators dropped
    assert problems[0].prompt == GSM8K[0]["question"] and problems[0].id  # an id derived from the content
    assert _score(task, problems[0], "3 * 24 is 72.\n#### 72") == 1.0
    assert _score(task, problems[0], "#### 71") == 0.0
    assert [p.answer for p in task.heldout_problems()] == ["7"]


def test_a_math_style_parquet_file_takes_the_last_boxed_answer_with_nested_braces(tmp_path):
    datasets.Dataset.from_list(MATH).to_parquet(tmp_path / "math.parquet")
    config = load_config(
        None,
        [
            f"data.train_path={tmp_path / 'math.parquet'}",
            "data.heldout_fraction=0.34",
            "data.fields.prompt=problem",
            "data.fields.answer=solution",
            "data.fields.answer_format=boxed",
        ],
    )
    task = make_task(config)
    by_prompt = {p.prompt: p for p in [*task.train_problems(), *task.heldout_problems()]}
    assert by_prompt["Simplify 2/4."].answer == "\\frac{1}{2}" and by_prompt["Solve x+1=3."].answer == "2"
    half = by_prompt["Simplify 2/4."]
    assert _score(task, half, "#### \\frac{1}{2}") == 1.0 and _score(task, half, "#### 0.5") == 1.0
    assert _score(task, half, "#### \\frac{1}{3}") == 0.0
    assert last_boxed("a \\boxed{\\{x\\}} b") == "\\{x\\}" and last_boxed("\\boxed{x") is None


def test_a_verl_style_parquet_file_maps_nested_columns_and_chat_prompts(tmp_path):
    rows = [_verl(0, "What is 2+2?", "4"), _verl(1, "What is 5*5?", "25"), _verl(2, "What is 9-3?", "6")]
    datasets.Dataset.from_list(rows[:2]).to_parquet(tmp_path / "train.parquet")
    datasets.Dataset.from_list(rows[2:]).to_parquet(tmp_path / "test.parquet")
    config = _run(
        str(tmp_path / "train.parquet"),
        str(tmp_path / "test.parquet"),
        "data.chat_template=true",
        "data.fields.prompt=null",
        "data.fields.messages=prompt",
        "data.fields.answer=reward_model.ground_truth",
        "data.fields.id=extra_info.index",
        "data.fields.system_prompt=Answer after ####.",
    )
    task = make_task(config)
    first = task.train_problems()[0]
    assert first.id == "0" and first.answer == "4" and first.messages[0]["content"] == "What is 2+2?"
    assert task.messages(first) == [
        {"role": "system", "content": "Answer after ####."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert _score(task, first, "2 and 2 make #### 4") == 1.0 and _score(task, first, "#### 5") == 0.0


def test_an_apps_style_code_set_reads_input_output_and_is_scored_by_running_programs(tmp_path):
    rows = [
        _apps("Read n, print 2n.", {"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]}),
        _apps("Print the sum of two numbers.", {"inputs": [["1 2"]], "outputs": [["3"]]}),  # lists of lines
    ]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "apps.parquet")
    problems = read_problems(
        tmp_path / "apps.parquet",
        FieldsConfig(prompt="question", tests="input_output", id="problem_id", difficulty=None),
    )
    assert [len(p.tests) for p in problems] == [2, 1]
    assert (problems[1].tests[0].input, problems[1].tests[0].output) == ("1 2\n", "3\n")
    reward = FileReward(math=None, code=RunsPrograms())
    assert reward(problems[0], "```python\nprint(2 * int(input()))\n```") == 1.0
    assert reward(problems[0], "```python\nprint(3 * int(input()))\n```") == 0.0


def test_a_save_to_disk_folder_gives_its_splits_to_training_and_held_out(tmp_path):
    rows = [{"question": q["question"], "answer": q["answer"]} for q in GSM8K]
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[:2]), test=datasets.Dataset.from_list(rows[2:])
    ).save_to_disk(tmp_path / "gsm8k")
    folder = str(tmp_path / "gsm8k")
    mapping = ["data.fields.prompt=question", "data.fields.answer_format=gsm8k"]
    task = make_task(_run(folder, folder, "data.train_split=train", "data.heldout_split=test", *mapping))
    assert [p.answer for p in task.train_problems()] == ["72", "1010"] and [
        p.answer for p in task.heldout_problems()
    ] == ["7"]
    assert task.where(task.heldout_problems()[0]) == f"{folder}[test]:1"
    with pytest.raises(ProblemFileError, match=r"gsm8k: the source has splits \['train', 'test'\]: name one"):
        check_data_files(_run(folder, folder, *mapping))
    with pytest.raises(ProblemFileError, match=r"gsm8k\[dev\]: no split 'dev'; the source has \['train', 'test'\]"):
        check_data_files(_run(folder, folder, "data.train_split=train", "data.heldout_split=dev", *mapping))


def test_a_csv_file_with_text_cells_reads_numbers_and_plain_answers(tmp_path):
    (tmp_path / "train.csv").write_text("q,a,hardness\nWhat is 6*7?,42,0.8\nWhat is 1+1?,2,0.1\n")
    (tmp_path / "test.csv").write_text("q,a,hardness\nWhat is 3+3?,6,0.5\n")
    fields = ["data.fields.prompt=q", "data.fields.answer=a", "data.fields.difficulty=hardness"]
    task = make_task(_run(str(tmp_path / "train.csv"), str(tmp_path / "test.csv"), *fields))
    first = task.train_problems()[0]
    assert (first.answer, first.difficulty) == ("42", 0.8)
    assert _score(task, first, "#### 42") == 1.0 and _score(task, first, "#### 24") == 0.0


def test_the_jobs_defaults_run_a_users_file():
    """Nothing demo-only trips a problem set: the defaults' curriculum is on the one [0, 1] scale."""
    assert 0 < load_config(None, []).sampling.curriculum.min_difficulty < 1


# -- bad rows, refused by name ------------------------------------------------------------------------

BAD_ROWS = [
    # (shape, rows, fields, file type, row, column, text)
    (
        "gsm8k without ####",
        [GSM8K[0], {"question": "x?", "answer": "no marker"}],
        {"prompt": "question", "answer_format": "gsm8k"},
        "jsonl",
        2,
        "answer",
        'ending "#### <answer>"',
    ),
    (
        "boxed not closed",
        [MATH[0], {"problem": "p", "solution": "so \\boxed{\\frac{1}{2}"}],
        {"prompt": "problem", "answer": "solution", "answer_format": "boxed"},
        "parquet",
        2,
        "solution",
        "an unclosed brace",
    ),
    (
        "boxed missing",
        [{"problem": "p", "solution": "the answer is 3"}],
        {"prompt": "problem", "answer": "solution", "answer_format": "boxed"},
        "parquet",
        1,
        "solution",
        "none found",
    ),
    (
        "verl without ground truth",
        [_verl(0, "q?", "1"), _verl(1, "q2?", None)],
        {"prompt": None, "messages": "prompt", "answer": "reward_model.ground_truth", "id": "extra_info.index"},
        "parquet",
        2,
        "reward_model.ground_truth",
        'missing: expected "answer"',
    ),
    (
        "apps json does not parse",
        [_apps("q", "{not json")],
        {"prompt": "question", "tests": "input_output", "difficulty": None},
        "parquet",
        1,
        "input_output",
        "does not parse",
    ),
    (
        "apps call-based",
        [_apps("q", {"inputs": [[1]], "outputs": [2]}, fn_name="solve")],
        {"prompt": "question", "tests": "input_output", "difficulty": None},
        "parquet",
        1,
        "input_output",
        "call-based tests (fn_name 'solve')",
    ),
    (
        "apps uneven lists",
        [_apps("q", {"inputs": ["1\n"], "outputs": []})],
        {"prompt": "question", "tests": "input_output", "difficulty": None},
        "parquet",
        1,
        "input_output",
        "same length",
    ),
    (
        "csv difficulty not a number",
        [{"q": "a?", "a": "1", "d": "hard"}],
        {"prompt": "q", "answer": "a", "difficulty": "d"},
        "csv",
        1,
        "d",
        "expected a number in [0, 1]",
    ),
    (
        "apps difficulty is a label",
        [_apps("q", {"inputs": ["1\n"], "outputs": ["1\n"]})],
        {"prompt": "question", "tests": "input_output"},
        "parquet",
        1,
        "difficulty",
        'got "interview"',
    ),
]


@pytest.mark.parametrize(
    ("shape", "rows", "fields", "kind", "row", "column", "text"), BAD_ROWS, ids=[c[0] for c in BAD_ROWS]
)
def test_a_bad_row_is_named_by_file_row_and_column(tmp_path, shape, rows, fields, kind, row, column, text):
    path = tmp_path / f"set.{kind}"
    if kind == "jsonl":
        _jsonl(path, rows)
    else:
        table = datasets.Dataset.from_list(rows)
        table.to_parquet(path) if kind == "parquet" else table.to_csv(path, index=False)
    with pytest.raises(ProblemFileError) as e:
        read_problems(path, FieldsConfig(**fields))
    assert (e.value.path, e.value.line, e.value.field) == (str(path), row, column), e.value.errors
    assert text in e.value.errors[0] and e.value.errors[0].startswith(f'{path}:{row}: field "{column}": '), (
        e.value.errors
    )


def test_bad_rows_can_be_skipped_and_counted_instead(tmp_path, caplog):
    rows = [GSM8K[0], {"question": "no answer?", "answer": "none"}, GSM8K[1], {"question": "x", "answer": "#### "}]
    path = _jsonl(tmp_path / "gsm.jsonl", rows)
    problems = read_problems(path, FieldsConfig(prompt="question", answer_format="gsm8k", bad_rows="skip"))
    assert [p.answer for p in problems] == ["72", "1010"] and [p.line for p in problems] == [1, 3]
    assert "skipped 2 row(s)" in caplog.text and f"{path}:2" in caplog.text
    with pytest.raises(ProblemFileError, match="all 2 rows were skipped"):
        read_problems(
            _jsonl(tmp_path / "bad.jsonl", rows[1::2]),
            FieldsConfig(prompt="question", answer_format="gsm8k", bad_rows="skip"),
        )


def test_a_table_without_the_mapped_columns_lists_the_columns_it_has(tmp_path):
    datasets.Dataset.from_list(MATH).to_parquet(tmp_path / "math.parquet")
    with pytest.raises(
        ProblemFileError, match=r"no column 'answer' or 'tests'.*its columns: \['problem', 'solution', 'level'\]"
    ):
        read_problems(tmp_path / "math.parquet", FieldsConfig(prompt="problem"))


def test_nothing_is_downloaded_a_hub_name_says_how_to_fetch_it_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ProblemFileError, match=r"openai/gsm8k: .*Hub name, and nothing is downloaded at run time: download it first"
    ):
        check_data_files(_run("openai/gsm8k", "openai/gsm8k"))
    with pytest.raises(ProblemFileError, match=r"notes.txt: unknown file type '.txt'"):
        (tmp_path / "notes.txt").write_text("x")
        read_problems(tmp_path / "notes.txt")


def test_the_mapping_is_checked_in_the_config():
    with pytest.raises(ValueError, match=r"data.fields.answer_format='latex' must be one of"):
        load_config(None, ["data.train_path=t.jsonl", "data.heldout_fraction=0.5", "data.fields.answer_format=latex"])
    with pytest.raises(ValueError, match=r"data.fields.system_prompt is a system turn.*data.chat_template=true"):
        load_config(
            None, ["data.train_path=t.jsonl", "data.heldout_fraction=0.5", "data.fields.system_prompt=Be brief."]
        )
    with pytest.raises(ValueError, match=r"data.fields applies to problem files only"):
        load_config(None, ["data.fields.prompt=question"])
    with pytest.raises(ValueError, match=r"data.fields.prompt and data.fields.messages are both null"):
        FieldsConfig(prompt=None, messages=None)


def test_code_tests_in_this_projects_shape_pass_through_and_others_are_named():
    errors = Collector("set.parquet")
    assert code_tests([{"input": "1", "output": "1"}], "tests", 1, errors) == [{"input": "1", "output": "1"}]
    assert code_tests({"inputs": ["a"], "outputs": ["b"]}, "io", 1, errors) == [{"input": "a", "output": "b"}]
    assert code_tests(42, "io", 3, errors) is None and errors.issues[0].line == 3 and errors.issues[0].field == "io"


# -- the SFT file, through the same readers ------------------------------------------------------------


def test_an_sft_parquet_file_with_its_own_column_names(tmp_path):
    rows = [{"question": "What is 2+2?", "solution": "#### 4"}, {"question": "Double 3.", "solution": ""}]
    datasets.Dataset.from_list(rows[:1]).to_parquet(tmp_path / "sft.parquet")
    examples = read_sft_examples(tmp_path / "sft.parquet", {"prompt": "question", "response": "solution"})
    assert [(e.prompt, e.response, e.line) for e in examples] == [("What is 2+2?", "#### 4", 1)]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ProblemFileError, match=r'bad.parquet:2: field "solution": expected a non-empty string'):
        read_sft_examples(tmp_path / "bad.parquet", {"prompt": "question", "response": "solution"})


def test_curation_reads_a_mapped_set_and_its_problems_out_is_this_projects_format(tmp_path):
    """Curation's input is named as the job names its files (job_sections with the command's own file);
    what --problems-out writes (write_problems) is read back by the job with the default mapping."""
    from orchestrator.tasks.factory import file_task_from_sections, job_sections
    from orchestrator.tasks.problems import write_problems

    datasets.Dataset.from_list(GSM8K).to_parquet(tmp_path / "gsm8k.parquet")
    overrides = ["data.fields.prompt=question", "data.fields.answer_format=gsm8k"]
    data, reward = job_sections(None, overrides, tmp_path / "gsm8k.parquet")
    source = file_task_from_sections(data, reward, tmp_path / "gsm8k.parquet")
    assert [p.answer for p in source.train_problems()] == ["72", "1010", "7"] and not source.heldout_problems()
    write_problems(tmp_path / "kept.jsonl", source.train_problems())
    assert read_problems(tmp_path / "kept.jsonl") == list(source.train_problems())
