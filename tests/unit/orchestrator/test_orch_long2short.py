"""long2short (k1.5 2.4): the long-CoT format and its SFT wiring, model merging (table test), shortest
rejection sampling and DPO on scripted engines, token-efficiency evaluation; the CLI stays light."""

from __future__ import annotations

import json
import pathlib
import random
import re
import subprocess
import sys

import pytest
import torch

from demo import task
from demo import tiny_model as tm
from orchestrator.engine_pool.base import GenResult
from orchestrator.long2short import cli as long2short
from orchestrator.long2short import eval as long2short_eval
from orchestrator.long2short import merge as long2short_merge
from orchestrator.long2short import sample as long2short_sample
from orchestrator.long2short import train as long2short_train
from trainer import dpo, sft

REPO = pathlib.Path(__file__).resolve().parents[3]

SMALL = tm.TinyModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128, init_std=0.1
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.make_tiny_model(tmp_path_factory.mktemp("l2s"), SMALL, seed=3)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# -- the long-CoT format ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "operation, operands, expected",
    [
        ("add", (3, 4), "3+4+0=7\ncheck 7-4-0=3\nrecheck 3+4=7\n#### 7"),
        (
            "add",
            (347, 586),
            "7+6+0=13\ncheck 13-6-0=7\n4+8+1=13\ncheck 13-8-1=4\n3+5+1=9\ncheck 9-5-1=3\nrecheck 347+586=933\n#### 933",
        ),
        ("sub", (52, 17), "12-7-0=5\ncheck 5+7+0=12\n5-1-1=3\ncheck 3+1+1=5\nrecheck 35+17=52\n#### 35"),
        (
            "add3",
            (12, 34, 56),
            "2+4+6+0=12\ncheck 12-4-6-0=2\n1+3+5+1=10\ncheck 10-3-5-1=1\nrecheck 12+34+56=102\n#### 102",
        ),
    ],
)
def test_long_solution_text(operation, operands, expected):
    level = {"add": 3, "sub": 4, "add3": 7}[operation]
    problem = task.make_problem(operation, operands, level)
    assert task.long_solution_text(problem) == expected
    assert task.solution_text_for(problem, "long") == expected
    assert task.solution_text_for(problem, "short") == task.solution_text(problem)


def test_long_format_parses_scores_and_rechecks_correctly():
    rng = random.Random(0)
    for level in task.LEVELS:
        for _ in range(50):
            problem = task.sample_problem(rng, level)
            long, short = task.long_solution_text(problem), task.solution_text(problem)
            assert task.is_correct(problem, long) and task.extract_answer(long) == problem.answer
            assert len(long) > len(short) and len(long) <= task.max_solution_chars_for(problem, "long") - 16
            lines = long.split("\n")
            assert lines[0::2][: len(task.column_lines(problem))] == task.column_lines(problem)
            for line in lines[1::2][: len(task.column_lines(problem))] + [lines[-2]]:  # every re-check holds
                left, right = line.split(" ", 1)[1].split("=")
                assert left[0] != "-" and sum(int(t) for t in re.findall(r"[+-]?\d+", left)) == int(right)
    with pytest.raises(ValueError, match="solution style"):
        task.solution_text_for(task.make_problem("add", (1, 2), 1), "medium")


def test_long_format_fits_the_tokenizer_and_the_rl_cap(tokenizer):
    problem = task.make_problem("add", (999, 999), 3)
    text = task.long_solution_text(problem)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text  # one char, one token
    assert len(ids) + 1 <= 128  # the RL job's default response cap, eos included


def test_sft_solution_style_wiring(tokenizer):
    short, long = sft.SFTConfig(), sft.SFTConfig(solution_style="long")
    assert short.cache_key() == sft.SFTConfig(solution_style="short").cache_key() != long.cache_key()
    # the default key is the one from before the field existed (hash of the same payload without it)
    import dataclasses
    import hashlib

    fields = {k: v for k, v in dataclasses.asdict(short).items() if k not in sft._NOT_IN_CACHE_KEY}
    del fields["solution_style"]
    del fields["data_path"], fields["data_fields"], fields["data_split"]  # trainer.sft_file's, out of the key when None
    payload = json.dumps({"recipe": sft.SFT_RECIPE_VERSION, **fields}, sort_keys=True)
    assert short.cache_key() == hashlib.sha256(payload.encode()).hexdigest()[:16]
    with pytest.raises(ValueError, match="solution_style"):
        sft.SFTConfig(solution_style="verbose")
    problems = [task.make_problem("add", (25, 38), 2)]
    _, responses = sft.encode_examples(tokenizer, problems, "long")
    assert tokenizer.decode(responses[0][:-1]) == task.long_solution_text(problems[0])
    assert responses[0][-1] == tokenizer.eos_token_id


