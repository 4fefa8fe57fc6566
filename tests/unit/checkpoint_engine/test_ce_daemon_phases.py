"""The daemon's commands as phases (check -> apply -> undo | collective): all-or-nothing, bounded, typed.

Two ranks in one process: rank 0's Driver and rank 1's `serve_rank` (a thread), each with a fake
ParameterServer, over the real `Relay` on an in-process store (`HashStore`). No process group."""

from __future__ import annotations

import json
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from checkpoint_engine.daemon.commands import (
    KIND_STATUS,
    CommandError,
    check_files,
    error_kind,
    execute,
    phases,
    serve_rank,
)
from checkpoint_engine.daemon.driver import Driver
from checkpoint_engine.daemon.relay import Relay
from checkpoint_engine.errors import CheckpointExists, CheckpointNotFound, DaemonBusy


class FakeStore:
    def put(self, key, value, ttl_s=None):
        pass

    def delete(self, key):
        pass


class FakePS:
    """What the daemon's commands use of a ParameterServer; `fail[step]` raises in that step."""

    def __init__(self, rank: int, world_size: int = 2):
        self.rank, self.world_size = rank, world_size
        self.registered: dict[str, list[str]] = {}
        self.metas: dict[str, object] = {}
        self.fail: dict[str, BaseException] = {}
        self.calls: list[str] = []
        self.last_metrics = None
        self.registry = type("Registry", (), {"store": FakeStore()})()

    def _step(self, step: str) -> None:
        self.calls.append(step)
        if step in self.fail:
            raise self.fail[step]

    def checkpoints(self) -> dict:
        return {
            n: {"num_tensors": len(f), "nbytes": 0, "gathered": n in self.metas} for n, f in self.registered.items()
        }

    def register_checkpoint(self, name, files):
        self._step("register")
        if name in self.registered:
            raise CheckpointExists(f"{name} is already registered")
        self.registered[name] = list(files)

    def unregister_checkpoint(self, name):
        self._step("unregister")
        if name not in self.registered:
            raise CheckpointNotFound(f"{name} is not registered")
        del self.registered[name]
        self.metas.pop(name, None)
        self.metas.pop(name, None)

    def gather_metas(self, name):
        self._step("gather")
        self.metas[name] = "gathered"

    def check_update(self, name, ranks=None):
        if name not in self.metas:
            raise CheckpointNotFound(f"unknown checkpoint {name!r}")
        return [0, 1]

    def update(self, name, req_func, timeout=None, ranks=None):
        self._step("update")

    def load_metas(self, metas):
        self._step("load_metas")
        self.metas[metas["checkpoint"]] = metas

    def metas_state(self, name):
        return self.metas.get(name), None

    def has_loaded_metas(self, name):
        return name in self.metas and name not in self.registered

    def forget_metas(self, name):
        self._step("forget_metas")
        del self.metas[name]

    def restore_metas_state(self, name, state):
        if state[0] is None:
            self.metas.pop(name, None)
        else:
            self.metas[name] = state[0]

    def get_metas(self, name):
        if name not in self.metas:
            raise CheckpointNotFound(f"no gathered metas for {name!r}")
        return {"checkpoint": name}


class Daemon:
    """Rank 0's Driver and rank 1's serve_rank thread over one in-process store."""

    def __init__(self, result_timeout_s: float = 5.0):
        store = dist.HashStore()
        self.ps = [FakePS(0), FakePS(1)]
        self.relays = [Relay(store, r, 2, result_timeout_s) for r in range(2)]
        self.driver = Driver(self.ps[0], self.relays[0])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=serve_rank, args=(self.ps[1], self.relays[1], self.stop), daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.close()


def safetensors_file(path, **tensors) -> str:
    save_file(tensors or {"w": torch.zeros(4)}, str(path))
    return str(path)


def names_on(d: Daemon) -> list[set]:
    return [set(ps.registered) for ps in d.ps]


