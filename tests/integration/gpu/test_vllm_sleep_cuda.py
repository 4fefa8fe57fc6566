"""vLLM's sleep mode through the daemon, on CUDA (vLLM sleeps only there): the colocated switch
without stopping the engine.

    start (A through the load step) -> greedy tokens T
    sleep level 1 -> device memory released; wake -> the same tokens T
    sleep level 2 -> weights dropped; wake {"name": "A"} -> weights woken, A pulled, KV cache woken -> T

Run on a machine with a GPU and vLLM: `pytest -m gpu tests/integration/gpu/test_vllm_sleep_cuda.py`.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (vLLM sleeps on CUDA only)"),
]

PROMPTS = ["12+34=", "Hello world\n", "The quick brown fox"]
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 600.0


def _free_device_bytes() -> int:
    free, _total = torch.cuda.mem_get_info(0)
    return free


def test_daemon_sleeps_and_wakes_a_vllm_engine_on_cuda(tmp_path):
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from testing.vllm_servers import child_env, completion_token_ids
    from tests.integration.dist.harness import start_daemon
    from tests.integration.dist.test_ce_engines import engines
    from vllm_ext.launch_config import model_safetensors_files

    model = make_tiny_model(tmp_path / "A", TinyModelConfig.tiny(init_std=0.1), seed=11)
    engine_cmd = [
        *(sys.executable, "-m", "vllm_ext.launch", "--model", str(model), "--load-rendezvous", "{rendezvous}"),
        *("--port", "{port}", "--engine-timeout-s", "300", "--"),
        *("--enable-sleep-mode", "--gpu-memory-utilization", "0.3", "--max-model-len", "256", "--seed", "0"),
    ]
    daemon = start_daemon(
        *("--collective-timeout-s", "300", "--engine-log-dir", str(tmp_path), "--transport", "cuda"),
        *("--engine-start-timeout-s", str(STARTUP_TIMEOUT_S)),
        nproc=1,
        engine_cmd=engine_cmd,
        env=child_env(),
        log=tmp_path / "daemon.log",
        ready_timeout_s=120,
        interval_s=0.2,
    )

    def call(method: str, path: str, body: dict | None = None):
        code, res = daemon.call(method, path, body, timeout_s=STARTUP_TIMEOUT_S)
        assert code == 200 and res["ok"], (path, code, res, daemon.log_tail())
        return res

    try:
        call("POST", "/checkpoints", {"name": "A", "files": model_safetensors_files(str(model))})
        call("POST", "/engines/start", {"name": "A"})
        url = engines(daemon.url)[0]["url"]
        tokens = completion_token_ids(url, str(model), PROMPTS, MAX_TOKENS)

        awake_free = _free_device_bytes()
        call("POST", "/engines/sleep", {"level": 1})
        assert [(e["state"], e["sleep_level"]) for e in engines(daemon.url)] == [("sleeping", 1)]
        assert _free_device_bytes() > awake_free + (64 << 20), "a level-1 sleep released no device memory"
        call("POST", "/engines/wake", {})
        assert completion_token_ids(url, str(model), PROMPTS, MAX_TOKENS) == tokens

        call("POST", "/engines/sleep", {"level": 2})
        assert [(e["state"], e["checkpoint"]) for e in engines(daemon.url)] == [("sleeping", None)]
        res = call("POST", "/engines/wake", {"name": "A"})
        assert res["ranks"][0]["result"]["update"]["total_bytes"] > 0, res
        assert [(e["state"], e["checkpoint"]) for e in engines(daemon.url)] == [("serving", "A")]
        assert completion_token_ids(url, str(model), PROMPTS, MAX_TOKENS) == tokens
        call("POST", "/engines/stop", {})
        assert daemon.shutdown() == 0, daemon.log_tail()
    finally:
        daemon.stop()
