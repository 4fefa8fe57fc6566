"""Real processes: PS ranks (gloo) + one plain engine process per rank; exit codes checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.dist.harness import (
    REPO,
    Engine,
    _env,
    free_port,
    get_json,
    rank_pid,
    run_scenario,
    stop_group,
)

BUCKET = ["--bucket-size", "24576"]  # ~10 buckets per update: the double buffer wraps around


def engines_for(world, *flags_for_rank, timeout_s=30.0):
    return [Engine(*(flags_for_rank[r] if r < len(flags_for_rank) else ()), timeout_s=timeout_s) for r in range(world)]


def stop_all(engines):
    return [e.stop() for e in engines]


@pytest.mark.parametrize(
    "world,source,mode",
    [(1, "files", "collective"), (2, "both", "collective"), (3, "named", "collective"), (2, "both", "auto")],
)
def test_updates_are_bit_exact(tmp_path, world, source, mode):
    """Two checkpoints updated alternately, then new weights for one: every tensor bit-exact each time."""
    engines = engines_for(world)
    try:
        checksums = ["--checksums"] if world == 2 else []
        res = run_scenario(
            engines, tmp_path, "--source", source, "--mode", mode, *BUCKET, *checksums, steps="A1,B2,A1,A3"
        )
        for rank, (rc, out) in enumerate(res):
            assert rc == 0, f"rank {rank} failed:\n{out}"
            assert out.count("STEP_OK") == 4
        for e in engines:
            assert e.state()["version"] == 4
    finally:
        assert stop_all(engines) == [0] * world


def _assert_all_failed(res, pattern):
    for rank, (rc, out) in enumerate(res):
        assert rc == 3, f"rank {rank} exited {rc}:\n{out}"
        assert pattern in out, f"rank {rank} output lacks {pattern!r}:\n{out}"


def test_engine_raising_aborts_all_ranks(tmp_path):
    engines = engines_for(2, (), ("--fail-on-bucket", "3"))
    try:
        res = run_scenario(engines, tmp_path, *BUCKET)
        _assert_all_failed(res, "rank 1: engine failed on bucket 3: RuntimeError: injected failure")
        for e in engines:  # both engines keep serving and say their weights are incomplete
            s = get_json(e.url + "/health")
            assert s["status"] == "incomplete" and s["version"] == 0 and "0->1 aborted" in s["last_error"]
    finally:
        assert stop_all(engines) == [0, 0]


def test_engine_killed_mid_update(tmp_path):
    engines = engines_for(2, ("--die-on-bucket", "2"), ())
    try:
        t0 = time.monotonic()
        res = run_scenario(engines, tmp_path, *BUCKET, "--timeout-s", "60")
        assert time.monotonic() - t0 < 45, "a dead engine must be noticed without waiting for the 60 s deadline"
        _assert_all_failed(res, "rank 0: engine: engine disconnected")
        assert engines[0].proc.wait(5) == -9
        s = engines[1].state()
        assert s["status"] == "incomplete" and s["version"] == 0
    finally:
        stop_all(engines)


@pytest.mark.parametrize("mode", ["collective", "local"])
def test_rank_killed_mid_update(tmp_path, mode):
    engines = engines_for(2, (), ("--load-delay-s", "0.3"), timeout_s=5.0)

    def kill_rank1_once_receiving(procs):
        deadline = time.monotonic() + 60
        while get_json(engines[1].url + "/health")["status"] != "receiving":
            assert time.monotonic() < deadline, "update never started"
            time.sleep(0.02)
        procs[1].kill()

    try:
        res = run_scenario(
            engines, tmp_path, *BUCKET, "--timeout-s", "20", "--mode", mode, kill_rank_after=kill_rank1_once_receiving
        )
        assert res[1][0] == -9
        assert (
            res[0][0] == 3 and "UPDATE_ERROR: RuntimeError: rank 0: weight update aborted: rank 1 (pid" in res[0][1]
        ), res[0][1]
        assert engines[0].state()["status"] == "incomplete"
        deadline = time.monotonic() + 30  # engine 1 lost its PS rank: its own deadline (5 s) fires
        while engines[1].state()["status"] != "incomplete":
            assert time.monotonic() < deadline, engines[1].state()
            time.sleep(0.1)
    finally:
        assert stop_all(engines) == [0, 0]


@pytest.mark.parametrize(
    "flag,pattern,statuses",
    [
        # rank 1's request function raises: rank 0's engine is left incomplete, rank 1's is untouched
        (
            "--req-func-raise",
            "rank 1: req_func raised ConnectionError: injected: engine endpoint unreachable",
            ["incomplete", "initial"],
        ),
        ("--tamper-metas", "metas of 'A' differ between ranks", ["initial", "initial"]),  # nothing was sent
    ],
    ids=["req_func_raising", "metas_differing_between_ranks"],
)
def test_update_refused_on_every_rank(tmp_path, flag, pattern, statuses):
    engines = engines_for(2)
    try:
        res = run_scenario(engines, tmp_path, flag)
        _assert_all_failed(res, pattern)
        assert [e.state()["status"] for e in engines] == statuses
    finally:
        assert stop_all(engines) == [0, 0]


def test_a_first_rank_failing_before_the_engines_connect_stops_the_others_at_once(tmp_path):
    """Rank 0's request (the one that would make every rank's engine connect) fails: rank 1, whose
    engine is never asked, stops at once through the early-failure signal, not at its 60 s deadline."""
    engines = engines_for(2)
    try:
        t0 = time.monotonic()
        res = run_scenario(engines, tmp_path, "--first-req-func-raise", "--timeout-s", "60")
        took_s = time.monotonic() - t0
        _assert_all_failed(res, "rank 0: req_func raised ConnectionError: injected: the engine's endpoint")
        assert "rank 1: rank 0 failed before its engine connected" in res[1][1], res[1][1]
        assert took_s < 40, f"rank 1 waited for its engine's connect deadline ({took_s:.0f} s)"
        assert [e.state()["status"] for e in engines] == ["initial", "initial"]  # neither engine was touched
    finally:
        assert stop_all(engines) == [0, 0]


def test_duplicate_name_across_ranks(tmp_path):
    engines = engines_for(2)
    try:
        res = run_scenario(engines, tmp_path, "--dup-name")
        for rc, out in res:
            assert rc == 4 and "'layers.0.w' is registered on rank 0 and on rank 1" in out, out
    finally:
        assert stop_all(engines) == [0, 0]


@pytest.mark.parametrize("reader", ["rank", "engine"])
def test_p2p_recovery_of_a_restarted_engine(tmp_path, reader):
    """Rank 1's engine comes back empty; update(ranks=[1]) refills it from the owners' memory through
    Mooncake (TCP) while rank 0's engine is not touched. reader=engine: the engine's own transfer
    engine reads the pull (into scratch after the reset, then, pulled once more, into its tensors)."""
    engines = engines_for(2)
    try:
        res = run_scenario(engines, tmp_path, *BUCKET, "--p2p-recover", "1", "--p2p-reader", reader)
        for rank, (rc, out) in enumerate(res):
            assert rc == 0 and "P2P_OK" in out, f"rank {rank}:\n{out}"
        assert engines[0].state()["version"] == 1  # untouched
        assert engines[1].state()["version"] == (1 if reader == "rank" else 2)
    finally:
        assert stop_all(engines) == [0, 0]


# -- the Python API under torchrun (issue 40's fault matrix where the command exists there) -----------
# torchrun gives every rank the same command line: the scenario takes its rank from RANK and one engine
# URL per rank. The collective and engine deadlines are 60 s: a failure must end the job far sooner.
TORCHRUN_QUICK_S = 25.0


def _torchrun(engines, tmp_path, *args: str, while_running=None) -> tuple[int, str, float]:
    """`torchrun --nproc-per-node N -m tests.integration.dist.scenario ...`: (exit code, output, seconds)."""
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(len(engines))),
        *("--master-port", str(free_port()), "-m", "tests.integration.dist.scenario"),
        *("--engine-url", ",".join(e.url for e in engines), "--tmp", str(tmp_path)),
        *("--steps", "A1", "--timeout-s", "60", *args),
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        if while_running is not None:
            while_running(proc)
        out, _ = proc.communicate(timeout=120)
    finally:
        stop_group(proc)
    return proc.returncode, out, time.monotonic() - t0


def _root_cause(out: str) -> str:
    """torchrun's report of the first rank that failed (its 'Root Cause' block)."""
    assert "Root Cause (first observed failure)" in out, out[-3000:]
    return out.split("Root Cause (first observed failure)", 1)[1]


