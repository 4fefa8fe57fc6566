"""HTTP edge of the sandbox: FastAPI app with /run, /judge and /health.

    client ──POST /run|/judge (JSON)──▶ pydantic validation (400 on bad input)
           ──▶ admission (num_workers running + max_queue waiting, else 503 "rejected")
           ──▶ thread pool (num_workers) ──▶ Sandbox.run / judge_submission ──▶ JSON answer

Handlers never block the event loop: every sandbox call runs in the bounded thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .config import ServiceConfig
from .executor import Sandbox
from .judge import judge_submission
from .models import RunRequest, TestCase

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: Literal["python", "c", "cpp"]
    code: str = Field(min_length=1)
    stdin: str = ""
    timeout_s: float = Field(2.0, gt=0)
    memory_mb: int = Field(256, gt=0)


class CaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str
    output: str


class JudgeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: Literal["python", "c", "cpp"]
    code: str = Field(min_length=1)
    test_cases: list[CaseBody] = Field(min_length=1)
    timeout_s: float = Field(2.0, gt=0)
    memory_mb: int = Field(256, gt=0)
    compare: Literal["exact", "lines", "tokens"] = "lines"
    stop_on_first_failure: bool = False


class _Rejected(Exception):
    """A request that waited in the queue past queue_timeout_s."""


class Admission:
    """At most `capacity` requests in the service (running plus queued) at any time."""

    def __init__(self, num_workers: int, max_queue: int) -> None:
        self.num_workers = num_workers
        self.capacity = num_workers + max_queue
        self._inside = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self._inside >= self.capacity:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._lock:
            assert self._inside > 0, "admission left more often than entered"
            self._inside -= 1

    @property
    def inside(self) -> int:
        with self._lock:
            return self._inside


def _error(status_code: int, error: str, detail: str) -> JSONResponse:
    body = {"error": error, "detail": detail}
    if status_code == 503:
        body["status"] = "rejected"
    headers = {"Retry-After": "1"} if status_code == 503 else None
    return JSONResponse(status_code=status_code, content=body, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            parts.append(f"body is not valid JSON ({err.get('ctx', {}).get('error', '')})")
            continue
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


class _Handlers:
    """The endpoints' logic: validate, admit, run in the worker pool, answer."""

    def __init__(self, sandbox: Sandbox, config: ServiceConfig) -> None:
        self.sandbox = sandbox
        self.config = config
        self.admission = Admission(config.num_workers, config.max_queue)
        self.workers = ThreadPoolExecutor(max_workers=config.num_workers, thread_name_prefix="sandbox-run")
        self.counters = {"runs": 0, "judges": 0, "rejected": 0, "errors": 0}

    async def call(self, fn: Callable[[], T]) -> T | JSONResponse:
        """Run `fn` in the worker pool if there is room; map its errors to HTTP answers."""
        cfg = self.config
        if not self.admission.try_enter():
            self.counters["rejected"] += 1
            return _error(
                503,
                "overloaded",
                f"{self.admission.inside} requests are running or queued (capacity "
                f"{self.admission.capacity} = {cfg.num_workers} workers + "
                f"{cfg.max_queue} queued); retry later",
            )
        enqueued_at = time.monotonic()

        def timed() -> T:
            waited_s = time.monotonic() - enqueued_at
            if waited_s > cfg.queue_timeout_s:
                raise _Rejected(f"waited {waited_s:.1f} s in the queue (queue_timeout_s={cfg.queue_timeout_s})")
            return fn()

        try:
            return await asyncio.get_running_loop().run_in_executor(self.workers, timed)
        except _Rejected as exc:
            self.counters["rejected"] += 1
            return _error(503, "queue timeout", str(exc))
        except ValueError as exc:
            return _error(400, "invalid request", str(exc))
        except RuntimeError as exc:
            self.counters["errors"] += 1
            logger.error("sandbox failure: %s", exc)
            return _error(500, "sandbox failure", str(exc))
        finally:
            self.admission.leave()

    async def health(self) -> dict:
        cfg = self.config
        return {
            "status": "ok",
            "service": {
                "num_workers": cfg.num_workers,
                "max_queue": cfg.max_queue,
                "inside": self.admission.inside,
                **self.counters,
            },
            "sandbox": self.sandbox.health(),
        }

    async def run(self, body: RunBody):
        try:
            request = RunRequest(**body.model_dump())
            self.sandbox.config.check_request(request)
        except ValueError as exc:
            return _error(400, "invalid request", str(exc))
        self.counters["runs"] += 1
        result = await self.call(lambda: self.sandbox.run(request))
        return result if isinstance(result, JSONResponse) else result.to_dict()

    async def judge(self, body: JudgeBody):
        if len(body.test_cases) > self.config.max_judge_cases:
            return _error(
                400,
                "invalid request",
                f"test_cases holds {len(body.test_cases)} cases, "
                f"more than max_judge_cases={self.config.max_judge_cases}",
            )
        try:
            cases = [TestCase(c.input, c.output) for c in body.test_cases]
            longest = RunRequest(
                language=body.language,
                code=body.code,
                stdin=max((c.input for c in cases), key=len),
                timeout_s=body.timeout_s,
                memory_mb=body.memory_mb,
            )
            self.sandbox.config.check_request(longest)
        except ValueError as exc:
            return _error(400, "invalid request", str(exc))
        self.counters["judges"] += 1
        result = await self.call(
            lambda: judge_submission(
                self.sandbox,
                body.language,
                body.code,
                cases,
                timeout_s=body.timeout_s,
                memory_mb=body.memory_mb,
                compare=body.compare,
                stop_on_first_failure=body.stop_on_first_failure,
            )
        )
        return result if isinstance(result, JSONResponse) else result.to_dict()


def create_app(sandbox: Sandbox, config: ServiceConfig) -> FastAPI:
    """The service around an existing Sandbox (the caller closes the sandbox)."""
    handlers = _Handlers(sandbox, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            handlers.workers.shutdown(wait=True, cancel_futures=True)

    app = FastAPI(title="code sandbox", version="1", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, "invalid request", _validation_message(exc))

    @app.get("/health")
    async def health() -> dict:
        return await handlers.health()

    @app.post("/run")
    async def run(body: RunBody):
        return await handlers.run(body)

    @app.post("/judge")
    async def judge(body: JudgeBody):
        return await handlers.judge(body)

    return app
