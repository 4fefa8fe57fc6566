"""The RL job's side of the daemon layout (`engine.type: daemon`): versions handed over as files in
the handoff dir, registered with a real torchrun daemon (2 ranks, plain engines as --engine-cmd),
pushed into every managed engine, the old version unregistered and its files removed; a SIGKILLed
engine is healed by the daemon and the pool takes it back at the current version.

Colocated mode (`engine.colocated`): three inference -> train -> inference switches (every engine
stopped and its process gone, then started with the new version only), and a failure injected in each
phase (an engine that ignores SIGTERM at the stop, an engine that exits at once at the start, an
update that fails in the engine): the daemon keeps a clear state in etcd (stopped / failed /
incomplete, with the exit code or the error), the job's error names the phase, and the next switch
succeeds.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from checkpoint_engine.checksum import tensor_checksum
from demo.tiny_model import TinyModelConfig, make_tiny_model, random_state_dict
from orchestrator.config import EngineConfig, SyncConfig
from orchestrator.engine_pool.daemon import DaemonWeightSync, start_daemon_pool
from orchestrator.engine_pool.daemon_client import SwitchError, shard_size_bytes
from orchestrator.engine_pool.memory_source import memory_source
from tests.integration.dist.harness import rpc
from tests.integration.dist.test_ce_engines import alive, call, engines, shutdown, start_daemon, wait_for


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


def _tiny_model_and_handoff(tmp_path):
    """The demo's tiny shape, its SFT model directory (seed 0) and an empty handoff folder."""
    config = TinyModelConfig.tiny()
    model = make_tiny_model(tmp_path / "sft", config, seed=0)
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    return config, model, handoff


def _nudged(weights: dict, seed: int) -> dict:
    """`weights` with one value changed in each of two tensors: what a small optimizer step changes in bf16."""
    out = {k: t.clone() for k, t in weights.items()}
    for name in sorted(out)[:2]:
        out[name].view(-1)[seed] += 1.0
    return out


def _assert_serving(base: str, name: str, weights: dict) -> None:
    """Every engine serves `name` (the daemon's records, and the engine's own state) with exactly `weights`."""
    expected = {k: tensor_checksum(v) for k, v in weights.items()}
    for r in engines(base):
        assert r["state"] == "serving" and r["checkpoint"] == name, r
        assert rpc(r["url"], "weights_state")["checkpoint"] == name
        assert digests(r["url"]) == expected
    assert call("GET", base + "/engines")[1]["current"] == name


def test_versions_reach_every_daemon_engine_and_old_ones_are_dropped(tmp_path):
    config, model, handoff = _tiny_model_and_handoff(tmp_path)
    daemon = start_daemon(tmp_path)
    base = daemon.url
    try:
        engine_config = EngineConfig(type="daemon", endpoint=base, start_timeout_s=60)
        # plain engines hold weights but do not generate: the rollout side is a stand-in here
        pool = start_daemon_pool(
            engine_config, str(model), str(handoff), timeout_s=60, engine_for_url=NoRollouts, probe_path="/health"
        )
        sync = DaemonWeightSync(SyncConfig(timeout_s=60, delta=True), pool)
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
            result = sync.push(newer, version=2)
            assert result.kind == "full" and "more than 0.5 of the full" in result.reason  # every value changed
            expected2 = {k: tensor_checksum(v) for k, v in newer.items()}
            assert all(digests(r["url"]) == expected2 for r in engines(base))

            # sync.delta: a version that changed a few values goes as those values; the full version stays
            # registered (the daemon's current checkpoint: heals pull it), the delta is dropped after
            full_bytes = sum(v.numel() * v.element_size() for v in newer.values())
            versions = {2: newer}
            for v in (3, 4, 5):
                versions[v] = _nudged(versions[v - 1], v)
            result = sync.push(versions[3], version=3)
            assert result.kind == "delta" and result.total_bytes < full_bytes / 10, result
            _assert_serving(base, "policy-v3", versions[3])
            assert not (handoff / "policy-v3.delta").exists() and not (handoff / "policy-v2").exists()
            code, listed = call("GET", base + "/checkpoints")
            assert code == 200 and [set(r["result"]["checkpoints"]) for r in listed["ranks"]] == [{"policy-v3"}] * 2
            # a heal after a delta brings the restarted engine to the full version, which the next delta builds on
            victim = engines(base)[0]
            os.kill(victim["pid"], signal.SIGKILL)
            pool.report_failure(pool.members[0], pool.members[0].epoch, "killed by the test")
            wait_for(lambda: pool.members[0].state == "serving", "pool member 0 back", timeout_s=60)
            assert engines(base)[0]["pid"] != victim["pid"]
            _assert_serving(base, "policy-v3", versions[3])
            result = sync.push(versions[4], version=4)
            assert result.kind == "delta", result
            _assert_serving(base, "policy-v4", versions[4])
            # an engine whose weights are not the base (reset behind the daemon's back) refuses the delta: the
            # full version follows, and says why
            rpc(engines(base)[1]["url"], "reset_weights")
            result = sync.push(versions[5], version=5)
            assert result.kind == "full" and "refused the delta" in result.reason, result
            _assert_serving(base, "policy-v5", versions[5])
        finally:
            sync.close()
            pool.close()
        assert not (handoff / "policy-v5").exists()
        shutdown(daemon)
    finally:
        daemon.stop()