def test_the_python_api_under_torchrun_fails_within_seconds_and_the_same_job_then_succeeds(tmp_path):
    """A bad file on each rank in turn, an engine request that raises, a rank SIGKILLed mid-update:
    torchrun's job ends within seconds naming the rank (not at the 60 s collective deadline), the
    engines say what they hold, and the same job without the fault then updates both engines exactly
    (the scenario checks every tensor's digest)."""
    engines = engines_for(2, (), ("--load-delay-s", "0.3"), timeout_s=5.0)
    try:
        for bad_rank in (0, 1):
            rc, out, took_s = _torchrun(engines, tmp_path, "--bad-file-rank", str(bad_rank))
            assert rc != 0 and took_s < TORCHRUN_QUICK_S, (rc, took_s, out[-3000:])
            assert f"not-safetensors-r{bad_rank}.safetensors: corrupt safetensors header length" in out, out[-3000:]
            cause = _root_cause(out)
            assert f"rank      : {bad_rank} (local_rank: {bad_rank})" in cause and "exitcode  : 1 " in cause, cause
            assert [e.state()["status"] for e in engines] == ["initial", "initial"]  # nothing was sent

        rc, out, took_s = _torchrun(engines, tmp_path, "--req-func-raise")
        assert rc != 0 and took_s < TORCHRUN_QUICK_S, (rc, took_s, out[-3000:])
        assert out.count("rank 1: req_func raised ConnectionError: injected") >= 2, out[-3000:]  # both ranks say it
        assert [e.state()["status"] for e in engines] == ["incomplete", "initial"]

        def kill_rank1_once_receiving(proc):
            deadline = time.monotonic() + 60
            while get_json(engines[1].url + "/health")["status"] != "receiving":
                assert time.monotonic() < deadline and proc.poll() is None, "the update never started"
                time.sleep(0.02)
            os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)

        rc, out, took_s = _torchrun(engines, tmp_path, *BUCKET, while_running=kill_rank1_once_receiving)
        assert rc != 0 and took_s < TORCHRUN_QUICK_S + 10, (rc, took_s, out[-3000:])
        cause = _root_cause(out)
        assert "rank      : 1 (local_rank: 1)" in cause and "exitcode  : -9" in cause, cause
        deadline = time.monotonic() + 30  # engine 1 lost its PS rank: its own deadline (5 s) ends the update
        while engines[1].state()["status"] == "receiving":
            assert time.monotonic() < deadline, engines[1].state()
            time.sleep(0.1)

        rc, out, _ = _torchrun(engines, tmp_path)
        assert rc == 0 and out.count("STEP_OK") == 2, out[-3000:]
        assert [e.state()["status"] for e in engines] == ["ready", "ready"]
    finally:
        assert stop_all(engines) == [0, 0]
