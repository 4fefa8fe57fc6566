"""The task interface (orchestrator.tasks): the demo and problem files behind it, the job config's
data section (data.train_path, data.heldout_path, ...) and its checks before anything starts, and the
loop's data path on the demo's own export."""

from __future__ import annotations

import json
import pathlib

import pytest

from demo import task as demo
from orchestrator.config import DataConfig, RewardConfig, load_config
from orchestrator.tasks import ProblemFileError
from orchestrator.tasks.base import PromptTooLongError, Task
from orchestrator.tasks.demo_task import DemoTask, demo_difficulty
from orchestrator.tasks.factory import check_data_files, make_task
from orchestrator.tasks.file_task import FileReward, FileTask

MATH = {"id": "m1", "prompt": "What is 2+3?", "answer": "5", "difficulty": 0.2}
MATH2 = {"prompt": "What is 7*6?", "answer": "42"}
CODE = {"id": "c1", "prompt": "Print the sum.", "tests": [{"input": "1 2\n", "output": "3\n"}]}
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "9-4?"}], "answer": "5"}
DEMO_CONFIG = pathlib.Path(__file__).resolve().parents[3] / "configs" / "demo.json"
FILE_RUN = ["sampling.curriculum.min_difficulty=0.3"]  # difficulties of problem files are in [0, 1]


def _write(path: pathlib.Path, *records) -> pathlib.Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _files(tmp_path, train=(MATH, MATH2), heldout=({"prompt": "1+1?", "answer": "2"},)) -> list[str]:
    t = _write(tmp_path / "train.jsonl", *train)
    h = _write(tmp_path / "heldout.jsonl", *heldout)
    return [f"data.train_path={t}", f"data.heldout_path={h}", *FILE_RUN]


class CharTokenizer:
    """A tokenizer stand-in: one id per character, a BOS id 1 unless told not to; a chat template if given one."""

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template
        self.name_or_path = "char"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


# -- config: the data section's own checks (no file read) ------------------------------------------

