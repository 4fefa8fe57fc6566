"""Prompt-set curation on a scripted engine: format filters, the easy-to-hack filter (N direct-answer
tries), pass rates over the samples, the output records; the CLI's --help stays light."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from orchestrator import curation
from orchestrator.curation import CurationConfig, curate, summarize
from orchestrator.engine_pool.base import GenResult
from orchestrator.tasks.problems import stable_id

REPO = pathlib.Path(__file__).resolve().parents[3]
EOS = 2


def encode(text):
    return [1] + [ord(c) for c in text]


def decode(ids):
    return "".join(chr(t) for t in ids if t != EOS)


class ScriptedEngine:
    """Per prompt: how many of the sampled (chain-of-thought) copies answer right, and which direct-answer
    try (if any) guesses the answer; copy c of a problem is request "<s|d><index>.<c>"."""

    def __init__(self, script):
        self.script = script  # expression -> (answer, num_correct_samples, first_guessing_try or None)
        self.calls = []

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        self.calls.append((sampling.temperature, [r.request_id for r in requests]))
        results = []
        for r in requests:
            prompt = decode(r.prompt_token_ids[1:])
            copy = int(r.request_id.rsplit(".", 1)[1])
            if prompt.endswith("#### "):  # asked to answer directly
                answer, _, guess_at = self.script[prompt[: -len("#### ")]]
                text = answer if guess_at is not None and copy >= guess_at else "12345"
                assert r.max_tokens == 8
            else:
                answer, num_correct, _ = self.script[prompt]
                text = f"1+1+0=2\n#### {answer if copy < num_correct else 99999}"
            results.append(GenResult(r.request_id, tuple(encode(text)[1:]) + (EOS,), "stop"))
        return results

    def close(self):
        pass


def line(prompt, answer, **extra):
    return json.dumps({"prompt": prompt, "answer": answer, **extra})


SCRIPT = {"3+4\n": ("7", 10, None), "25+38\n": ("63", 3, 7), "41+22\n": ("63", 6, 8), "90-45\n": ("45", 0, None)}
LINES = [
    line("3+4\n", "7", id="a", level=1),  # solved 10/10, never guessed: kept (pass rate 1)
    line("25+38\n", 63, id="b"),  # guessed on the 8th direct try (index 7 < N = 8): easy to hack
    line("41+22\n", "63", id="c"),  # would be guessed on the 9th try only: not within N = 8, kept
    line("90-45\n", "45", id="d"),  # never solved: kept, difficulty 1
    line("   \n", "1", id="e"),  # empty prompt
    line("1+" * 20 + "1\n", "21", id="f"),  # 42 characters + bos > 16 tokens: overlong
    line("7/2\n", "3.5", id="g"),  # the verifier reads integers only: uncheckable
    line("5+2\n", "007", id="h"),  # "#### 007" reads as 7: never equal to "007"
    line("5+3\n", "", id="i"),  # empty answer
    "not json",
    json.dumps({"prompt": 3, "answer": "1"}),
    json.dumps({"prompt": "1+1\n", "answer": True}),
]
EXPECTED = [
    ("a", "kept", 1.0),
    ("b", "easy_to_hack", 0.3),
    ("c", "kept", 0.6),
    ("d", "kept", 0.0),
    ("e", "empty_prompt", None),
    ("f", "overlong_prompt", None),
    ("g", "uncheckable_answer", None),
    ("h", "uncheckable_answer", None),
    ("i", "uncheckable_answer", None),
    (None, "bad_record", None),
    (None, "bad_record", None),
    (None, "bad_record", None),
]


def test_curation_filters_and_pass_rates():
    engine = ScriptedEngine(SCRIPT)
    config = CurationConfig(max_prompt_tokens=16, temperature=1.2, hack_temperature=0.9)
    results = curate(LINES, engine, encode, decode, config)
    assert [(r.get("id"), r["reason"], r.get("pass_rate")) for r in results] == EXPECTED
    assert [r["kept"] for r in results] == [reason == "kept" for _, reason, _ in EXPECTED]
    by_id = {r.get("id"): r for r in results}
    assert by_id["a"]["level"] == 1 and by_id["a"]["difficulty"] == 0.0 and by_id["d"]["difficulty"] == 1.0
    assert by_id["b"]["num_direct_correct"] == 1 and by_id["c"]["num_direct_correct"] == 0
    assert by_id["b"]["num_correct"] == 3 and by_id["b"]["num_samples"] == 10
    assert [r["line"] for r in results if r["reason"] == "bad_record"] == [10, 11, 12]
    # only the 4 well-formed problems reach the engine: 10 samples each at the sampling temperature,
    # then N = 8 direct tries each at the hack temperature
    (t_samples, samples), (t_direct, direct) = engine.calls
    assert t_samples == 1.2 and len(samples) == 40 and all(i.startswith("s") for i in samples)
    assert t_direct == 0.9 and len(direct) == 32 and all(i.startswith("d") for i in direct)
    assert summarize(results) == {
        "num_problems": 12,
        "num_kept": 3,
        "mean_pass_rate": pytest.approx(1.9 / 4),
        "reasons": {
            "kept": 3,
            "easy_to_hack": 1,
            "empty_prompt": 1,
            "overlong_prompt": 1,
            "uncheckable_answer": 3,
            "bad_record": 3,
        },
    }


def test_too_easy_threshold_and_chunks():
    engine = ScriptedEngine(SCRIPT)
    config = CurationConfig(max_prompt_tokens=16, max_pass_rate=0.5, request_chunk_problems=3)
    results = curate(LINES[:4], engine, encode, decode, config)
    assert [r["reason"] for r in results] == ["too_easy", "easy_to_hack", "too_easy", "kept"]
    assert len(engine.calls) == 4  # two chunks (3 + 1 problems), two generate calls each


def test_no_hack_tries_means_no_direct_requests():
    engine = ScriptedEngine(SCRIPT)
    results = curate(LINES[:2], engine, encode, decode, CurationConfig(num_hack_tries=0))
    assert [r["reason"] for r in results] == ["kept", "kept"] and len(engine.calls) == 1


@pytest.mark.parametrize(
    "kwargs", [{"num_samples": 0}, {"num_hack_tries": -1}, {"temperature": 0}, {"max_pass_rate": 1.5}]
)
def test_config_rejects(kwargs):
    with pytest.raises(ValueError):
        CurationConfig(**kwargs)


def test_cli_help_is_light_and_missing_input_is_an_error(tmp_path):
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys, orchestrator.curation; "
                "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and check.stdout.strip() == "[]", check.stderr
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.curation", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--num-hack-tries" in out.stdout
    assert (
        curation.main(
            [
                "--problems",
                str(tmp_path / "missing.jsonl"),
                "--out",
                str(tmp_path / "o.jsonl"),
                "--model",
                str(tmp_path),
            ]
        )
        == 2
    )


def test_cli_flags_come_from_the_configs(tmp_path, capsys):
    from orchestrator.config import EngineConfig

    parser, config_args, engine_args = curation._parser()
    args = parser.parse_args(["--problems", "p", "--out", "o", "--model", "m"])
    assert config_args.build(args, parser) == CurationConfig()
    assert engine_args.build(args, parser) == EngineConfig()
    args = parser.parse_args(["--problems", "p", "--out", "o", "--model", "m", "--num-hack-tries", "0"])
    assert config_args.build(args, parser) == CurationConfig(num_hack_tries=0)
    with pytest.raises(SystemExit) as e:
        curation.main(["--problems", "p", "--out", "o", "--model", "m", "--max-pass-rate", "2"])
    assert (
        e.value.code == 2 and "max_pass_rate=2.0 must be in [0, 1] (flag: --max-pass-rate)" in capsys.readouterr().err
    )


# -- any task (issue 45): --config/--set, a problem file read through the task -------------------------


class CharTokenizer:
    """One id per character, bos 1, eos 2; a chat template that writes ``<role>content`` lines."""

    chat_template = "<role>content lines"
    name_or_path = "chars"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(t) for t in ids if t not in (1, EOS))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )


class TaskEngine:
    """Answers ``script(prompt text, kind, copy)`` (kind "s": a pass-rate sample, "d": a direct try) and
    records every request (prompt text, whether it starts with bos, kind)."""

    def __init__(self, script):
        self.script, self.requests, self.closed = script, [], False

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        out = []
        for r in requests:
            ids = list(r.prompt_token_ids)
            bos = bool(ids) and ids[0] == 1
            prompt = "".join(chr(t) for t in ids[1:] if bos) if bos else "".join(chr(t) for t in ids)
            kind, copy = r.request_id[0], int(r.request_id.rsplit(".", 1)[1])
            self.requests.append((prompt, bos, kind, r.max_tokens))
            out.append(GenResult(r.request_id, tuple(ord(c) for c in self.script(prompt, kind, copy)) + (EOS,), "stop"))
        return out

    def close(self):
        self.closed = True


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _file_task(path, *overrides):
    from orchestrator.tasks.factory import file_task_from_sections, job_sections

    data, reward = job_sections(None, overrides, path)
    source = file_task_from_sections(data, reward, path)
    return source, source.make_is_correct(reward)


MARKED = [
    {"id": "sum", "prompt": "2+2", "answer": "4"},  # 7 of 10 samples right; never guessed: kept
    {"id": "guess", "prompt": "capital of Peru?", "answer": "Lima"},  # guessed on direct try 2
    {"id": "long", "prompt": "x" * 40, "answer": "1"},  # over max_prompt_tokens
    {"id": "bad-ref", "prompt": "5-1", "answer": "see Answer: below"},  # the verifier never accepts it
    {"prompt": "9*9", "answer": "81"},  # no id: the stable one; answers in the demo's format only: 0/10
]


def test_a_math_file_with_its_own_marker_is_curated_through_the_task(tmp_path):
    source, is_correct = _file_task(
        _write(tmp_path / "in.jsonl", MARKED),
        "data.prompt_template=Q: {prompt}\n",
        'data.answer_markers=["Answer:", "Final:"]',
    )
    answers = {f"Q: {p['prompt']}\n": p["answer"] for p in MARKED}

    def script(prompt, kind, copy):
        if kind == "d":  # asked for the answer at once: the prompt ends with the task's first marker
            assert prompt.endswith("\nAnswer: ")
            return "Lima" if prompt.startswith("Q: capital") and copy >= 2 else "Paris"
        answer = answers[prompt]
        if prompt == "Q: 9*9\n":
            return f"9 nines\n#### {answer}"  # the demo's marker: not this task's answer
        return f"thinking\nAnswer: {answer}" if copy < 7 else "thinking\nAnswer: 0"

    engine = TaskEngine(script)
    config = CurationConfig(max_prompt_tokens=30, num_hack_tries=4)
    results = curation.curate_task(source, engine, CharTokenizer(), CharTokenizer().decode, is_correct, config)
    stable = results[4]["id"]
    assert stable == stable_id(prompt="9*9")
    assert [(r["id"], r["reason"], r["pass_rate"]) for r in results] == [
        ("sum", "kept", 0.7),
        ("guess", "easy_to_hack", 0.7),
        ("long", "overlong_prompt", None),
        ("bad-ref", "uncheckable_answer", None),
        (stable, "kept", 0.0),
    ]
    by_id = {r["id"]: r for r in results}
    assert by_id["sum"]["difficulty"] == pytest.approx(0.3) and by_id["sum"]["num_direct_correct"] == 0
    assert by_id["guess"]["num_direct_correct"] == 2 and by_id["guess"]["num_hack_tries"] == 4
    assert by_id[stable]["prompt"] == "9*9" and by_id[stable]["answer"] == "81"
    # prompts: the task's template, bos added; 3 problems reach the engine: 10 samples and 4 tries each
    samples = [(p, bos) for p, bos, kind, _ in engine.requests if kind == "s"]
    direct = [(p, n) for p, _, kind, n in engine.requests if kind == "d"]
    assert {p for p, _ in samples} == {"Q: 2+2\n", "Q: capital of Peru?\n", "Q: 9*9\n"} and len(samples) == 30
    assert all(bos for _, bos in samples)
    assert len(direct) == 12 and all(p.endswith("\nAnswer: ") and n == 8 for p, n in direct)
    kept = curation.kept_problems(results)
    assert [(p.id, p.prompt, p.answer, p.pass_rate, p.difficulty) for p in kept] == [
        ("sum", "2+2", "4", 0.7, pytest.approx(0.3)),
        (stable, "9*9", "81", 0.0, 1.0),
    ]


def test_no_answer_markers_means_a_probe_with_nothing_appended(tmp_path):
    source, is_correct = _file_task(_write(tmp_path / "in.jsonl", MARKED[:2]), "data.answer_markers=[]")
    engine = TaskEngine(lambda prompt, kind, copy: {"2+2": "4", "capital of Peru?": "Lima"}[prompt])
    results = curation.curate_task(source, engine, CharTokenizer(), CharTokenizer().decode, is_correct)
    assert {p for p, _, kind, _ in engine.requests if kind == "d"} == {"2+2", "capital of Peru?"}
    assert [(r["reason"], r["pass_rate"]) for r in results] == [("easy_to_hack", 1.0), ("easy_to_hack", 1.0)]


CHAT = [
    {
        "id": "m1",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*3?"}],
        "answer": "9",
    },
    {"id": "p1", "prompt": "5-1?", "answer": "4"},
]
CHAT_PROMPTS = {"<system>Be brief.\n<user>3*3?\n<assistant>": "9", "<user>5-1?\n<assistant>": "4"}


def _chat_script(prompt, kind, copy):
    if kind == "d":
        assert prompt.endswith("<assistant>#### ")
        return "7"
    answer = CHAT_PROMPTS[prompt]
    right = copy < (2 if answer == "9" else 5)
    return f"so\n#### {answer if right else 0}"


def test_messages_records_are_rendered_by_the_chat_template(tmp_path):
    source, is_correct = _file_task(_write(tmp_path / "in.jsonl", CHAT), "data.chat_template=true")
    engine = TaskEngine(_chat_script)
    results = curation.curate_task(source, engine, CharTokenizer(), CharTokenizer().decode, is_correct)
    assert [(r["id"], r["reason"], r["pass_rate"]) for r in results] == [("m1", "kept", 0.2), ("p1", "kept", 0.5)]
    assert results[0]["messages"] == CHAT[0]["messages"] and "prompt" not in results[0]
    # the template writes the special tokens: no bos added, for the samples and the probe alike
    assert {p for p, _, _, _ in engine.requests} == {*CHAT_PROMPTS, *(p + "#### " for p in CHAT_PROMPTS)}
    assert not any(bos for _, bos, _, _ in engine.requests)
    kept = curation.kept_problems(results)
    assert [(p.id, p.messages, p.pass_rate) for p in kept] == [
        ("m1", tuple(CHAT[0]["messages"]), 0.2),
        ("p1", None, 0.5),
    ]


def test_code_problems_are_scored_by_the_tasks_reward_and_not_probed(tmp_path, monkeypatch):
    from orchestrator.rewards import code_sandbox

    class FakeSandbox:
        def __init__(self, url, code=None):
            pass

        def __call__(self, problem, text):
            assert problem["test_cases"] == [{"input": "", "output": "3\n"}]
            return {"print(3)": 1.0, "print(2)": 0.4}.get(text, 0.0)

    monkeypatch.setattr(code_sandbox, "CodeSandboxReward", FakeSandbox)
    path = _write(
        tmp_path / "in.jsonl", [{"id": "c1", "prompt": "print 1+2", "tests": [{"input": "", "output": "3\n"}]}]
    )
    source, is_correct = _file_task(path, "reward.sandbox_url=http://sandbox.invalid", "reward.correct_threshold=0.5")
    engine = TaskEngine(lambda prompt, kind, copy: ["print(3)", "print(2)"][copy % 2])
    (record,) = curation.curate_task(source, engine, CharTokenizer(), CharTokenizer().decode, is_correct)
    assert {kind for _, _, kind, _ in engine.requests} == {"s"}  # no direct-answer tries
    assert record["pass_rate"] == 0.5 and record["reason"] == "kept"  # 0.4 < the threshold
    assert record["num_hack_tries"] == 0 and record["num_direct_correct"] == 0
    (problem,) = curation.kept_problems([record])
    assert problem.tests[0].output == "3\n" and problem.answer is None and problem.difficulty == 0.5


@pytest.fixture
def cli(monkeypatch):
    """main() with the char tokenizer and a scripted engine (``cli.script``) in place of vLLM."""

    class Cli:
        engines = []
        script = None

    def engine(args, engine_config):
        e = TaskEngine(Cli.script) if Cli.script is not None else ScriptedEngine(SCRIPT)
        Cli.engines.append(e)
        return e, None

    monkeypatch.setattr(curation, "_tokenizer", lambda model_dir: CharTokenizer())
    monkeypatch.setattr(curation, "_engine", engine)
    monkeypatch.setattr("ckpt_common.logs.setup_logging", lambda level: None)
    return Cli


def test_cli_on_a_chat_problem_file_writes_a_train_file(tmp_path, cli, capsys):
    from orchestrator.tasks.problems import read_problems

    cli.script = _chat_script
    src, out, kept = _write(tmp_path / "in.jsonl", CHAT), tmp_path / "out.jsonl", tmp_path / "kept.jsonl"
    config = _write(tmp_path / "job.json", ['{"data": {"chat_template": true}}'])
    argv = ["--problems", str(src), "--out", str(out), "--problems-out", str(kept), "--model", "m"]
    assert curation.main([*argv, "--config", str(config), "--max-pass-rate", "0.4"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in results] == [("m1", "kept"), ("p1", "too_easy")]
    assert cli.engines[0].closed
    (problem,) = read_problems(kept)  # a valid data.train_path
    assert (problem.id, problem.pass_rate, problem.difficulty) == ("m1", 0.2, 0.8) and problem.messages
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_kept"] == 1 and summary["reasons"] == {"kept": 1, "too_easy": 1}


@pytest.mark.parametrize(
    "records, flags, fragment",
    [
        ([CHAT[1], {"id": "x", "answer": "1"}], [], ':2: field "prompt"'),
        ([CHAT[1], "not json"], [], ":2: invalid JSON"),
        (CHAT, [], ':1: field "messages"'),  # messages without data.chat_template
        ([{"prompt": "p", "tests": [{"input": "", "output": ""}]}], [], ':1: field "tests"'),  # no sandbox
        (CHAT, ["--direct-answer-suffix", "Answer: "], "--direct-answer-suffix is the demo's"),
    ],
)
def test_cli_a_bad_problem_file_is_an_error_naming_file_line(tmp_path, cli, capsys, records, flags, fragment):
    src = _write(tmp_path / "in.jsonl", records)
    argv = ["--problems", str(src), "--out", str(tmp_path / "o.jsonl"), "--model", "m", *flags]
    assert curation.main([*argv, "--set", 'data.answer_markers=["Answer:"]']) == 2
    err = capsys.readouterr().err
    assert fragment in err and (str(src) in err or "suffix" in fragment)
    assert cli.engines == [] and not (tmp_path / "o.jsonl").exists()  # before any engine starts


def test_cli_missing_problem_file_with_a_task_is_an_error(tmp_path, cli, capsys):
    argv = ["--problems", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o.jsonl"), "--model", "m"]
    assert curation.main([*argv, "--set", "reward.correct_threshold=0.9"]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err and cli.engines == []


def test_cli_without_a_task_is_the_demos_curation(tmp_path, cli, capsys):
    """No --config/--set: lines of prompt text, bad lines as bad_record records, the demo's check and
    its "#### " probe (ScriptedEngine asserts it), the same output as curate()."""
    src, out, kept = _write(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl", tmp_path / "kept.jsonl"
    argv = ["--problems", str(src), "--out", str(out), "--problems-out", str(kept), "--model", "m"]
    assert curation.main([*argv, "--max-prompt-tokens", "16"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    expected = curate(LINES, ScriptedEngine(SCRIPT), encode, decode, CurationConfig(max_prompt_tokens=16))
    assert results == json.loads(json.dumps(expected)) and len(results) == 12
    assert [(r.get("id"), r["reason"], r.get("pass_rate")) for r in results] == EXPECTED
    assert [json.loads(line)["id"] for line in kept.read_text().splitlines()] == ["a", "c", "d"]
