"""Every process the project starts ends with its parent: SIGTERM to a benchmark or to the launcher
leaves none of their processes (vLLM's front end, engine core and workers included).

Each test starts the real thing, waits until vLLM's own processes exist (no need to wait for
health), signals the parent and checks that every descendant recorded along the way is gone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 300.0
END_TIMEOUT_S = 90.0


def _descendants(proc: psutil.Process) -> set[psutil.Process]:
    try:
        return set(proc.children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def _describe(proc: psutil.Process) -> str:
    """Command line and name, or "" for a process that is gone or a zombie (short-lived helpers)."""
    try:
        return " ".join(proc.cmdline()) + " " + proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # ZombieProcess is a NoSuchProcess
        return ""


def _run_until_vllm_then_signal(cmd: list[str], sig: int, tmp_path: Path) -> set[psutil.Process]:
    """Start `cmd`, wait until a vLLM engine process runs below it, send `sig`; every process seen."""
    from testing.vllm_servers import child_env

    log = open(tmp_path / "parent.log", "w")
    parent = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    seen: set[psutil.Process] = set()
    try:
        root = psutil.Process(parent.pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            seen |= _descendants(root)
            names = " ".join(_describe(p) for p in seen)
            if "EngineCore" in names or "VLLM" in names:
                break
            if parent.poll() is not None:
                raise AssertionError(
                    f"{cmd[2:4]} exited (rc {parent.returncode}) before vLLM started: "
                    f"{(tmp_path / 'parent.log').read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no vLLM process below {cmd[2:4]} within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)  # polling the process tree, bounded by the deadline
        seen |= _descendants(root)
        parent.send_signal(sig)
        rc = parent.wait(timeout=END_TIMEOUT_S)
        assert rc != 0 or sig == signal.SIGINT, f"parent exited {rc} after signal {sig}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)
        log.close()
    return seen


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_gone(seen: set[psutil.Process]) -> None:
    deadline = time.monotonic() + END_TIMEOUT_S
    alive = [p for p in seen if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the recorded processes, bounded by the deadline
        alive = [p for p in alive if _running(p)]
    for p in alive:  # leave nothing behind for the next test, then fail
        p.kill()
    assert not alive, f"left running: {[(p.pid, _describe(p)[:80]) for p in alive]}"


@pytest.mark.vllm
def test_sigterm_to_benchmark_ends_its_servers(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_vllm_update.py"),
        "--size-gib",
        "0.5",
        "--repeats",
        "1",
        "--start-repeats",
        "0",
        "--skip-zero-copy",
        "--skip-vllm-impl",
        "--out-dir",
        str(tmp_path / "bench"),
    ]
    seen = _run_until_vllm_then_signal(cmd, signal.SIGTERM, tmp_path)
    _assert_all_gone(seen)


@pytest.mark.vllm
def test_sigterm_to_launcher_ends_vllm(tmp_path):
    from ckpt_common.ports import free_port
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from testing.vllm_servers import CPU_ENGINE_ARGS

    model = make_tiny_model(tmp_path / "model", TinyModelConfig.tiny(), seed=1)
    cmd = [
        sys.executable,
        "-m",
        "vllm_ext.launch",
        "--model",
        str(model),
        "--port",
        str(free_port()),
        "--",
        *CPU_ENGINE_ARGS,
    ]
    seen = _run_until_vllm_then_signal(cmd, signal.SIGTERM, tmp_path)
    _assert_all_gone(seen)


@pytest.mark.vllm
def test_killing_the_launchers_process_group_ends_vllm_at_once(tmp_path):
    """The daemon starts each engine command in a process group of its own and, when the engine dies
    (even by SIGKILL), signals that group: vLLM's processes must be in it, so none outlives the engine
    and holds the device (or a compile-cache lock) while a restarted engine starts."""
    import os

    from ckpt_common.ports import free_port
    from ckpt_common.procs import shm_segments, unlink_segments
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from testing.vllm_servers import CPU_ENGINE_ARGS, child_env

    model = make_tiny_model(tmp_path / "model", TinyModelConfig.tiny(), seed=1)
    cmd = [sys.executable, "-m", "vllm_ext.launch", "--model", str(model), "--port", str(free_port())]
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen(
        [*cmd, "--", *CPU_ENGINE_ARGS],
        cwd=REPO,
        env=child_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # as the daemon starts an engine
    )
    seen: set[psutil.Process] = set()
    segments: set[str] = set()
    try:
        root = psutil.Process(launcher.pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any("EngineCore" in _describe(p) or "VLLM" in _describe(p) for p in seen):
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no vLLM engine process within {START_TIMEOUT_S:.0f} s"
            time.sleep(0.2)  # polling the process tree, bounded by the deadline
            seen |= _descendants(root)
        while not segments:  # vLLM's message queue: the kill leaves it, removed below (nobody else will)
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"vLLM mapped no shared memory within {START_TIMEOUT_S:.0f} s"
            seen |= _descendants(root)
            segments = shm_segments([launcher.pid, *(p.pid for p in seen)])
            time.sleep(0.1)  # polling the process tree, bounded by the deadline
        outside = []
        for p in seen:
            try:
                if os.getpgid(p.pid) != launcher.pid:
                    outside.append((p.pid, _describe(p)[:80]))
            except ProcessLookupError:
                pass
        launcher.kill()  # the engine "crashes"
        launcher.wait(10)
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # what the daemon does with the group it started
        except ProcessLookupError:
            pass
        stop_by = time.monotonic() + 10.0
        alive = [p for p in seen if _running(p)]
        while alive and time.monotonic() < stop_by:
            time.sleep(0.1)  # polling the recorded processes, bounded by the deadline
            alive = [p for p in alive if _running(p)]
        for p in alive:
            p.kill()
        assert not outside, f"vLLM processes outside the launcher's process group: {outside}"
        assert not alive, f"left running 10 s after SIGKILL to the group: {[(p.pid, _describe(p)[:80]) for p in alive]}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
        unlink_segments(segments)
        log.close()
