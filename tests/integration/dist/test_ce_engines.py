"""Engines managed by the torchrun daemon (--engine-cmd): start, update, SIGKILL + self-healing, stop.

Two ranks, the plain engine as the engine command, the in-process metadata store (and etcd in the
`etcd` variant, where the states are read from etcd itself).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_engine.checksum import tensor_checksum
from ckpt_common.httpjson import status_json
from testing.daemon import status_json_when_free
from tests.integration.dist import harness
from tests.integration.dist.harness import Daemon, rpc, rpc_all

ENGINE_CMD = json.dumps(
    [sys.executable, "-m", "checkpoint_engine.engines.plain", "--port", "{port}", "--device", "{device}"]
)


def call(method: str, url: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, dict]:
    """The daemon's answer; asked again while a heal keeps it busy (409 busy), as its clients do."""
    return status_json_when_free(method, url, body, timeout_s=timeout_s)


def write_checkpoint(folder, seed: int) -> tuple[list[str], dict[str, int]]:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": torch.randn(32, 19 + i, generator=g) for i in range(6)}
    folder.mkdir()
    files = []
    for part in range(2):
        path = folder / f"model-{part}.safetensors"
        save_file({k: v for i, (k, v) in enumerate(tensors.items()) if i % 2 == part}, path)
        files.append(str(path))
    return files, {k: tensor_checksum(v) for k, v in tensors.items()}


def start_daemon(tmp_path, *flags: str) -> Daemon:
    """Two ranks managing plain engines (ENGINE_CMD; a later --engine-cmd in `flags` wins), logs in tmp_path."""
    return harness.start_daemon(
        *("--collective-timeout-s", "60", "--engine-start-timeout-s", "60", "--engine-log-dir", str(tmp_path)),
        *flags,
        engine_cmd=json.loads(ENGINE_CMD),
        log=tmp_path / "daemon.log",
    )


def engines(base: str) -> list[dict]:
    code, res = call("GET", base + "/engines")
    assert code == 200 and res["ok"], res
    return res["engines"]