BAD_CONFIG = [
    (["data.train_path=t.jsonl"], "data.train_path is set but data.heldout_path is not"),
    (["data.heldout_path=h.jsonl"], "data.heldout_path is set but data.train_path is not"),
    (["data.train_path="], "data.train_path='' must be the path"),
    (["data.chat_template=true"], "data.chat_template applies to problem files only"),
    (["data.answer_markers=[]"], "data.answer_markers applies to problem files only"),
    (["data.prompt_template=Q: {prompt}"], "data.prompt_template applies to problem files only"),
    (["data.prompt_template=no field"], "data.prompt_template: 'no field' must contain {prompt}"),
    (["data.prompt_template={prompt} {other}"], "no other field (found ['other'])"),
    (["data.prompt_template={prompt"], "is not a format string"),
    (["data.answer_markers=['####', '']"], "data.answer_markers="),
    (["data.chat_template=1"], "data.chat_template=1 must be true or false"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIG, ids=[m for _, m in BAD_CONFIG])
def test_bad_data_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_one_difficulty_scale_serves_the_demo_and_files(tmp_path):
    """A user's file runs with the job's defaults (no demo-only setting trips it); a level (3) where the
    [0, 1] scale is meant is refused for the demo and files alike, naming the level's place on it."""
    files = _files(tmp_path)[:2]
    assert load_config(None, files).data.uses_files  # the defaults fit a file
    for overrides in ([], files):
        with pytest.raises(ValueError, match=r"min_difficulty=3(\.0)? must be in \[0, 1\].*level 3 and up is 0.33"):
            load_config(None, [*overrides, "sampling.curriculum.min_difficulty=3"])
    config = load_config(DEMO_CONFIG, _files(tmp_path))
    assert config.data.train_path.endswith("train.jsonl") and config.data.answer_markers == ("####",)


# -- config: problem files checked before anything starts -------------------------------------------

# (name, train lines, held-out lines, extra overrides, file of the first error, its line, its field, text)
BAD_FILES = [
    ("bad line", [MATH], [MATH2, '{"prompt": "x", "answer": 42}'], [], "heldout", 2, "answer", "expected a non-empty"),
    ("bad json", ["{", MATH], [MATH2], [], "train", 1, None, "invalid JSON"),
    ("empty file", [], [MATH2], [], "train", None, None, "the file is empty"),
    ("unknown field", [{**MATH, "level": 3}], [MATH2], [], "train", 1, "level", "unknown field"),
    (
        "same prompt",
        [MATH, MATH2],
        [{"id": "h", "prompt": MATH2["prompt"], "answer": "1"}],
        [],
        "heldout",
        1,
        "prompt",
        "also a",
    ),
    ("same id", [MATH], [{**MATH2, "id": "m1"}], [], "heldout", 1, "id", 'held-out problem "m1" is also'),
    ("messages, no chat", [MATH, CHAT], [MATH2], [], "train", 2, "messages", "data.chat_template=true"),
    ("code, no sandbox", [MATH], [MATH2, CODE], [], "heldout", 2, "tests", "reward.sandbox_url"),
]


@pytest.mark.parametrize(
    "train, heldout, extra, where, line, field, text",
    [case[1:] for case in BAD_FILES],
    ids=[case[0] for case in BAD_FILES],
)
def test_a_bad_problem_file_is_refused_naming_file_line_and_field(
    tmp_path, train, heldout, extra, where, line, field, text
):
    paths = {"train": _write(tmp_path / "train.jsonl", *train), "heldout": _write(tmp_path / "heldout.jsonl", *heldout)}
    overrides = [f"data.train_path={paths['train']}", f"data.heldout_path={paths['heldout']}", *FILE_RUN, *extra]
    with pytest.raises(ProblemFileError) as e:
        check_data_files(load_config(None, overrides))
    assert (e.value.path, e.value.line, e.value.field) == (str(paths[where]), line, field)
    first = e.value.errors[0]
    assert first.startswith(f"{paths[where]}:{line}: " if line else f"{paths[where]}: ") and text in first, first


def test_a_missing_file_names_its_setting(tmp_path):
    overrides = _files(tmp_path)
    overrides[1] = f"data.heldout_path={tmp_path / 'nowhere.jsonl'}"
    with pytest.raises(ProblemFileError, match=r"nowhere.jsonl: no such file or folder: check data.heldout_path"):
        check_data_files(load_config(None, overrides))


def test_the_job_command_stops_on_a_bad_file_before_anything_starts(tmp_path, capsys):
    from orchestrator.__main__ import main

    overrides = _files(tmp_path, heldout=('{"prompt": "1+1?"}',))
    argv = ["--output-dir", str(tmp_path / "run"), *[a for o in overrides for a in ("--set", o)]]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f'error: {tmp_path / "heldout.jsonl"}:1: field "answer": missing: expected "answer" (a string, math) '
        'or "tests" (a list, code)\n'
    )
    assert not (tmp_path / "run").exists()
    assert main([*argv[:2], "--print-config", *argv[2:]]) == 2  # even the printed config waits for valid files


def test_messages_and_code_pass_with_their_settings(tmp_path):
    overrides = _files(tmp_path, train=(MATH, CHAT, CODE))
    config = load_config(None, [*overrides, "data.chat_template=true", "reward.sandbox_url=http://127.0.0.1:1"])
    assert isinstance(make_task(config), FileTask)


# -- the two tasks behind one interface -------------------------------------------------------------


