"""The daemon's HTTP surface against a stub Driver (no torchrun, no ranks): the status codes a client
can act on, the bearer token, /metrics in Prometheus text, the `/v1` routes' contract, and the
token's loading at start (`__main__`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
from aiohttp.test_utils import TestClient, TestServer

from checkpoint_engine.daemon import http as daemon_http
from checkpoint_engine.daemon.http import BodyError, parse_json
from checkpoint_engine.daemon.prometheus import STAGES, DaemonMetrics, ObservedDriver
from checkpoint_engine.daemon.routes import METAS_FIELDS, make_app

WORLD = 2


class StubPS:
    world_size = WORLD


class StubBoard:
    def __init__(self, records):
        self._records = records

    def records(self):
        return [dict(r) for r in self._records]


class StubDriver:
    """Driver's surface: `run(cmd)` answers with `answer(cmd)` (default: every rank ok) and records `cmd`."""

    def __init__(self, answer=None, board=None):
        self.ps, self.host, self.board, self.current = StubPS(), None, board, None
        self.fault_injection = False
        self.cmds: list[dict] = []
        self.answer = answer or (lambda cmd: ok_result(cmd))

    def run(self, cmd, result_timeout_s=None):
        self.cmds.append(cmd)
        return self.answer(cmd)


def ok_result(cmd, results=None):
    results = results or [{} for _ in range(WORLD)]
    return {"ok": True, "op": cmd.get("op"), "ranks": [{"ok": True, "result": r} for r in results], "status": 200}


def failed_result(cmd, status, kind="engine", text="boom"):
    ranks = [{"ok": False, "error": f"{text} on rank {r}", "kind": kind} for r in range(WORLD)]
    errors = {str(r): x["error"] for r, x in enumerate(ranks)}
    out = {"ok": False, "op": cmd.get("op"), "ranks": ranks, "errors": errors}
    if status is not None:
        out["status"] = status
    return out


def serve(driver, *requests, token=None, stop=None, metrics=None):
    """Run `requests(client)` coroutines against make_app(driver) in one loop; their results."""

    async def main():
        app = make_app(driver, stop or asyncio.Event(), token=token, metrics=metrics)
        async with TestClient(TestServer(app)) as client:
            return [await r(client) for r in requests]

    return asyncio.run(main())


def req(method, path, body=None, *, raw=None, headers=None):
    """A request coroutine factory: (status, decoded JSON or text, response headers)."""

    async def go(client):
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with client.request(method, path, data=data, headers=hdrs) as resp:
            text = await resp.text()
            try:
                decoded = json.loads(text) if text else ""
            except json.JSONDecodeError:
                decoded = text
            return resp.status, decoded, dict(resp.headers)

    return go


def one(driver, method, path, body=None, **kw):
    token, stop = kw.pop("token", None), kw.pop("stop", None)
    ((status, answer, _),) = serve(driver, req(method, path, body, **kw), token=token, stop=stop)
    return status, answer


GOOD_METAS = {"checkpoint": "m", "ranks": {}, "device_ids": ["cpu", "cpu"], "pids": [1, 2], "hosts": ["h", "h"]}
GOOD = {
    "/checkpoints": {"name": "m", "files": ["/x.safetensors"]},
    "/update": {"name": "m", "endpoints": ["http://127.0.0.1:1", "http://127.0.0.1:2"]},
    "/metas": GOOD_METAS,
}


# ── 400: unknown fields (by name), bad values, deep JSON ─────────────────────────────────────────────
@pytest.mark.parametrize("path", sorted(GOOD))
def test_unknown_field_is_refused_by_name_and_never_relayed(path):
    driver = StubDriver()
    assert one(driver, "POST", path, GOOD[path])[0] == 200  # the good body passes
    driver.cmds.clear()
    status, answer = one(driver, "POST", path, {**GOOD[path], "bogus": 1})
    assert status == 400 and "'bogus'" in answer["error"] and answer["field"] == "bogus", answer
    assert driver.cmds == []


