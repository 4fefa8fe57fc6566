"""The checkpoint-engine daemon managing two real vLLM servers that load from its ranks
(`vllm_ext.launch --load-rendezvous {rendezvous}`): each start, and the heal of a SIGKILLed one, updates
vLLM's load step (never dummy weights), while the other keeps answering. The start is a broadcast
(`--mode collective`); the heal is a pull that the restarted engine reads itself from rank 0's memory
through Mooncake, straight into vLLM's parameters (`--p2p-reader engine`). The dummy-start path
(`--no-initial-push`, push after health) runs in tests/integration/e2e/test_daemon_rl.py."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests.integration.dist.harness import start_daemon
from tests.integration.dist.test_ce_engines import engines

pytestmark = pytest.mark.vllm

PROMPTS = ["12+34=", "Hello world\n", "The quick brown fox"]
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 600.0


def test_daemon_heals_a_killed_vllm_engine(tmp_path):
    from ckpt_common.procs import group_shm_segments
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from testing.vllm_servers import (
        CPU_ENGINE_ARGS,
        assert_kernels_checked,
        assert_same_logprobs,
        child_env,
        completion_logprobs,
        completion_token_ids,
        http_json,
    )
    from vllm_ext.extension_req import collective_rpc
    from vllm_ext.launch_config import model_safetensors_files

    # tied embeddings (no lm_head.weight in the checkpoint), as most small open models have
    model = make_tiny_model(tmp_path / "A", TinyModelConfig.tiny(init_std=0.1, tie_word_embeddings=True), seed=11)
    engine_cmd = [
        *(sys.executable, "-m", "vllm_ext.launch", "--model", str(model), "--load-rendezvous", "{rendezvous}"),
        # the load step starts its transfer engine, connects to the owners and places the tensors
        # the daemon left beside the rendezvous while vLLM starts
        # (at the daemon's own --p2p-host, filled in for {p2p_host})
        *("--p2p-host", "{p2p_host}", "--port", "{port}", "--engine-timeout-s", "120", "--", *CPU_ENGINE_ARGS),
    ]
    daemon = start_daemon(
        *("--collective-timeout-s", "300", "--engine-log-dir", str(tmp_path)),
        *("--p2p-host", "127.0.0.1", "--mode", "collective", "--p2p-reader", "engine"),
        # the gate's /health (the default) opens once the loaded weights are in
        *("--engine-start-timeout-s", str(STARTUP_TIMEOUT_S)),
        engine_cmd=engine_cmd,
        env=child_env(),
        log=tmp_path / "daemon.log",
        ready_timeout_s=120,
        interval_s=0.2,
    )

    def call(method: str, path: str, body: dict | None = None, timeout_s: float = STARTUP_TIMEOUT_S):
        return daemon.call(method, path, body, timeout_s=timeout_s)

    try:
        code, res = call("POST", "/checkpoints", {"name": "A", "files": model_safetensors_files(str(model))})
        assert code == 200 and res["ok"], res
        code, res = call("POST", "/engines/start", {"name": "A"})  # A through vLLM's load step, then serving
        assert code == 200 and res["ok"], res
        states = engines(daemon.url)
        assert [(e["state"], e["checkpoint"]) for e in states] == [("serving", "A")] * 2, states
        tokens = [completion_token_ids(e["url"], str(model), PROMPTS, MAX_TOKENS) for e in states]
        assert tokens[0] == tokens[1]
        logprobs = completion_logprobs(states[0]["url"], str(model), PROMPTS, MAX_TOKENS)
        assert_same_logprobs(completion_logprobs(states[1]["url"], str(model), PROMPTS, MAX_TOKENS), logprobs)
        # the load step's weights passed the kernel check (asked when the receiver is taken over)
        for e in states:
            assert_kernels_checked(collective_rpc(e["url"], "weights_state", timeout_s=30.0))

        # the engine's whole process group SIGKILLed (as the OOM killer or a batch system's kill of
        # everything leaves it): its segments in /dev/shm must not outlive the heal
        dead_segments = group_shm_segments(states[1]["pid"])
        os.killpg(states[1]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        answered_during_heal = 0
        deadline = killed_at + STARTUP_TIMEOUT_S
        while True:
            now = engines(daemon.url)
            assert now[0]["state"] == "serving" and now[0]["pid"] == states[0]["pid"], now
            if now[1]["state"] == "serving" and now[1]["restarts"] == 1:
                break
            # the other engine keeps answering, with the same tokens
            assert completion_token_ids(now[0]["url"], str(model), PROMPTS, MAX_TOKENS) == tokens[0]
            answered_during_heal += 1
            assert time.monotonic() < deadline, f"not healed within {STARTUP_TIMEOUT_S} s: {now}"
            time.sleep(2.0)  # leave the two cores to the restarting engine between probes
        heal_s = time.monotonic() - killed_at
        assert answered_during_heal >= 1
        assert now[1]["last_failure"]["exit_code"] == -9 and now[1]["checkpoint"] == "A", now
        assert completion_token_ids(now[1]["url"], str(model), PROMPTS, MAX_TOKENS) == tokens[0]
        assert_same_logprobs(completion_logprobs(now[1]["url"], str(model), PROMPTS, MAX_TOKENS), logprobs)
        left = sorted(p for p in dead_segments if os.path.exists(p))
        assert not left, f"the killed engine's segments outlived its heal: {left}"
        # the healed engine's weights came in its load step (version 1), not as a push into dummy weights
        (healed_state,) = collective_rpc(now[1]["url"], "weights_state", timeout_s=30.0)
        assert healed_state["version"] == 1 and healed_state["checkpoint"] == "A", healed_state
        # ... read by the engine itself: rank 0's half of the checkpoint over Mooncake, every byte of it
        # straight into vLLM's parameters (q/k/v into slices of qkv_proj, and so on)
        reads = healed_state["last_update"]["engine_reads"]
        print(f"the healed engine's own reads: {reads}")
        assert reads["placed_bytes"] > 0 and reads["scratch_bytes"] == 0, reads
        # ... and loaded by those reads: their loaders ran once, in the slot probe, and not again after
        assert healed_state["last_update"]["num_loaded_by_read"] == reads["placed_tensors"], healed_state
        # ... whose slots were found while vLLM started, from the tensors the daemon left beside the
        # rendezvous: the pull itself probed none
        last = healed_state["last_update"]
        assert (last["probed_ahead"], last["probed_in_update"]) == (last["num_tensors"], 0), last

        # a managed update goes through vLLM's own weight-transfer routes (--engine-update-route auto: the
        # launchers say they serve them), the checkpoint's name the version vLLM reports afterwards
        code, res = call("POST", "/checkpoints", {"name": "A2", "files": model_safetensors_files(str(model))})
        assert code == 200 and res["ok"], res
        code, res = call("POST", "/update", {"name": "A2"})
        assert code == 200 and res["ok"], res
        for e in engines(daemon.url):
            assert (e["state"], e["checkpoint"]) == ("serving", "A2"), e
            assert http_json("GET", e["url"] + "/launcher/status")[1]["update_route"] == "native"
            assert http_json("GET", e["url"] + "/weight_info")[1] == {"weight_version": "A2"}, e
            assert completion_token_ids(e["url"], str(model), PROMPTS, MAX_TOKENS) == tokens[0]
            assert_same_logprobs(completion_logprobs(e["url"], str(model), PROMPTS, MAX_TOKENS), logprobs)
            assert_kernels_checked(collective_rpc(e["url"], "weights_state", timeout_s=30.0))

        serving_segments = set().union(*(group_shm_segments(e["pid"]) for e in engines(daemon.url)))
        code, res = call("POST", "/engines/stop", {})
        assert code == 200 and res["ok"], res
        assert [e["state"] for e in engines(daemon.url)] == ["stopped", "stopped"]
        for pid in (states[0]["pid"], states[1]["pid"], now[1]["pid"]):  # launchers and their vLLM processes
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)  # each engine ran in its own process group: none of it is left
        left = sorted(p for p in serving_segments if os.path.exists(p))
        assert not left, f"stopped engines left segments: {left}"
        assert daemon.shutdown(120) == 0, daemon.log_tail()
        print(f"heal of a vLLM engine: {heal_s:.1f} s (recovery_s {now[1]['recovery_s']})")
    finally:
        daemon.stop()
