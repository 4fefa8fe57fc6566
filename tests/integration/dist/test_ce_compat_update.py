"""MoonshotAI's tests/test_update.py scenarios, on CPU: 2 ranks under torchrun, each with an engine
process that checks every tensor bit-exact (tests/integration/dist/compat_scenario.py), plus the join flow of
their examples/update.py (a second torchrun job pulls from the first while it is alive)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tests.integration.dist.harness import REPO, _env, free_port

WORLD = 2
JOB_TIMEOUT_S = 90.0


def start_job(scenario: str, *args: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(WORLD),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "tests.integration.dist.compat_scenario",
        scenario,
        *args,
    ]
    env = _env()
    env.setdefault("GLOG_minloglevel", "2")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout_s: float = JOB_TIMEOUT_S) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"torchrun job hung past {timeout_s} s:\n{out[-6000:]}") from None
    return out


def assert_ok(proc: subprocess.Popen, out: str, scenario: str) -> None:
    assert proc.returncode == 0, f"{scenario} exited {proc.returncode}:\n{out[-6000:]}"
    for r in range(WORLD):
        assert f"COMPAT_OK {scenario} rank {r} " in out, f"rank {r} did not finish {scenario}:\n{out[-6000:]}"


def run_job(scenario: str, *args: str) -> str:
    proc = start_job(scenario, *args)
    out = finish(proc)
    assert_ok(proc, out, scenario)
    return out


def test_rank_lists_in_sequence():
    """[0], [1], [], [0, 1], then random subsets of every size: receivers bit-exact, others return None."""
    rng = random.Random(7)
    rank_lists = [[0], [1], [], [0, 1]] + [rng.sample(range(WORLD), k) for k in range(WORLD + 1)]
    out = run_job("ranks", "--rank-lists", json.dumps(rank_lists))
    for n, ranks in enumerate(rank_lists):
        receivers = ranks or list(range(WORLD))
        assert out.count(f"UPDATE_OK {n} ranks={ranks} receiver=True") == len(receivers), out[-4000:]
        assert out.count(f"UPDATE_OK {n} ranks={ranks} receiver=False") == WORLD - len(receivers), out[-4000:]


def test_remote_error_then_next_update_succeeds():
    out = run_job("error")
    assert out.count("REMOTE_ERROR Failed to update weights due to remote errors") == WORLD, out[-4000:]


def test_checkpoint_from_dev_shm_and_disk_files_and_memory(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    shm_dir = f"/dev/shm/ce-compat-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm_dir)
    try:
        run_job("files", "--tmp", str(tmp_path), "--shm-dir", shm_dir)
        assert os.listdir(shm_dir) == [], "the ranks remove their files"
    finally:
        import shutil

        shutil.rmtree(shm_dir, ignore_errors=True)


def test_join_a_second_job_pulls_from_the_first(tmp_path):
    """Job A registers and saves its metas (pickle, the user's file); job B gathers metas of a name it never
    registered, loads A's metas and updates ranks [0, 1] (and all ranks) while A is alive."""
    metas_file = str(tmp_path / "metas.pkl")
    with socket.socket() as ctl:
        ctl.bind(("127.0.0.1", 0))
        ctl.listen(WORLD)
        ctl.settimeout(JOB_TIMEOUT_S)
        owner = start_job("owner", "--metas-file", metas_file, "--ctl-port", str(ctl.getsockname()[1]))
        conns = []
        try:
            for _ in range(WORLD):  # every owner rank says it is ready (metas saved) and waits for the release
                try:
                    c, _ = ctl.accept()
                except TimeoutError:
                    raise AssertionError(f"owner job never got ready:\n{finish(owner, 5)[-6000:]}") from None
                c.settimeout(JOB_TIMEOUT_S)
                assert c.recv(1) == b"R"
                conns.append(c)
            assert os.path.exists(metas_file)
            t0 = time.monotonic()
            joiner = start_job("join", "--metas-file", metas_file)
            join_out = finish(joiner)
            assert owner.poll() is None, "the owner job must still be alive while the join job pulls"
            assert_ok(joiner, join_out, "join")
            join_s = time.monotonic() - t0
        finally:
            for c in conns:
                c.sendall(b"G")
                c.close()
            owner_out = finish(owner)
    assert_ok(owner, owner_out, "owner")
    print(f"join job took {join_s:.1f} s")
