"""The daemon's service surface through a real torchrun daemon (two ranks, one start shared by the
checks): the bearer token, the status codes of malformed requests, /metrics after one update; and the
start refused beyond loopback without a token."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from checkpoint_engine.daemon.prometheus import STAGES
from ckpt_common.httpjson import status_json
from tests.integration.dist.harness import REPO, Engine, _env, free_port, start_daemon
from tests.integration.dist.test_ce_engines import write_checkpoint

TOKEN = "integration-t0ken"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    files, _ = write_checkpoint(tmp / "ckpt", seed=3)
    nbytes = sum(t.nbytes for f in files for t in load_file(f).values())
    d = start_daemon("--collective-timeout-s", "60", "--token-file", str(token_file), log=tmp / "daemon.log")
    engines = []
    try:
        engines += [Engine(), Engine()]
        yield d, files, engines, nbytes
    finally:
        d.stop()
        for e in engines:
            e.stop()


def call(d, method, path, body=None, token=TOKEN):
    return status_json(method, d.url + path, body, timeout_s=60, token=token)


def test_token_deep_json_unknown_fields_and_metrics(daemon):
    d, files, engines, nbytes = daemon
    endpoints = [e.url for e in engines]
    # the token: health without, everything else with
    assert call(d, "GET", "/health", token=None)[0] == 200
    code, answer = call(d, "GET", "/checkpoints", token=None)
    assert code == 401 and "Bearer" in answer["error"], answer
    assert call(d, "GET", "/metrics", token="wrong")[0] == 401
    assert call(d, "POST", "/v1/checkpoints/m/files", {"files": files}, token=None)[0] == 401
    # malformed requests: 400 naming what is wrong, nothing relayed
    code, answer = call(d, "POST", "/update", {"name": "m", "endpoints": endpoints, "bogus": 1})
    assert code == 400 and "'bogus'" in answer["error"], answer
    code, answer = call(d, "POST", "/update", {"name": "m", "endpoints": endpoints, "ranks": [-1]})
    assert code == 400 and "'ranks'" in answer["error"], answer
    code, answer = call(d, "POST", "/checkpoints")  # no body: its fields are missing
    assert code == 400 and "'name'" in answer["error"], answer
    conn_status, text = _raw_post(d, "/checkpoints", b"[" * 100_000)
    assert conn_status == 400 and "nested" in text, text
    # one update, then /metrics says so
    code, answer = call(d, "POST", "/checkpoints", {"name": "m", "files": files})
    assert code == 200 and answer["ok"], answer
    code, answer = call(d, "POST", "/checkpoints", {"name": "m", "files": files})  # already registered
    assert code == answer.get("status", 500) and code in (409, 500), answer
    code, answer = call(d, "POST", "/update", {"name": "m", "endpoints": endpoints, "timeout_s": 30})
    assert code == 200 and answer["ok"], answer
    code, answer = call(d, "DELETE", "/checkpoints/nope")  # unknown checkpoint
    assert code == answer.get("status", 500) and code in (404, 500), answer
    code, inspect = call(d, "GET", "/checkpoints")
    last = inspect["ranks"][0]["result"]["last_update"]
    assert last["total_bytes"] == nbytes

    status, answer = call(d, "GET", "/metrics")
    assert status == 200
    text = answer["raw"]  # not JSON: Prometheus text
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(family, suffix="", **labels):
        (v,) = [
            s.value
            for s in fams[family].samples
            if s.name == family + suffix and all(s.labels.get(k) == x for k, x in labels.items())
        ]
        return v

    p = "checkpoint_engine_"
    assert value(p + "updates", "_total", outcome="ok") == 1
    assert value(p + "update_bytes", "_total") == nbytes
    assert value(p + "last_update_bytes") == nbytes
    assert value(p + "last_update_seconds") >= last["total_s"] > 0  # the slowest rank's
    assert value(p + "last_update_gib_per_second") > 0
    assert {s.labels["stage"] for s in fams[p + "last_update_stage_seconds"].samples} == set(STAGES)
    assert value(p + "world_size") == 2
    http = p + "http_requests"
    assert value(http, "_total", route="/update", method="POST", status="200") == 1
    assert value(http, "_total", route="/update", method="POST", status="400") == 2
    assert value(http, "_total", route="/checkpoints", method="GET", status="401") == 1
    assert value(p + "failures", "_total", op="register", kind=_kind_or_unknown(fams, "register")) >= 1
    code, _ = call(d, "POST", "/shutdown")
    assert code == 200
    assert d.proc.wait(60) == 0, d.log_tail()


def _kind_or_unknown(fams, op: str) -> str:
    (kind,) = {s.labels["kind"] for s in fams["checkpoint_engine_failures"].samples if s.labels["op"] == op}
    return kind


def _raw_post(d, path: str, data: bytes) -> tuple[int, str]:
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(d.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
        conn.request("POST", path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_start_beyond_loopback_without_token_is_refused():
    env = {k: v for k, v in _env().items() if k != "CKPT_ENGINE_TOKEN"}
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
            *("--master-port", str(free_port()), "-m", "checkpoint_engine", "--host", "0.0.0.0"),
            *("--port", str(free_port())),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "--token-file" in text and "CKPT_ENGINE_TOKEN" in text, text[-3000:]
    assert time.perf_counter() - t0 < 60