def test_the_demo_task_is_the_job_without_files():
    from orchestrator import data

    config = load_config(None, ["data.num_train_problems=32", "data.num_heldout_per_level=4"])
    task = make_task(config)
    assert isinstance(task, DemoTask) and isinstance(task, Task) and task.compares_with_sft
    assert [p.id for p in task.train_problems()] == [p.id for p in data.train_pool(config.data)]
    assert [p.id for p in task.heldout_problems()] == [p.id for p in data.heldout_set(config.data)]
    problem = task.heldout_problems()[0]
    assert task.prompt_text(problem) == problem.prompt and task.reference(problem) == problem.answer
    assert task.difficulty(problem) == (problem.level - 1) / 6 and task.level_of(problem) == problem.level
    # the curriculum's default splits the demo's levels where it always did: levels 3-7 are hard
    hard = config.sampling.curriculum.min_difficulty
    assert [level for level in range(1, 8) if demo_difficulty(level) >= hard] == [3, 4, 5, 6, 7]
    assert task.encode(problem, CharTokenizer()) == [1, *map(ord, problem.prompt)]
    reward = task.make_reward_fn(RewardConfig())
    assert reward(problem, demo.solution_text(problem)) == 1.0 and reward(problem, "#### -1") == 0.0
    assert task.direct_answer_prefix == "#### "


# (template, chat, problem, rendered prompt, token ids: BOS added?)
RENDER = [
    ("{prompt}", False, MATH, "What is 2+3?", True),
    ("Question: {prompt}\nAnswer:", False, MATH, "Question: What is 2+3?\nAnswer:", True),
    ("{{literal}} {prompt}", False, MATH, "{literal} What is 2+3?", True),
    ("Q: {prompt}", True, MATH, "<user>Q: What is 2+3?<assistant>", False),
    ("Q: {prompt}", True, CHAT, "<system>Be brief.<user>9-4?<assistant>", False),  # messages: as written
]


@pytest.mark.parametrize("template, chat, record, text, bos", RENDER)
def test_file_prompts_render_through_the_template_or_the_chat_template(tmp_path, template, chat, record, text, bos):
    train = _write(tmp_path / "t.jsonl", record)
    task = FileTask(train, _write(tmp_path / "h.jsonl", MATH2), prompt_template=template, chat_template=chat)
    problem = task.train_problems()[0]
    tokenizer = CharTokenizer(chat_template="{{ messages }}" if chat else None)
    assert task.prompt_text(problem, tokenizer) == text
    assert task.encode(problem, tokenizer) == [1] * bos + [ord(c) for c in text]


def test_a_chat_template_the_tokenizer_lacks_is_a_clear_error(tmp_path):
    task = FileTask(_write(tmp_path / "t.jsonl", MATH), _write(tmp_path / "h.jsonl", MATH2), chat_template=True)
    with pytest.raises(ValueError, match="has no chat template: set data.chat_template=false"):
        task.encode(task.train_problems()[0], CharTokenizer())


def test_file_problems_give_reference_difficulty_level_and_where(tmp_path):
    train = _write(tmp_path / "t.jsonl", MATH, CODE)
    task = FileTask(train, _write(tmp_path / "h.jsonl", MATH2))
    math, code = task.train_problems()
    (held,) = task.heldout_problems()
    assert task.reference(math) == "5" and task.reference(code)[0].output == "3\n"
    assert (task.difficulty(math), task.level_of(math)) == (0.2, 20)
    assert (task.difficulty(held), task.level_of(held)) == (1.0, -1)  # unknown: hard, its own bucket
    assert task.where(code) == f"{train}:2" and task.where(held) == f"{tmp_path / 'h.jsonl'}:1"
    assert not task.compares_with_sft and task.direct_answer_prefix == "#### "


# (answer markers, response, reward)
MATH_REWARDS = [
    (("####",), "2+3 is five\n#### 5", 1.0),
    (("####",), "#### 5.0", 1.0),  # math-verify: equal values
    (("####",), "#### 6", 0.0),
    (("####",), "5", 0.0),  # no marker: no answer
    (("Answer:",), "so... Answer: 5", 1.0),
    ((), "the sum is \\boxed{5}", 1.0),  # no marker: math-verify reads the whole response
]