def test_versions_from_the_jobs_memory_reach_every_engine_without_a_file(tmp_path):
    """`sync.source: memory`: each version is registered in the job's own parameter server and the daemon
    takes its metas (POST /metas): no version is written to the handoff dir; on one host the engines read
    the job's memory in place. With `sync.delta` a small step goes as its changed values, registered from
    memory too (and dropped after). A SIGKILLed engine is healed from the full version in memory, and the
    next delta builds on it."""
    config, model, handoff = _tiny_model_and_handoff(tmp_path)
    daemon = start_daemon(tmp_path)
    base = daemon.url
    try:
        engine_config = EngineConfig(type="daemon", endpoint=base, start_timeout_s=60)
        sync_config = SyncConfig(timeout_s=60, source="memory", delta=True)
        pool = start_daemon_pool(
            engine_config,
            str(model),
            str(handoff),
            timeout_s=60,
            engine_for_url=NoRollouts,
            probe_path="/health",
            source=memory_source(sync_config),
        )
        sync = DaemonWeightSync(sync_config, pool)
        try:
            assert sync.source is pool.source and sync.source.registered == ["policy-v0"]
            assert [p.name for p in handoff.iterdir()] == ["model"]  # the engines' config and tokenizer only
            assert not list((handoff / "model").glob("*.safetensors"))
            # the job's initial push of v0, which every engine started with: nothing is sent again
            from ckpt_common.hf_dir import read_tensors

            pids = [r["pid"] for r in engines(base)]
            first = sync.push(read_tensors(model), version=0)
            assert first.update_s == 0 and first.total_bytes == 0 and "serves policy-v0 already" in first.reason
            assert [(r["pid"], r["checkpoint"]) for r in engines(base)] == [(p, "policy-v0") for p in pids]
            for version in (1, 2):
                new = random_state_dict(config, seed=10 + version)
                result = sync.push(new, version=version)
                assert result.version == version
                _assert_serving(base, f"policy-v{version}", new)
                assert not (handoff / f"policy-v{version}").exists()  # nothing went through a file
                assert sync.source.registered == [f"policy-v{version}"]  # the older one released
                # ... and the daemon forgot its metas: an update to it is refused by name, nothing reads
                # the released memory
                status, answer = call("POST", f"{base}/update", {"name": f"policy-v{version - 1}"})
                assert status == 404 and f"policy-v{version - 1}" in json.dumps(answer), (status, answer)
            assert [p.name for p in handoff.iterdir()] == ["model"]
            # a few values changed: the delta's wire tensors registered from memory, dropped after the update
            full_bytes = sum(v.numel() * v.element_size() for v in new.values())
            versions = {2: new}
            for v in (3, 4):
                versions[v] = _nudged(versions[v - 1], v)
            result = sync.push(versions[3], version=3)
            assert result.kind == "delta" and result.total_bytes < full_bytes / 10, result
            _assert_serving(base, "policy-v3", versions[3])
            assert sync.source.registered == ["policy-v3"]  # the delta dropped, the full version kept
            assert sorted(sync.source.ps.checkpoints()) == ["policy-v3"]
            status, answer = call("POST", f"{base}/update", {"name": "policy-v3.delta"})  # its metas forgotten
            assert status == 404 and "policy-v3.delta" in json.dumps(answer), (status, answer)
            assert [p.name for p in handoff.iterdir()] == ["model"]  # no file for the delta either
            victim = engines(base)[1]
            os.kill(victim["pid"], signal.SIGKILL)
            pool.report_failure(pool.members[1], pool.members[1].epoch, "killed by the test")
            wait_for(lambda: pool.members[1].state == "serving", "pool member 1 back", timeout_s=60)
            assert engines(base)[1]["pid"] != victim["pid"]
            _assert_serving(base, "policy-v3", versions[3])
            result = sync.push(versions[4], version=4)  # the healed engine holds the base
            assert result.kind == "delta", result
            _assert_serving(base, "policy-v4", versions[4])
            assert [p.name for p in handoff.iterdir()] == ["model"]
        finally:
            sync.close()
            pool.close()
        shutdown(daemon)
    finally:
        daemon.stop()