# -- the check functions -------------------------------------------------------------------------
def test_check_files_names_each_problem(tmp_path):
    good = safetensors_file(tmp_path / "good.safetensors", a=torch.zeros(3))
    assert check_files([good]) == {"tensors": 1, "nbytes": 12}
    missing = str(tmp_path / "missing.safetensors")
    long_header = tmp_path / "long.safetensors"
    long_header.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    not_json = tmp_path / "garbage.safetensors"
    not_json.write_bytes(struct.pack("<Q", 4) + b"nope")
    short = tmp_path / "short.safetensors"  # a header whose tensor ends past the file's end
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    short.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    twice = safetensors_file(tmp_path / "twice.safetensors", a=torch.zeros(1))
    for files, why in (
        ([missing], "not found"),
        ([str(tmp_path)], "not a regular file"),
        ([str(long_header)], "corrupt safetensors header length 10000"),
        ([str(not_json)], "corrupt safetensors header"),
        ([str(short)], "truncated or corrupt"),
        ([good, twice], "duplicate tensor name 'a'"),
        (["/etc/passwd"], "corrupt safetensors header"),
    ):
        with pytest.raises(ValueError, match=why):
            check_files(files)


@pytest.mark.parametrize(
    ("error", "phase", "kind"),
    [
        (CommandError("x"), None, "bad_request"),
        (CheckpointNotFound("x"), "check", "not_found"),
        (CheckpointExists("x"), "check", "conflict"),
        (DaemonBusy("x"), None, "busy"),
        (ValueError("bad file"), "check", "bad_request"),
        (FileNotFoundError("gone"), "check", "bad_request"),
        (FileNotFoundError("gone"), "apply", "internal"),
        (MemoryError("no memory"), "apply", "internal"),
        (RuntimeError("[gloo] ... Timed out waiting 300000ms for recv operation"), "collective", "unavailable"),
        (dist.DistBackendError("peer gone"), "run", "unavailable"),
        (RuntimeError("engine answered 500"), "run", "internal"),
    ],
)
def test_error_kinds(error, phase, kind):
    assert error_kind(error, phase) == kind


def test_phases_per_op():
    assert phases({"op": "register", "name": "x"}) == ("check", "apply", "collective")
    assert phases({"op": "register", "name": "x", "gather": False}) == ("check", "apply")
    assert phases({"op": "unregister", "name": "x"}) == ("check", "apply")
    assert phases({"op": "load_metas"}) == ("check", "apply")
    assert phases({"op": "gather_metas", "name": "x"}) == ("check", "collective")
    assert phases({"op": "update", "name": "x"}) == ("check", "run")
    assert phases({"op": "engine_start", "name": None}) == ("check", "run")
    assert phases({"op": "inspect"}) == ("run",)
    assert phases({"op": "exit"}) == ("run",)


# -- all-or-nothing --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_rank", [0, 1])
@pytest.mark.parametrize("bad", ["passwd", "missing", "long_header"])
def test_register_fails_on_every_rank_when_one_rank_fails_its_check(daemon, tmp_path, bad_rank, bad):
    good = safetensors_file(tmp_path / "b.safetensors")
    bad_path = {"passwd": "/etc/passwd", "missing": str(tmp_path / "a-missing.safetensors")}.get(bad)
    if bad == "long_header":
        bad_path = str(tmp_path / "a-long.safetensors")
        with open(bad_path, "wb") as f:
            f.write(struct.pack("<Q", 1 << 20) + b"{}")
    # the owner holds both files, the other rank none (the original hang: it went on into gather_metas)
    answer = daemon.driver.run({"op": "register", "name": "x", "files": [bad_path, good], "owner_ranks": [bad_rank]})
    assert not answer["ok"] and answer["status"] == 400 and answer["kind"] == "bad_request", answer
    assert set(answer["errors"]) == {str(bad_rank)}
    assert answer["ranks"][bad_rank]["kind"] == "bad_request" and answer["ranks"][bad_rank]["phase"] == "check"
    assert "not applied" in answer["ranks"][1 - bad_rank]["result"]["skipped"]
    assert names_on(daemon) == [set(), set()]
    assert all("register" not in ps.calls and "gather" not in ps.calls for ps in daemon.ps)
    # the same request with good files succeeds
    good2 = safetensors_file(tmp_path / "c.safetensors", v=torch.ones(2))
    answer = daemon.driver.run({"op": "register", "name": "x", "files": [good2, good]})
    assert answer["ok"] and answer["status"] == 200 and "errors" not in answer, answer
    assert names_on(daemon) == [{"x"}, {"x"}]
    assert [r["result"]["registered_files"] for r in answer["ranks"]] == [[good], [good2]]


