"""Blocking HTTP client of the sandbox service (`python -m sandbox`).

    SandboxClient.run   ──POST /run──▶   RunResult      (one program, one stdin)
    SandboxClient.judge ──POST /judge──▶ JudgeResult    (one program against test cases)

503 (overload) and refused connections are retried with back-off until a deadline; 4xx raises
ValueError with the service's message, other failures RuntimeError. `timeout_s` bounds each socket
operation (connect, send, each read). Each request opens its own connection (ckpt_common.httpjson):
safe to share between threads; benchmarks/RESULTS.md ("Sandbox on aiohttp") measured what that
costs. Used by the orchestrator's code reward (`orchestrator.rewards.code_sandbox`) and by
`python -m sandbox.testgen --sandbox-url`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ckpt_common.httpjson import call_json, status_json

from .models import JudgeResult, RunRequest, RunResult, TestCase

logger = logging.getLogger(__name__)


class SandboxClient:
    """Small blocking client of the sandbox service; retries 503 (overload) until a deadline."""

    def __init__(
        self, base_url: str, timeout_s: float = 300.0, *, retry_deadline_s: float = 120.0, retry_delay_s: float = 0.2
    ) -> None:
        if timeout_s <= 0 or retry_deadline_s < 0 or retry_delay_s <= 0:
            raise ValueError(
                f"timeout_s ({timeout_s}) and retry_delay_s ({retry_delay_s}) must be "
                f"> 0, retry_deadline_s ({retry_deadline_s}) >= 0"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._retry_deadline_s = retry_deadline_s
        self._retry_delay_s = retry_delay_s

    def health(self) -> dict:
        """The service's /health answer; RuntimeError (httpjson.HTTPError for a status >= 400) otherwise."""
        return call_json("GET", self.base_url + "/health", timeout_s=self.timeout_s)

    def run(self, request: RunRequest) -> RunResult:
        return RunResult.from_dict(self._post("/run", request.to_dict()))

    def judge(
        self,
        language: str,
        code: str,
        test_cases: Sequence[TestCase],
        *,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        compare: str = "lines",
        stop_on_first_failure: bool = False,
    ) -> JudgeResult:
        body = {
            "language": language,
            "code": code,
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "compare": compare,
            "stop_on_first_failure": stop_on_first_failure,
            "test_cases": [{"input": c.input, "output": c.output} for c in test_cases],
        }
        return JudgeResult.from_dict(self._post("/judge", body))

    def close(self) -> None:
        """Nothing to release (no connection outlives its request); kept for `with` and callers."""

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, body: dict) -> dict:
        """POST with retries on overload (503) and refused connections, within the deadline.
        4xx raises ValueError (the service's message), other failures RuntimeError."""
        deadline = time.monotonic() + self._retry_deadline_s
        delay_s = self._retry_delay_s
        while True:
            try:
                status, data = status_json("POST", self.base_url + path, body, timeout_s=self.timeout_s)
            except TimeoutError as exc:
                raise RuntimeError(
                    f"sandbox {self.base_url}{path} gave no answer within {self.timeout_s} s: {exc}"
                ) from exc
            except OSError as exc:  # refused, reset, closed without an answer, name not resolved
                problem = f"cannot reach the sandbox at {self.base_url}: {type(exc).__name__}: {exc}"
            else:
                if status == 200 and set(data) != {"raw"}:
                    return data
                detail = _detail(data)
                if status == 200:
                    raise RuntimeError(f"sandbox answered {path} with non-JSON: {detail}")
                if 400 <= status < 500:
                    raise ValueError(f"sandbox refused the request ({status}): {detail}")
                if status != 503:
                    raise RuntimeError(f"sandbox error {status} on {path}: {detail}")
                problem = f"sandbox overloaded: {detail}"
            if time.monotonic() + delay_s > deadline:
                raise RuntimeError(f"{problem} (gave up after {self._retry_deadline_s} s)")
            logger.debug("%s; retrying in %.2f s", problem, delay_s)
            time.sleep(delay_s)  # back-off between retries, bounded by the deadline above
            delay_s = min(2 * delay_s, 2.0)


def _detail(data: object) -> str:
    """The service's message: its `detail`, else the answer's text (`raw` when it was not JSON)."""
    if isinstance(data, dict):
        return str(data.get("detail", data.get("raw", data)))[:500]
    return str(data)[:500]
