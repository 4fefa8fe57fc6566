"""The RL job's side of the daemon layout (`engine.type: daemon`): versions handed over as files in
the handoff dir, registered with a real torchrun daemon (2 ranks, plain engines as --engine-cmd),
pushed into every managed engine, the old version unregistered and its files removed; a SIGKILLed
engine is healed by the daemon and the pool takes it back at the current version.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from checkpoint_engine.checksum import tensor_checksum
from orchestrator.config import EngineConfig, SyncConfig
from orchestrator.daemon_engines import DaemonWeightSync, shard_size_bytes, start_daemon_pool
from tests.dist.harness import rpc, stop_group
from tests.dist.test_ce_engines import call, engines, shutdown, start_daemon, wait_for
from vllm_ext.tiny_model import TinyModelConfig, make_tiny_model, random_state_dict


@pytest.mark.parametrize(
    "sizes,ranks,expected",
    [
        ({"a": 10, "b": 10}, 2, 10),  # two even halves
        ({"a": 30, "b": 5, "c": 5}, 2, 30),  # no tensor is cut: the largest sets the floor
        ({"a": 10, "b": 10, "c": 10}, 1, 30),  # one rank: one file
        ({"a": 7}, 4, 7),
    ],
)
def test_shard_size_bytes(sizes, ranks, expected):
    assert shard_size_bytes(sizes, ranks) == expected


class NoRollouts:
    def __init__(self, url: str) -> None:
        self.url = url

    def close(self) -> None:
        pass


def digests(url: str) -> dict[str, int]:
    return rpc(url, "weights_digest")


def test_versions_reach_every_daemon_engine_and_old_ones_are_dropped(tmp_path):
    config = TinyModelConfig.tiny()
    model = make_tiny_model(tmp_path / "sft", config, seed=0)
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    daemon, base = start_daemon(tmp_path)
    try:
        engine_config = EngineConfig(type="daemon", endpoint=base, start_timeout_s=60)
        # plain engines hold weights but do not generate: the rollout side is a stand-in here
        pool = start_daemon_pool(
            engine_config, str(model), str(handoff), timeout_s=60, engine_for_url=NoRollouts, probe_path="/health"
        )
        sync = DaemonWeightSync(SyncConfig(timeout_s=60), pool)
        try:
            records = engines(base)
            assert [r["state"] for r in records] == ["serving", "serving"]
            assert {r["checkpoint"] for r in records} == {"policy-v0"}
            assert not list((handoff / "model").glob("*.safetensors"))  # weights travel as versions only
            assert (handoff / "model" / "config.json").is_file()

            new = random_state_dict(config, seed=1)
            result = sync.push(new, version=1)
            expected = {k: tensor_checksum(v) for k, v in new.items()}
            for r in engines(base):
                assert r["checkpoint"] == "policy-v1" and r["state"] == "serving"
                assert digests(r["url"]) == expected
            assert result.version == 1 and result.total_bytes == sum(v.numel() * v.element_size() for v in new.values())
            assert not (handoff / "policy-v0").exists() and (handoff / "policy-v1").is_dir()
            code, listed = call("GET", base + "/checkpoints")
            assert code == 200 and "policy-v0" not in str(listed) and "policy-v1" in str(listed)

            # SIGKILL engine 1: the daemon heals it to v1; the pool takes it back (bring_up -> serving)
            victim = engines(base)[1]
            os.kill(victim["pid"], signal.SIGKILL)
            pool.report_failure(pool.members[1], pool.members[1].epoch, "killed by the test")
            wait_for(lambda: pool.members[1].state == "serving", "pool member 1 back", timeout_s=60)
            healed = engines(base)[1]
            assert healed["pid"] != victim["pid"] and healed["checkpoint"] == "policy-v1"
            assert digests(healed["url"]) == expected
            assert pool.metrics()["engine_recoveries"] == 1

            newer = random_state_dict(config, seed=2)
            sync.push(newer, version=2)
            expected2 = {k: tensor_checksum(v) for k, v in newer.items()}
            assert all(digests(r["url"]) == expected2 for r in engines(base))
        finally:
            sync.close()
            pool.close()
        assert not (handoff / "policy-v2").exists()
        shutdown(daemon, base, tmp_path)
    finally:
        if daemon.poll() is None:
            stop_group(daemon)
    time.sleep(0)
