"""The deploy/k8s layout on one machine: the RL job (`engine.type=daemon`) on the checkpoint-engine
daemon's vLLM engines.

    torchrun --nproc-per-node 2 -m checkpoint_engine --engine-cmd "python -m vllm_ext.launch
        --model <handoff>/model --port {port} --no-initial-push" --engine-health-path /version
    python -m orchestrator --set engine.type=daemon --set engine.endpoint=<daemon>
        --set sync.handoff_dir=<handoff>  (a short run of the demo task)

Both engines start with dummy weights and serve only after the daemon pushed the first version;
each iteration's version reaches both (the daemon's broadcast/local update), rollouts went to both,
and at the end both report the newest checkpoint and hold the same weights. Real processes, exit
codes checked, nothing left running.

Colocated (`--set engine.colocated=true`): the same, but every iteration the job stops both engines
before training and starts them with the new version after it; each iteration's metrics carry the
two switch times (inference -> train, train -> inference) and the summary their means.
"""

from __future__ import annotations

import json
import sys

import pytest

from orchestrator.metrics_log import read_jsonl
from tests.integration.dist.harness import REPO, _env, run_python, start_daemon
from tests.integration.dist.test_ce_engines import alive, engines, shutdown

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(1800)]
# the orchestrator's default SFT, configs/demo.json's: trained in the background (tests/conftest.py)
SFT_WARMUP = ("tests.integration.e2e.test_rl_demo:demo_sft_config",)

# Colocated: one iteration already stops both engines for training and starts them with its version;
# each more costs a stop and a vLLM start of both engines (about 80 s on a slow 2-core CPU).
NUM_ITERATIONS = {False: 2, True: 1}  # by colocated


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_rl_job_on_the_daemons_engines(tmp_path, colocated):
    num_iterations = NUM_ITERATIONS[colocated]
    handoff = tmp_path / "handoff"
    env = _env() | {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    engine_cmd = [sys.executable, "-m", "vllm_ext.launch", "--model", str(handoff / "model"), "--port", "{port}"]
    daemon = start_daemon(
        *("--collective-timeout-s", "900", "--engine-health-path", "/version"),
        *("--engine-start-timeout-s", "1200", "--engine-log-dir", str(tmp_path)),
        # float32 as engine.dtype; eager: a compile per test's fresh model folder (testing.vllm_servers)
        engine_cmd=[*engine_cmd, "--no-initial-push", "--", "--dtype", "float32", "--enforce-eager"],
        env=env,
        log=tmp_path / "daemon.log",
        ready_timeout_s=120,
        interval_s=0.2,
    )
    base = daemon.url
    out = tmp_path / "run"
    try:
        run_python(
            *("-m", "orchestrator", "--config", str(REPO / "configs" / "demo.json")),
            *("--output-dir", str(out), "--no-progress"),
            *("--set", f"sft_cache_dir={REPO / '.cache' / 'sft'}"),
            *("--set", "engine.type=daemon", "--set", f"engine.endpoint={base}"),
            *("--set", f"sync.handoff_dir={handoff}", "--set", f"rl.num_iterations={num_iterations}"),
            *("--set", f"eval.every_iterations={num_iterations}", "--set", "eval.num_sampled_problems=0"),
            *("--set", "data.num_heldout_per_level=16", "--set", "rollout.iteration_token_budget=4096"),
            *("--set", "rollout.max_new_groups_per_iteration=16"),
            *("--set", f"engine.colocated={str(colocated).lower()}"),
            env=env,
            timeout_s=1500,
        )

        lines = [m for m in read_jsonl(out / "metrics.jsonl") if "rollout_engine_requests" in m]
        assert len(lines) == num_iterations, lines
        for m in lines:  # every iteration's rollouts went to both engines
            assert len(m["rollout_engine_requests"]) == 2 and min(m["rollout_engine_requests"].values()) > 0, m
            switches = {"switch_to_train_s", "switch_to_inference_s"}
            if colocated:  # both switches timed: the engines stopped for training and started after it
                assert all(m[k] > 0 for k in switches), m
            else:
                assert not switches & set(m), m
        summary = json.loads((out / "summary.json").read_text())
        assert ("mean_switch_to_inference_s" in summary) == colocated, summary
        records = engines(base)
        assert [r["state"] for r in records] == ["serving", "serving"], records
        assert {r["checkpoint"] for r in records} == {f"policy-v{num_iterations}"}, records

        from vllm_ext.extension_req import collective_rpc

        checksums = [[c["checksum"] for c in collective_rpc(r["url"], "weights_checksum")] for r in records]
        assert checksums[0] == checksums[1] and checksums[0][0], checksums
        pids = [r["pid"] for r in records]
        shutdown(daemon)
        assert not any(alive(p) for p in pids), "an engine outlived the daemon"
        assert not (handoff / f"policy-v{num_iterations}").exists()  # the job unregistered its last version
    finally:
        daemon.stop()
