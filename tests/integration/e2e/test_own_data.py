"""RL on your own problems and your own model, end to end: what docs/own-data.md walks a user through.

A model directory made here (a random Qwen2 with its own chat template: not the demo's model), a
JSONL file of prompt/response pairs for the SFT warm-up (``sft.data_path``), a math problem set as
GSM8K keeps it (parquet: ``question``, a worked ``answer`` ending ``#### 42``, mapped by
``data.fields``; the final answer scored by math-verify) and a code problem set (``tests``, scored by
the sandbox service, started here as a real process on a free port); the job's defaults otherwise.
Three runs of ``python -m orchestrator`` and one of curation:

1. math, the torch trainer: the SFT warm-up fine-tunes the model on the pairs (the loss on the
   responses only), so that RL starts from a policy that answers: rewards above 0 show that
   math-verify scored real answers; one RL iteration, then the same command with
   ``rl.num_iterations=2`` resumes from its checkpoint and runs the second; metrics, summary and
   TensorBoard files hold each iteration once;
2. curation (``python -m orchestrator.curation``) of the code set with the warm-up's model: pass rates
   from the sandbox, written as a problem file (difficulty = 1 - pass rate);
3. code, from that file, with the Megatron trainer (TP 1: this model's one key/value head cannot be
   split): its pass rates start prioritized sampling, the same warm-up (its cached result: same model,
   pairs and settings), two RL iterations; the sandbox's own
   counters say it judged the answers; vLLM, started on dummy weights, answers the held-out problem
   with the weights Megatron sent (this model's HF layout converted to Megatron's and back).

Real vLLM (CPU), real processes, exit codes checked.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from orchestrator.metrics_log import read_jsonl
from testing.sandbox_service import request, start_service

REPO = pathlib.Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.sandbox, pytest.mark.timeout(1800)]

# The model's own chat template (ChatML-like); the job renders every prompt through it (data.chat_template)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DOUBLE = "print(2*int(input()))"
# The math set as GSM8K keeps it (a "question" and a worked "answer" ending "#### <final answer>"),
# as parquet: the job maps it with data.fields (MATH_FIELDS) and scores the final answer
MATH = [
    {"id": "add-1", "question": "What is 12+30?", "answer": "12 + 30 = 42\n#### 42"},
    {"id": "add-2", "question": "What is 20+22?", "answer": "20 + 22 = 42\n#### 42"},
    {"id": "chat-1", "messages": [{"role": "user", "content": "What is 40+2?"}], "answer": "40 + 2 = 42\n#### 42"},
]
MATH_FIELDS = ("data.fields.prompt=question", "data.fields.answer_format=gsm8k")
CODE = [
    {"id": "double-1", "prompt": "Read n, print 2n.", "tests": [{"input": "3\n", "output": "6\n"}]},
    {"id": "double-2", "prompt": "Print twice the input.", "tests": [{"input": "5\n", "output": "10\n"}]},
]
MATH_HELDOUT = [{"id": "add-h", "question": "What is 41+1?", "answer": "41 + 1 = 42\n#### 42"}]
CODE_HELDOUT = [{"id": "double-h", "prompt": "Double it.", "tests": [{"input": "7\n", "output": "14\n"}]}]


def _write_parquet(path: pathlib.Path, records) -> pathlib.Path:
    """``records`` as a parquet table (through datasets, as its users save theirs): every column in every
    row, null where a record has no such field."""
    import datasets

    columns = list(dict.fromkeys(key for record in records for key in record))
    datasets.Dataset.from_list([{key: record.get(key) for key in columns} for record in records]).to_parquet(path)
    return path


def _write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sft_pairs() -> list[dict]:
    """What the warm-up teaches: '#### 42' after each math prompt, the doubling program after each code one."""
    pairs = []
    for problem in MATH + CODE + MATH_HELDOUT + CODE_HELDOUT:
        response = "#### 42" if "answer" in problem else f"```python\n{DOUBLE}\n```"
        if "messages" in problem:
            pairs.append({"messages": [*problem["messages"], {"role": "assistant", "content": response}]})
        else:
            pairs.append({"prompt": problem.get("prompt") or problem["question"], "response": response})
    return pairs


def _make_model(out: pathlib.Path) -> pathlib.Path:
    """A random 2-layer Qwen2 with the demo's byte-level vocabulary and a chat template of its own."""
    from demo.tiny_model import TinyModelConfig, make_tiny_model

    config = TinyModelConfig(
        num_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, seed=7
    )
    make_tiny_model(out, config)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": CHAT_TEMPLATE}, indent=2))
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", GLOG_minloglevel="2")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _job(
    out: pathlib.Path, data: pathlib.Path, kind: str, model: pathlib.Path, sandbox_url: str, iterations: int, *extra
) -> list[str]:
    """The run on the ``kind`` ("math": GSM8K-style parquet, or "code": this project's JSONL) problem
    files; ``extra``: more ``--set`` items."""
    suffix, fields = ("parquet", MATH_FIELDS) if kind == "math" else ("jsonl", ())
    sets = [
        f"init_model_dir={model}",
        f"sft.data_path={data / 'sft.jsonl'}",
        "sft.num_steps=60",
        "sft.batch_size=8",
        "sft.lr=0.003",
        "sft.warmup_steps=5",
        f"data.train_path={data / f'{kind}-train.{suffix}'}",
        f"data.heldout_path={data / f'{kind}-heldout.{suffix}'}",
        *fields,
        "data.chat_template=true",
        f"reward.sandbox_url={sandbox_url}",
        f"rl.num_iterations={iterations}",
        "rl.num_responses_per_prompt=4",
        "eval.every_iterations=1",
        "eval.num_sampled_problems=0",
        "rollout.max_response_tokens=48",
        "rollout.segment_max_tokens=48",
        "rollout.iteration_token_budget=2048",
        "rollout.max_new_groups_per_iteration=5",
        "engine.enforce_eager=true",  # a folder vLLM has not compiled for: eager starts faster
        *extra,
    ]
    return [
        sys.executable,
        "-m",
        "orchestrator",
        "--output-dir",
        str(out),
        "--no-progress",
        *(arg for item in sets for arg in ("--set", item)),
    ]


