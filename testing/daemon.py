"""Start the checkpoint-engine daemon (`torchrun -m checkpoint_engine`) as a child process and wait
until its HTTP API answers; the one place tests, benchmarks and examples do it.

    daemon = start_daemon("--collective-timeout-s", "60", log=tmp_path / "daemon.log",
                          engine_cmd=[sys.executable, "-m", "checkpoint_engine.engines.plain", ...])
    try:
        code, body = daemon.call("GET", "/engines")
        assert daemon.shutdown() == 0, daemon.log_tail()
    finally:
        daemon.stop()

The daemon runs in its own session (process group) with its output in a log file; `stop()` ends
torchrun and every rank, whatever state they are in. Stdlib and `ckpt_common.httpjson` only:
importing this module is instant.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpt_common.httpjson import status_json
from ckpt_common.ports import free_port

REPO = Path(__file__).resolve().parents[1]


class DaemonStartError(RuntimeError):
    """The daemon exited or did not answer in time; the message ends with its log's last lines."""


def repo_env(**extra: str) -> dict:
    """This environment with the checkout first on PYTHONPATH and one OpenMP thread unless set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


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


def status_json_when_free(
    method: str, url: str, body: dict | None = None, *, timeout_s: float = 60.0, uds: str | None = None
) -> tuple[int, object]:
    """`status_json`, asked again while the daemon answers 409 busy (a heal its healer runs, which a
    test cannot time), until `timeout_s`; then the last answer, busy or not."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, answer = status_json(method, url, body, timeout_s=timeout_s, uds=uds)
        busy = code == 409 and isinstance(answer, dict) and answer.get("kind") == "busy"
        if not busy or time.monotonic() > deadline:
            return code, answer
        time.sleep(0.2)  # the command in flight runs on; bounded by the deadline


@dataclass
class Daemon:
    """A started daemon: `url` (``http://127.0.0.1:PORT``, or ``http://localhost`` with `uds`), the
    process (torchrun) and the log file."""

    proc: subprocess.Popen
    url: str
    log: Path
    uds: str | None = None
    token: str | None = None  # sent on every call (the daemon's --token-file)
    ca_file: str | None = None  # the CA of its --tls-cert-file (url https://)

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, object]:
        """(status, decoded answer) for any status; OSError while nothing listens."""
        return status_json(
            method, self.url + path, body, timeout_s=timeout_s, uds=self.uds, token=self.token, ca_file=self.ca_file
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout_s: float, path: str = "/health", interval_s: float = 0.1) -> None:
        """Poll GET `path` until it answers 200; DaemonStartError (with the log's tail) when the daemon
        exits first or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise DaemonStartError(
                    f"the daemon exited with {self.proc.returncode} before it answered; {self.log}:\n{self.log_tail()}"
                )
            try:
                if self.call("GET", path, timeout_s=1.0)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise DaemonStartError(
                    f"the daemon did not answer within {timeout_s:.0f} s; {self.log}:\n{self.log_tail()}"
                )
            time.sleep(interval_s)

    def shutdown(self, timeout_s: float = 60.0) -> int:
        """POST /shutdown and wait for torchrun's exit code."""
        code, body = self.call("POST", "/shutdown", timeout_s=timeout_s)
        if code != 200:
            raise RuntimeError(f"POST /shutdown answered {code}: {body}")
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_group(self.proc, timeout_s)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_daemon(
    *flags: str,
    log: str | os.PathLike,
    nproc: int = 2,
    engine_cmd: Sequence[str] | None = None,
    uds: str | None = None,
    env: dict | None = None,
    ready_timeout_s: float = 90.0,
    ready_path: str = "/health",
    interval_s: float = 0.1,
    token: str | None = None,
    ca_file: str | None = None,
) -> Daemon:
    """`torchrun --nproc-per-node NPROC -m checkpoint_engine --port PORT (or --uds UDS) [--engine-cmd
    JSON] FLAGS...` from the checkout, its output in `log`; returns once GET `ready_path` answers 200
    (DaemonStartError with the log's tail otherwise)."""
    port = free_port()
    where = ("--uds", uds) if uds else ("--port", str(port))
    engine = ("--engine-cmd", json.dumps(list(engine_cmd))) if engine_cmd is not None else ()
    log = Path(log)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)),
                *("--master-port", str(free_port()), "-m", "checkpoint_engine", *where, *engine, *flags),
            ],
            cwd=REPO,
            env=repo_env() if env is None else env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    scheme = "https" if "--tls-cert-file" in flags else "http"
    url = "http://localhost" if uds else f"{scheme}://127.0.0.1:{port}"
    daemon = Daemon(proc, url, log, uds, token, ca_file)
    try:
        daemon.wait_ready(ready_timeout_s, ready_path, interval_s)
    except BaseException:
        daemon.stop()
        raise
    return daemon