@pytest.mark.parametrize("markers, response, expected", MATH_REWARDS)
def test_math_rewards_read_the_answer_after_the_tasks_marker(tmp_path, markers, response, expected):
    task = FileTask(_write(tmp_path / "t.jsonl", MATH), _write(tmp_path / "h.jsonl", MATH2), answer_markers=markers)
    assert task.make_reward_fn(RewardConfig())(task.train_problems()[0], response) == expected
    assert task.direct_answer_prefix == (f"{markers[0]} " if markers else "")


@pytest.mark.parametrize("chat", [False, True])
def test_the_direct_answer_prompt_is_the_prompt_and_the_tasks_marker(tmp_path, chat):
    """Curation's easy-to-hack probe: the rendered prompt followed by direct_answer_prefix, encoded as the
    prompt is (no BOS after a chat template); is_correct: the reward against reward.correct_threshold."""
    train, held = _write(tmp_path / "t.jsonl", MATH), _write(tmp_path / "h.jsonl", MATH2)
    task = FileTask(train, held, chat_template=chat, answer_markers=("Answer:",))
    problem = task.train_problems()[0]
    tokenizer = CharTokenizer(chat_template="{{ messages }}" if chat else None)
    text = task.prompt_text(problem, tokenizer) + "Answer: "
    assert task.encode_direct_answer(problem, tokenizer) == [1] * (not chat) + [ord(c) for c in text]
    assert task.make_is_correct(RewardConfig())(problem, "Answer: 5")
    assert not task.make_is_correct(RewardConfig())(problem, "#### 5")
    assert not task.make_is_correct(RewardConfig(correct_threshold=1.5))(problem, "Answer: 5")
    demo_task = DemoTask(DataConfig(num_heldout_per_level=1))
    demo_problem = demo_task.heldout_problems()[0]
    assert demo_task.encode_direct_answer(demo_problem, CharTokenizer()) == [
        1,
        *map(ord, demo_problem.prompt + "#### "),
    ]


def test_one_file_whole_is_a_task_with_no_held_out_problems(tmp_path):
    from orchestrator.tasks.factory import file_task_from_sections, job_sections

    path = _write(tmp_path / "in.jsonl", MATH, MATH2, CHAT)
    data, reward = job_sections(None, ["data.chat_template=true", 'data.answer_markers=["Answer:"]'], path)
    task = file_task_from_sections(data, reward, path)
    assert [p.line for p in task.train_problems()] == [1, 2, 3] and list(task.heldout_problems()) == []
    assert (
        task.chat_template
        and task.direct_answer_prefix == "Answer: "
        and task.where(task.train_problems()[2]) == f"{path}:3"
    )
    with pytest.raises(ValueError, match="hold_out=False reads one file whole"):
        FileTask(path, path, hold_out=False)
    with pytest.raises(ProblemFileError, match=r'in.jsonl:3: field "messages"'):
        file_task_from_sections(*job_sections(None, [], path), path)  # messages need data.chat_template


def test_code_problems_go_to_the_sandbox_reward_with_their_tests(tmp_path):
    task = FileTask(_write(tmp_path / "t.jsonl", MATH, CODE), _write(tmp_path / "h.jsonl", MATH2))
    seen = []

    def sandbox(problem, text):
        seen.append((problem, text))
        return 0.5

    reward = FileReward(math=lambda p, t: 1.0, code=sandbox)
    math, code = task.train_problems()
    assert reward(math, "x") == 1.0 and reward(code, "```python\nprint(3)\n```") == 0.5
    assert seen == [({"test_cases": [{"input": "1 2\n", "output": "3\n"}]}, "```python\nprint(3)\n```")]
    built = task.make_reward_fn(RewardConfig(type="code_sandbox", sandbox_url="http://127.0.0.1:1"))
    assert type(built.code).__name__ == "CodeSandboxReward"


