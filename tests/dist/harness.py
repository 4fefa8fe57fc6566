"""Helpers for multi-process tests: free ports, engine processes, rank processes, deadlines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def get_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def rpc(url: str, method: str, timeout_s: float = 30.0) -> dict:
    req = urllib.request.Request(
        url + "/collective_rpc",
        data=json.dumps({"method": method, "args": []}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["results"][0]


class Engine:
    def __init__(self, *flags: str, device: str = "cpu", timeout_s: float = 30.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "checkpoint_engine.plain_engine",
                "--port",
                str(self.port),
                "--device",
                device,
                "--timeout-s",
                str(timeout_s),
                *flags,
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited early: {self.proc.stdout.read()}")
            try:
                get_json(self.url + "/health", 1.0)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("engine did not come up within 60 s") from None
                time.sleep(0.05)

    def state(self) -> dict:
        return rpc(self.url, "weights_state")

    def digest(self) -> dict:
        return rpc(self.url, "weights_digest")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def stop_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """End a process started with ``start_new_session=True`` and everything in its session (torchrun's
    ranks outlive a killed torchrun otherwise)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout_s)


def run_ranks(world: int, args_for_rank, timeout_s: float = 120.0, kill_rank_after=None) -> list[tuple[int, str]]:
    """Run `python -m tests.dist.scenario` for every rank; return [(exit code, output)] per rank."""
    port = free_port()
    procs = []
    for r in range(world):
        cmd = [
            sys.executable,
            "-m",
            "tests.dist.scenario",
            "--rank",
            str(r),
            "--world",
            str(world),
            "--master-port",
            str(port),
            *args_for_rank(r),
        ]
        procs.append(
            subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    if kill_rank_after is not None:
        kill_rank_after(procs)
    out = []
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank processes hung past {timeout_s} s") from None
        out.append((p.returncode, text))
    return out