def wait_for(predicate, what: str, timeout_s: float = 60.0, interval_s: float = 0.05):
    """Poll `predicate()` until it returns a truthy value (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(interval_s)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too (reaped later by its parent)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def shutdown(daemon: Daemon) -> None:
    assert daemon.shutdown() == 0, daemon.log_tail()


def test_engines_start_update_heal_stop(tmp_path):
    files, expected = write_checkpoint(tmp_path / "v1", seed=0)
    daemon = start_daemon(tmp_path)
    base = daemon.url
    try:
        assert [e["state"] for e in engines(base)] == ["stopped", "stopped"]
        # bad requests: 4xx naming the field; a managed update before any engine runs: 409
        code, res = call("POST", base + "/engines/start", {"ranks": [5]})
        assert code == 400 and "'ranks'" in res["error"], res
        code, res = call("POST", base + "/engines/start", {"rank": [0]})
        assert code == 400 and "unknown field(s) ['rank']" in res["error"], res
        code, res = call("POST", base + "/update", {"name": "v1"})
        assert code == 409 and res["states"] == {"0": "stopped", "1": "stopped"}, res

        t0 = time.monotonic()
        code, res = call("POST", base + "/engines/start", {})
        assert code == 200 and res["ok"], res
        start_s = time.monotonic() - t0
        states = engines(base)
        # no checkpoint yet: healthy on dummy weights, never reported as serving
        assert [(e["state"], e["healthy"]) for e in states] == [("starting", True)] * 2, states
        code, res = call("POST", base + "/engines/start", {"ranks": [1]})
        assert code == 409 and "POST /engines/stop first" in res["error"], res

        code, res = call("POST", base + "/checkpoints", {"name": "v1", "files": files})
        assert code == 200 and res["ok"], res
        code, res = call("POST", base + "/update", {"name": "v1", "timeout_s": 30})
        assert code == 200 and res["ok"], res
        states = engines(base)
        assert [(e["state"], e["checkpoint"]) for e in states] == [("serving", "v1")] * 2, states
        urls = [e["url"] for e in states]
        assert all(rpc(u, "weights_digest") == expected for u in urls)
        # an update the PS refuses before touching the engines leaves them serving v1
        code, res = call("POST", base + "/update", {"name": "nope"})
        assert code == 404 and "nope" in res["errors"]["0"], res
        states = engines(base)
        assert [(e["state"], e["checkpoint"]) for e in states] == [("serving", "v1")] * 2, states
        assert "'nope'" not in (states[0]["last_error"] or "")  # refused at the check: no engine was asked

        # SIGKILL rank 1's engine: noticed (failed, exit code -9), restarted, pulled v1 from the owners
        pid0, pid1 = states[0]["pid"], states[1]["pid"]
        killed_at, killed_wall = time.monotonic(), time.time()
        os.kill(pid1, signal.SIGKILL)

        def healed():
            now = engines(base)
            assert now[0]["state"] == "serving" and now[0]["pid"] == pid0, now  # rank 0 keeps serving
            return now if now[1]["state"] == "serving" and now[1]["pid"] != pid1 else None

        states = wait_for(healed, "rank 1's engine healed", timeout_s=60)
        heal_s = time.monotonic() - killed_at
        e1 = states[1]
        assert e1["restarts"] == 1 and e1["checkpoint"] == "v1", e1
        failure = e1["last_failure"]
        assert failure["exit_code"] == -signal.SIGKILL and "exited with code -9" in failure["reason"], failure
        assert 0 < e1["recovery_s"] < heal_s, e1
        assert 0 <= failure["at"] - killed_wall < 2.0, failure  # noticed within the watchdog's period (+ load)
        assert rpc(e1["url"], "weights_digest") == rpc(states[0]["url"], "weights_digest") == expected
        assert states[0]["restarts"] == 0

        # the next update reaches both engines again
        files2, expected2 = write_checkpoint(tmp_path / "v2", seed=1)
        assert call("POST", base + "/checkpoints", {"name": "v2", "files": files2})[0] == 200
        code, res = call("POST", base + "/update", {"name": "v2"})
        assert code == 200 and res["ok"], res
        assert call("DELETE", base + "/checkpoints/v1")[0] == 200
        states = engines(base)
        assert [(e["state"], e["checkpoint"]) for e in states] == [("serving", "v2")] * 2, states
        assert all(rpc(e["url"], "weights_digest") == expected2 for e in states)

        code, res = call("POST", base + "/engines/stop", {})
        assert code == 200 and res["ok"], res
        assert [e["state"] for e in engines(base)] == ["stopped", "stopped"]
        assert not alive(pid0) and not alive(e1["pid"])
        for pid in (pid0, pid1, e1["pid"]):  # each engine ran in its own process group: none of it is left
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)
        shutdown(daemon)
        print(f"start of 2 engines {start_s:.2f} s, heal after SIGKILL {heal_s:.2f} s, recovery_s {e1['recovery_s']}")
    finally:
        daemon.stop()


def test_tensor_parallel_engines_of_two_ranks_each_start_update_heal_and_stop_as_one(tmp_path):
    """Four ranks, `--ranks-per-engine 2`: two engines of two workers (the plain engine's `--workers`),
    each worker fed by its own rank. One record per engine under its first rank; a SIGKILLed engine is
    healed by a pull of both its workers while the other serves on; any rank of a group selects it."""
    files, expected = write_checkpoint(tmp_path / "v1", seed=0)
    cmd = [*json.loads(ENGINE_CMD), "--workers", "{ranks_per_engine}"]
    daemon = harness.start_daemon(
        *("--collective-timeout-s", "60", "--engine-start-timeout-s", "60", "--engine-log-dir", str(tmp_path)),
        *("--ranks-per-engine", "2", "--p2p-host", "127.0.0.1", "--mode", "collective"),
        engine_cmd=cmd,
        nproc=4,
        log=tmp_path / "daemon.log",
    )
    base = daemon.url
    try:
        assert call("POST", base + "/checkpoints", {"name": "v1", "files": files})[0] == 200
        code, res = call("POST", base + "/engines/start", {"name": "v1"})
        assert code == 200 and res["ok"], res
        states = engines(base)
        assert [(e["rank"], e["ranks"], e["state"], e["checkpoint"]) for e in states] == [
            (0, [0, 1], "serving", "v1"),
            (2, [2, 3], "serving", "v1"),
        ], states
        # each worker took the update of its own rank, whole (a plain worker keeps every tensor)
        assert all(rpc_all(e["url"], "weights_digest") == [expected] * 2 for e in states)

        pid0, pid2 = states[0]["pid"], states[1]["pid"]
        os.kill(pid2, signal.SIGKILL)

        def healed():
            now = engines(base)
            assert now[0]["state"] == "serving" and now[0]["pid"] == pid0, now  # the other engine serves on
            return now if now[1]["state"] == "serving" and now[1]["pid"] != pid2 else None

        states = wait_for(healed, "the engine of ranks 2-3 healed", timeout_s=60)
        assert (states[1]["restarts"], states[1]["checkpoint"], states[1]["ranks"]) == (1, "v1", [2, 3]), states
        assert rpc_all(states[1]["url"], "weights_digest") == [expected] * 2
        assert [w["checkpoint"] for w in rpc_all(states[1]["url"], "weights_state")] == ["v1", "v1"]

        # rank 3 names its group's engine: only that one stops
        code, res = call("POST", base + "/engines/stop", {"ranks": [3]})
        assert code == 200 and res["ok"], res
        assert [e["state"] for e in engines(base)] == ["serving", "stopped"]
        assert not alive(states[1]["pid"]) and alive(pid0)
        shutdown(daemon)
        assert not alive(pid0)
    finally:
        daemon.stop()


def test_engines_that_load_from_the_ps_start_and_heal_through_their_load_step(tmp_path):
    """`{rendezvous}` engines never run on dummy weights: each start, heals included, updates the
    engine's load step (the P2P pull on a heal) and only then waits for its health."""
    files, expected = write_checkpoint(tmp_path / "v1", seed=0)
    loading_cmd = [*json.loads(ENGINE_CMD), "--load-rendezvous", "{rendezvous}"]
    daemon = start_daemon(tmp_path, "--engine-cmd", json.dumps(loading_cmd))
    base = daemon.url
    try:
        code, res = call("POST", base + "/engines/start", {})
        assert code == 400 and "'name' is required" in res["error"], res  # nothing to load yet
        assert call("POST", base + "/checkpoints", {"name": "v1", "files": files})[0] == 200
        code, res = call("POST", base + "/engines/start", {"name": "v1"})
        assert code == 200 and res["ok"], res
        assert all(r["result"]["update"]["total_bytes"] > 0 for r in res["ranks"]), res
        states = engines(base)
        assert [(e["state"], e["checkpoint"], e["healthy"]) for e in states] == [("serving", "v1", True)] * 2
        assert all(rpc(e["url"], "weights_digest") == expected for e in states)

        pid0, pid1 = states[0]["pid"], states[1]["pid"]
        killed_at = time.monotonic()
        os.kill(pid1, signal.SIGKILL)

        def healed():
            now = engines(base)
            assert now[0]["state"] == "serving" and now[0]["pid"] == pid0, now
            return now if now[1]["state"] == "serving" and now[1]["pid"] != pid1 else None

        states = wait_for(healed, "rank 1's engine healed through its load step", timeout_s=60)
        e1 = states[1]
        assert e1["restarts"] == 1 and e1["checkpoint"] == "v1" and 0 < e1["recovery_s"] < time.monotonic() - killed_at
        assert rpc(e1["url"], "weights_digest") == expected
        assert rpc(e1["url"], "weights_state")["version"] == 1  # one update: the load, no dummy weights before

        # a start of a checkpoint some rank lacks is refused before any engine starts (404, nothing
        # waits in a load step); the same start of a checkpoint every rank holds then serves it
        assert call("POST", base + "/engines/stop", {})[0] == 200
        code, res = call("POST", base + "/engines/start", {"name": "nope"})
        assert code == 404 and "nope" in json.dumps(res["errors"]), res
        assert [e["state"] for e in engines(base)] == ["stopped", "stopped"]
        assert call("POST", base + "/engines/start", {"name": "v1"})[0] == 200
        states = engines(base)
        assert all(e["state"] == "serving" for e in states), states
        assert [e["checkpoint"] for e in states] == ["v1", "v1"]
        assert all(rpc(e["url"], "weights_digest") == expected for e in states)
        assert call("POST", base + "/engines/stop", {})[0] == 200
        shutdown(daemon)
    finally:
        daemon.stop()


# -- the same states, read from a real etcd ------------------------------------------------------
@pytest.mark.etcd
def test_engine_states_in_etcd_without_auto_heal(tmp_path, etcd_port):
    from checkpoint_engine.metadata import EtcdStore

    files, expected = write_checkpoint(tmp_path / "v1", seed=2)
    daemon = start_daemon(tmp_path, "--metadata-url", f"etcd://127.0.0.1:{etcd_port}/ce", "--no-auto-heal")
    base = daemon.url
    store = EtcdStore("127.0.0.1", etcd_port, prefix="/ce")

    def etcd_states() -> list[dict]:
        return [json.loads(store.get(f"engines/{r}/lifecycle") or "{}") for r in range(2)]

    try:
        assert [s.get("state") for s in etcd_states()] == ["stopped", "stopped"]
        assert call("POST", base + "/checkpoints", {"name": "v1", "files": files})[0] == 200
        code, res = call("POST", base + "/engines/start", {"name": "v1"})  # start + push before serving
        assert code == 200 and res["ok"], res
        states = etcd_states()
        assert [(s["state"], s["checkpoint"]) for s in states] == [("serving", "v1")] * 2, states

        os.kill(states[0]["pid"], signal.SIGKILL)
        failed = wait_for(lambda: etcd_states()[0]["state"] == "failed" and etcd_states(), "failed in etcd", 10)
        assert failed[0]["exit_code"] == -9 and failed[1]["state"] == "serving", failed
        time.sleep(1.0)  # no auto-heal: it stays failed (a few healer periods)
        assert etcd_states()[0]["state"] == "failed"
        code, res = call("POST", base + "/update", {"name": "v1"})
        assert code == 409 and res["states"] == {"0": "failed"}, res

        # a manual start of rank 0's engine pulls the current checkpoint (v1) from the owners
        code, res = call("POST", base + "/engines/start", {"ranks": [0]})
        assert code == 200 and res["ok"], res
        states = etcd_states()
        assert [(s["state"], s["checkpoint"]) for s in states] == [("serving", "v1")] * 2, states
        assert states[0]["restarts"] == 1 and states[0]["recovery_s"] > 0
        assert rpc(states[0]["url"], "weights_digest") == rpc(states[1]["url"], "weights_digest") == expected

        assert call("POST", base + "/engines/stop", {"ranks": [1]})[0] == 200
        assert store.get_prefix("ops/") == {}  # engine operations in flight are listed there until they end
        assert [s["state"] for s in etcd_states()] == ["serving", "stopped"]
        shutdown(daemon)  # stops rank 0's engine too
        assert [s["state"] for s in etcd_states()] == ["stopped", "stopped"]
        assert not alive(states[0]["pid"]) and not alive(states[1]["pid"])
    finally:
        store.close()
        daemon.stop()


def test_an_engine_operation_during_an_update_is_busy_and_get_engines_answers(tmp_path):
    """A command that comes while another runs is refused at once (409, naming the one in flight), never
    queued behind it; the same command once the update is done succeeds. GET /engines reads the store."""
    import threading

    files, expected = write_checkpoint(tmp_path / "v1", seed=3)
    slow = json.loads(ENGINE_CMD) + ["--load-delay-s", "1.5"]  # each bucket takes 1.5 s to load
    daemon = start_daemon(tmp_path, "--engine-cmd", json.dumps(slow))  # the last --engine-cmd wins
    base = daemon.url
    try:
        assert call("POST", base + "/checkpoints", {"name": "v1", "files": files})[0] == 200
        assert call("POST", base + "/engines/start", {})[0] == 200
        answers: dict[str, tuple[float, int]] = {}

        def post(key: str, path: str, body: dict) -> None:
            code, _ = call("POST", base + path, body)
            answers[key] = (time.monotonic(), code)

        update = threading.Thread(target=post, args=("update", "/update", {"name": "v1"}))
        update.start()
        during = wait_for(lambda: [e["state"] for e in engines(base)] == ["updating"] * 2, "updating", 30)
        t0 = time.monotonic()
        assert engines(base) and time.monotonic() - t0 < 1.0  # read from the store, not queued behind the update
        t0 = time.monotonic()
        code, res = status_json("POST", base + "/engines/stop", {"ranks": [1]}, timeout_s=60.0)
        assert code == 409 and res["kind"] == "busy" and time.monotonic() - t0 < 2.0, res
        update.join(60)
        assert during and answers["update"][1] == 200, answers
        assert call("POST", base + "/engines/stop", {"ranks": [1]})[0] == 200  # the same request, now free
        states = engines(base)
        assert [e["state"] for e in states] == ["serving", "stopped"], states
        assert rpc(states[0]["url"], "weights_digest") == expected
        shutdown(daemon)
    finally:
        daemon.stop()


def test_sigterm_to_torchrun_stops_every_rank_and_engine_within_the_deadline(tmp_path):
    """torchrun forwards SIGTERM to every rank at once: rank 0 must not wait for rank 1's answer to
    its exit command (rank 1 has left), each rank stops its engine, and all of it ends well inside
    torchrun's 30 s before SIGKILL."""
    daemon = start_daemon(tmp_path, "--stop-timeout-s", "20")
    try:
        code, res = call("POST", daemon.url + "/engines/start", {})
        assert code == 200 and res["ok"], res
        pids = [e["pid"] for e in engines(daemon.url)]
        assert all(isinstance(p, int) and alive(p) for p in pids), pids
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.proc.wait(30)
        stop_s = time.monotonic() - t0
        log = daemon.log.read_text(errors="replace")
        assert stop_s < 15, (stop_s, log[-4000:])
        assert "forcefully exiting via 9" not in log and "forcing the exit" not in log, log[-4000:]
        assert "rank 0: exiting" in log, log[-4000:]
        wait_for(lambda: not any(alive(p) for p in pids), "the engines end with their ranks", timeout_s=10)
    finally:
        daemon.stop()


def test_sigkill_to_torchrun_stops_every_rank_and_engine(tmp_path):
    """torchrun starts its ranks in sessions of their own and, SIGKILLed, signals nobody: each rank
    notices it was orphaned and stops as on SIGTERM, its engine with it."""
    import psutil

    daemon = start_daemon(tmp_path, "--stop-timeout-s", "20")
    rank_pids, engine_pids = [], []
    try:
        code, res = call("POST", daemon.url + "/engines/start", {})
        assert code == 200 and res["ok"], res
        engine_pids = [e["pid"] for e in engines(daemon.url)]
        rank_pids = [p.pid for p in psutil.Process(daemon.proc.pid).children()]
        assert len(rank_pids) == 2 and all(alive(p) for p in [*rank_pids, *engine_pids]), (rank_pids, engine_pids)
        daemon.proc.kill()  # torchrun alone
        assert daemon.proc.wait(10) == -signal.SIGKILL
        wait_for(
            lambda: not any(alive(p) for p in [*rank_pids, *engine_pids]),
            "the ranks and their engines end once torchrun is gone",
            timeout_s=30,
        )
        log = daemon.log.read_text(errors="replace")
        assert "is gone: stopping" in log and "forcing the exit" not in log, log[-4000:]
    finally:
        daemon.stop()
        for pid in [*rank_pids, *engine_pids]:  # left by a failure above (not in torchrun's group)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_engines_sleep_and_wake_at_both_levels(tmp_path):
    """vLLM's sleep mode through the daemon (plain engines answer its routes the same way): level 1
    keeps the weights, level 2 drops them and the wake updates them (weights woken first, KV cache
    after), and bad requests are refused before any engine is touched."""
    files, expected = write_checkpoint(tmp_path / "v1", seed=0)
    files2, expected2 = write_checkpoint(tmp_path / "v2", seed=1)
    daemon = start_daemon(tmp_path)
    base = daemon.url

    def view() -> list[tuple]:
        return [(e["state"], e["checkpoint"], e["sleep_level"]) for e in engines(base)]

    def asleep(url: str) -> bool:
        code, res = call("GET", url + "/is_sleeping")
        assert code == 200, res
        return res["is_sleeping"]

    try:
        assert call("POST", base + "/checkpoints", {"name": "v1", "files": files})[0] == 200
        assert call("POST", base + "/engines/start", {"name": "v1"})[0] == 200
        urls = [e["url"] for e in engines(base)]
        code, res = call("POST", base + "/engines/sleep", {"level": 3})
        assert code == 400 and "'level'" in res["error"], res
        code, res = call("POST", base + "/engines/wake", {})
        assert code == 409 and "not sleeping" in res["error"], res

        # level 1: the weights come back as they were; a sleeping engine takes no update
        code, res = call("POST", base + "/engines/sleep", {"level": 1})
        assert code == 200 and res["ok"], res
        assert view() == [("sleeping", "v1", 1)] * 2
        assert all(asleep(u) for u in urls)
        code, res = call("POST", base + "/update", {"name": "v1"})
        assert code == 409 and res["states"] == {"0": "sleeping", "1": "sleeping"}, res
        code, res = call("POST", base + "/engines/sleep", {})
        assert code == 409 and "only a serving engine sleeps" in res["error"], res
        # an engine that dies asleep is healed and put back to sleep at its level
        pid1 = engines(base)[1]["pid"]
        os.kill(pid1, signal.SIGKILL)
        back = lambda: (e := engines(base)[1])["pid"] != pid1 and e["state"] == "sleeping" and e
        e1 = wait_for(back, "rank 1's engine healed and asleep again", timeout_s=60)
        assert e1["restarts"] == 1 and e1["sleep_level"] == 1 and e1["checkpoint"] == "v1", e1
        urls[1] = e1["url"]
        assert asleep(urls[1])
        code, res = call("POST", base + "/engines/wake", {})
        assert code == 200 and res["ok"], res
        assert view() == [("serving", "v1", None)] * 2
        assert all(rpc(u, "weights_digest") == expected and not asleep(u) for u in urls)

        # level 2: the weights are gone; the wake brings the named checkpoint
        assert call("POST", base + "/engines/sleep", {"level": 2})[0] == 200
        assert view() == [("sleeping", None, 2)] * 2
        assert call("POST", base + "/checkpoints", {"name": "v2", "files": files2})[0] == 200
        code, res = call("POST", base + "/engines/wake", {"name": "v2"})
        assert code == 200 and res["ok"], res
        assert all(r["result"]["update"]["total_bytes"] > 0 for r in res["ranks"]), res
        assert view() == [("serving", "v2", None)] * 2
        assert all(rpc(u, "weights_digest") == expected2 and not asleep(u) for u in urls)

        # one engine at level 2, woken without a name: it pulls the current checkpoint (v2) alone
        assert call("POST", base + "/engines/sleep", {"ranks": [1], "level": 2})[0] == 200
        assert view() == [("serving", "v2", None), ("sleeping", None, 2)]
        code, res = call("POST", base + "/engines/wake", {"ranks": [1]})
        assert code == 200 and res["ok"], res
        assert view() == [("serving", "v2", None)] * 2
        assert rpc(urls[1], "weights_digest") == expected2 and not asleep(urls[1])
        assert call("POST", base + "/engines/stop", {})[0] == 200
        shutdown(daemon)
    finally:
        daemon.stop()


def test_an_engine_without_sleep_mode_refuses_and_keeps_serving(tmp_path):
    files, expected = write_checkpoint(tmp_path / "v1", seed=0)
    daemon = start_daemon(tmp_path, "--engine-cmd", json.dumps([*json.loads(ENGINE_CMD), "--no-sleep-mode"]))
    base = daemon.url
    try:
        assert call("POST", base + "/checkpoints", {"name": "v1", "files": files})[0] == 200
        assert call("POST", base + "/engines/start", {"name": "v1"})[0] == 200
        code, res = call("POST", base + "/engines/sleep", {"level": 1})
        assert code == 500 and "refused to sleep" in res["errors"]["0"] and "--enable-sleep-mode" in res["errors"]["1"]
        states = engines(base)
        assert [(e["state"], e["checkpoint"]) for e in states] == [("serving", "v1")] * 2
        assert call("POST", base + "/update", {"name": "v1"})[0] == 200  # still takes updates
        assert all(rpc(e["url"], "weights_digest") == expected for e in states)
        shutdown(daemon)
    finally:
        daemon.stop()
