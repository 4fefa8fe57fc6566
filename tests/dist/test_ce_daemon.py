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
from tests.dist.harness import REPO, Engine, _env, free_port, get_json


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
    out = subprocess.run([sys.executable, "-m", "checkpoint_engine", "--help"], capture_output=True, text=True,
                         env=_env(), timeout=30)
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
    engines = [Engine(), Engine()]
    port = free_port()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "checkpoint_engine", "--port", str(port), "--collective-timeout-s", "60",
         "--metrics-jsonl", str(tmp_path / "metrics.jsonl"), "--p2p-host", "127.0.0.1"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert daemon.poll() is None, daemon.stdout.read()
            try:
                get_json(base + "/health", 1.0)
                break
            except OSError:
                assert time.monotonic() < deadline, "daemon did not come up"
                time.sleep(0.1)
        code, res = call("POST", base + "/checkpoints", {"name": "m", "files": files})
        assert code == 200 and res["ok"], res
        assert sum(len(r["result"]["registered_files"]) for r in res["ranks"]) == 3
        code, res = call("POST", base + "/checkpoints", {"name": "m", "files": files})
        assert code == 500 and "already registered" in res["errors"]["0"]
        code, res = call("POST", base + "/checkpoints", {"name": "x"})
        assert code == 400 and "'files' must be a non-empty list" in res["error"]
        code, res = call("POST", base + "/update", {"name": "m", "endpoints": [e.url for e in engines], "timeout_s": 30})
        assert code == 200 and res["ok"], res
        assert res["ranks"][0]["result"]["gib_per_s"] > 0
        expected = {k: tensor_checksum(v) for k, v in tensors.items()}
        for e in engines:
            assert e.digest() == expected and e.state()["version"] == 1
        # rank 1's engine restarts empty and recovers through P2P; rank 0's engine is not touched
        from tests.dist.harness import rpc

        rpc(engines[1].url, "reset_weights")
        code, res = call("POST", base + "/update", {"name": "m", "endpoints": [e.url for e in engines], "ranks": [1]})
        assert code == 200 and res["ok"], res
        assert res["ranks"][0]["result"] == {"skipped": "not a P2P receiver"} and res["ranks"][1]["result"]["mode"] == "p2p"
        assert engines[1].digest() == expected and engines[1].state()["version"] == 1
        assert engines[0].state()["version"] == 1
        code, res = call("GET", base + "/metas/m")
        assert code == 200 and set(res["ranks"][0]["result"]["p2p_addrs"]) == {"0", "1"}
        code, res = call("POST", base + "/update", {"name": "nope", "endpoints": [e.url for e in engines]})
        assert code == 500 and "nope" in res["errors"]["0"]
        code, res = call("GET", base + "/checkpoints")
        assert res["ranks"][0]["result"]["checkpoints"]["m"]["gathered"] is True
        code, res = call("DELETE", base + "/checkpoints/m")
        assert code == 200 and res["ok"]
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3 and all(json.loads(x)["ok"] for x in lines)  # one line per rank and update
        assert call("POST", base + "/shutdown")[0] == 200
        out, _ = daemon.communicate(timeout=60)
        assert daemon.returncode == 0, out
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        for e in engines:
            e.stop()