def test_every_documented_field_is_accepted():
    driver = StubDriver()
    register = {"name": "m", "files": ["/a"], "owner_ranks": [0], "split_files": True, "gather": False}
    assert one(driver, "POST", "/checkpoints", register)[0] == 200
    assert driver.cmds[-1] == {"op": "register", **register}
    update = {
        "name": "m",
        "endpoints": ["http://e0", "http://e1"],
        "ranks_per_engine": 1,
        "ranks": [1],
        "timeout_s": 5,
    }
    assert one(driver, "POST", "/update", update)[0] == 200
    assert driver.cmds[-1] == {"op": "update", **update}
    native = {"name": "m", "endpoints": "http://e", "route": "native", "pause_mode": "keep", "weight_version": "v9"}
    assert one(driver, "POST", "/update", native)[0] == 200
    assert driver.cmds[-1] == {"op": "update", **native}
    moonshot_style = {"name": "m", "update_url": "http://e", "inference_group_ranks": [0], "uds": None, "ranks": [0]}
    assert one(driver, "POST", "/update", moonshot_style)[0] == 200
    assert driver.cmds[-1]["world_size"] == WORLD


def test_metas_fields_are_those_get_metas_answers():
    from checkpoint_engine.jobs import GlobalMetas

    assert set(METAS_FIELDS) == set(GlobalMetas.from_dict(GOOD_METAS).to_dict())


def test_metas_missing_field_is_named():
    driver = StubDriver()
    status, answer = one(driver, "POST", "/metas", {k: v for k, v in GOOD_METAS.items() if k != "hosts"})
    assert status == 400 and "'hosts'" in answer["error"] and driver.cmds == []


@pytest.mark.parametrize(
    "body,field",
    [
        ({"ranks": [-1]}, "ranks"),
        ({"ranks": [WORLD]}, "ranks"),
        ({"ranks": [0, 0]}, "ranks"),
        ({"ranks": "0"}, "ranks"),
        ({"ranks": [True]}, "ranks"),
        ({"ranks_per_engine": 0}, "ranks_per_engine"),
        ({"ranks_per_engine": 3}, "ranks_per_engine"),
        ({"endpoints": ["http://only-one"]}, "endpoints"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"route": "nccl"}, "route"),
        ({"pause_mode": "freeze"}, "pause_mode"),
        ({"route": "extension", "pause_mode": "keep"}, "pause_mode"),
        ({"weight_version": ""}, "weight_version"),
        ({"weight_version": 7}, "weight_version"),
        ({"full_checkpoint": "full"}, "full_checkpoint"),  # for the managed engines only, not 'endpoints'
        ({"full_checkpoint": 3}, "full_checkpoint"),
    ],
)
def test_update_bad_value_is_400_naming_the_field(body, field):
    driver = StubDriver()
    status, answer = one(driver, "POST", "/update", {**GOOD["/update"], **body})
    assert status == 400 and f"'{field}'" in answer["error"] and answer.get("field") == field, answer
    assert driver.cmds == []


@pytest.mark.parametrize(
    "cmd,error",
    [
        ({"full_checkpoint": "m"}, "must name another checkpoint than 'name'"),
        ({"full_checkpoint": ""}, "must be a checkpoint name"),
    ],
)
def test_a_managed_delta_update_names_another_full_checkpoint(cmd, error):
    from checkpoint_engine.daemon.commands import CommandError, validate

    assert validate({"op": "update", "name": "m", "managed": True, "full_checkpoint": "m-full"})
    with pytest.raises(CommandError, match=error) as info:
        validate({"op": "update", "name": "m", "managed": True, **cmd})
    assert info.value.field == "full_checkpoint"


@pytest.mark.parametrize("field", ["route", "pause_mode", "weight_version"])
def test_route_fields_apply_to_endpoints_only(field):
    """MoonshotAI's update_url keeps its /collective_rpc; managed engines take --engine-update-route."""
    driver = StubDriver()
    value = {"route": "native", "pause_mode": "wait", "weight_version": "v1"}[field]
    status, answer = one(driver, "POST", "/update", {"name": "m", "update_url": "http://e", field: value})
    assert status == 400 and answer.get("field") == field and "'endpoints' only" in answer["error"], answer
    assert driver.cmds == []