# The engine command of the colocated test: a plain engine, unless the test left a flag file for this
# rank: fail-start-r<rank> (the process exits at once: a failed start), fail-update-r<rank> (the
# engine raises on the first bucket: a failed update) or hang-stop-r<rank> (the engine's process
# ignores SIGTERM: the stop must SIGKILL its group). Each flag is used once.
ENGINE_SCRIPT = """#!/bin/sh
flags="$1"; port="$2"; rank="$3"
if [ -e "$flags/fail-start-r$rank" ]; then rm -f "$flags/fail-start-r$rank"; echo "injected: exit"; exit 3; fi
if [ -e "$flags/hang-stop-r$rank" ]; then
  rm -f "$flags/hang-stop-r$rank"; trap '' TERM
  "{python}" -m checkpoint_engine.engines.plain --port "$port"
  sleep 3600
fi
extra=""
if [ -e "$flags/fail-update-r$rank" ]; then rm -f "$flags/fail-update-r$rank"; extra="--fail-on-bucket 0"; fi
exec "{python}" -m checkpoint_engine.engines.plain --port "$port" $extra
"""


@pytest.mark.etcd
def test_colocated_switches_and_failed_phases(tmp_path, etcd_port):
    from checkpoint_engine.metadata import EtcdStore

    config, model, handoff = _tiny_model_and_handoff(tmp_path)
    flags = tmp_path / "flags"
    flags.mkdir()
    script = tmp_path / "engine.sh"
    script.write_text(ENGINE_SCRIPT.replace("{python}", sys.executable))
    engine_cmd = json.dumps(["sh", str(script), str(flags), "{port}", "{rank}"])
    # no auto-heal: the daemon must keep the state a failed switch left for the test to read
    daemon = start_daemon(
        tmp_path, "--engine-cmd", engine_cmd, "--no-auto-heal", "--metadata-url", f"etcd://127.0.0.1:{etcd_port}/ce"
    )
    base = daemon.url
    store = EtcdStore("127.0.0.1", etcd_port, prefix="/ce")

    def etcd_states() -> list[dict]:
        """Each engine's lifecycle record as etcd holds it (what an operator or another master reads)."""
        return [json.loads(store.get(f"engines/{r}/lifecycle") or "{}") for r in range(2)]

    try:
        engine_config = EngineConfig(type="daemon", endpoint=base, start_timeout_s=60, colocated=True)
        pool = start_daemon_pool(
            engine_config, str(model), str(handoff), timeout_s=60, engine_for_url=NoRollouts, probe_path="/health"
        )
        sync = DaemonWeightSync(SyncConfig(timeout_s=60), pool, colocated=True, start_timeout_s=60)

        def to_train() -> None:
            pids = [r["pid"] for r in engines(base)]
            switched = sync.before_train()
            assert switched["switch_to_train_s"] > 0
            assert [r["state"] for r in engines(base)] == ["stopped", "stopped"]
            assert not any(alive(p) for p in pids), "a stopped engine's process is still running"
            assert {m.state for m in pool.members} == {"stopped"}  # no rollout goes to a stopped engine

        def check_serves(version: int, weights: dict) -> None:
            expected = {k: tensor_checksum(v) for k, v in weights.items()}
            records = engines(base)
            assert [(r["state"], r["checkpoint"]) for r in records] == [("serving", f"policy-v{version}")] * 2
            assert all(digests(r["url"]) == expected for r in records)
            assert [m.engine.url for m in pool.members] == [r["url"] for r in records]  # the pool took the new URLs
            assert {(m.state, m.version) for m in pool.members} == {("serving", version)}

        try:
            for version in (1, 2, 3):  # three switches: inference -> train -> inference
                to_train()
                weights = random_state_dict(config, seed=version)
                result = sync.push(weights, version=version)
                assert result.switch["switch_to_inference_s"] > 0 and result.version == version
                check_serves(version, weights)
                assert not (handoff / f"policy-v{version - 1}").exists()

            # a stop that does not go as planned: rank 0's engine ignores SIGTERM -> SIGKILL of its group
            to_train()
            (flags / "hang-stop-r0").touch()
            sync.push(random_state_dict(config, seed=9), version=9)
            hung_pid = engines(base)[0]["pid"]
            to_train()  # asserts every engine stopped and its process gone
            assert not alive(hung_pid)
            assert [s["state"] for s in etcd_states()] == ["stopped", "stopped"], etcd_states()

            # a failed engine start: rank 1's process exits at once
            weights = random_state_dict(config, seed=4)
            (flags / "fail-start-r1").touch()
            with pytest.raises(SwitchError, match=r"train->inference failed in phase 'engine start"):
                sync.push(weights, version=4)
            failed = engines(base)[1]
            assert failed["state"] == "failed" and failed["exit_code"] == 3, failed
            in_etcd = etcd_states()
            assert in_etcd[1]["state"] == "failed" and in_etcd[1]["exit_code"] == 3, in_etcd
            assert engines(base)[0]["state"] != "serving"  # never serving dummy weights
            assert in_etcd[0]["state"] != "serving", in_etcd
            sync.push(weights, version=4)  # the next start: what is left stopped, every engine started
            check_serves(4, weights)

            # a failed update into the started engines: rank 0's engine raises on the first bucket
            to_train()
            weights = random_state_dict(config, seed=5)
            (flags / "fail-update-r0").touch()
            with pytest.raises(SwitchError, match=r"failed in phase 'weight update to policy-v5'"):
                sync.push(weights, version=5)
            assert engines(base)[0]["state"] == "incomplete"
            assert "policy-v5" in engines(base)[0]["last_error"]
            in_etcd = etcd_states()
            assert in_etcd[0]["state"] == "incomplete" and "policy-v5" in in_etcd[0]["last_error"], in_etcd
            sync.push(weights, version=5)
            check_serves(5, weights)
            assert [(s["state"], s["checkpoint"]) for s in etcd_states()] == [("serving", "policy-v5")] * 2
        finally:
            sync.close()
            pool.close()
        shutdown(daemon)
    finally:
        store.close()
        daemon.stop()