@pytest.mark.parametrize("failing", [0, 1])
def test_register_apply_failure_is_undone_on_the_ranks_that_applied(daemon, tmp_path, failing):
    f = safetensors_file(tmp_path / "a.safetensors")
    daemon.ps[failing].fail["register"] = MemoryError("cannot allocate 8 GiB")
    answer = daemon.driver.run({"op": "register", "name": "x", "files": [f]})
    assert answer["status"] == 500 and answer["kind"] == "internal" and set(answer["errors"]) == {str(failing)}
    assert answer["ranks"][failing]["phase"] == "apply"
    assert answer["ranks"][1 - failing]["result"]["undo_ranks"] == [1 - failing]
    assert names_on(daemon) == [set(), set()]
    assert all("gather" not in ps.calls for ps in daemon.ps)  # undone before any collective
    del daemon.ps[failing].fail["register"]
    assert daemon.driver.run({"op": "register", "name": "x", "files": [f]})["status"] == 200


def test_register_whose_gather_fails_is_unregistered_everywhere(daemon, tmp_path):
    f = safetensors_file(tmp_path / "a.safetensors")
    for ps in daemon.ps:
        ps.fail["gather"] = ValueError("tensor 'w' is registered on rank 0 and on rank 1")
    answer = daemon.driver.run({"op": "register", "name": "x", "files": [f], "split_files": False})
    assert answer["status"] == 400 and set(answer["errors"]) == {"0", "1"}
    assert names_on(daemon) == [set(), set()]


def test_register_twice_conflicts_and_a_disagreement_is_repaired_by_unregister(daemon, tmp_path):
    f = safetensors_file(tmp_path / "a.safetensors")
    assert daemon.driver.run({"op": "register", "name": "x", "files": [f]})["ok"]
    answer = daemon.driver.run({"op": "register", "name": "x", "files": [f]})
    assert answer["status"] == 409 and answer["kind"] == "conflict" and set(answer["errors"]) == {"0", "1"}
    daemon.ps[0].registered.pop("x")  # the ranks disagree (an older daemon's failure): rank 0 keeps metas only
    answer = daemon.driver.run({"op": "register", "name": "x", "files": [f]})
    assert answer["status"] == 409 and set(answer["errors"]) == {"1"}
    answer = daemon.driver.run({"op": "unregister", "name": "x"})
    assert answer["ok"] and answer["ranks"][0]["result"] == {"forgot_metas": "x"}
    assert names_on(daemon) == [set(), set()]
    answer = daemon.driver.run({"op": "unregister", "name": "x"})
    assert answer["status"] == 404 and answer["kind"] == "not_found" and set(answer["errors"]) == {"0", "1"}
    assert "registered on no rank" in answer["error"]


def test_gather_update_and_get_metas_of_unknown_names_are_404_before_any_collective(daemon):
    for cmd in (
        {"op": "gather_metas", "name": "nope"},
        {"op": "update", "name": "nope", "endpoints": ["http://a", "http://b"]},
        {"op": "get_metas", "name": "nope"},
    ):
        answer = daemon.driver.run(cmd)
        assert answer["status"] == 404 and answer["kind"] == "not_found", answer
    assert all(not ps.calls for ps in daemon.ps)


