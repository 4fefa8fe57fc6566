"""The daemon's fault matrix (issue 40): commands are all-or-nothing and bounded, with typed statuses.

ONE 2-rank daemon (torchrun) for the whole module. Each failing command must answer within seconds,
leave the ranks agreeing (GET /checkpoints: the name on no rank), and the same request with good
input must then succeed. The daemon runs through this module's `__main__` (below), which turns on the
Driver's test-only fault injection (`_fault`: an allocation failing during the apply phase on one
rank); the library never reads it from the environment. Last, rank 1 goes silent (SIGSTOP): the next
command names it within its deadline, later ones answer 503 at once, and the daemon still stops.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt_common.ports import free_port
from testing.daemon import REPO, Daemon, repo_env
from tests.integration.dist.harness import rank_pid

SILENT_TIMEOUT_S = 3.0  # the silent-rank check's request deadline
QUICK_S = 10.0  # a failing command answers within this (the old daemon hung for the collective timeout)


def start_fault_daemon(log: Path) -> Daemon:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
                *("--master-port", str(free_port()), "-m", __spec__.name),
                *("--port", str(port), "--collective-timeout-s", "60"),
            ],
            cwd=REPO,
            env=repo_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    daemon = Daemon(proc, f"http://127.0.0.1:{port}", log)
    try:
        daemon.wait_ready(90.0)
    except BaseException:
        daemon.stop()
        raise
    return daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_fault_daemon(tmp_path_factory.mktemp("daemon") / "daemon.log")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Good shards, and bad files that each fail register's check in their own way."""
    root = tmp_path_factory.mktemp("files")
    out = {}
    for part in range(2):
        path = root / f"good-{part}.safetensors"
        save_file({f"w{part}": torch.full((16, 8), float(part))}, str(path))
        out[f"good{part}"] = str(path)
    long_header = root / "long-header.safetensors"  # the header claims more bytes than the file has
    long_header.write_bytes(struct.pack("<Q", 1 << 20) + b'{"a": {}}')
    out["long_header"] = str(long_header)
    out["missing"] = str(root / "missing.safetensors")
    out["passwd"] = "/etc/passwd"
    return out


def call(daemon: Daemon, method: str, path: str, body: dict | None = None) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    code, answer = daemon.call(method, path, body, timeout_s=60.0)
    return code, answer, time.monotonic() - t0


def registered(daemon: Daemon) -> list[set[str]]:
    code, answer, _ = call(daemon, "GET", "/checkpoints")
    assert code == 200, answer
    return [set(r["result"]["checkpoints"]) for r in answer["ranks"]]


@pytest.mark.parametrize("bad", ["passwd", "missing", "long_header"])
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_register_with_a_bad_file_on_one_rank(daemon, files, bad, bad_rank):
    # the bad rank owns every file; the other rank holds none (the original hang: it entered gather_metas)
    body = {"name": f"x-{bad}-{bad_rank}", "files": [files[bad], files["good0"]], "owner_ranks": [bad_rank]}
    code, answer, elapsed = call(daemon, "POST", "/checkpoints", body)
    assert elapsed < QUICK_S and code == 400, (elapsed, answer)
    assert set(answer["errors"]) == {str(bad_rank)} and answer["ranks"][bad_rank]["kind"] == "bad_request"
    assert answer["ranks"][bad_rank]["phase"] == "check"
    assert registered(daemon) == [set(), set()]
    code, answer, _ = call(daemon, "POST", "/checkpoints", {**body, "files": [files["good0"], files["good1"]]})
    assert code == 200 and answer["ok"], answer
    assert registered(daemon) == [{body["name"]}, {body["name"]}]
    code, answer, _ = call(daemon, "DELETE", f"/checkpoints/{body['name']}")
    assert code == 200, answer


@pytest.mark.parametrize("failing", [0, 1])
def test_an_allocation_failing_during_apply_is_undone_on_the_other_rank(daemon, files, failing):
    body = {"name": f"alloc-{failing}", "files": [files["good0"], files["good1"]]}
    code, answer, elapsed = call(daemon, "POST", "/checkpoints", {**body, "_fault": {"apply_fails_on": [failing]}})
    assert elapsed < QUICK_S and code == 500, (elapsed, answer)
    assert set(answer["errors"]) == {str(failing)} and "fault injection" in answer["errors"][str(failing)]
    assert answer["ranks"][1 - failing]["result"]["undo_ranks"] == [1 - failing]
    assert registered(daemon) == [set(), set()]
    code, answer, _ = call(daemon, "POST", "/checkpoints", body)
    assert code == 200, answer
    assert call(daemon, "DELETE", f"/checkpoints/{body['name']}")[0] == 200