def test_colocated_needs_the_daemon():
    with pytest.raises(ValueError, match=r"engine.colocated=true .* set engine.type='daemon'"):
        EngineConfig(colocated=True)
    with pytest.raises(ValueError, match=r"engine.colocated='yes' must be true or false"):
        EngineConfig(type="daemon", endpoint="http://127.0.0.1:8400", colocated="yes")
    assert EngineConfig(type="daemon", endpoint="http://127.0.0.1:8400", colocated=True).colocated


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_switches_with_sleeping_engines(tmp_path, level):
    """`engine.sleep_level`: the engines sleep through training and wake with the new version; their
    processes are never restarted (the plain engine answers vLLM's sleep routes)."""
    config, model, handoff = _tiny_model_and_handoff(tmp_path)
    daemon = start_daemon(tmp_path)
    base = daemon.url
    try:
        engine_config = EngineConfig(
            type="daemon", endpoint=base, start_timeout_s=60, colocated=True, sleep_level=level
        )
        pool = start_daemon_pool(
            engine_config, str(model), str(handoff), timeout_s=60, engine_for_url=NoRollouts, probe_path="/health"
        )
        sync = DaemonWeightSync(SyncConfig(timeout_s=60), pool, colocated=True, start_timeout_s=60, sleep_level=level)
        pids = [r["pid"] for r in engines(base)]
        try:
            for version in (1, 2, 3):
                switched = sync.before_train()
                assert switched["switch_to_train_s"] > 0
                records = engines(base)
                assert [(r["state"], r["sleep_level"]) for r in records] == [("sleeping", level)] * 2, records
                assert all(call("GET", r["url"] + "/is_sleeping")[1]["is_sleeping"] for r in records)
                weights = random_state_dict(config, seed=version)
                result = sync.push(weights, version=version)
                assert result.switch["switch_to_inference_s"] > 0 and result.version == version
                expected = {k: tensor_checksum(v) for k, v in weights.items()}
                records = engines(base)
                assert [(r["state"], r["checkpoint"]) for r in records] == [("serving", f"policy-v{version}")] * 2
                assert all(digests(r["url"]) == expected for r in records)
                assert [r["pid"] for r in records] == pids  # woken, never restarted
                assert {(m.state, m.version) for m in pool.members} == {("serving", version)}
        finally:
            sync.close()
            pool.close()
        shutdown(daemon)
    finally:
        daemon.stop()
