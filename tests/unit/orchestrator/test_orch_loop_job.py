"""The whole RL job on a tiny model with a scripted engine (no vLLM): the real trainer, the real
checkpoint engine in process, metrics, plot, checkpoints and resume."""

import hashlib
import json
import threading

import pytest
import torch
import zmq
from tensorboard.backend.event_processing import event_accumulator

from checkpoint_engine.state import EngineWeightState
from checkpoint_engine.worker import update_weights_from_ipc
from demo import task
from demo import tiny_model as tm
from orchestrator.config import load_config
from orchestrator.engine_pool.base import GenResult
from orchestrator.loop import run_job
from orchestrator.metrics_log import REQUIRED_KEYS, read_jsonl

SMALL = tm.TinyModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128, init_std=0.1
)


class ScriptedEngine:
    """Answers right or wrong by a hash of the request id; receives weights like a vLLM worker."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.ctx = zmq.Context()
        self.state = EngineWeightState()
        self.received: list[dict[str, torch.Tensor]] = []
        self.lock = threading.Lock()

    def _answer(self, request):
        prompt = self.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=True)
        expression = prompt.split("\n")[0]
        operation = "sub" if "-" in expression else "add"
        operands = [int(x) for x in expression.replace("-", "+").split("+")]
        level = 7 if len(operands) == 3 else 2 if operation == "add" else 4  # the level only checks the operands
        problem = task.make_problem(operation, operands, level=level)
        text = task.solution_text(problem)
        if int(hashlib.sha1(request.request_id.encode()).hexdigest(), 16) % 3 == 0:
            text = text[:-1] + str((int(text[-1]) + 1) % 10)  # a wrong last digit
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return ids

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        results = []
        for request in requests:
            full = self._answer(request)
            done = len(request.earlier_response_ids)
            new = full[done : done + request.max_tokens]
            result = GenResult(request.request_id, tuple(new), "stop" if done + len(new) == len(full) else "length")
            if on_result is not None:
                on_result(result)
            results.append(result)
        return results

    def weight_req_func(self, timeout_s, weight_version=None):
        def req_func(socket_paths):
            weights = {}

            def run(named):
                for name, tensor in named:
                    weights[name] = tensor.clone()

            update_weights_from_ipc(self.ctx, socket_paths[0][1], None, run=run, state=self.state, timeout_s=timeout_s)
            self.received.append(weights)

        return req_func

    def close(self):
        self.ctx.term()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.make_tiny_model(tmp_path_factory.mktemp("job") / "model", SMALL, seed=5)


def _config(model_dir, num_iterations):
    return load_config(None, _config_overrides(model_dir, num_iterations))


def _config_overrides(model_dir, num_iterations):
    return [
        f"init_model_dir={model_dir}",
        f"rl.num_iterations={num_iterations}",
        "rl.num_responses_per_prompt=2",
        "rl.lr=1e-3",
        "rl.num_threads=1",
        "data.train_levels=[2,4]",
        "data.num_train_problems=64",
        "data.heldout_levels=[2]",
        "data.num_heldout_per_level=6",
        "rollout.iteration_token_budget=256",
        "rollout.segment_max_tokens=16",
        "rollout.max_response_tokens=64",
        "eval.every_iterations=2",
        "eval.num_sampled_problems=2",
        "eval.num_samples_per_problem=2",
        "sampling.curriculum.warmup_iterations=1",
        "length_penalty.warmup_iterations=1",
    ]


def test_job_runs_syncs_every_iteration_and_resumes(model_dir, tmp_path):
    engines = []

    def factory(engine_config, path):
        engines.append(ScriptedEngine(path))
        return engines[-1]

    out = tmp_path / "run"
    summary = run_job(_config(model_dir, 3), out, progress_bar=False, engine_factory=factory)
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(k in r for r in records for k in REQUIRED_KEYS)
    # responses need two 16-token segments: groups finish every other iteration; the others have no reward
    assert [r["num_groups"] > 0 for r in records] == [False, True, False]
    assert records[0]["mean_reward"] is None
    assert all(records[1][k] is not None for k in REQUIRED_KEYS)
    assert records[1]["num_continued"] == 16 and records[1]["num_new_groups"] == 0
    assert [r["evaluated"] for r in records] == [False, True, True]
    # one push before the first rollout plus one per iteration, each the trainer's weights at that time
    assert len(engines[0].received) == 4 and engines[0].state.report()["version"] == 4
    first, last = engines[0].received[0], engines[0].received[-1]
    initial = tm.load_state_dict_from_dir(model_dir)
    assert all(torch.equal(first[k], initial[k]) for k in initial)
    assert any(not torch.equal(last[k], initial[k]) for k in initial)  # training moved the weights
    saved = tm.load_state_dict_from_dir(out / "state" / "ckpt-000003" / "model")
    assert all(torch.equal(saved[k], last[k]) for k in saved)
    assert summary["num_iterations"] == 3 and summary["heldout_accuracy_before"] is not None
    assert json.loads((out / "summary.json").read_text())["num_iterations"] == 3
    assert (out / "metrics.png").stat().st_size > 0
    assert _tensorboard(out) == [(r["iteration"], pytest.approx(r["heldout_accuracy"])) for r in records]

    # resume with more iterations: continues from the checkpoint, the weights it pushes first are the saved ones
    summary = run_job(_config(model_dir, 5), out, progress_bar=False, engine_factory=factory)
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    # the resumed run's own event file: each step in one file only, under the JSONL keys
    assert _tensorboard(out) == [(r["iteration"], pytest.approx(r["heldout_accuracy"])) for r in records]
    assert len([p for p in (out / "tensorboard").iterdir() if "tfevents" in p.name]) == 2
    resume = [json.loads(line) for line in (out / "resume.jsonl").read_text().splitlines()]
    assert resume[0]["iteration"] == 3 and resume[0]["num_trajectories"] > 0
    assert all(torch.equal(engines[1].received[0][k], saved[k]) for k in saved)
    assert summary["num_iterations"] == 5


def _tensorboard(out):
    """(step, heldout_accuracy) as TensorBoard's reader shows DIR/tensorboard (every file, a step once)."""
    accumulator = event_accumulator.EventAccumulator(
        str(out / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0}
    )
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("heldout_accuracy")]


