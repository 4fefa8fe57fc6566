"""A short RL run with the Megatron trainer (configs/megatron.json): real vLLM (CPU), real checkpoint
engine, a megatron-core GPTModel initialized from the shared SFT model at TP=2 (the job's process is
TP rank 0 and starts rank 1: trainer.megatron.tp).

Asserts what makes the backend real in the loop:
- every iteration's metrics are written (the torch e2e test's checks), training steps were taken and
  every weight sync moved the whole model (bytes == the HF model's float32 size);
- vLLM's greedy accuracy of the SFT model after the first sync from Megatron (vLLM starts on dummy
  weights) equals what transformers measured on the same problems: the Megatron -> HF conversion
  and the sync are exact;
- the summary names the megatron trainer, and the last saved state is a loadable HF directory.
Learning is not asserted here: configs/megatron.json is the demo's recipe with the Megatron trainer
(tests/unit/trainer/test_megatron_trainer.py::test_the_megatron_config_is_the_demo_recipe_with_another_trainer),
the Megatron TP=2 k1.5 iteration equals the HF trainer's within 1e-4 (tests/integration/dist/
test_megatron_tp_trainer.py: two AdamW steps, loss and gradient norm), and the HF trainer on that recipe
raises held-out accuracy in the demo's learning run (tests/integration/e2e/test_rl_demo.py). An 8-iteration
learning run here (7 min of CI) measured the same thing a second time: P(solution) rose x1.085-x1.44.
TP=1 keeps the whole model in the job's process: the job's TP=1 trainer (make_trainers on this config
at trainer.tp_size=1) is checked in tests/unit/trainer/test_megatron_trainer.py, its sync into vLLM
in tests/integration/vllm/test_megatron_vllm.py (a job run of its own cost ~2 min of CI).
Two iterations: the second syncs weights that Megatron trained at TP=2 and then evaluates them.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import psutil
import pytest

from tests.integration.e2e.test_rl_demo import (  # noqa: F401 (fixture)
    COMMON,
    REPO,
    SFT_WARMUP,
    _check_metrics,
    _env,
    sft_model_dir,
)

MEGATRON = REPO / "configs" / "megatron.json"
TP_SIZE = 2
ITERATIONS = 2
# The demo's settings (configs/megatron.json), at its peak lr held constant, on a 64-problem held-out
# set per level (half the demo's) and a quarter of its rollout per iteration (32 new groups: what
# this test checks needs trained steps, not the demo's batch).
SHORT = [
    "--set",
    "rl.lr_schedule=constant",
    "--set",
    "data.num_heldout_per_level=64",
    "--set",
    "rollout.iteration_token_budget=16384",
    "--set",
    "rollout.max_new_groups_per_iteration=32",
]


@pytest.fixture(scope="module")
def start_model_dir(request) -> pathlib.Path:
    """The shared SFT fixture's model, or MEGATRON_E2E_INIT_MODEL_DIR (an SFT ``model`` dir with its
    ``sft_done.json`` beside it) to skip training one when the cache key differs."""
    given = os.environ.get("MEGATRON_E2E_INIT_MODEL_DIR")
    return pathlib.Path(given) if given else request.getfixturevalue("sft_model_dir")


@pytest.fixture(scope="module")
def megatron_run(start_model_dir, tmp_path_factory):
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("rl_megatron") / "run"
    cmd = [
        __import__("sys").executable,
        "-m",
        "orchestrator",
        "--config",
        str(MEGATRON),
        "--output-dir",
        str(out),
        "--no-progress",
        *COMMON,
        "--set",
        f"init_model_dir={start_model_dir}",
        *SHORT,
        *("--set", f"rl.num_iterations={ITERATIONS}"),
        *("--set", f"eval.every_iterations={ITERATIONS}"),
        "--set",
        f"trainer.tp_size={TP_SIZE}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out, start_model_dir, TP_SIZE


@pytest.mark.e2e
@pytest.mark.vllm
def test_megatron_rl_run_trains_syncs_and_reports(megatron_run):
    from demo.tiny_model import load_state_dict_from_dir

    summary, out, sft_dir, tp_size = megatron_run
    records = _check_metrics(out, ITERATIONS)
    assert summary["trainer"] == "megatron"
    assert json.loads((out / "config.json").read_text())["trainer"]["type"] == "megatron"
    assert summary["trainer_tp_size"] == tp_size
    followers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "trainer.megatron.tp" in (p.info["cmdline"] or []) and str(sft_dir) in " ".join(p.info["cmdline"] or [])
    ]
    assert not followers, "TP follower ranks outlived the job"
    assert summary["sft_match_checked"] is True
    assert summary["sft_match_ok"] is True and summary["sft_match_gap"] == 0, (
        f"vLLM {summary['sft_vllm_by_level']} vs transformers {summary['sft_transformers_by_level']}"
    )
    sft_state = load_state_dict_from_dir(sft_dir)
    model_bytes = sum(t.numel() * t.element_size() for t in sft_state.values())
    assert all(r["weight_sync_bytes"] == model_bytes for r in records)
    assert sum(r["num_steps"] for r in records) >= 1
    assert records[-1]["evaluated"] and summary["heldout_accuracy_after"] == records[-1]["heldout_accuracy"]
    latest = pathlib.Path(out / "state")
    saved = sorted(latest.glob("*/model"))
    assert saved, "no saved model under state/"
    state = load_state_dict_from_dir(saved[-1])
    assert set(state) == set(sft_state) and any(not state[n].equal(sft_state[n]) for n in state)