@pytest.mark.parametrize("opening", ["[", '{"a":'])
@pytest.mark.parametrize("path", ["/checkpoints", "/update", "/metas", "/engines/stop"])
def test_deeply_nested_body_is_400_not_a_bare_500(path, opening):
    driver = StubDriver()
    t0 = time.perf_counter()
    status, answer = one(driver, "POST", path, raw=opening * 100_000)
    assert status == 400 and "nested" in answer["error"], answer
    assert time.perf_counter() - t0 < 5.0 and driver.cmds == []


def test_deep_body_on_v1_route_is_their_422():
    status, answer = one(StubDriver(), "POST", "/v1/checkpoints/m/update", raw="[" * 100_000)
    assert status == 422 and answer["detail"][0]["loc"] == ["body"], answer


def test_parse_json_counts_brackets_outside_strings_only():
    brackets = "[" * 500 + "]" * 500
    assert parse_json(json.dumps({"name": brackets, "q": 'say "[[[["'}).encode()) == {
        "name": brackets,
        "q": 'say "[[[["',
    }
    wide = {"ranks": {str(i): [[i], {"s": [i]}] for i in range(200)}}  # many brackets, 4 deep
    assert parse_json(json.dumps(wide).encode()) == wide
    assert parse_json(b"[" * 64 + b"]" * 64) is not None  # at the limit
    with pytest.raises(BodyError, match="nested"):
        parse_json(b"[" * 65 + b"]" * 65)
    with pytest.raises(BodyError, match="must be JSON"):
        parse_json(b"{nope")


def test_parse_json_scan_is_linear_on_hostile_strings():
    hostile = b'"' + b'\\"' * 1_000_000 + b"[" * 100  # an unterminated string of escaped quotes
    t0 = time.perf_counter()
    with pytest.raises(BodyError):
        parse_json(hostile)
    assert time.perf_counter() - t0 < 3.0


def test_body_must_be_an_object():
    status, answer = one(StubDriver(), "POST", "/checkpoints", [1, 2])
    assert status == 400 and "JSON object" in answer["error"]


# ── relayed statuses: 404, 409, 500, 503 from the driver ───────────────────────────────────────────
@pytest.mark.parametrize("code", [404, 409, 500, 503])
@pytest.mark.parametrize(
    "method,path,body",
    [
        ("DELETE", "/checkpoints/nope", None),
        ("GET", "/metas/nope", None),
        ("POST", "/update", {"name": "nope", "endpoints": ["http://e0", "http://e1"]}),
        ("POST", "/checkpoints", {"name": "m", "files": ["/x"]}),
    ],
)
def test_driver_status_is_the_answer(method, path, body, code):
    driver = StubDriver(lambda cmd: failed_result(cmd, code))
    status, answer = one(driver, method, path, body)
    assert status == code and answer["ok"] is False and answer["errors"], answer


def test_failure_without_a_status_is_500():
    status, _ = one(StubDriver(lambda cmd: failed_result(cmd, None)), "DELETE", "/checkpoints/x")
    assert status == 500


def test_a_daemon_fault_is_a_json_500():
    def explode(cmd):
        raise RuntimeError("store went away")

    status, answer = one(StubDriver(explode), "GET", "/checkpoints")
    assert status == 500 and "store went away" in answer["error"], answer


# ── the /v1 routes keep their contract ─────────────────────────────────────────────────────────────
def test_v1_routes_answer_as_theirs_whatever_the_driver_status():
    driver = StubDriver(lambda cmd: failed_result(cmd, 404, text="not registered"))
    status, answer = one(driver, "DELETE", "/v1/checkpoints/m")
    assert status == 500 and isinstance(answer, str) and "not registered" in answer
    assert one(StubDriver(), "POST", "/v1/checkpoints/m/files", {"files": ["/a"]}) == (200, "")
    status, answer = one(StubDriver(), "POST", "/v1/checkpoints/m/update", {"timeout": -1})
    assert status == 422 and answer["detail"][0]["loc"] == ["body", "timeout"]
    assert one(StubDriver(), "GET", "/v1/healthz") == (200, "")