def test_update_with_too_few_endpoints_fails_in_the_check(daemon, tmp_path):
    for ps in daemon.ps:
        ps.metas["x"] = "gathered"
    answer = daemon.driver.run({"op": "update", "name": "x", "endpoints": ["http://a"]})
    assert answer["status"] == 400 and set(answer["errors"]) == {"1"} and answer["ranks"][1]["phase"] == "check"
    assert all("update" not in ps.calls for ps in daemon.ps)
    answer = daemon.driver.run({"op": "update", "name": "x", "endpoints": ["http://a", "http://b"]})
    assert answer["ok"] and [ps.calls for ps in daemon.ps] == [["update"], ["update"]]


def _metas(name: str = "m") -> dict:
    return {
        "checkpoint": name,
        "device_ids": ["a", "b"],
        "pids": [1, 2],
        "hosts": ["h", "h"],
        "ranks": {"0": [["w", "float32", [4], 0, 0]]},
    }


def test_load_metas_all_or_nothing(daemon):
    for bad in ({"checkpoint": "m"}, {**_metas(), "pids": [1]}, {**_metas(), "ranks": {}}):
        answer = daemon.driver.run({"op": "load_metas", "metas": bad})
        assert answer["status"] == 400 and set(answer["errors"]) == {"0", "1"}, answer
    daemon.ps[1].fail["load_metas"] = MemoryError("no")
    daemon.ps[0].metas["m"] = "older"
    answer = daemon.driver.run({"op": "load_metas", "metas": _metas()})
    assert answer["status"] == 500 and set(answer["errors"]) == {"1"}
    assert daemon.ps[0].metas == {"m": "older"} and daemon.ps[1].metas == {}  # rank 0's apply undone
    del daemon.ps[1].fail["load_metas"]
    assert daemon.driver.run({"op": "load_metas", "metas": _metas()})["ok"]
    assert daemon.ps[0].metas["m"] == daemon.ps[1].metas["m"] == _metas()
    daemon.ps[1].registered["r"] = []
    answer = daemon.driver.run({"op": "load_metas", "metas": _metas("r")})
    assert answer["status"] == 409 and set(answer["errors"]) == {"1"} and "r" not in daemon.ps[0].metas


# -- bounded ---------------------------------------------------------------------------------------
def test_a_silent_rank_breaks_the_daemon_and_later_commands_answer_at_once(tmp_path):
    d = Daemon(result_timeout_s=60.0)
    d.stop.set()  # rank 1 stops serving: silent from now on
    d.thread.join(10)
    f = safetensors_file(tmp_path / "a.safetensors")
    t0 = time.monotonic()
    answer = d.driver.run({"op": "register", "name": "x", "files": [f], "timeout_s": 0.5})
    assert time.monotonic() - t0 < 5  # the check's deadline, not the relay's 60 s
    assert answer["status"] == 503 and answer["kind"] == "unavailable" and set(answer["errors"]) == {"1"}
    assert "rank 1 did not answer within" in answer["errors"]["1"] and "restarted" in answer["errors"]["1"]
    assert d.ps[0].registered == {}
    t0 = time.monotonic()
    for cmd in ({"op": "inspect"}, {"op": "register", "name": "x", "files": [f]}):
        answer = d.driver.run(cmd)
        assert answer["status"] == 503 and "rank 1 did not answer" in answer["errors"]["1"] and answer["ranks"] == []
    assert time.monotonic() - t0 < 1
    t0 = time.monotonic()
    answer = d.driver.run({"op": "exit"}, 30.0)  # rank 1 is not waited for again
    assert time.monotonic() - t0 < 5 and answer["ranks"][0]["ok"]
    assert d.driver.run({"op": "inspect"})["status"] == 503


def test_a_rank_that_exited_is_reported_at_once(daemon):
    daemon.stop.set()
    daemon.thread.join(10)
    daemon.relays[1].leave()
    t0 = time.monotonic()
    answer = daemon.driver.run({"op": "inspect"})
    assert time.monotonic() - t0 < 2
    assert answer["status"] == 503 and "rank 1 has exited" in answer["errors"]["1"]