def _run(cmd: list[str], log: list[str] | None = None) -> dict:
    """Run ``cmd`` (exit 0 asserted); its last printed line, a JSON summary. ``log`` gets its stderr."""
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    if log is not None:
        log.append(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sandbox(bwrap_available):
    service = start_service(["--workers", "2", "--max-timeout-s", "10"])
    yield service
    assert service.stop() == 0, service.log_text()


@pytest.fixture(scope="module")
def bwrap_available() -> None:
    from sandbox.bwrap import probe_bwrap

    reason = probe_bwrap()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


def _data(tmp_path: pathlib.Path) -> pathlib.Path:
    data = tmp_path / "data"
    data.mkdir()
    _write_parquet(data / "math-train.parquet", MATH)
    _write_parquet(data / "math-heldout.parquet", MATH_HELDOUT)
    _write_jsonl(data / "code-train.jsonl", CODE)
    _write_jsonl(data / "code-heldout.jsonl", CODE_HELDOUT)
    _write_jsonl(data / "sft.jsonl", _sft_pairs())
    return data


def _tensorboard_steps(out: pathlib.Path) -> list[int]:
    """The steps TensorBoard's reader shows in DIR/tensorboard, in its order (a step twice: twice)."""
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    accumulator.Reload()
    return [e.step for e in accumulator.Scalars("iteration")]


def test_rl_on_your_own_math_and_code_files_with_your_own_model_and_sft_pairs(tmp_path, sandbox):
    data = _data(tmp_path)
    model = _make_model(tmp_path / "model")

    # 1. math, torch trainer: one iteration, then resumed for the second
    out = tmp_path / "math"
    first = _run(_job(out, data, "math", model, sandbox.url, 1))
    assert first["task"] == "file" and first["num_iterations"] == 1
    summary = _run(_job(out, data, "math", model, sandbox.url, 2))  # resumes from iteration 1's checkpoint
    resumes = [json.loads(line) for line in (out / "resume.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in resumes] == [1]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]
    assert summary["num_iterations"] == 2 and summary["task"] == "file" and summary["trainer"] == "hf"
    # the warm-up taught the answer: rewards above 0 come from math-verify (no code problem here)
    rewards = [r["mean_reward"] for r in records if r["mean_reward"] is not None]
    assert rewards and max(rewards) > 0, records
    assert summary["heldout_accuracy_before"] > 0, summary  # the SFT model already answers the held-out problem
    assert request("GET", sandbox.url + "/health").json()["service"]["judges"] == 0  # math never reaches it
    assert _tensorboard_steps(out) == [1, 2]  # each iteration's scalars once, across the resume

    # 2. curation of the code set with the warm-up's model (pass rates from the sandbox): its output is the
    # code run's training file
    curated = data / "code-curated.jsonl"
    curation = _run(
        [
            *(sys.executable, "-m", "orchestrator.curation", "--problems", str(data / "code-train.jsonl")),
            *("--out", str(tmp_path / "curation.jsonl"), "--problems-out", str(curated)),
            *("--model", str(REPO / first["sft_model_dir"]), "--num-samples", "4", "--enforce-eager"),
            *("--set", "data.chat_template=true", "--set", f"reward.sandbox_url={sandbox.url}"),
        ]
    )
    assert curation["num_kept"] == 2, curation
    rates = {r["id"]: r["pass_rate"] for r in map(json.loads, curated.read_text().splitlines())}
    assert set(rates) == {"double-1", "double-2"} and all(0 <= r <= 1 for r in rates.values()), rates
    (data / "code-train.jsonl").write_text(curated.read_text())

    # 3. code, Megatron trainer at TP 1 on the same model (its warm-up: the cached result of run 1's), on
    # the curated file: its pass rates start the prioritized sampling (difficulty: the curriculum's labels)
    out, log = tmp_path / "code", []
    summary = _run(_job(out, data, "code", model, sandbox.url, 2, "trainer.type=megatron", "trainer.tp_size=1"), log)
    assert "prioritized sampling: 2 of 2 training problems start from their pass rate" in log[0], log[0][-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]
    assert summary["trainer"] == "megatron" and summary["task"] == "file"
    rewards = [r["mean_reward"] for r in records if r["mean_reward"] is not None]
    assert rewards and max(rewards) > 0, records  # the sandbox ran the SFT model's programs and passed some
    assert request("GET", sandbox.url + "/health").json()["service"]["judges"] > 0
    # vLLM starts on dummy weights: it answers the held-out problem only with the SFT weights that Megatron
    # (converted from this model's HF layout and back) sent it
    assert summary["heldout_accuracy_before"] > 0, summary
    assert sum(r["num_steps"] for r in records) >= 1  # Megatron took training steps