# ── 503 while stopping ─────────────────────────────────────────────────────────────────────────────
def test_after_shutdown_every_route_but_health_is_503():
    driver = StubDriver()
    answers = serve(
        driver,
        req("POST", "/shutdown"),
        req("POST", "/checkpoints", GOOD["/checkpoints"]),
        req("GET", "/checkpoints"),
        req("POST", "/v1/checkpoints/m/files", {"files": ["/a"]}),
        req("GET", "/metrics"),
        req("POST", "/shutdown"),
        req("GET", "/health"),
        req("GET", "/v1/healthz"),
    )
    codes = [a[0] for a in answers]
    assert codes == [200, 503, 503, 503, 503, 503, 200, 200], answers
    assert "stopping" in answers[1][1]["error"] and answers[6][1]["stopping"] is True
    assert driver.cmds == []


def test_a_signal_stops_the_routes_too():
    stop = asyncio.Event()
    stop.set()  # what serve_http's signal handler does
    assert one(StubDriver(), "GET", "/checkpoints", stop=stop)[0] == 503
    assert one(StubDriver(), "GET", "/health", stop=stop)[0] == 200


# ── the bearer token ───────────────────────────────────────────────────────────────────────────────
def test_token_required_on_every_route_but_health(monkeypatch):
    compared = []
    real = daemon_http.hmac.compare_digest
    monkeypatch.setattr(daemon_http.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    driver = StubDriver()
    good, wrong = {"Authorization": "Bearer s3cret"}, {"Authorization": "Bearer s3cre7"}
    answers = serve(
        driver,
        req("GET", "/checkpoints"),
        req("GET", "/checkpoints", headers=wrong),
        req("GET", "/checkpoints", headers={"Authorization": "Basic s3cret"}),
        req("GET", "/metrics"),
        req("POST", "/v1/checkpoints/m/files", {"files": ["/a"]}),
        req("POST", "/shutdown"),
        req("GET", "/health"),
        req("GET", "/v1/healthz"),
        req("GET", "/checkpoints", headers=good),
        req("GET", "/metrics", headers=good),
        token="s3cret",
    )
    codes = [a[0] for a in answers]
    assert codes == [401, 401, 401, 401, 401, 401, 200, 200, 200, 200], answers
    assert "Authorization: Bearer" in answers[0][1]["error"] and answers[1][1]["error"] == "wrong bearer token"
    assert answers[0][2]["WWW-Authenticate"].startswith("Bearer")
    assert isinstance(answers[4][1], str)  # their error shape on /v1
    assert "s3cret" not in json.dumps([a[1] for a in answers[:6]])
    assert len(driver.cmds) == 1 and compared  # only the authorised GET /checkpoints was relayed


def test_no_token_configured_needs_no_header():
    assert one(StubDriver(), "GET", "/checkpoints")[0] == 200


# ── /metrics ───────────────────────────────────────────────────────────────────────────────────────
def update_metrics(rank, total_s, broadcast_s, total_bytes=3 * 2**30):
    m = {f"{s}_s": 0.01 * (i + 1) for i, s in enumerate(STAGES)}
    m.update(rank=rank, total_s=total_s, broadcast_s=broadcast_s, total_bytes=total_bytes)
    m["gib_per_s"] = total_bytes / 2**30 / total_s
    return m


def families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams, family, suffix="", **labels) -> float:
    values = [
        s.value
        for s in fams[family].samples
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(values) == 1, (family, labels, fams[family].samples)
    return values[0]


def test_metrics_after_one_update_are_consistent():
    results = [update_metrics(0, 1.5, 0.4), update_metrics(1, 2.0, 0.9)]

    def answer(cmd):
        if cmd["op"] == "update":
            return ok_result(cmd, results)
        return failed_result(cmd, 409, kind="already_registered")

    records = [
        {"rank": 0, "state": "serving", "restarts": 1, "recovery_s": 2.5},
        {"rank": 1, "state": "failed", "restarts": 0, "recovery_s": None},
    ]
    driver = StubDriver(answer, board=StubBoard(records))
    metrics = DaemonMetrics(WORLD)
    answers = serve(
        driver,
        req("POST", "/update", GOOD["/update"]),
        req("POST", "/checkpoints", GOOD["/checkpoints"]),
        req("POST", "/checkpoints", {"bogus": 1}),
        req("GET", "/metrics"),
        metrics=metrics,
    )
    assert [a[0] for a in answers] == [200, 409, 400, 200]
    _, text, headers = answers[-1]
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    fams = families(text)
    p = "checkpoint_engine_"
    assert sample(fams, p + "updates", "_total", outcome="ok") == 1
    assert sample(fams, p + "updates", "_total", outcome="error") == 0
    assert sample(fams, p + "update_bytes", "_total") == 3 * 2**30
    assert sample(fams, p + "last_update_seconds") == 2.0  # the slowest rank
    assert sample(fams, p + "last_update_gib_per_second") == pytest.approx(1.5)
    assert sample(fams, p + "last_update_stage_seconds", stage="broadcast") == 0.9
    assert {s.labels["stage"] for s in fams[p + "last_update_stage_seconds"].samples} == set(STAGES)
    assert sample(fams, p + "update_duration_seconds", "_count") == 1
    assert sample(fams, p + "update_duration_seconds", "_sum") == 2.0
    assert sample(fams, p + "failures", "_total", op="register", kind="already_registered") == 1
    assert sample(fams, p + "commands", "_total", op="update", outcome="ok") == 1
    http = p + "http_requests"
    assert sample(fams, http, "_total", route="/update", method="POST", status="200") == 1
    assert sample(fams, http, "_total", route="/checkpoints", method="POST", status="409") == 1
    assert sample(fams, http, "_total", route="/checkpoints", method="POST", status="400") == 1
    assert sample(fams, p + "engine_state", rank="0", state="serving") == 1
    assert sample(fams, p + "engine_state", rank="1", state="serving") == 0
    assert sample(fams, p + "engine_state", rank="1", state="failed") == 1
    assert sample(fams, p + "engine_restarts", rank="0") == 1
    assert sample(fams, p + "engine_recovery_seconds", rank="0") == 2.5
    assert sample(fams, p + "world_size") == WORLD
    assert fams[p + "updates"].type == "counter" and fams[p + "last_update_seconds"].type == "gauge"


P = "checkpoint_engine_"
# every family of GET /metrics: (type, help, label names, sample names); dashboards are built on these
FAMILIES = {
    P + "world_size": ("gauge", "the daemon's ranks", (), ("",)),
    P + "http_requests": (
        "counter",
        "HTTP requests answered, by route template, method and status code",
        ("method", "route", "status"),
        ("_total",),
    ),
    P + "commands": (
        "counter",
        "commands relayed to every rank (HTTP routes and the healer), by operation and outcome",
        ("op", "outcome"),
        ("_total",),
    ),
    P + "failures": (
        "counter",
        "failed commands by operation and failure kind (each kind its failing ranks reported, once per command)",
        ("kind", "op"),
        ("_total",),
    ),
    P + "updates": ("counter", "weight updates (op update), by outcome", ("outcome",), ("_total",)),
    P + "update_bytes": (
        "counter",
        "bytes of the checkpoints successful updates delivered (once per update)",
        (),
        ("_total",),
    ),
    P + "update_duration_seconds": (
        "summary",
        "seconds of successful updates (slowest rank)",
        (),
        ("_count", "_sum"),
    ),
    P + "last_update_stage_seconds": (
        "gauge",
        "the last successful update's seconds per stage, on its slowest rank",
        ("stage",),
        ("",),
    ),
    P + "last_update_seconds": ("gauge", "the last successful update's total seconds", (), ("",)),
    P + "last_update_gib_per_second": ("gauge", "the last successful update's GiB/s", (), ("",)),
    P + "last_update_bytes": ("gauge", "the last successful update's bytes", (), ("",)),
    P + "last_update_timestamp_seconds": (
        "gauge",
        "Unix time at which the last successful update ended",
        (),
        ("",),
    ),
    P + "heals": (
        "counter",
        "engine heals (restart + update to the current checkpoint), by outcome",
        ("outcome",),
        ("_total",),
    ),
    P + "heal_duration_seconds": (
        "summary",
        "seconds of each heal command (restart and update)",
        (),
        ("_count", "_sum"),
    ),
    P + "engine_state": (
        "gauge",
        "1 for the state each rank's managed engine is in, 0 for the others",
        ("rank", "state"),
        ("",),
    ),
    P + "engine_restarts": ("gauge", "restarts (heals) of each rank's managed engine", ("rank",), ("",)),
    P + "engine_recovery_seconds": (
        "gauge",
        "seconds from failure to serving of each engine's last heal",
        ("rank",),
        ("",),
    ),
}
ENGINE_FAMILIES = {P + "engine_state", P + "engine_restarts", P + "engine_recovery_seconds"}


def exposed_families(text: str) -> dict:
    """(type, help, label names, sample name suffixes) of each family in the exposition text."""
    out = {}
    for f in families(text).values():
        labels = tuple(sorted({k for s in f.samples for k in s.labels}))
        out[f.name] = (f.type, f.documentation, labels, tuple(sorted({s.name[len(f.name) :] for s in f.samples})))
    return out


def test_metric_names_types_help_and_labels_are_the_dashboards():
    metrics = DaemonMetrics(WORLD)
    metrics.observe_request("/update", "POST", 200)
    metrics.observe_command(
        {"op": "update", "heal": True}, ok_result({"op": "update"}, [update_metrics(0, 1.0, 0.5)]), 1
    )
    metrics.observe_command({"op": "update"}, failed_result({"op": "update"}, 500), 0.5)
    records = [{"rank": 0, "state": "serving", "restarts": 1, "recovery_s": 2.0}]
    assert exposed_families(metrics.render(records)) == FAMILIES  # no family more (e.g. `_created`), none less
    # a fresh daemon: every family is there; the counters with labels have no sample yet
    fresh = families(DaemonMetrics(WORLD).render())
    assert set(fresh) == set(FAMILIES) - ENGINE_FAMILIES
    assert {f for f in fresh if not fresh[f].samples} == {P + "http_requests", P + "commands", P + "failures"}
    assert sorted((s.name, tuple(s.labels.items()), s.value) for f in fresh.values() for s in f.samples) == sorted(
        [(P + "world_size", (), WORLD), (P + "update_bytes_total", (), 0)]
        + [
            (P + f"{n}_{x}", (), 0)
            for n in ("update_duration_seconds", "heal_duration_seconds")
            for x in ("count", "sum")
        ]
        + [(P + f"{n}_total", (("outcome", o),), 0) for n in ("updates", "heals") for o in ("ok", "error")]
        + [(P + "last_update_stage_seconds", (("stage", s),), 0) for s in STAGES]
        + [(P + f"last_update_{n}", (), 0) for n in ("seconds", "gib_per_second", "bytes", "timestamp_seconds")]
    )


def test_heals_through_the_observed_driver_are_counted():
    driver = StubDriver(lambda cmd: ok_result(cmd) if cmd.get("ranks") == [0] else failed_result(cmd, 500))
    metrics = DaemonMetrics(WORLD)
    observed = ObservedDriver(driver, metrics)
    observed.run({"op": "engine_start", "ranks": [0], "name": "m", "heal": True})
    observed.run({"op": "engine_start", "ranks": [1], "name": "m", "heal": True})
    assert observed.ps is driver.ps and observed.current is None  # the rest is the driver's
    fams = families(metrics.render())
    assert sample(fams, "checkpoint_engine_heals", "_total", outcome="ok") == 1
    assert sample(fams, "checkpoint_engine_heals", "_total", outcome="error") == 1
    assert sample(fams, "checkpoint_engine_heal_duration_seconds", "_count") == 2
    assert "checkpoint_engine_engine_state" not in fams  # no engine board: no engine families


def test_label_values_are_escaped():
    metrics = DaemonMetrics(WORLD)
    odd = 'a"b\\c\nd'
    metrics.observe_request(odd, "GET", 200)
    fams = families(metrics.render())
    assert sample(fams, "checkpoint_engine_http_requests", "_total", route=odd, method="GET", status="200") == 1


def test_unmatched_paths_share_one_label():
    metrics = DaemonMetrics(WORLD)
    answers = serve(StubDriver(), req("GET", "/nope/1"), req("GET", "/nope/2"), metrics=metrics)
    assert [a[0] for a in answers] == [404, 404]
    fams = families(metrics.render())
    assert sample(fams, "checkpoint_engine_http_requests", "_total", route="unmatched", status="404") == 2


# ── the token at start (__main__) ──────────────────────────────────────────────────────────────────
def test_load_token_from_file_or_environment(tmp_path):
    from checkpoint_engine.__main__ import load_token

    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert load_token(str(f), {}) == "s3cret"
    assert load_token(str(f), {"CKPT_ENGINE_TOKEN": "other"}) == "s3cret"  # the file wins
    assert load_token(None, {"CKPT_ENGINE_TOKEN": " envtok "}) == "envtok"
    assert load_token(None, {}) is None
    for bad, why in (("", "empty"), ("two words", "printable ASCII")):
        f.write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_token(str(f), {})
    with pytest.raises(ValueError, match="cannot read"):
        load_token(str(tmp_path / "missing"), {})


@pytest.mark.parametrize(
    "host,loopback",
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True)]
    + [("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("myhost", False), ("", False)],
)
def test_is_loopback(host, loopback):
    from ckpt_common.ports import is_loopback

    assert is_loopback(host) is loopback


def test_start_beyond_loopback_without_token_is_refused(monkeypatch, capsys, tmp_path):
    from checkpoint_engine.__main__ import parse_args

    monkeypatch.delenv("CKPT_ENGINE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args(["--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--token-file" in err and "CKPT_ENGINE_TOKEN" in err, err
    assert parse_args([]).token is None  # loopback: no token needed
    assert parse_args(["--host", "0.0.0.0", "--uds", str(tmp_path / "s")]).token is None
    monkeypatch.setenv("CKPT_ENGINE_TOKEN", "envtok")
    assert parse_args(["--host", "0.0.0.0"]).token == "envtok"
    assert parse_args([]).token == "envtok"  # given on loopback: enforced there too
    monkeypatch.setenv("CKPT_ENGINE_TOKEN", "")
    with pytest.raises(SystemExit):
        parse_args([])


# ── clients send the token ─────────────────────────────────────────────────────────────────────────
@pytest.fixture
def echo_server():
    from ckpt_common.httpjson import JsonRequestHandler

    class Echo(JsonRequestHandler):
        def do_GET(self):
            self.reply(200, {"auth": self.headers.get("Authorization")})

        do_POST = do_DELETE = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_httpjson_sends_the_token(echo_server):
    from ckpt_common.httpjson import call_json, post_json, status_json

    assert status_json("GET", echo_server, timeout_s=5, token="t0k") == (200, {"auth": "Bearer t0k"})
    assert status_json("GET", echo_server, timeout_s=5) == (200, {"auth": None})
    assert call_json("DELETE", echo_server, timeout_s=5, token="a") == {"auth": "Bearer a"}
    assert post_json(echo_server, {}, timeout_s=5, token="b") == {"auth": "Bearer b"}


def test_daemon_client_takes_the_token_or_the_environment(echo_server, monkeypatch):
    from orchestrator.engine_pool.daemon_client import DaemonClient

    monkeypatch.delenv("CKPT_ENGINE_TOKEN", raising=False)
    assert DaemonClient(echo_server, 5).engines() == {"auth": None}
    assert DaemonClient(echo_server, 5, token="x").engines() == {"auth": "Bearer x"}
    monkeypatch.setenv("CKPT_ENGINE_TOKEN", "fromenv\n")
    assert DaemonClient(echo_server, 5).engines() == {"auth": "Bearer fromenv"}


def test_failure_kind_falls_back_to_the_answers_kind():
    metrics = DaemonMetrics(WORLD)
    busy = {"ok": False, "op": "update", "status": 409, "kind": "busy", "ranks": [], "errors": {"0": "busy"}}
    metrics.observe_command({"op": "update"}, busy, 0.0)
    fams = families(metrics.render())
    assert sample(fams, "checkpoint_engine_failures", "_total", op="update", kind="busy") == 1
    assert sample(fams, "checkpoint_engine_updates", "_total", outcome="error") == 1
