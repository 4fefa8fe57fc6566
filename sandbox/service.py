"""HTTP edge of the sandbox (aiohttp): POST /run, POST /judge, GET /health.

    client ──POST /run|/judge (JSON, at most max_body_bytes, read within BODY_READ_TIMEOUT_S)
           ──▶ body checks (`parse_run` / `parse_judge`: 400 naming the field)
           ──▶ admission (num_workers running + max_queue waiting, else 503 "rejected")
           ──▶ thread pool (num_workers) ──▶ Sandbox.run / judge_submission ──▶ JSON answer
                                              (within `answer_bound_s`, else 500)

Every answer is JSON. Errors are `{"error": ..., "detail": ...}`: 400 for a request the service
refuses (the detail names the field), 413 for a body over max_body_bytes, 503 with
`"status": "rejected"` and `Retry-After: 1` when full or after waiting past queue_timeout_s, 500 for
a sandbox failure; unknown routes and methods answer 404 / 405 in the same shape. Handlers never
block the event loop: every sandbox call runs in the bounded thread pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from .config import ServiceConfig
from .executor import Sandbox
from .judge import judge_submission
from .models import COMPARE_MODES, LANGUAGES, RunRequest, TestCase

logger = logging.getLogger(__name__)
T = TypeVar("T")

BODY_READ_TIMEOUT_S = 60.0  # a client that has not sent its whole body by then gets 408
SHUTDOWN_GRACE_S = 30.0  # requests still running at SIGTERM get this long before they are cut
ANSWER_SLACK_S = 30.0  # on top of the worst case of the sandbox's own limits (a loaded machine)
_MISSING = object()


class BodyError(ValueError):
    """A request body that is not what the route takes; the message starts with the field."""


# ------------------------------------------------------------------------------ body checks
@dataclass(frozen=True)
class JudgeRequest:
    """A checked /judge body."""

    language: str
    code: str
    test_cases: tuple[TestCase, ...]
    timeout_s: float = 2.0
    memory_mb: int = 256
    compare: str = "lines"
    stop_on_first_failure: bool = False


def _object(data: Any, where: str, fields: tuple[str, ...], required: tuple[str, ...]) -> dict:
    if not isinstance(data, dict):
        raise BodyError(f"{where}: must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        name = unknown[0] if where == "body" else f"{where}.{unknown[0]}"
        raise BodyError(f"{name}: unknown field (this takes {', '.join(fields)})")
    for name in required:
        if name not in data:
            raise BodyError(f"{name if where == 'body' else f'{where}.{name}'}: field required")
    return data


def _string(data: dict, name: str, default: Any = _MISSING, *, where: str = "", non_empty: bool = False) -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise BodyError(f"{where}{name}: must be a string, got {type(value).__name__}")
    if non_empty and not value:
        raise BodyError(f"{where}{name}: must not be empty")
    return value


def _choice(data: dict, name: str, choices: tuple[str, ...], default: Any = _MISSING) -> str:
    value = data.get(name, default)
    if value not in choices:
        raise BodyError(f"{name}: must be one of {', '.join(choices)}; got {value!r}")
    return value


def _positive_number(data: dict, name: str, default: float) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BodyError(f"{name}: must be a finite number > 0, got {value!r}")
    return float(value)


def _positive_int(data: dict, name: str, default: int) -> int:
    value = data.get(name, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BodyError(f"{name}: must be an integer > 0, got {value!r}")
    return value


_RUN_FIELDS = ("language", "code", "stdin", "timeout_s", "memory_mb")
_JUDGE_FIELDS = ("language", "code", "test_cases", "timeout_s", "memory_mb", "compare", "stop_on_first_failure")


def parse_run(data: Any) -> RunRequest:
    """The RunRequest of a /run body; BodyError (or the request's own ValueError) naming the field."""
    _object(data, "body", _RUN_FIELDS, ("language", "code"))
    return RunRequest(
        language=_choice(data, "language", LANGUAGES),
        code=_string(data, "code", non_empty=True),
        stdin=_string(data, "stdin", ""),
        timeout_s=_positive_number(data, "timeout_s", 2.0),
        memory_mb=_positive_int(data, "memory_mb", 256),
    )


def parse_judge(data: Any) -> JudgeRequest:
    """The JudgeRequest of a /judge body; BodyError naming the field (`test_cases.3.output`)."""
    _object(data, "body", _JUDGE_FIELDS, ("language", "code", "test_cases"))
    raw_cases = data["test_cases"]
    if not isinstance(raw_cases, list) or not raw_cases:
        raise BodyError(f"test_cases: must be a non-empty list of {{input, output}}, got {raw_cases!r:.100}")
    cases = []
    for i, case in enumerate(raw_cases):
        where = f"test_cases.{i}"
        _object(case, where, ("input", "output"), ("input", "output"))
        cases.append(TestCase(_string(case, "input", where=where + "."), _string(case, "output", where=where + ".")))
    stop = data.get("stop_on_first_failure", False)
    if not isinstance(stop, bool):
        raise BodyError(f"stop_on_first_failure: must be true or false, got {stop!r}")
    return JudgeRequest(
        language=_choice(data, "language", LANGUAGES),
        code=_string(data, "code", non_empty=True),
        test_cases=tuple(cases),
        timeout_s=_positive_number(data, "timeout_s", 2.0),
        memory_mb=_positive_int(data, "memory_mb", 256),
        compare=_choice(data, "compare", COMPARE_MODES, "lines"),
        stop_on_first_failure=stop,
    )


def answer_bound_s(config: ServiceConfig, timeout_s: float, runs: int) -> float:
    """The longest a request may take once admitted: its wait in the queue, a compile, and each run
    at its limits (setup, wall timeout, kill grace), plus slack. Past it the answer is a 500."""
    sb = config.sandbox
    per_run = sb.setup_timeout_s + timeout_s + sb.kill_grace_s
    return config.queue_timeout_s + sb.compile_timeout_s + runs * per_run + ANSWER_SLACK_S


# -------------------------------------------------------------------------------- the service
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


def _error(status: int, error: str, detail: str, headers: dict | None = None) -> web.Response:
    body = {"error": error, "detail": detail}
    if status == 503:
        body["status"] = "rejected"
        headers = {**(headers or {}), "Retry-After": "1"}
    return web.json_response(body, status=status, headers=headers)


class _Answer(Exception):
    """An error answer decided while reading the body."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


async def _read_json(request: web.Request, max_bytes: int) -> Any:
    """The request's decoded JSON body; BodyError when it is not JSON, `_Answer` (413, 408) for a
    body too large or too slow to arrive."""
    size = request.content_length
    if size is not None and size > max_bytes:
        raise _Answer(_error(413, "request too large", f"body is {size} bytes, more than max_body_bytes={max_bytes}"))
    try:
        raw = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except web.HTTPRequestEntityTooLarge:
        raise _Answer(_error(413, "request too large", f"body is more than max_body_bytes={max_bytes}")) from None
    except asyncio.TimeoutError:
        raise _Answer(
            _error(408, "request timeout", f"the body did not arrive within {BODY_READ_TIMEOUT_S} s")
        ) from None
    try:
        return json.loads(raw)
    except RecursionError:
        raise BodyError("body: is not valid JSON (nested too deep)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"body: is not valid JSON ({e})") from None


class _Handlers:
    """The endpoints' logic: check, admit, run in the worker pool, answer."""

    def __init__(self, sandbox: Sandbox, config: ServiceConfig) -> None:
        self.sandbox = sandbox
        self.config = config
        self.admission = Admission(config.num_workers, config.max_queue)
        self.workers = ThreadPoolExecutor(max_workers=config.num_workers, thread_name_prefix="sandbox-run")
        self.counters = {"runs": 0, "judges": 0, "rejected": 0, "errors": 0}

    async def call(self, fn: Callable[[], T], bound_s: float) -> T | web.Response:
        """Run `fn` in the worker pool if there is room; map its errors to HTTP answers. A request
        leaves the admission when its work ends (even one answered 500 past `bound_s`)."""
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
            work = self.workers.submit(timed)
        except RuntimeError:  # the pool is shut down: the service is stopping
            self.admission.leave()
            return _error(503, "stopping", "the sandbox service is stopping")
        work.add_done_callback(lambda _: self.admission.leave())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(work), bound_s)
        except asyncio.TimeoutError:
            self.counters["errors"] += 1
            logger.error("no answer within %.0f s; the run goes on in its worker until its own limits", bound_s)
            return _error(500, "sandbox failure", f"no answer within {bound_s:.0f} s")
        except _Rejected as exc:
            self.counters["rejected"] += 1
            return _error(503, "queue timeout", str(exc))
        except ValueError as exc:
            return _error(400, "invalid request", str(exc))
        except RuntimeError as exc:
            self.counters["errors"] += 1
            logger.error("sandbox failure: %s", exc)
            return _error(500, "sandbox failure", str(exc))

    async def health(self, _: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response(
            {
                "status": "ok",
                "service": {
                    "num_workers": cfg.num_workers,
                    "max_queue": cfg.max_queue,
                    "inside": self.admission.inside,
                    **self.counters,
                },
                "sandbox": self.sandbox.health(),
            }
        )

    async def run(self, request: web.Request) -> web.Response:
        try:
            run = parse_run(await _read_json(request, self.config.max_body_bytes))
            self.sandbox.config.check_request(run)
        except _Answer as answer:
            return answer.response
        except ValueError as exc:
            return _error(400, "invalid request", str(exc))
        self.counters["runs"] += 1
        result = await self.call(lambda: self.sandbox.run(run), answer_bound_s(self.config, run.timeout_s, 1))
        return result if isinstance(result, web.Response) else web.json_response(result.to_dict())

    async def judge(self, request: web.Request) -> web.Response:
        try:
            body = parse_judge(await _read_json(request, self.config.max_body_bytes))
            if len(body.test_cases) > self.config.max_judge_cases:
                raise BodyError(
                    f"test_cases holds {len(body.test_cases)} cases, "
                    f"more than max_judge_cases={self.config.max_judge_cases}"
                )
            longest = RunRequest(
                language=body.language,
                code=body.code,
                stdin=max((c.input for c in body.test_cases), key=len),
                timeout_s=body.timeout_s,
                memory_mb=body.memory_mb,
            )
            self.sandbox.config.check_request(longest)
        except _Answer as answer:
            return answer.response
        except ValueError as exc:
            return _error(400, "invalid request", str(exc))
        self.counters["judges"] += 1
        result = await self.call(
            lambda: judge_submission(
                self.sandbox,
                body.language,
                body.code,
                list(body.test_cases),
                timeout_s=body.timeout_s,
                memory_mb=body.memory_mb,
                compare=body.compare,
                stop_on_first_failure=body.stop_on_first_failure,
            ),
            answer_bound_s(self.config, body.timeout_s, len(body.test_cases)),
        )
        return result if isinstance(result, web.Response) else web.json_response(result.to_dict())

    async def close(self, _: web.Application) -> None:
        await asyncio.to_thread(self.workers.shutdown, wait=True, cancel_futures=True)


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own error answers (404, 405...) and unexpected exceptions, in the service's JSON shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return _error(e.status, (e.reason or "error").lower(), f"{request.method} {request.path}: {e.reason}", headers)
    except Exception as e:  # a bug, not a bad request: a JSON 500 naming it
        logger.exception("%s %s failed", request.method, request.path)
        return _error(500, "sandbox fault", f"{type(e).__name__}: {e}")


def create_app(sandbox: Sandbox, config: ServiceConfig) -> web.Application:
    """The service around an existing Sandbox (the caller closes the sandbox; the app's cleanup
    stops its worker pool)."""
    handlers = _Handlers(sandbox, config)
    # the bound aiohttp applies to bodies without a Content-Length; _read_json answers 413 itself
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_json_errors])
    app.router.add_get("/health", handlers.health)
    app.router.add_post("/run", handlers.run)
    app.router.add_post("/judge", handlers.judge)
    app.on_cleanup.append(handlers.close)
    return app


def serve(sandbox: Sandbox, config: ServiceConfig) -> None:
    """Serve until SIGTERM or SIGINT; then requests still running get SHUTDOWN_GRACE_S and the
    worker pool is stopped (its runs end within their own limits)."""
    asyncio.run(_serve(create_app(sandbox, config), config))


async def _serve(app: web.Application, config: ServiceConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        logger.info("serving on %s", ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses))
        await stop.wait()
        logger.info("signal received: stopping")
    finally:
        await runner.cleanup()