def test_prompts_too_long_for_the_context_are_refused_naming_file_and_line(tmp_path):
    long_prompt = {"prompt": "x" * 40, "answer": "1"}
    task = FileTask(_write(tmp_path / "t.jsonl", MATH, long_prompt), _write(tmp_path / "h.jsonl", MATH2))
    task.check_prompt_lengths(CharTokenizer(), 41)  # 40 characters + BOS fit
    with pytest.raises(
        PromptTooLongError,
        match=rf"1 prompt\(s\) longer than 40 tokens.*\n  {tmp_path / 't.jsonl'}:2: 41 prompt tokens",
    ):
        task.check_prompt_lengths(CharTokenizer(), 40)


# -- the loop's data path on the demo's export ------------------------------------------------------


def test_the_demos_export_runs_as_problem_files_like_the_demo(tmp_path):
    """`python -m orchestrator.tasks.demo_export --config configs/demo.json` files through the file task give the
    loop the demo's problems: the same prompts (token for token), references, rewards and curriculum order."""
    from demo import tiny_model as tm
    from orchestrator.loop_setup import make_sampler
    from orchestrator.tasks.demo_export import export

    train_path, heldout_path = export(tmp_path, num_train=48, config_path=DEMO_CONFIG)
    demo_config = load_config(DEMO_CONFIG, ["data.num_train_problems=48"])
    file_config = load_config(
        DEMO_CONFIG,
        [
            f"data.train_path={train_path}",
            f"data.heldout_path={heldout_path}",
            "sampling.curriculum.min_difficulty=0.3",  # (level - 1) / 6: level 3 and up, as the demo's 3
        ],
    )
    demo_task, file_task = make_task(demo_config), make_task(file_config)
    assert isinstance(file_task, FileTask)
    chars = tm.build_tokenizer()  # the demo model's own tokenizer (tokenizers), called as transformers calls it

    def tokenizer(text, add_special_tokens=True):
        return {"input_ids": chars.encode(text, add_special_tokens=add_special_tokens).ids}

    for ours, theirs in [
        (demo_task.train_problems(), file_task.train_problems()),
        (demo_task.heldout_problems(), file_task.heldout_problems()),
    ]:
        assert len(ours) == len(theirs)
        assert [demo_task.encode(p, tokenizer) for p in ours] == [file_task.encode(p, tokenizer) for p in theirs]
        assert [demo_task.reference(p) for p in ours] == [file_task.reference(p) for p in theirs]
    demo_reward, file_reward = (
        demo_task.make_reward_fn(demo_config.reward),
        file_task.make_reward_fn(file_config.reward),
    )
    for ours, theirs in list(zip(demo_task.heldout_problems(), file_task.heldout_problems()))[::16]:
        right, wrong = demo.solution_text(ours), demo.solution_text(ours)[:-1] + "x"
        assert file_reward(theirs, right) == demo_reward(ours, right) == 1.0
        assert file_reward(theirs, wrong) == demo_reward(ours, wrong) == 0.0
    ours = make_sampler(demo_config, demo_task.train_problems(), demo_task.difficulty)
    theirs = make_sampler(file_config, file_task.train_problems(), file_task.difficulty)
    index = {p.id: i for i, p in enumerate(demo_task.train_problems())}
    file_index = {p.id: i for i, p in enumerate(file_task.train_problems())}
    for iteration in (0, 3):
        assert [index[i] for i in ours.sample(8, iteration)] == [file_index[i] for i in theirs.sample(8, iteration)]


def test_the_data_section_round_trips_through_a_saved_config_json(tmp_path):
    """config.json holds lists; a run's data section rebuilt from it (tests/integration/e2e/learning.py)
    holds the same values as the one it was saved from, with problem files or without."""
    from ckpt_common.dictconfig import from_dict, to_dict

    for overrides in ([], _files(tmp_path)):
        data = load_config(None, overrides).data
        saved = json.loads(json.dumps(to_dict(data)))
        rebuilt = from_dict(DataConfig, saved, "data")
        assert to_dict(rebuilt) == to_dict(data) and rebuilt.answer_markers == data.answer_markers