def test_a_run_on_the_demos_exported_problem_files_and_a_changed_config_refused_on_resume(model_dir, tmp_path):
    """The loop on `python -m orchestrator.tasks.demo_export` files (data.train_path, data.heldout_path): one
    iteration, its metrics and summary; then a changed config is refused in the same output dir."""
    from orchestrator.tasks.demo_export import export

    job = tmp_path / "job.json"  # the data section of the runs above, as a job config to export
    job.write_text(json.dumps({"data": {"train_levels": [2, 4], "heldout_levels": [2], "num_heldout_per_level": 6}}))
    train_path, heldout_path = export(tmp_path / "data", num_train=64, config_path=job)
    files = [
        f"data.train_path={train_path}",
        f"data.heldout_path={heldout_path}",
        "sampling.curriculum.min_difficulty=0.3",  # the files' difficulty scale: (level - 1) / 6
    ]
    out = tmp_path / "run"
    config = load_config(None, [*_config_overrides(model_dir, 1), *files])
    summary = run_job(config, out, progress_bar=False, engine_factory=lambda c, p: ScriptedEngine(p))
    (record,) = read_jsonl(out / "metrics.jsonl")
    assert all(k in record for k in REQUIRED_KEYS) and record["evaluated"]
    # the scripted engine answers two in three requests right; held-out buckets are the files' difficulties
    assert 0.0 < summary["heldout_accuracy_before"] < 1.0
    assert list(record["heldout_accuracy_by_level"]) == ["17"]  # level 2: difficulty 1/6, as a JSON key
    assert summary["sft_match_checked"] is False  # the held-out set is the files', not the SFT evaluation's
    changed = load_config(None, [*_config_overrides(model_dir, 1), *files, "rl.lr=0.5"])
    with pytest.raises(ValueError, match="different config"):
        run_job(changed, out, progress_bar=False, engine_factory=lambda c, p: ScriptedEngine(p))