# -- merge ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "long, short, alpha, expected",
    [
        ([1.0, 2.0], [3.0, 6.0], 0.5, [2.0, 4.0]),
        ([1.0, 2.0], [3.0, 6.0], 1.0, [1.0, 2.0]),
        ([1.0, 2.0], [3.0, 6.0], 0.0, [3.0, 6.0]),
        ([0.0, -4.0], [4.0, 4.0], 0.25, [3.0, 2.0]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_state_dicts_table(long, short, alpha, expected, dtype):
    a = {"w": torch.tensor(long, dtype=dtype), "b": torch.tensor([[1.0]], dtype=dtype)}
    b = {"w": torch.tensor(short, dtype=dtype), "b": torch.tensor([[3.0]], dtype=dtype)}
    merged = long2short_merge.merge_state_dicts(a, b, alpha)
    assert set(merged) == {"w", "b"} and merged["w"].dtype == dtype and merged["b"].shape == (1, 1)
    assert torch.equal(merged["w"], torch.tensor(expected, dtype=dtype))
    assert merged["b"].item() == pytest.approx(alpha * 1.0 + (1 - alpha) * 3.0)


@pytest.mark.parametrize(
    "long, short, alpha, match",
    [
        ({"w": torch.zeros(2)}, {"v": torch.zeros(2)}, 0.5, "names differ"),
        ({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, 0.5, "shapes differ"),
        ({"w": torch.zeros(2)}, {"w": torch.zeros(2, dtype=torch.bfloat16)}, 0.5, "dtypes differ"),
        ({"w": torch.zeros(2, dtype=torch.long)}, {"w": torch.ones(2, dtype=torch.long)}, 0.5, "non-float"),
        ({"w": torch.zeros(2)}, {"w": torch.zeros(2)}, 1.5, "alpha"),
    ],
)
def test_merge_state_dicts_rejects(long, short, alpha, match):
    with pytest.raises(ValueError, match=match):
        long2short_merge.merge_state_dicts(long, short, alpha)


def test_merge_command_on_model_dirs(tmp_path, model_dir):
    from ckpt_common.hf_dir import read_tensors

    other = tm.make_tiny_model(tmp_path / "other", SMALL, seed=4)
    out = tmp_path / "merged"
    assert long2short.main(["merge", "--long", str(model_dir), "--short", str(other), "--out", str(out)]) == 0
    a, b, m = read_tensors(model_dir), read_tensors(other), read_tensors(out)
    assert set(m) == set(a) and all(m[k].dtype == a[k].dtype for k in m)
    assert all(torch.allclose(m[k].float(), (a[k].float() + b[k].float()) / 2, atol=1e-2) for k in m)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert json.loads((out / long2short_merge.INFO_FILE).read_text())["alpha"] == 0.5
    bigger = tm.make_tiny_model(tmp_path / "bigger", SMALL.__class__(**{**SMALL.__dict__, "hidden_size": 128}))
    assert long2short.main(["merge", "--long", str(bigger), "--short", str(other), "--out", str(tmp_path / "x")]) == 2


# -- scripted engines -------------------------------------------------------------------------------


class ScriptedEngine:
    """Copy c of a problem's samples answers with ``script(problem, c)`` (text); eos appended."""

    def __init__(self, tokenizer, problems, script):
        self.tokenizer, self.script = tokenizer, script
        self.by_prompt = {p.prompt: p for p in problems}
        self.calls = []

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        self.calls.append((sampling.temperature, len(requests), {r.max_tokens for r in requests}))
        out = []
        for r in requests:
            problem = self.by_prompt[self.tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True)]
            copy = int(r.request_id.rsplit(".", 1)[1]) if "." in r.request_id else 0
            text = self.script(problem, copy)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(GenResult(r.request_id, tuple(ids), "stop"))
        return out


def _codec(tokenizer):
    return (
        lambda text: tokenizer(text)["input_ids"],
        lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
    )


def _wrong(problem):
    return task.solution_text(problem).rsplit("#### ", 1)[0] + "#### " + str(int(problem.answer) + 1)


PROBLEMS = [task.make_problem("add", (25, 38), 2), task.make_problem("add", (347, 586), 3)]
NEVER = task.make_problem("sub", (90, 45), 4)


def test_shortest_rejection_on_a_scripted_engine(tokenizer, tmp_path):
    def script(problem, copy):
        if problem is NEVER or copy in (0, 5):
            return _wrong(problem)  # wrong, and the shortest responses of all
        if copy in (3, 6):
            return task.solution_text(problem)  # the shortest correct: copy 3 (first of the tie)
        return task.long_solution_text(problem)

    problems = [*PROBLEMS, NEVER]
    engine = ScriptedEngine(tokenizer, problems, script)
    encode, decode = _codec(tokenizer)
    groups = long2short_sample.sample_groups(
        engine, problems, encode, decode, long2short_sample.SamplingConfig(num_samples=8)
    )
    assert engine.calls == [(1.0, 24, {128})]
    assert [len(g) for g in groups] == [8, 8, 8]
    assert [s.correct for s in groups[0]] == [False, True, True, True, True, False, True, True]
    assert dpo.shortest_correct_index(groups[0]) == 3
    records = long2short_sample.shortest_rejection_records(problems, groups)
    assert [r["id"] for r in records] == ["25+38", "347+586"]  # 90-45: no correct sample, no record
    for record, problem in zip(records, PROBLEMS):
        assert record["response"] == task.solution_text(problem)
        assert record["num_tokens"] == len(task.solution_text(problem)) + 1 == len(record["response_ids"])
        assert record["response_ids"][-1] == tokenizer.eos_token_id
        assert record["num_correct"] == 6 and record["mean_correct_tokens"] > record["num_tokens"]
    # sft-on that data: the records' ids are the SFT targets as sampled; one epoch saves a model dir
    examples = long2short_train.sft_examples(tokenizer, records)
    assert examples[0][1] == records[0]["response_ids"] and examples[0][0][0] == tokenizer.bos_token_id
    no_ids = long2short_train.sft_examples(tokenizer, [{**records[0], "response_ids": None}])
    assert no_ids == examples[:1]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "sft-on"
    argv = ["sft-on", "--model", str(tm.make_tiny_model(tmp_path / "m", SMALL, seed=3)), "--data", str(data)]
    assert long2short.main([*argv, "--out", str(out), "--num-epochs", "1", "--num-threads", "1"]) == 0
    info = json.loads((out / long2short_merge.INFO_FILE).read_text())
    assert info["num_examples"] == 2 and info["num_steps"] == 1 and (out / "model.safetensors").exists()


def test_dpo_end_to_end_on_a_scripted_engine(tmp_path, tokenizer):
    base = tm.make_tiny_model(tmp_path / "base", SMALL, seed=3)

    def script(problem, copy):
        if copy == 1:
            return _wrong(problem)
        return task.solution_text(problem) if copy == 2 else task.long_solution_text(problem)

    problems = PROBLEMS + [task.make_problem("sub", (52, 17), 4)]
    encode, decode = _codec(tokenizer)
    engine = ScriptedEngine(tokenizer, problems, script)
    groups = long2short_sample.sample_groups(engine, problems, encode, decode)
    config = long2short_train.DpoConfig(lr=3e-3, num_epochs=3, pairs_per_step=8, num_threads=1)
    result = long2short_train.run_dpo(base, tmp_path / "dpo", problems, groups, config)
    # per problem: chosen = the short correct copy; rejected = the wrong one and six long correct ones
    assert result["num_pairs"] == 21 and result["pairs_by_reason"] == {"wrong": 3, "long": 18}
    assert result["num_steps"] == 9 and result["mean_chosen_tokens"] < result["mean_rejected_tokens"]
    assert result["margin_before"] == pytest.approx(0.0, abs=1e-4)
    assert result["margin_after"] > result["margin_before"] + 1.0 and result["last_loss"] < result["first_loss"]
    # the saved model holds the trained weights: its margin against the untouched base matches
    from trainer.base import TrainerConfig
    from trainer.hf import HFTrainer

    pairs, _ = long2short_train.dpo_token_pairs(tokenizer, problems, groups)
    saved, ref = (HFTrainer(d, TrainerConfig(num_threads=1)) for d in (tmp_path / "dpo", base))
    assert long2short_train.pair_margin(saved, ref, pairs) == pytest.approx(result["margin_after"], rel=1e-3, abs=1e-3)


# -- token efficiency -------------------------------------------------------------------------------


def test_evaluate_writes_summary_and_plot(tmp_path, tokenizer):
    problems = task.heldout_problems(0, 6, [2, 3])
    loaded = []

    def script(problem, copy):
        if loaded[-1] == "dirs/long":
            return task.long_solution_text(problem)
        good = problem.level == 2  # the short model misses level 3
        return task.solution_text(problem) if good else _wrong(problem)

    engine = ScriptedEngine(tokenizer, problems, script)
    encode, decode = _codec(tokenizer)
    models = [long2short_eval.parse_model_spec(s) for s in ["long=dirs/long", "dirs/short"]]
    assert models == [("long", "dirs/long"), ("short", "dirs/short")]
    assert long2short_eval.parse_model_spec("cache/sft-ab12/model/") == ("sft-ab12", "cache/sft-ab12/model/")
    summary = long2short_eval.evaluate_models(models, engine, loaded.append, problems, encode, decode, 128)
    assert loaded == ["dirs/long", "dirs/short"] and {c[0] for c in engine.calls} == {0.0}
    rows = {r["label"]: r for r in summary["models"]}
    assert rows["long"]["accuracy"] == 1.0 and rows["short"]["accuracy"] == 0.5
    assert rows["short"]["accuracy_by_level"] == {"2": 1.0, "3": 0.0}
    expected_long = sum(len(task.long_solution_text(p)) + 1 for p in problems) / len(problems)
    assert rows["long"]["mean_response_tokens"] == pytest.approx(expected_long)
    assert rows["short"]["mean_response_tokens"] < rows["long"]["mean_response_tokens"]
    written = long2short_eval.write_evaluation(summary, tmp_path / "eval")
    png = tmp_path / "eval" / "token_efficiency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and written["plot"] == str(png)
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["models"] == summary["models"]
    with pytest.raises(ValueError, match="distinct"):
        long2short_eval.evaluate_models([("a", "x"), ("a", "y")], engine, loaded.append, problems, encode, decode)


# -- the command ------------------------------------------------------------------------------------


def test_cli_help_is_light():
    code = "import sys, orchestrator.long2short.cli; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.long2short", "--help"],
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for command in ("merge", "shortest-rejection", "sft-on", "dpo", "evaluate"):
        assert command in out


def test_documented_long2short_rl_overrides_load():
    from orchestrator.config import load_config

    overrides = re.findall(r"--set (\S+)", long2short.__doc__)
    assert len(overrides) == 4
    config = load_config(REPO / "configs" / "demo.json", overrides)
    assert config.sft.solution_style == "long" and config.length_penalty.warmup_iterations == 0
    assert config.length_penalty.weight == 1.0 and config.rollout.max_response_tokens < 128


def test_cli_flags_come_from_the_configs(capsys):
    from orchestrator.config import EngineConfig

    parser, commands = long2short._parser()
    args = parser.parse_args(["dpo", "--model", "m", "--out", "o", "--seed", "3", "--beta", "0.2"])
    configs = long2short._configs(args, commands)
    assert configs["sampling"] == long2short_sample.SamplingConfig()
    assert configs["engine"] == EngineConfig()
    assert configs["problems"] == long2short_sample.ProblemSetConfig(seed=3)
    assert configs["dpo"] == long2short_train.DpoConfig(beta=0.2, seed=3)  # one --seed for problems and DPO
    args = parser.parse_args(["evaluate", "--models", "a", "--out-dir", "o", "--heldout-seed", "2"])
    configs = long2short._configs(args, commands)
    assert configs["problems"] == long2short_sample.ProblemSetConfig(num_problems=192, seed=2)
    args = parser.parse_args(["sft-on", "--model", "m", "--data", "d", "--out", "o", "--num-threads", "1"])
    assert long2short._configs(args, commands)["train"] == long2short_train.TrainConfig(num_threads=1)
    with pytest.raises(SystemExit) as e:
        long2short.main(["shortest-rejection", "--model", "m", "--out", "o", "--levels", "9"])
    assert e.value.code == 2 and "(flag: --levels)" in capsys.readouterr().err
