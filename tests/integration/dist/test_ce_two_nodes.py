"""The daemon launched as on two hosts: two torchrun agents (`--nnodes 2 --node-rank 0|1`, one rank
each, static rendezvous at node 0), as the disaggregated Kubernetes layout runs it. Every per-node
value differs from a single-node launch: both ranks have LOCAL_RANK 0, each node's engine logs go to
that node's folder, and the HTTP API is on node 0 only. Node 1's agent and its engines run in a UTS
namespace of their own (`bwrap --unshare-uts --hostname`), so the two nodes have different host
names, as two hosts do, and the daemon picks its modes itself (`--mode auto`): ranks on different
hosts cannot map each other's memory, so updates move bytes.

Checks: engines on both nodes start through their load step (a broadcast), rank 1's engine is
SIGKILLed and heals by a P2P pull from node 0 (Mooncake over TCP, as between hosts), an update
reaches both, and a shutdown through node 0's API ends both agents with exit code 0 and no engine
left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ckpt_common.ports import free_port
from testing.daemon import REPO, repo_env, status_json_when_free, stop_group
from tests.integration.dist.harness import rpc
from tests.integration.dist.test_ce_engines import ENGINE_CMD, alive, wait_for, write_checkpoint

READY_TIMEOUT_S = 90.0
NODE1_HOSTNAME = "ce-test-node1"


def _own_hostname(name: str) -> list[str]:
    """Command prefix running a process tree under host name `name` (a UTS namespace; same network)."""
    return ["bwrap", "--unshare-uts", "--hostname", name, "--dev-bind", "/", "/", "--die-with-parent", "--"]


@pytest.fixture(scope="module")
def uts_namespaces() -> None:
    try:
        probe = subprocess.run([*_own_hostname(NODE1_HOSTNAME), "hostname"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("bubblewrap (bwrap) is not installed: bash scripts/setup.sh installs it")
    if probe.returncode != 0 or probe.stdout.strip() != NODE1_HOSTNAME:
        pytest.skip(f"bwrap cannot give a process its own host name here: {probe.stderr.strip()[:300]}")


def _agent(node_rank: int, master_port: int, api_port: int, tmp_path, engine_cmd: list[str]) -> subprocess.Popen:
    """One torchrun agent ("host"), its output in node<N>.log; node 1 under a host name of its own."""
    log = open(tmp_path / f"node{node_rank}.log", "w")
    env = repo_env()
    env["GLOO_SOCKET_IFNAME"] = "lo"  # node 1's made-up host name resolves nowhere; both nodes use loopback
    try:
        return subprocess.Popen(
            [
                *(_own_hostname(NODE1_HOSTNAME) if node_rank == 1 else []),
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank)),
                *("--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port)),
                *("-m", "checkpoint_engine", "--port", str(api_port), "--engine-cmd", json.dumps(engine_cmd)),
                *("--collective-timeout-s", "60", "--engine-start-timeout-s", "60"),
                *("--engine-log-dir", str(tmp_path / f"node{node_rank}")),
                # Mooncake's address: node 1's host name resolves nowhere (on Kubernetes: the pod IP)
                *("--p2p-host", "127.0.0.1"),
                # how rollout clients reach node 1's engine (on Kubernetes: the pod IP)
                *(("--engine-url-host", "localhost") if node_rank == 1 else ()),
                *("--metrics-jsonl", str(tmp_path / f"node{node_rank}" / "updates.jsonl")),
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()


def _log(tmp_path) -> str:
    return "\n".join(f"--- node{n}.log:\n{(tmp_path / f'node{n}.log').read_text()[-3000:]}" for n in (0, 1))


def test_two_node_daemon_starts_heals_across_nodes_and_shuts_down(tmp_path, uts_namespaces):
    files, expected = write_checkpoint(tmp_path / "v1", seed=0)
    files2, expected2 = write_checkpoint(tmp_path / "v2", seed=1)
    engine_cmd = [*json.loads(ENGINE_CMD), "--load-rendezvous", "{rendezvous}"]
    master_port, api_port = free_port(), free_port()
    for n in (0, 1):
        (tmp_path / f"node{n}").mkdir()
    agents = [_agent(n, master_port, api_port, tmp_path, engine_cmd) for n in (0, 1)]
    base = f"http://127.0.0.1:{api_port}"

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        return status_json_when_free(method, base + path, body, timeout_s=60.0)  # a heal may keep it busy

    def engines() -> list[dict]:
        code, res = call("GET", "/engines")
        assert code == 200 and res["ok"], res
        return res["engines"]

    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert all(a.poll() is None for a in agents), _log(tmp_path)
            try:
                if call("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass  # node 0's API is not listening yet
            assert time.monotonic() < deadline, f"no API within {READY_TIMEOUT_S:.0f} s\n{_log(tmp_path)}"
            time.sleep(0.1)  # readiness poll, bounded by the deadline

        assert call("POST", "/checkpoints", {"name": "v1", "files": files})[0] == 200
        code, res = call("POST", "/engines/start", {"name": "v1"})
        assert code == 200 and res["ok"], (res, _log(tmp_path))
        states = engines()
        assert [(e["rank"], e["state"], e["checkpoint"]) for e in states] == [(r, "serving", "v1") for r in (0, 1)]
        assert states[0]["url"].startswith("http://127.0.0.1:") and states[1]["url"].startswith("http://localhost:")
        assert all(rpc(e["url"], "weights_digest") == expected for e in states)
        # each node's engine log went to that node's folder
        assert (tmp_path / "node0" / "engine-r0.log").exists() and (tmp_path / "node1" / "engine-r1.log").exists()

        # node 1's engine dies; its rank pulls v1 from node 0 (the owner of the other half) into the load step
        pid0, pid1 = states[0]["pid"], states[1]["pid"]
        os.kill(pid1, signal.SIGKILL)

        def healed():
            now = engines()
            assert now[0]["state"] == "serving" and now[0]["pid"] == pid0, now
            return now if now[1]["state"] == "serving" and now[1]["pid"] != pid1 else None

        states = wait_for(healed, "node 1's engine healed from node 0", timeout_s=60)
        assert states[1]["restarts"] == 1 and rpc(states[1]["url"], "weights_digest") == expected

        assert call("POST", "/checkpoints", {"name": "v2", "files": files2})[0] == 200
        code, res = call("POST", "/update", {"name": "v2"})
        assert code == 200 and res["ok"], res
        states = engines()
        assert [e["checkpoint"] for e in states] == ["v2", "v2"]
        assert all(rpc(e["url"], "weights_digest") == expected2 for e in states)

        assert call("POST", "/engines/stop", {})[0] == 200
        assert call("POST", "/shutdown")[0] == 200
        codes = [a.wait(60) for a in agents]
        assert codes == [0, 0], (codes, _log(tmp_path))
        assert not any(alive(e["pid"]) for e in states)
        # node 1's updates, modes chosen by the daemon: the start's broadcast, the heal's pull from node 0
        # over Mooncake, v2's broadcast (on one host name every one of them would be local)
        lines = (tmp_path / "node1" / "updates.jsonl").read_text().splitlines()
        got = [(m["checkpoint"], m["mode"], m["total_bytes"] > 0) for m in map(json.loads, lines)]
        assert got == [("v1", "collective", True), ("v1", "p2p", True), ("v2", "collective", True)], got
    finally:
        for a in agents:
            stop_group(a)