def test_a_busy_daemon_answers_at_once_but_exit_waits(daemon):
    release = threading.Event()
    entered = threading.Event()
    real = daemon.ps[0].checkpoints

    def slow():
        entered.set()
        release.wait(10)
        return real()

    daemon.ps[0].checkpoints = slow
    first = {}
    t = threading.Thread(target=lambda: first.update(daemon.driver.run({"op": "inspect"})))
    t.start()
    assert entered.wait(10)
    t0 = time.monotonic()
    answer = daemon.driver.run({"op": "unregister", "name": "x"})
    assert time.monotonic() - t0 < 1
    assert answer["status"] == 409 and answer["kind"] == "busy" and "inspect" in answer["error"]
    exited = {}
    e = threading.Thread(target=lambda: exited.update(daemon.driver.run({"op": "exit"}, 10.0)))
    e.start()
    time.sleep(0.2)
    assert not exited  # waiting for the lock
    release.set()
    t.join(10)
    e.join(10)
    assert first["ok"] and exited["ok"], (first, exited)
    assert daemon.driver.run({"op": "inspect"})["status"] == 503  # stopping


def test_fault_field_needs_fault_injection(daemon, tmp_path):
    f = safetensors_file(tmp_path / "a.safetensors")
    cmd = {"op": "register", "name": "x", "files": [f], "_fault": {"apply_fails_on": [1]}}
    answer = daemon.driver.run(cmd)
    assert answer["status"] == 400 and names_on(daemon) == [set(), set()] and not daemon.ps[1].calls
    daemon.driver.fault_injection = True
    answer = daemon.driver.run(cmd)
    assert answer["status"] == 500 and "fault injection" in answer["errors"]["1"]
    assert names_on(daemon) == [set(), set()]


def test_status_of_every_kind():
    assert KIND_STATUS == {
        "bad_request": 400,
        "not_found": 404,
        "conflict": 409,
        "busy": 409,
        "internal": 500,
        "unavailable": 503,
    }


# -- execute: one rank alone (the Python API) ------------------------------------------------------
def test_execute_runs_the_whole_command_with_its_checks(tmp_path):
    ps = FakePS(0, world_size=1)
    f = safetensors_file(tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="not found"):
        execute(ps, {"op": "register", "name": "x", "files": [str(tmp_path / "nope")]})
    assert not ps.calls
    assert execute(ps, {"op": "register", "name": "x", "files": [f]})["registered_files"] == [f]
    assert ps.calls == ["register", "gather"]
    with pytest.raises(CheckpointExists):
        execute(ps, {"op": "register", "name": "x", "files": [f]})
    execute(ps, {"op": "gather_metas", "name": "joined"})  # a name registered nowhere: the join flow
    execute(ps, {"op": "unregister", "name": "x"})
    with pytest.raises(CheckpointNotFound):
        execute(ps, {"op": "unregister", "name": "x"})


def test_unregister_forgets_the_loaded_metas_of_another_jobs_memory(daemon):
    """POST /metas, then DELETE /checkpoints/<name>: every rank forgets the owners' addresses (the owner
    is about to free that memory), so the next update to that name is a 404, not a read of freed memory;
    a failed forget on one rank puts the other's metas back."""
    for ps in daemon.ps:
        ps.metas["v1"] = "loaded"
    answer = daemon.driver.run({"op": "unregister", "name": "v1"})
    assert answer["ok"] and [r["result"] for r in answer["ranks"]] == [{"forgot_metas": "v1"}] * 2
    assert all("v1" not in ps.metas for ps in daemon.ps)
    answer = daemon.driver.run({"op": "update", "name": "v1", "endpoints": ["http://a", "http://b"]})
    assert answer["status"] == 404, answer
    for ps in daemon.ps:
        ps.metas["v2"] = "loaded"
    daemon.ps[1].fail["forget_metas"] = RuntimeError("injected")
    answer = daemon.driver.run({"op": "unregister", "name": "v2"})
    assert not answer["ok"] and [ps.metas.get("v2") for ps in daemon.ps] == ["loaded"] * 2, answer
