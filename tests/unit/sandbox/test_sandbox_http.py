"""The sandbox service's HTTP edge without bubblewrap: body checks (table tests), the command line built
from the config dataclasses, and the aiohttp app's answers around a fake sandbox."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sandbox.__main__ import parse_config
from sandbox.config import MIB, SandboxConfig, ServiceConfig
from sandbox.models import RunRequest, RunResult
from sandbox.service import BodyError, answer_bound_s, create_app, parse_judge, parse_run

RUN = {"language": "python", "code": "print(1)"}
CASES = [{"input": "1", "output": "1"}]


# ------------------------------------------------------------------------------ body checks
@pytest.mark.parametrize(
    "body, field",
    [
        ([RUN], "body"),
        ({"code": "x"}, "language"),
        ({**RUN, "language": "rust"}, "language"),
        ({**RUN, "code": ""}, "code"),
        ({**RUN, "code": 3}, "code"),
        ({**RUN, "stdin": None}, "stdin"),
        ({**RUN, "timeout_s": -1}, "timeout_s"),
        ({**RUN, "timeout_s": "2"}, "timeout_s"),
        ({**RUN, "timeout_s": float("inf")}, "timeout_s"),
        ({**RUN, "memory_mb": 0}, "memory_mb"),
        ({**RUN, "memory_mb": 1.5}, "memory_mb"),
        ({**RUN, "memory_mb": True}, "memory_mb"),
        ({**RUN, "extra": 1}, "extra"),
    ],
)
def test_a_bad_run_body_is_refused_naming_the_field(body, field):
    with pytest.raises(BodyError) as err:
        parse_run(body)
    assert str(err.value).startswith(f"{field}: "), err.value


def test_a_run_body_takes_the_defaults_of_run_request():
    assert parse_run(RUN) == RunRequest("python", "print(1)")
    got = parse_run({**RUN, "stdin": "x", "timeout_s": 3, "memory_mb": 512.0})
    assert (got.stdin, got.timeout_s, got.memory_mb) == ("x", 3.0, 512)
    assert isinstance(got.memory_mb, int)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"test_cases": []}, "test_cases"),
        ({"test_cases": "1"}, "test_cases"),
        ({"test_cases": [{"input": "1"}]}, "test_cases.0.output"),
        ({"test_cases": [*CASES, {"input": "1", "output": 2}]}, "test_cases.1.output"),
        ({"test_cases": [*CASES, {"input": "1", "output": "1", "x": 0}]}, "test_cases.1.x"),
        ({"test_cases": CASES, "compare": "fuzzy"}, "compare"),
        ({"test_cases": CASES, "stop_on_first_failure": 1}, "stop_on_first_failure"),
        ({}, "test_cases"),
    ],
)
def test_a_bad_judge_body_is_refused_naming_the_field(extra, field):
    with pytest.raises(BodyError) as err:
        parse_judge({**RUN, **extra})
    assert str(err.value).startswith(f"{field}: "), err.value


def test_a_judge_body_keeps_its_cases_and_options():
    got = parse_judge({**RUN, "test_cases": CASES * 2, "compare": "tokens", "stop_on_first_failure": True})
    assert [(c.input, c.output) for c in got.test_cases] == [("1", "1"), ("1", "1")]
    assert (got.compare, got.stop_on_first_failure, got.timeout_s, got.memory_mb) == ("tokens", True, 2.0, 256)


def test_the_answer_bound_covers_the_queue_and_every_run():
    cfg = ServiceConfig()
    one, ten = answer_bound_s(cfg, 2.0, 1), answer_bound_s(cfg, 2.0, 10)
    assert one > cfg.queue_timeout_s + 2.0
    assert ten - one == pytest.approx(9 * (2.0 + cfg.sandbox.setup_timeout_s + cfg.sandbox.kill_grace_s))


def test_service_config_needs_room_for_the_largest_run():
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServiceConfig(max_body_bytes=MIB)


# ------------------------------------------------------------------------------ command line
def test_the_flags_set_the_config_fields():
    cfg, args = parse_config(
        ["--port", "0", "--workers", "3", "--bwrap", "/b", "--python", "/p", "--max-timeout-s", "5", "--no-cgroup"]
    )
    assert (cfg.port, cfg.num_workers, cfg.max_queue) == (0, 3, ServiceConfig.max_queue)
    sb = cfg.sandbox
    assert (sb.bwrap_path, sb.python_executable, sb.max_timeout_s, sb.use_cgroup) == ("/b", "/p", 5.0, "off")
    assert sb.pool_size == 6  # 2 x workers unless given
    assert args.python_package is None and args.log_level == "INFO"


def test_the_defaults_come_from_the_dataclasses():
    import os

    cfg, _ = parse_config([])
    expected = ServiceConfig(num_workers=len(os.sched_getaffinity(0)))
    assert cfg == ServiceConfig(
        num_workers=expected.num_workers,
        sandbox=SandboxConfig(pool_size=2 * expected.num_workers),
    )
    cfg, _ = parse_config(["--pool-size", "0", "--cgroup", "off"])
    assert (cfg.sandbox.pool_size, cfg.sandbox.use_cgroup) == (0, "off")


def test_a_bad_flag_value_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--max-processes", "2"])
    assert exit_.value.code == 2
    assert "--max-processes" in capsys.readouterr().err


# ------------------------------------------------------------------------ the app (fake sandbox)
class FakeSandbox:
    """What the service calls: config, run, health. `gate` holds runs until set."""

    def __init__(self) -> None:
        self.config = SandboxConfig()
        self.gate = threading.Event()
        self.gate.set()

    def run(self, request: RunRequest) -> RunResult:
        self.gate.wait(30)
        return RunResult("ok", 0, request.stdin, "", 0.001)

    def health(self) -> dict:
        return {"fake": True}


async def _with_app(sandbox, config, fn):
    from aiohttp.test_utils import TestClient, TestServer

    client = TestClient(TestServer(create_app(sandbox, config)))
    await client.start_server()
    try:
        return await fn(client)
    finally:
        sandbox.gate.set()
        await client.close()


def test_the_app_answers_in_its_json_shape():
    async def calls(client):
        out = {}
        resp = await client.post("/run", json={**RUN, "stdin": "hi"})
        out["run"] = (resp.status, (await resp.json())["stdout"])
        resp = await client.post("/run", json={**RUN, "language": "rust"})
        out["bad"] = (resp.status, (await resp.json())["detail"][:9])
        resp = await client.post("/run", data=b"{not json")
        out["not json"] = (resp.status, "JSON" in (await resp.json())["detail"])
        resp = await client.post("/run", data=b"[" * 100_000 + b"]" * 100_000)
        out["deep"] = resp.status
        resp = await client.post("/run", data=b" " * (2 * MIB))
        out["large"] = (resp.status, "max_body_bytes" in (await resp.json())["detail"])
        resp = await client.get("/run")
        out["method"] = (resp.status, resp.headers.get("Allow"), (await resp.json())["error"])
        resp = await client.get("/nowhere")
        out["route"] = (resp.status, (await resp.json())["error"])
        resp = await client.get("/health")
        out["health"] = (await resp.json())["sandbox"]
        return out

    config = ServiceConfig(max_body_bytes=MIB, sandbox=SandboxConfig(max_stdin_bytes=MIB // 2, max_code_bytes=MIB // 4))
    out = asyncio.run(_with_app(FakeSandbox(), config, calls))
    assert out == {
        "run": (200, "hi"),
        "bad": (400, "language:"),
        "not json": (400, True),
        "deep": 400,
        "large": (413, True),
        "method": (405, "POST", "method not allowed"),
        "route": (404, "not found"),
        "health": {"fake": True},
    }


def test_a_full_service_answers_503_with_retry_after():
    sandbox = FakeSandbox()
    sandbox.gate.clear()

    async def calls(client):
        first = asyncio.ensure_future(client.post("/run", json=RUN))
        for _ in range(200):  # until the first is inside (bounded)
            health = await (await client.get("/health")).json()
            if health["service"]["inside"] == 1:
                break
            await asyncio.sleep(0.01)
        resp = await client.post("/run", json=RUN)
        body, retry = await resp.json(), resp.headers.get("Retry-After")
        sandbox.gate.set()
        done = await first
        return resp.status, body["status"], "capacity" in body["detail"], retry, done.status

    got = asyncio.run(_with_app(sandbox, ServiceConfig(num_workers=1, max_queue=0), calls))
    assert got == (503, "rejected", True, "1", 200)
