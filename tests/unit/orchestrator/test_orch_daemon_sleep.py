"""Colocated switches with ``engine.sleep_level``: the engines sleep (POST /engines/sleep) before training
and wake with the new version (POST /engines/wake) after it, against an in-process fake daemon."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt_common.dictconfig import to_dict
from ckpt_common.httpjson import JsonRequestHandler
from orchestrator.config import EngineConfig, SyncConfig, load_config
from orchestrator.engine_pool.daemon import PARKED, DaemonEnginePool, DaemonWeightSync
from orchestrator.engine_pool.daemon_client import DaemonClient, SwitchError
from orchestrator.engine_pool.pool_members import SERVING, Member
from orchestrator.loop_setup import check_resumable
from testing.http_stub import serve_stub

NUM_ENGINES = 2
START_TIMEOUT_S = 30.0
UPDATE_S = 0.25  # what the fake daemon reports as each rank's update time on wake


# -- config -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "colocated, sleep_level, match",
    [
        (False, 0, None),
        (True, 0, None),
        (True, 1, None),
        (True, 2, None),
        (False, 1, r"engine\.sleep_level=1 .* set engine\.colocated=true"),
        (False, 2, r"engine\.sleep_level=2 .* set engine\.colocated=true"),
        (True, 3, r"engine\.sleep_level=3 must be 0 .*, 1 or 2"),
        (True, -1, r"engine\.sleep_level=-1 must be"),
        (True, True, r"engine\.sleep_level=True must be"),  # a bool is not a level
        (True, 1.0, r"engine\.sleep_level=1\.0 must be"),
        (True, "1", r"engine\.sleep_level='1' must be"),
    ],
)
def test_sleep_level_validation(colocated, sleep_level, match):
    make = lambda: EngineConfig(
        type="daemon", endpoint="http://127.0.0.1:8400", colocated=colocated, sleep_level=sleep_level
    )
    if match is None:
        assert make().sleep_level == sleep_level
    else:
        with pytest.raises(ValueError, match=match):
            make()


def test_sleep_level_defaults_to_stop_and_start_and_loads_from_overrides():
    assert EngineConfig().sleep_level == 0
    overrides = ["engine.type=daemon", "engine.endpoint=http://127.0.0.1:8400", "engine.colocated=true"]
    assert load_config(None, [*overrides, "engine.sleep_level=2"]).engine.sleep_level == 2
    with pytest.raises(ValueError, match=r"engine\.sleep_level"):
        load_config(None, ["engine.sleep_level=1"])  # not colocated


def test_a_run_saved_before_sleep_level_resumes_as_stop_and_start():
    current = to_dict(load_config(None, []))
    saved = {**current, "engine": {k: v for k, v in current["engine"].items() if k != "sleep_level"}}
    check_resumable(saved, current)


# -- a fake daemon ------------------------------------------------------------------------------------
class FakeDaemon(JsonRequestHandler):
    """The daemon's engine routes over one record per rank. ``faults`` scripts failures:
    "refuse_sleep" (500, engines keep serving), "sleep_leaves_awake" (200 but rank 1 keeps serving),
    "wake_fails" (500, rank 1 incomplete), "wake_wrong_checkpoint" (200 but rank 1 serves the old one)."""

    engines: list[dict] = []
    current: str | None = None
    calls: list[tuple[str, str, dict]] = []
    faults: set[str] = set()
    lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        cls.engines = [
            {"rank": r, "state": "serving", "checkpoint": "policy-v0", "url": f"http://127.0.0.1:{9000 + r}"}
            for r in range(NUM_ENGINES)
        ]
        cls.current, cls.calls, cls.faults = "policy-v0", [], set()

    def do_GET(self):
        with self.lock:
            self.reply(200, {"ok": True, "current": self.current, "engines": [dict(e) for e in self.engines]})

    def do_DELETE(self):
        with self.lock:
            self.calls.append(("DELETE", self.path, {}))
            self.reply(200, {"ok": True})

    def do_POST(self):
        body = self.read_json()
        with self.lock:
            self.calls.append(("POST", self.path, body))
            status, answer = self._post(self.path, body)
            self.reply(status, answer)

    def _post(self, route: str, body: dict) -> tuple[int, dict]:
        cls = type(self)
        if route == "/checkpoints":
            cls.current = body["name"]
            return 200, {"ok": True}
        if route == "/engines/stop":
            for e in self.engines:
                e.update(state="stopped", checkpoint=None, sleep_level=None)
            return 200, {"ok": True}
        if route == "/engines/start":
            for e in self.engines:
                e.update(state="serving", checkpoint=body["name"], url=e["url"] + "0")  # a new process
            return 200, {"ok": True, "ranks": []}
        if route == "/engines/sleep":
            if any(e["state"] != "serving" for e in self.engines):
                return 409, {"ok": False, "error": "not serving"}
            if "refuse_sleep" in self.faults:
                return 500, {"ok": False, "errors": {"0": "the engine refused to sleep (no sleep mode)"}}
            for e in self.engines:
                if not (e["rank"] == 1 and "sleep_leaves_awake" in self.faults):
                    level = body.get("level", 1)
                    e.update(state="sleeping", sleep_level=level, checkpoint=e["checkpoint"] if level == 1 else None)
            return 200, {"ok": True}
        if route == "/engines/wake":
            if any(e["state"] != "sleeping" for e in self.engines):
                return 409, {"ok": False, "error": "not sleeping"}
            name = body.get("name") or self.current
            for e in self.engines:
                e.update(state="serving", checkpoint=name, sleep_level=None)
            if "wake_fails" in self.faults:
                self.engines[1].update(state="incomplete", checkpoint=None, last_error="update failed")
                return 500, {"ok": False, "errors": {"1": "update failed"}}
            if "wake_wrong_checkpoint" in self.faults:
                self.engines[1]["checkpoint"] = "policy-v0"
            ranks = [{"rank": e["rank"], "result": {"update": {"total_s": UPDATE_S}}} for e in self.engines]
            return 200, {"ok": True, "ranks": ranks}
        if route == "/update":
            wanted = set(body.get("ranks") or [r for e in self.engines for r in e.get("ranks", [e["rank"]])])
            for e in self.engines:
                if wanted & set(e.get("ranks", [e["rank"]])):
                    e.update(state="serving", checkpoint=body["name"])
            return 200, {"ok": True, "ranks": []}
        return 404, {"ok": False, "error": f"no route {route}"}


class FakeEngine:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def daemon():
    FakeDaemon.reset()
    with serve_stub(FakeDaemon) as url:
        yield url


@pytest.fixture
def make_sync(daemon, tmp_path):
    pools = []

    def make(sleep_level: int) -> DaemonWeightSync:
        client = DaemonClient(daemon, timeout_s=10.0)
        records = client.engines()["engines"]
        members = [Member(i, engine=FakeEngine(), state=SERVING, version=0) for i in range(NUM_ENGINES)]
        pool = DaemonEnginePool(
            members,
            client=client,
            handoff=tmp_path,
            records=records,
            probe_path="/v1/models",
            connect=lambda member: FakeEngine(),
        )
        pools.append(pool)
        return DaemonWeightSync(
            SyncConfig(timeout_s=10), pool, colocated=True, start_timeout_s=START_TIMEOUT_S, sleep_level=sleep_level
        )

    yield make
    for pool in pools:
        pool.close()
        pool.stop_healing()


def routes() -> list[str]:
    return [f"{method} {path}" for method, path, _ in FakeDaemon.calls]


def bodies(route: str) -> list[dict]:
    return [body for method, path, body in FakeDaemon.calls if f"{method} {path}" == route]


TENSORS = {"w": torch.zeros(4)}


# -- the switches -------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2])
def test_engines_sleep_for_training_and_wake_with_the_new_version(make_sync, level):
    sync = make_sync(level)
    switched = sync.before_train()
    assert set(switched) == {"switch_to_train_s"} and switched["switch_to_train_s"] >= 0
    assert bodies("POST /engines/sleep") == [{"level": level}]
    assert all(e["state"] == "sleeping" for e in FakeDaemon.engines)
    assert all(m.state == PARKED and m.engine is None for m in sync.pool.members)

    result = sync.push(TENSORS, 1)
    assert bodies("POST /engines/wake") == [{"name": "policy-v1", "timeout_s": START_TIMEOUT_S}]
    assert "POST /engines/stop" not in routes() and "POST /engines/start" not in routes()
    assert [(e["state"], e["checkpoint"]) for e in FakeDaemon.engines] == [("serving", "policy-v1")] * NUM_ENGINES
    assert [(m.state, m.version) for m in sync.pool.members] == [(SERVING, 1)] * NUM_ENGINES
    assert all(isinstance(m.engine, FakeEngine) for m in sync.pool.members)
    assert set(result.switch) == {"switch_to_inference_s"} and result.switch["switch_to_inference_s"] >= 0
    assert result.update_s == UPDATE_S  # the daemon's update into the woken engines
    assert "DELETE /checkpoints/policy-v0" in routes()

    sync.before_train()  # a second round trip: the same switches
    sync.push(TENSORS, 2)
    assert [b["name"] for b in bodies("POST /engines/wake")] == ["policy-v1", "policy-v2"]


def test_sleep_level_0_stops_and_starts(make_sync):
    sync = make_sync(0)
    sync.before_train()
    sync.push(TENSORS, 1)
    assert "POST /engines/stop" in routes() and bodies("POST /engines/start") == [{"name": "policy-v1"}]
    assert not bodies("POST /engines/sleep") and not bodies("POST /engines/wake")


def test_an_engine_that_refuses_to_sleep_names_the_fix_and_the_next_push_starts_the_engines(make_sync):
    sync = make_sync(1)
    FakeDaemon.faults = {"refuse_sleep"}
    with pytest.raises(
        SwitchError,
        match=r"inference->train: POST /engines/sleep \{level: 1\} failed: .*500.*"
        r"--enable-sleep-mode; else set engine\.sleep_level=0",
    ):
        sync.before_train()
    FakeDaemon.faults = set()
    sync.push(TENSORS, 1)  # the engines still serve (not asleep): stopped and started, not woken
    assert not bodies("POST /engines/wake") and bodies("POST /engines/start") == [{"name": "policy-v1"}]
    assert [(e["state"], e["checkpoint"]) for e in FakeDaemon.engines] == [("serving", "policy-v1")] * NUM_ENGINES
    assert [m.state for m in sync.pool.members] == [SERVING] * NUM_ENGINES


def test_an_engine_left_awake_names_every_engines_state(make_sync):
    sync = make_sync(2)
    FakeDaemon.faults = {"sleep_leaves_awake"}
    with pytest.raises(
        SwitchError, match=r"inference->train: engines not sleeping .*rank 0: sleeping; rank 1: serving policy-v0"
    ):
        sync.before_train()


def test_a_failed_wake_names_the_phase_and_the_next_push_starts_every_engine(make_sync):
    sync = make_sync(1)
    sync.before_train()
    FakeDaemon.faults = {"wake_fails"}
    with pytest.raises(
        SwitchError,
        match=r"train->inference failed in phase 'weight update to policy-v1' \(POST /engines/wake "
        r"\{name: policy-v1\}\).*rank 0: serving policy-v1; rank 1: incomplete \(update failed\)",
    ):
        sync.push(TENSORS, 1)
    FakeDaemon.faults = set()
    sync.push(TENSORS, 1)  # the retry: not all asleep, so every engine is stopped and started
    assert routes()[-3:] == ["POST /engines/stop", "POST /engines/start", "DELETE /checkpoints/policy-v0"]
    assert [(e["state"], e["checkpoint"]) for e in FakeDaemon.engines] == [("serving", "policy-v1")] * NUM_ENGINES


def test_a_wake_that_leaves_an_engine_on_the_old_version_is_a_switch_error(make_sync):
    sync = make_sync(1)
    sync.before_train()
    FakeDaemon.faults = {"wake_wrong_checkpoint"}
    with pytest.raises(
        SwitchError,
        match=r"after POST /engines/wake \{name: policy-v1\} the engines do not all serve policy-v1 "
        r"\(rank 1: serving policy-v0\)",
    ):
        sync.push(TENSORS, 1)


def test_a_push_names_tensor_parallel_engines_by_their_first_rank(make_sync):
    """The daemon's records of TP 2 engines (`--ranks-per-engine 2`): the second engine, of ranks 2-3,
    is selected by rank 2, not by its place in the list (1 would select the first engine's group)."""
    from orchestrator.engine_pool.daemon_client import num_ranks

    FakeDaemon.engines = [
        {"rank": 0, "ranks": [0, 1], "state": "failed", "checkpoint": None, "url": "http://127.0.0.1:9000"},
        {"rank": 2, "ranks": [2, 3], "state": "serving", "checkpoint": "policy-v0", "url": "http://127.0.0.1:9002"},
    ]
    sync = make_sync(0)
    sync.colocated = False
    sync.push(TENSORS, 1)
    assert bodies("POST /update") == [{"name": "policy-v1", "ranks": [2]}]
    assert [e["checkpoint"] for e in FakeDaemon.engines] == [None, "policy-v1"]  # the healing one is left to its heal
    assert num_ranks(FakeDaemon.engines) == 4 and num_ranks([{"rank": 0}, {"rank": 1}]) == 2
