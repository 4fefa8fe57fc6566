"""Code reward for the RL orchestrator, computed by the sandbox service.

    policy sample ──extract_code_block──▶ code ──SandboxClient.judge (POST /judge)──▶ passed/total
                                                                            └──▶ reward in [0, 1]

`mode="fraction"` gives passed/total; `mode="all_or_nothing"` gives 1.0 only when every case passes
(and asks the service to stop at the first failing case).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from .models import COMPARE_MODES, LANGUAGES, JudgeResult, RunRequest, RunResult, TestCase

logger = logging.getLogger(__name__)
RewardMode = Literal["fraction", "all_or_nothing"]
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+#-]*)[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeRewardConfig:
    """How the orchestrator scores code: `code_reward(client, code, cases, **asdict(cfg))`."""

    mode: RewardMode = "fraction"
    language: str = "python"
    timeout_s: float = 2.0
    memory_mb: int = 256
    compare: str = "lines"

    def __post_init__(self) -> None:
        if self.mode not in ("fraction", "all_or_nothing"):
            raise ValueError(f"mode must be 'fraction' or 'all_or_nothing', got {self.mode!r}")
        if self.language not in LANGUAGES:
            raise ValueError(f"language must be one of {LANGUAGES}, got {self.language!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb <= 0:
            raise ValueError(f"memory_mb must be a positive integer, got {self.memory_mb!r}")
        if self.compare not in COMPARE_MODES:
            raise ValueError(f"compare must be one of {COMPARE_MODES}, got {self.compare!r}")


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
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def health(self) -> dict:
        resp = self._http.get("/health")
        resp.raise_for_status()
        return resp.json()

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
        self._http.close()

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
                resp = self._http.post(path, json=body)
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                problem = f"cannot reach the sandbox at {self.base_url}: {exc}"
            except httpx.TimeoutException as exc:
                raise RuntimeError(
                    f"sandbox {self.base_url}{path} gave no answer within {self.timeout_s} s: {exc}"
                ) from exc
            else:
                if resp.status_code == 200:
                    return resp.json()
                detail = _detail(resp)
                if 400 <= resp.status_code < 500:
                    raise ValueError(f"sandbox refused the request ({resp.status_code}): {detail}")
                if resp.status_code != 503:
                    raise RuntimeError(f"sandbox error {resp.status_code} on {path}: {detail}")
                problem = f"sandbox overloaded: {detail}"
            if time.monotonic() + delay_s > deadline:
                raise RuntimeError(f"{problem} (gave up after {self._retry_deadline_s} s)")
            logger.debug("%s; retrying in %.2f s", problem, delay_s)
            time.sleep(delay_s)  # back-off between retries, bounded by the deadline above
            delay_s = min(2 * delay_s, 2.0)


def _detail(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:500]
    return str(data.get("detail", data)) if isinstance(data, dict) else str(data)


def _as_case(case: TestCase | Mapping[str, Any] | Sequence[str]) -> TestCase:
    if isinstance(case, TestCase):
        return case
    if isinstance(case, Mapping):
        return TestCase(input=case["input"], output=case["output"])
    stdin, expected = case
    return TestCase(input=stdin, output=expected)


def extract_code_block(text: str, language: str | None = None) -> str:
    """The last fenced code block of a model answer (preferring one tagged `language`), or the
    whole text when it has none."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return text
    if language is not None:
        aliases = {"python": {"python", "py", "python3"}, "c": {"c"}, "cpp": {"cpp", "c++", "cc", "cxx"}}.get(
            language, {language}
        )
        tagged = [body for tag, body in blocks if tag.lower() in aliases]
        if tagged:
            return tagged[-1]
    return blocks[-1][1]


def code_reward(
    client: SandboxClient,
    code: str,
    test_cases: Sequence[TestCase | Mapping[str, Any] | Sequence[str]],
    *,
    mode: RewardMode,
    language: str = "python",
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    compare: str = "lines",
) -> float:
    """Reward of one submission: fraction of cases passed, or 1.0/0.0 for all-or-nothing.

    Empty code scores 0.0 without a call. ValueError for bad arguments or a request the sandbox
    refuses (for example code over its size limit); RuntimeError when the sandbox fails."""
    if mode not in ("fraction", "all_or_nothing"):
        raise ValueError(f"mode must be 'fraction' or 'all_or_nothing', got {mode!r}")
    cases = [_as_case(c) for c in test_cases]
    if not cases:
        raise ValueError("test_cases must hold at least one case")
    if not code.strip():
        return 0.0
    result = client.judge(
        language,
        code,
        cases,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        compare=compare,
        stop_on_first_failure=mode == "all_or_nothing",
    )
    if mode == "all_or_nothing":
        return 1.0 if result.all_passed else 0.0
    return result.passed / result.total
