"""long2short on problem files (issue 45): shortest-rejection, dpo and evaluate take any task, named as
the RL job names it (``--config`` / ``--set data.train_path=...``); driven through ``main`` with a
scripted engine in place of vLLM (``cli._Engine``), the tokenizer of a tiny model."""

from __future__ import annotations

import json

import pytest

from demo import tiny_model as tm
from orchestrator.engine_pool.base import GenResult
from orchestrator.long2short import cli as long2short

SMALL = tm.TinyModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128, init_std=0.1
)

TRAIN = [
    {"id": "t-sum", "prompt": "25+38=", "answer": "63"},
    {"id": "t-mul", "prompt": "6*7=", "answer": "42", "difficulty": 0.5},
    {"id": "t-never", "prompt": "9-4=", "answer": "5"},
]
HELDOUT = [
    {"id": "h-a", "prompt": "2+2=", "answer": "4", "difficulty": 0.2},
    {"id": "h-b", "prompt": "3*3=", "answer": "9", "difficulty": 0.8},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.make_tiny_model(tmp_path_factory.mktemp("l2s-files"), SMALL, seed=3)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def files(tmp_path):
    return _write(tmp_path / "train.jsonl", TRAIN), _write(tmp_path / "heldout.jsonl", HELDOUT)


class FakeEngine:
    """Stands in for ``cli._Engine``: records what it is asked; the scripted engine answers
    ``script(prompt text, copy, loaded model dir)`` (eos appended)."""

    instances: list[FakeEngine] = []
    script = None
    tokenizer = None

    def __init__(self, model_dir, endpoint, config):
        self.loaded, self.prompts, self.temperatures = [], [], set()
        FakeEngine.instances.append(self)
        self.engine = self

    def load(self, model_dir):
        self.loaded.append(str(model_dir))

    def close(self):
        pass

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        self.temperatures.add(sampling.temperature)
        out = []
        for r in requests:
            prompt = self.tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True)
            self.prompts.append((prompt, tuple(r.prompt_token_ids)))
            copy = int(r.request_id.rsplit(".", 1)[1]) if "." in r.request_id else 0
            text = FakeEngine.script(prompt, copy, self.loaded[-1] if self.loaded else None)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(GenResult(r.request_id, tuple(ids), "stop"))
        return out


@pytest.fixture
def fake_engine(monkeypatch, tokenizer):
    FakeEngine.instances = []
    FakeEngine.tokenizer = tokenizer
    monkeypatch.setattr(long2short, "_Engine", FakeEngine)
    monkeypatch.setattr(long2short, "_setup", lambda args: None)  # leave the test's logging alone
    return FakeEngine


ANSWERS = {p["prompt"]: p["answer"] for p in TRAIN + HELDOUT}


def _files_flags(train, heldout):
    return ["--set", f"data.train_path={train}", "--set", f"data.heldout_path={heldout}"]


def test_shortest_rejection_on_problem_files(tmp_path, files, model_dir, tokenizer, fake_engine, capsys):
    def script(prompt, copy, loaded):
        answer = ANSWERS[prompt]
        if prompt == "9-4=" or copy == 0:
            return f"#### {int(answer) + 1}"  # wrong (and the shortest of all)
        if copy == 2:
            return f"#### {answer}"  # the shortest correct
        return f"the result, worked out carefully, is\n#### {answer}"

    fake_engine.script = script
    out = tmp_path / "sr.jsonl"
    argv = ["shortest-rejection", "--model", str(model_dir), "--out", str(out), "--num-samples", "4"]
    assert long2short.main([*argv, *_files_flags(*files)]) == 0
    (engine,) = fake_engine.instances
    assert engine.loaded == [str(model_dir)] and engine.temperatures == {1.0}
    # every training problem (not a held-out one), through the task's template ("{prompt}")
    assert {p for p, _ in engine.prompts} == {"25+38=", "6*7=", "9-4="} and len(engine.prompts) == 12
    assert all(list(ids) == tokenizer(p)["input_ids"] for p, ids in engine.prompts)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["t-sum", "t-mul"]  # the file's ids; t-never: no correct sample
    for record in records:
        answer = ANSWERS[record["prompt"]]
        assert record["answer"] == answer and record["response"] == f"#### {answer}"
        assert record["prompt_ids"] == tokenizer(record["prompt"])["input_ids"]
        assert record["num_correct"] == 3 and record["num_samples"] == 4
        assert record["num_tokens"] == len(record["response_ids"]) == len(f"#### {answer}") + 1
        assert record["mean_correct_tokens"] > record["num_tokens"]
    assert [r["level"] for r in records] == [-1, 50]  # the file task's buckets (no difficulty: -1)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_problems"] == 3 and summary["num_records"] == 2 and summary["num_samples"] == 12
    assert summary["sample_accuracy"] == pytest.approx(6 / 12)


def test_sft_on_trains_on_the_sampled_prompt_ids(tokenizer):
    from orchestrator.long2short import train as long2short_train

    record = {"prompt": "ignored", "prompt_ids": [5, 6, 7], "response": "x", "response_ids": [8, 9]}
    assert long2short_train.sft_examples(tokenizer, [record]) == [([5, 6, 7], [8, 9])]