def test_unknown_names_twice_registered_names_and_bad_metas(daemon, files):
    code, answer, elapsed = call(daemon, "DELETE", "/checkpoints/nope")
    assert elapsed < QUICK_S and code == 404 and answer["kind"] == "not_found", answer
    code, answer, elapsed = call(
        daemon, "POST", "/update", {"name": "nope", "endpoints": ["http://127.0.0.1:9", "http://127.0.0.1:9"]}
    )
    assert elapsed < QUICK_S and code == 404 and set(answer["errors"]) == {"0", "1"}, answer
    assert all(r["phase"] == "check" for r in answer["ranks"])
    body = {"name": "twice", "files": [files["good0"], files["good1"]]}
    assert call(daemon, "POST", "/checkpoints", body)[0] == 200
    code, answer, elapsed = call(daemon, "POST", "/checkpoints", body)
    assert elapsed < QUICK_S and code == 409 and set(answer["errors"]) == {"0", "1"}, answer
    code, metas, _ = call(daemon, "GET", "/metas/twice")
    assert code == 200, metas
    code, answer, _ = call(daemon, "POST", "/metas", metas["ranks"][0]["result"])  # its own metas: registered
    assert code == 409, answer
    assert call(daemon, "DELETE", "/checkpoints/twice")[0] == 200
    assert call(daemon, "GET", "/metas/twice")[0] == 404
    code, answer, elapsed = call(daemon, "POST", "/metas", {"checkpoint": "m"})  # the route's own 400
    assert elapsed < QUICK_S and code == 400, answer
    # well-formed fields, but for a world of one rank with no owner: every rank's check refuses them
    bad = {"checkpoint": "m", "device_ids": ["a"], "pids": [1], "hosts": ["h"], "ranks": {}}
    code, answer, elapsed = call(daemon, "POST", "/metas", bad)
    assert elapsed < QUICK_S and code == 400 and set(answer["errors"]) == {"0", "1"}, answer
    assert call(daemon, "GET", "/metas/m")[0] == 404
    assert registered(daemon) == [set(), set()]


def test_a_silent_rank_is_named_then_every_command_answers_503_and_the_daemon_stops(daemon, files):
    """Runs last: it leaves the daemon needing a restart."""
    pid = rank_pid(daemon.proc.pid, 1)
    os.kill(pid, signal.SIGSTOP)  # silent, as a hung or dead rank on another agent (torchrun sees nothing)
    try:
        # the request's own deadline bounds the check phase (CHECK_TIMEOUT_S without one)
        body = {"name": "late", "files": [files["good0"], files["good1"]], "timeout_s": SILENT_TIMEOUT_S}
        code, answer, elapsed = call(daemon, "POST", "/checkpoints", body)
        assert elapsed < SILENT_TIMEOUT_S + QUICK_S and code == 503, (elapsed, answer)
        assert (
            set(answer["errors"]) == {"1"}
            and f"rank 1 did not answer within {SILENT_TIMEOUT_S:g} s" in answer["errors"]["1"]
        )
        assert "restarted" in answer["errors"]["1"]
        for method, path, req in (
            ("GET", "/checkpoints", None),
            ("POST", "/checkpoints", body),
            ("DELETE", "/checkpoints/late", None),
        ):
            code, answer, elapsed = call(daemon, method, path, req)
            assert elapsed < 2 and code == 503 and "rank 1" in answer["errors"]["1"], (elapsed, answer)
    finally:
        os.kill(pid, signal.SIGCONT)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(40) is not None, daemon.log_tail()


if __name__ == "__main__":  # the daemon's entry point for this module: fault injection on (tests only)
    from checkpoint_engine.__main__ import main
    from checkpoint_engine.daemon.driver import Driver

    Driver.fault_injection = True
    sys.exit(main())
