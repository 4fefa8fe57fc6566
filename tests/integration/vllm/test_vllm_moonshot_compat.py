"""A MoonshotAI checkpoint-engine user's commands, unchanged, against real vLLM (CPU):

  vLLM A, B   `VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --load-format dummy
              --worker-extension-cls checkpoint_engine.worker.VllmColocateWorkerExtension` (both at once)
  job 1       `torchrun examples/moonshot_update.py --update-method all --save-metas-file ... --sleep-time`
              into A (broadcast, then P2P), stays alive holding the weights
  job 2       `torchrun examples/moonshot_update.py --load-metas-file ...` into B: joins, pulling from job 1

Checked: A and B hold exactly the checkpoint (the extension's `weights_checksum` equals the
checkpoint's), answer the same greedy tokens, and B's answer changed from its dummy weights; every
process exits 0 (job 1 once SIGTERM ends its --sleep-time).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

EXTENSION = "checkpoint_engine.worker.VllmColocateWorkerExtension"  # the path their README gives
PROMPTS = ["12+34=", "Hello world\n", "The quick brown fox"]
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 600.0
JOB_TIMEOUT_S = 300.0


def _vllm(model_dir: Path, log_dir: Path, tag: str):
    from ckpt_common.ports import free_port
    from testing.vllm_servers import CPU_ENGINE_ARGS, ServerProcess, child_env

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "demo",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--worker-extension-cls",
        EXTENSION,
        *CPU_ENGINE_ARGS,
    ]
    return ServerProcess(
        cmd, f"http://127.0.0.1:{port}", log_dir / f"vllm-{tag}.log", env=child_env(VLLM_SERVER_DEV_MODE="1")
    )


def _torchrun(log_dir: Path, tag: str, *flags: str):
    from ckpt_common.ports import free_port
    from testing.vllm_servers import REPO, ServerProcess, child_env

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-port",
        str(free_port()),
        str(REPO / "examples" / "moonshot_update.py"),
        "--inference-parallel-size",
        "1",
        "--checkpoint-name",
        "tiny-iter-0",
        *flags,
    ]
    return ServerProcess(cmd, "", log_dir / f"{tag}.log", env=child_env(OMP_NUM_THREADS="1"))


def _result_line(job, timeout_s: float) -> dict:
    """The JSON line the example prints once its updates are done (the job keeps running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in job.log_tail(200_000).splitlines():
            if line.startswith('{"rank"'):
                return json.loads(line)
        if not job.alive():
            raise AssertionError(f"job exited with {job.proc.returncode} before its updates:\n{job.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"job did not finish its updates within {timeout_s:.0f} s:\n{job.log_tail()}")
        time.sleep(0.2)  # log polling interval, bounded by the deadline


def _wait_exit(job, timeout_s: float) -> int:
    try:
        return job.proc.wait(timeout_s)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: report with the log
        raise AssertionError(f"job still running after {timeout_s:.0f} s:\n{job.log_tail()}") from None


def _checksum(url: str) -> dict:
    from vllm_ext.extension_req import collective_rpc

    return collective_rpc(url, "weights_checksum", timeout_s=90.0)[0]


def test_moonshot_readme_flow_broadcast_p2p_and_join(tmp_path):
    from demo.tiny_model import load_state_dict_from_dir, make_tiny_model
    from testing.vllm_servers import completion_token_ids
    from vllm_ext.weight_cache import checkpoint_checksum

    model_dir = make_tiny_model(tmp_path / "model", seed=7)
    expected = checkpoint_checksum(load_state_dict_from_dir(model_dir))
    metas = tmp_path / "global_metas.json"
    procs = []
    try:
        a = _vllm(model_dir, tmp_path, "a")
        b = _vllm(model_dir, tmp_path, "b")
        procs += [a, b]
        # "No need to wait for vLLM to get ready": the job waits for A's /health itself
        job1 = _torchrun(
            tmp_path,
            "job1",
            "--checkpoint-path",
            str(model_dir),
            "--endpoint",
            a.url,
            "--update-method",
            "all",
            "--save-metas-file",
            str(metas),
            "--sleep-time",
            "900",
        )
        procs.append(job1)
        done1 = _result_line(job1, STARTUP_TIMEOUT_S + JOB_TIMEOUT_S)
        assert [u["method"] for u in done1["updates"]] == ["broadcast", "p2p"]
        assert all(u["metrics"]["ok"] for u in done1["updates"]), done1
        got_a = _checksum(a.url)
        assert got_a["checksum"] == expected and got_a["version"] == 2 and got_a["status"] == "ready", got_a
        tokens_a = completion_token_ids(a.url, "demo", PROMPTS, MAX_TOKENS)

        b.wait_for("/health", timeout_s=STARTUP_TIMEOUT_S)
        dummy_b = completion_token_ids(b.url, "demo", PROMPTS, MAX_TOKENS)  # cached: the join must reset it
        job2 = _torchrun(tmp_path, "job2", "--load-metas-file", str(metas), "--endpoint", b.url)
        procs.append(job2)
        assert _wait_exit(job2, JOB_TIMEOUT_S) == 0, job2.log_tail()
        assert job1.alive()  # the owner was alive throughout the join
        got_b = _checksum(b.url)
        assert got_b["checksum"] == expected and got_b["version"] == 1 and got_b["status"] == "ready", got_b
        tokens_b = completion_token_ids(b.url, "demo", PROMPTS, MAX_TOKENS)
        assert tokens_b == tokens_a
        assert tokens_b != dummy_b

        os.kill(done1["pid"], signal.SIGTERM)  # the worker ends its --sleep-time; torchrun then exits 0
        assert _wait_exit(job1, 60) == 0, job1.log_tail()
        assert _checksum(b.url)["checksum"] == expected  # B keeps its own copy once the owner is gone
    finally:
        for p in reversed(procs):
            p.stop()