def test_a_run_saved_before_problem_files_resumes():
    """config.json of a run saved before the data section had its file fields: the same demo config resumes."""
    from ckpt_common.dictconfig import to_dict
    from orchestrator.loop_setup import check_resumable

    current = to_dict(load_config(None, []))
    saved = json.loads(json.dumps(current))
    for key in ("train_path", "heldout_path", "prompt_template", "chat_template", "answer_markers"):
        del saved["data"][key]
    check_resumable(saved, current)
    with pytest.raises(ValueError, match=r"different config \(data.train_path\)"):
        check_resumable(saved, {**current, "data": {**current["data"], "train_path": "t.jsonl"}})


def test_curations_kept_problems_are_a_train_file_whose_difficulty_is_the_pass_rate(tmp_path):
    from orchestrator.curation import kept_problems
    from orchestrator.tasks.problems import write_problems

    results = [  # as curate() writes them
        {"id": "a", "prompt": "1+1\n", "answer": "2", "level": 1, "pass_rate": 0.9, "kept": True, "reason": "kept"},
        {"prompt": "2+5\n", "answer": 7, "pass_rate": 0.2, "kept": True, "reason": "kept"},
        {"id": "c", "prompt": "3+3\n", "answer": "6", "pass_rate": 1.0, "kept": False, "reason": "easy_to_hack"},
        {"id": "d", "prompt": "1+1\n", "answer": "2", "pass_rate": 0.5, "kept": True, "reason": "kept"},  # repeat
    ]
    train = tmp_path / "curated.jsonl"
    write_problems(train, kept_problems(results))
    task = FileTask(train, _write(tmp_path / "h.jsonl", MATH2))
    problems = task.train_problems()
    assert [(p.id, p.answer) for p in problems] == [("a", "2"), (problems[1].id, "7")]
    assert [task.difficulty(p) for p in problems] == [pytest.approx(0.1), pytest.approx(0.8)]
    assert [task.pass_rate(p) for p in problems] == [0.9, 0.2]


def test_the_prioritized_sampler_starts_from_a_problem_files_pass_rates(tmp_path):
    """Curation's pass rates are the sampler's starting success rates; a problem without one takes
    sampling.prior_success_rate, and results recorded later move each from its own start."""
    from orchestrator.config import load_config
    from orchestrator.loop_setup import make_sampler
    from orchestrator.tasks.problems import Problem, write_problems

    train = tmp_path / "t.jsonl"
    write_problems(
        train,
        [
            Problem(id="easy", prompt="1+1\n", answer="2", pass_rate=0.9),
            Problem(id="hard", prompt="9*9\n", answer="81", pass_rate=0.1),
            Problem(id="new", prompt="2+2\n", answer="4"),
        ],
    )
    task = FileTask(train, _write(tmp_path / "h.jsonl", MATH2))
    config = load_config(None, ["sampling.prior_success_rate=0.5", "sampling.prior_weight=1.0"])
    sampler = make_sampler(config, task.train_problems(), task.difficulty, task.pass_rate)
    stats = sampler.prioritized.stats
    assert [stats.success_rate(pid) for pid in ("easy", "hard", "new")] == [0.9, 0.1, 0.5]
    stats.record("hard", 1, 1)  # (1 + 0.1 * 1) / (1 + 1)
    assert stats.success_rate("hard") == pytest.approx(0.55)
    weights = dict(zip(["easy", "hard", "new"], sampler.prioritized.weights(["easy", "hard", "new"])))
    assert weights["easy"] < weights["new"] and weights["hard"] < 0.9


def test_export_of_a_config_that_names_files_or_none_is_an_error(tmp_path, capsys):
    from orchestrator.tasks.demo_export import main

    assert main(["--out", str(tmp_path), "--config", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err
    job = tmp_path / "job.json"
    data = {"train_path": "t.jsonl", "heldout_path": "h.jsonl"}
    job.write_text(json.dumps({"data": data, "sampling": {"curriculum": {"min_difficulty": 0.3}}}))
    assert main(["--out", str(tmp_path), "--config", str(job)]) == 2
    assert "names problem files already" in capsys.readouterr().err
