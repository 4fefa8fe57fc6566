"""The torchrun daemon end to end: HTTP register/update/inspect/unregister/shutdown, two ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import torch
from safetensors.torch import save_file

from checkpoint_engine.checksum import tensor_checksum
from tests.integration.dist.harness import Engine, _env, rpc, start_daemon


def call(method: str, url: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_help_is_instant():
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "checkpoint_engine", "--help"], capture_output=True, text=True, env=_env(), timeout=30
    )
    assert out.returncode == 0 and "POST /update" in out.stdout
    assert time.perf_counter() - t0 < 5.0


def test_daemon_register_update_shutdown(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(64, 33 + i, generator=g).to(torch.bfloat16) for i in range(8)}
    files = []
    for part in range(3):
        path = tmp_path / f"model-{part}.safetensors"
        save_file({k: v for i, (k, v) in enumerate(tensors.items()) if i % 3 == part}, path)
        files.append(str(path))
    daemon = start_daemon(
        *("--collective-timeout-s", "60", "--metrics-jsonl", str(tmp_path / "metrics.jsonl")),
        *("--p2p-host", "127.0.0.1"),
        log=tmp_path / "daemon.log",
    )
    base, engines = daemon.url, []
    try:
        engines += [Engine(), Engine()]
        code, res = call("POST", base + "/checkpoints", {"name": "m", "files": files})
        assert code == 200 and res["ok"], res
        assert sum(len(r["result"]["registered_files"]) for r in res["ranks"]) == 3
        code, res = call("POST", base + "/checkpoints", {"name": "m", "files": files})
        assert code == 409 and "already registered" in res["errors"]["0"]  # refused before any rank changed
        code, res = call("POST", base + "/checkpoints", {"name": "x"})
        assert code == 400 and "'files' must be a non-empty list" in res["error"]
        code, res = call(
            "POST", base + "/update", {"name": "m", "endpoints": [e.url for e in engines], "timeout_s": 30}
        )
        assert code == 200 and res["ok"], res
        assert res["ranks"][0]["result"]["gib_per_s"] > 0
        expected = {k: tensor_checksum(v) for k, v in tensors.items()}
        for e in engines:
            assert e.digest() == expected and e.state()["version"] == 1
        # rank 1's engine restarts empty and recovers through P2P; rank 0's engine is not touched
        rpc(engines[1].url, "reset_weights")
        code, res = call("POST", base + "/update", {"name": "m", "endpoints": [e.url for e in engines], "ranks": [1]})
        assert code == 200 and res["ok"], res
        # on one CPU host the receiver reads the owners' chunks in place ("local"); Mooncake ("p2p") across hosts
        assert res["ranks"][0]["result"] == {"skipped": "not a P2P receiver"}
        assert res["ranks"][1]["result"]["mode"] in ("local", "p2p")
        assert engines[1].digest() == expected and engines[1].state()["version"] == 1
        assert engines[0].state()["version"] == 1
        # a checkpoint held by rank 0 alone: rank 1's engine pulls all of it from rank 0
        code, res = call("POST", base + "/checkpoints", {"name": "o", "files": files, "owner_ranks": [0]})
        assert code == 200 and res["ok"], res
        assert [len(r["result"]["registered_files"]) for r in res["ranks"]] == [3, 0]
        rpc(engines[1].url, "reset_weights")
        code, res = call("POST", base + "/update", {"name": "o", "endpoints": [e.url for e in engines], "ranks": [1]})
        assert code == 200 and res["ok"], res
        assert res["ranks"][1]["result"]["total_bytes"] == sum(t.nbytes for t in tensors.values())
        assert engines[1].digest() == expected and engines[1].state()["version"] == 1
        for bad_owners, why in (([2], "ranks in [0, 2)"), ([], "non-empty list"), ([0, 0], "distinct"), ("0", "list")):
            code, res = call("POST", base + "/checkpoints", {"name": "p", "files": files, "owner_ranks": bad_owners})
            assert code == 400 and "'owner_ranks'" in res["error"] and why in res["error"], (bad_owners, res)
        code, res = call("DELETE", base + "/checkpoints/o")
        assert code == 200 and res["ok"]
        code, res = call("GET", base + "/metas/m")
        assert code == 200 and set(res["ranks"][0]["result"]["p2p_addrs"]) == {"0", "1"}
        code, res = call("POST", base + "/update", {"name": "nope", "endpoints": [e.url for e in engines]})
        assert code == 404 and "nope" in res["errors"]["0"]
        code, res = call("GET", base + "/checkpoints")
        assert res["ranks"][0]["result"]["checkpoints"]["m"]["gathered"] is True
        code, res = call("DELETE", base + "/checkpoints/m")
        assert code == 200 and res["ok"]
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        # one line per rank and update (a P2P pull: the receiver only)
        assert len(lines) == 4 and all(json.loads(x)["ok"] for x in lines)
        assert daemon.shutdown() == 0, daemon.log_tail()
    finally:
        daemon.stop()  # torchrun and its ranks, whatever state the test left them in
        for e in engines:
            e.stop()


# -- MoonshotAI checkpoint-engine's HTTP API on the same daemon, over a unix socket ---------------
def uds_call(uds: str, method: str, path: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, object]:
    """One HTTP request over a unix socket; (status, decoded JSON answer, {} when empty)."""
    from ckpt_common.httpjson import status_json

    return status_json(method, "http://localhost" + path, body, timeout_s=timeout_s, uds=uds)


def test_daemon_moonshot_routes_over_uds(tmp_path):
    import os
    import socket

    g = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": torch.randn(32, 17 + i, generator=g) for i in range(6)}
    files = []
    for part in range(2):
        path = tmp_path / f"model-{part}.safetensors"
        save_file({k: v for i, (k, v) in enumerate(tensors.items()) if i % 2 == part}, path)
        files.append(str(path))
    uds = str(tmp_path / "ps.sock")
    with socket.socket(socket.AF_UNIX) as s:  # a dead server's leftover socket file: taken over
        s.bind(uds)
    # as theirs: no P2P flags; ready once GET /v1/healthz (their route) answers 200 on the socket
    daemon = start_daemon(
        "--collective-timeout-s", "60", uds=uds, ready_path="/v1/healthz", log=tmp_path / "daemon.log"
    )
    engines = []
    try:
        engines += [Engine(), Engine()]
        rpc_urls = [e.url + "/collective_rpc" for e in engines]
        assert uds_call(uds, "GET", "/v1/healthz") == (200, {})
        v1 = "/v1/checkpoints/m"
        # bad requests: 422 naming the field (FastAPI's shape), nothing sent to the ranks
        code, answer = uds_call(uds, "POST", v1 + "/files", {"files": "model.safetensors"})
        assert code == 422 and answer["detail"][0]["loc"] == ["body", "files"], answer
        code, answer = uds_call(uds, "POST", v1 + "/update", {"inference_group_ranks": [5]})
        assert code == 422 and answer["detail"][0]["loc"] == ["body", "inference_group_ranks"], answer
        code, answer = uds_call(uds, "POST", v1 + "/update", {"timeout": -1})
        assert code == 422 and answer["detail"][0]["loc"] == ["body", "timeout"], answer
        code, answer = uds_call(uds, "POST", v1 + "/update", {"update_url": 7})
        assert code == 422 and answer["detail"][0]["loc"] == ["body", "update_url"], answer
        code, answer = uds_call(uds, "POST", v1 + "/update", {"ranks": [0], "inference_group_ranks": [1]})
        assert code == 422 and "inference_group_ranks" in str(answer), answer

        assert uds_call(uds, "POST", v1 + "/files", {"files": files}) == (200, {})
        # registered but not gathered: the update fails with the error text (a JSON string), 500
        code, answer = uds_call(uds, "POST", v1 + "/update", {"update_url": rpc_urls[0]})
        assert code == 500 and "gather_metas" in answer, answer
        assert uds_call(uds, "POST", v1 + "/gather-metas") == (200, {})
        # one URL per engine (our extension of update_url): a broadcast update of both engines
        assert uds_call(uds, "POST", v1 + "/update", {"update_url": rpc_urls, "timeout": 30}) == (200, {})
        expected = {k: tensor_checksum(v) for k, v in tensors.items()}
        for e in engines:
            assert e.digest() == expected and e.state()["version"] == 1
        # their P2P call: rank 1's engine restarts empty; inference_group_ranks picks its socket path
        rpc(engines[1].url, "reset_weights")
        body = {"ranks": [1], "update_url": rpc_urls[1], "inference_group_ranks": [1], "timeout": 30}
        assert uds_call(uds, "POST", v1 + "/update", body) == (200, {})
        assert engines[1].digest() == expected and engines[1].state()["version"] == 1
        assert engines[0].state()["version"] == 1  # not touched
        code, answer = uds_call(uds, "GET", "/checkpoints")  # our own routes answer on the same socket
        assert code == 200 and answer["ranks"][0]["result"]["checkpoints"]["m"]["gathered"] is True
        assert uds_call(uds, "DELETE", v1) == (200, {})
        code, answer = uds_call(uds, "DELETE", v1)
        assert code == 500 and "registered on no rank" in answer, answer
        assert uds_call(uds, "POST", "/shutdown")[0] == 200
        assert daemon.proc.wait(60) == 0, daemon.log_tail()
        assert not os.path.exists(uds)  # removed on exit
    finally:
        daemon.stop()  # torchrun and its ranks, whatever state the test left them in
        for e in engines:
            e.stop()
