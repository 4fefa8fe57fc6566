"""RL on your own problems and your own model, end to end: what docs/own-data.md walks a user through.

A model directory made here (a random Qwen2 with its own chat template: not the demo's model), a
JSONL file of prompt/response pairs for the SFT warm-up (``sft.data_path``), and problem files that
mix math (``answer``, scored by math-verify) and code (``tests``, scored by the sandbox service,
started here as a real process on a free port). One run of ``python -m orchestrator``:

1. the SFT warm-up fine-tunes the model on the pairs (the loss on the responses only), so that RL
   starts from a policy that answers both kinds: rewards above 0 show that math-verify and the
   sandbox scored real answers (the sandbox's own counters say it judged them);
2. one RL iteration, then the same command with ``rl.num_iterations=2`` resumes from its checkpoint
   and runs the second; metrics, summary and TensorBoard files hold each iteration once.

Real vLLM (CPU), real processes, exit codes checked.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from orchestrator.metrics import read_jsonl
from testing.sandbox_service import request, start_service

REPO = pathlib.Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.sandbox, pytest.mark.timeout(1800)]

# The model's own chat template (ChatML-like); the job renders every prompt through it (data.chat_template)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DOUBLE = "print(2 * int(input()))"
MATH = [
    {"id": "add-1", "prompt": "What is 12+30?", "answer": "42"},
    {"id": "add-2", "prompt": "What is 20+22?", "answer": "42"},
    {"id": "chat-1", "messages": [{"role": "user", "content": "What is 40+2?"}], "answer": "42"},
]
CODE = [
    {"id": "double-1", "prompt": "Read n, print 2n.", "tests": [{"input": "3\n", "output": "6\n"}]},
    {"id": "double-2", "prompt": "Print twice the input.", "tests": [{"input": "5\n", "output": "10\n"}]},
]
HELDOUT = [
    {"id": "add-h", "prompt": "What is 41+1?", "answer": "42"},
    {"id": "double-h", "prompt": "Double it.", "tests": [{"input": "7\n", "output": "14\n"}]},
]


def _write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sft_pairs() -> list[dict]:
    """What the warm-up teaches: '#### 42' after each math prompt, the doubling program after each code one."""
    pairs = []
    for problem in MATH + CODE + HELDOUT:
        response = "#### 42" if "answer" in problem else f"```python\n{DOUBLE}\n```"
        if "messages" in problem:
            pairs.append({"messages": [*problem["messages"], {"role": "assistant", "content": response}]})
        else:
            pairs.append({"prompt": problem["prompt"], "response": response})
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


def _job(out: pathlib.Path, data: pathlib.Path, model: pathlib.Path, sandbox_url: str, iterations: int) -> list[str]:
    sets = [
        f"init_model_dir={model}",
        f"sft.data_path={data / 'sft.jsonl'}",
        "sft.num_steps=60",
        "sft.batch_size=8",
        "sft.lr=0.003",
        "sft.warmup_steps=5",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.heldout_path={data / 'heldout.jsonl'}",
        "data.chat_template=true",
        f"reward.sandbox_url={sandbox_url}",
        "sampling.curriculum.min_difficulty=0",
        f"rl.num_iterations={iterations}",
        "rl.num_responses_per_prompt=4",
        "eval.every_iterations=1",
        "eval.num_sampled_problems=0",
        "rollout.max_response_tokens=48",
        "rollout.segment_max_tokens=48",
        "rollout.iteration_token_budget=2048",
        "rollout.max_new_groups_per_iteration=5",
        "engine.enforce_eager=true",  # a folder vLLM has not compiled for: eager starts faster
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


def _run(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
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


def test_rl_on_your_own_math_and_code_files_with_your_own_model_and_sft_pairs(tmp_path, sandbox):
    data = tmp_path / "data"
    data.mkdir()
    _write_jsonl(data / "train.jsonl", MATH + CODE)
    _write_jsonl(data / "heldout.jsonl", HELDOUT)
    _write_jsonl(data / "sft.jsonl", _sft_pairs())
    model = _make_model(tmp_path / "model")
    out = tmp_path / "run"

    first = _run(_job(out, data, model, sandbox.url, iterations=1))
    assert first["task"] == "file" and first["num_iterations"] == 1
    summary = _run(_job(out, data, model, sandbox.url, iterations=2))  # resumes from iteration 1's checkpoint

    resumes = [json.loads(line) for line in (out / "resume.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in resumes] == [1]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]
    assert summary["num_iterations"] == 2 and summary["task"] == "file"
    # the warm-up taught both answers: rewards above 0 come from math-verify and from the sandbox
    rewards = [r["mean_reward"] for r in records if r["mean_reward"] is not None]
    assert rewards and max(rewards) > 0, records
    judged = request("GET", sandbox.url + "/health").json()["service"]["judges"]
    assert judged > 0, "the sandbox judged no code answer"
    assert summary["heldout_accuracy_before"] > 0, summary  # the SFT model already answers a held-out problem
    # TensorBoard: each iteration's scalars once, across the resume
    from orchestrator.metric_sinks.tb_events import event_files, read_events

    events = [e for path in event_files(out / "tensorboard") for e in read_events(path)]
    steps = [e.step for e in events if "iteration" in e.scalars]
    assert sorted(steps) == [1, 2], steps
