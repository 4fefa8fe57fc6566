"""The real sandbox service as a subprocess on a free port, for tests (the sandbox tests' fixtures and
the RL job's code-reward test): `start_service(args)` -> a healthy `Service`; `request`, the project's
JSON client returning an `Answer`."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_common.httpjson import status_json
from ckpt_common.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SECRET_ENV_NAME = "SANDBOX_TEST_HOST_SECRET"


@dataclass(frozen=True)
class Answer:
    """An answer of the service: its status and decoded JSON body."""

    status_code: int
    body: Any

    def json(self) -> Any:
        return self.body

    @property
    def text(self) -> str:
        return json.dumps(self.body)


def request(method: str, url: str, body: Any = None, timeout_s: float = 60.0) -> Answer:
    """One request with the project's JSON client; an unreachable service raises OSError."""
    return Answer(*status_json(method, url, body, timeout_s=timeout_s))


class Service:
    """A running `python -m sandbox` process."""

    def __init__(self, extra_args: list[str], env_secret: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env_secret = env_secret
        env = dict(os.environ, **{SECRET_ENV_NAME: env_secret})
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sandbox",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "WARNING",
                *extra_args,
            ],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_healthy(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox service exited with {self.proc.returncode}: {self.log_text()}")
            try:
                resp = request("GET", self.url + "/health", timeout_s=2.0)
                if resp.status_code == 200:
                    return resp.json()
                last = resp.text
            except OSError as exc:
                last = exc
            time.sleep(0.1)  # polling a starting server, bounded by the deadline above
        raise RuntimeError(f"sandbox service not healthy within {timeout_s} s: {last}")

    def stop(self, timeout_s: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise
        return self.proc.returncode


def start_service(extra_args: list[str]) -> Service:
    service = Service(extra_args, env_secret="envsecret-" + secrets.token_hex(8))
    try:
        service.wait_healthy()
    except BaseException:
        service.proc.kill()
        service.proc.wait(timeout=10)
        raise
    return service
