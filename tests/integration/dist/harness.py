"""Helpers for multi-process tests: free ports, engine processes, rank processes, the daemon, deadlines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from ckpt_common.ports import free_port

# the daemon's start, free ports and process-group stops live in testing.daemon (examples use them too)
from testing.daemon import REPO, Daemon, DaemonStartError, start_daemon, stop_group
from testing.daemon import repo_env as _env

__all__ = [
    "REPO",
    "Daemon",
    "DaemonStartError",
    "Engine",
    "_env",
    "etcd_server",
    "free_port",
    "get_json",
    "rank_pid",
    "rpc",
    "rpc_all",
    "run_python",
    "run_ranks",
    "run_scenario",
    "start_daemon",
    "stop_group",
]


def run_python(*argv: str, timeout_s: float, env: dict | None = None, **env_extra: str):
    """`python ARGV...` from the checkout (PYTHONPATH: the checkout, then this environment's, plus
    `env_extra`; or exactly `env`), output captured; asserts exit code 0, showing stderr's tail."""
    if env is None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env_extra)
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def get_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def rpc(url: str, method: str, timeout_s: float = 30.0) -> dict:
    """The first worker's result of a `/collective_rpc` call (a plain engine has one)."""
    return rpc_all(url, method, timeout_s)[0]


def rpc_all(url: str, method: str, timeout_s: float = 30.0) -> list:
    """Every worker's result of a `/collective_rpc` call (one per worker, as vLLM answers)."""
    req = urllib.request.Request(
        url + "/collective_rpc",
        data=json.dumps({"method": method, "args": []}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["results"]


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker of `rank` (its child with RANK=<rank> in its environment)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no worker of rank {rank} under torchrun {torchrun_pid}")


class Engine:
    def __init__(self, *flags: str, device: str = "cpu", timeout_s: float = 30.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "checkpoint_engine.engines.plain",
                "--port",
                str(self.port),
                "--device",
                device,
                "--timeout-s",
                str(timeout_s),
                *flags,
            ],
            env=_env(),
            stdout=self._log,  # a file: an undrained pipe would block the engine once full
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"engine exited early: {self._log.read()}")
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
        self._log.close()
        return self.proc.returncode


def run_ranks(world: int, args_for_rank, timeout_s: float = 120.0, kill_rank_after=None) -> list[tuple[int, str]]:
    """Run `python -m tests.integration.dist.scenario` for every rank; return [(exit code, output)] per rank."""
    port = free_port()
    procs = []
    for r in range(world):
        cmd = [
            sys.executable,
            "-m",
            "tests.integration.dist.scenario",
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


def run_scenario(engines, tmp_path, *args: str, steps: str = "A1", **kwargs) -> list[tuple[int, str]]:
    """`run_ranks` with one rank per engine: `--engine-url` its engine's, `--tmp tmp_path`, `--steps
    STEPS`, then `args` (the scenario's other flags); `kwargs` go to `run_ranks`."""
    return run_ranks(
        len(engines),
        lambda r: ["--engine-url", engines[r].url, "--tmp", str(tmp_path), "--steps", steps, *args],
        **kwargs,
    )


@contextlib.contextmanager
def etcd_server(data_dir, timeout_s: float = 30.0):
    """A one-member etcd on free 127.0.0.1 ports (the apt etcd-server binary); yields its client port."""
    from checkpoint_engine.metadata import EtcdStore

    port, peer = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        [
            *("etcd", "--data-dir", str(data_dir), "--name", "test"),
            *("--listen-client-urls", client_url, "--advertise-client-urls", client_url),
            *("--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url),
            *("--initial-cluster", f"test={peer_url}"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                EtcdStore("127.0.0.1", port, timeout_s=2).close()
                break
            except RuntimeError:
                assert proc.poll() is None, "etcd exited"
                assert time.monotonic() < deadline, f"etcd did not come up within {timeout_s:.0f} s"
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        assert proc.wait(20) in (0, -15)  # etcd 3.4 exits by the signal itself