def test_evaluate_on_held_out_problem_files(tmp_path, files, model_dir, fake_engine, capsys):
    def script(prompt, copy, loaded):  # the first model ("long", the tiny model: its tokenizer is used)
        answer = ANSWERS[prompt]
        if loaded == str(model_dir):
            return f"let me check this twice over\n#### {answer}"
        return f"#### {answer}" if prompt == "2+2=" else "#### 0"  # the short model misses h-b

    fake_engine.script = script
    argv = ["evaluate", "--models", f"long={model_dir}", "short=dirs/short", "--out-dir", str(tmp_path / "eval")]
    assert long2short.main([*argv, *_files_flags(*files)]) == 0
    (engine,) = fake_engine.instances
    assert engine.temperatures == {0.0} and engine.loaded == [str(model_dir), "dirs/short"]
    assert sorted(p for p, _ in engine.prompts) == ["2+2=", "2+2=", "3*3=", "3*3="]  # held-out only
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    rows = {r["label"]: r for r in summary["models"]}
    assert summary["num_problems"] == 2
    assert rows["long"]["accuracy"] == 1.0 and rows["short"]["accuracy"] == 0.5
    assert rows["short"]["accuracy_by_level"] == {"20": 1.0, "80": 0.0}  # round(100 x difficulty)
    assert rows["short"]["mean_response_tokens"] < rows["long"]["mean_response_tokens"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"] == summary["models"]


def test_dpo_on_problem_files(tmp_path, files, model_dir, tokenizer, fake_engine, capsys):
    def script(prompt, copy, loaded):
        answer = ANSWERS[prompt]
        if copy == 1:
            return f"#### {int(answer) + 1}"
        return f"#### {answer}" if copy == 2 else f"the result, worked out carefully, is\n#### {answer}"

    fake_engine.script = script
    argv = ["dpo", "--model", str(model_dir), "--out", str(tmp_path / "dpo"), "--num-samples", "3"]
    argv += ["--num-epochs", "1", "--num-threads", "1", *_files_flags(*files)]
    assert long2short.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # per problem (3): chosen = copy 2; rejected = the wrong copy 1 and the long correct copy 0
    assert result["num_pairs"] == 6 and result["pairs_by_reason"] == {"wrong": 3, "long": 3}
    assert result["samples"]["num_problems"] == 3 and (tmp_path / "dpo" / "model.safetensors").exists()


@pytest.mark.parametrize("command", ["shortest-rejection", "evaluate"])
def test_a_bad_problem_file_is_an_error_naming_its_line(tmp_path, files, model_dir, fake_engine, capsys, command):
    train, heldout = files
    bad = _write(tmp_path / "bad.jsonl", [TRAIN[0], {"id": "x", "answer": "1"}])
    if command == "evaluate":
        argv = ["evaluate", "--models", str(model_dir), "--out-dir", str(tmp_path / "e"), *_files_flags(train, bad)]
    else:
        argv = ["shortest-rejection", "--model", str(model_dir), "--out", str(tmp_path / "o.jsonl")]
        argv += _files_flags(bad, heldout)
    assert long2short.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "prompt" in err
    assert fake_engine.instances == []  # refused before any engine starts


def test_task_flags_without_problem_files_are_an_error(tmp_path, model_dir, fake_engine, capsys):
    argv = ["shortest-rejection", "--model", str(model_dir), "--out", str(tmp_path / "o.jsonl")]
    assert long2short.main([*argv, "--set", "reward.correct_threshold=0.9"]) == 2
    assert "data.train_path" in capsys.readouterr().err and fake_engine.instances == []


def test_code_problems_are_scored_by_the_tasks_reward(tmp_path, model_dir, fake_engine, monkeypatch):
    """A code problem's samples are judged by the task's reward (the sandbox's, faked here) against
    reward.correct_threshold."""
    from orchestrator.rewards import code_sandbox

    scored = []

    class FakeSandbox:
        def __init__(self, url, code=None):
            self.url = url

        def __call__(self, problem, text):
            scored.append((problem["test_cases"], text))
            return {"print(3)": 1.0, "print(2)": 0.4}.get(text, 0.0)

    monkeypatch.setattr(code_sandbox, "CodeSandboxReward", FakeSandbox)
    train = _write(
        tmp_path / "code.jsonl", [{"id": "c1", "prompt": "print 1+2", "tests": [{"input": "", "output": "3\n"}]}]
    )
    heldout = _write(tmp_path / "h.jsonl", [HELDOUT[0]])
    fake_engine.script = lambda prompt, copy, loaded: ["print(3)", "print(2)", "print(3) # a longer one"][copy]
    out = tmp_path / "sr.jsonl"
    argv = ["shortest-rejection", "--model", str(model_dir), "--out", str(out), "--num-samples", "3"]
    argv += [*_files_flags(train, heldout), "--set", "reward.sandbox_url=http://sandbox.invalid"]
    argv += ["--set", "reward.correct_threshold=0.5"]
    assert long2short.main(argv) == 0
    assert len(scored) == 3 and scored[0][0] == [{"input": "", "output": "3\n"}]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["id"] == "c1" and record["answer"] is None and record["response"] == "print(3)"
    assert record["num_correct"] == 1  # 0.4 < the threshold; the third scores 0
