"""req_funcs that push a ParameterServer update through vLLM's own weight-transfer API (the engine runs
`--weight-transfer-config '{"backend": "checkpoint_engine"}'`: `vllm_ext.weight_transfer.engine`).

    ParameterServer.update(name, req_func) ──(background thread, every rank)──▶ req_func(socket_paths)
        native_http_req_func (first PS rank of each engine; VLLM_SERVER_DEV_MODE=1):
            POST /pause?mode=abort|wait|keep       new requests wait; abort: running ones end now;
                                                   wait: they finish first; keep: they freeze
            POST /start_weight_update
            POST /update_weights {"update_info": [info per worker]}   returns once every bucket is loaded
            POST /finish_weight_update {"weight_version": ...}         /weight_info reports it afterwards
            POST /reset_prefix_cache?reset_running_requests=true       keep only: no KV of the old weights
                                                                       survives (see below)
            POST /resume                                               also after a failure, if paused
        native_llm_req_func: the same methods of an in-process `vllm.LLM` (it has no pause/resume), then
                            llm.reset_prefix_cache()
        client_req_func: the same over a `VLLMWeightSyncClient` (vLLM's trainer API; `trainer.py`)
        engine_req_func: the way into a vLLM server by name: "native" (the above over HTTP) or
                         "extension" (the worker extension's /collective_rpc, `vllm_ext.extension_req`)
        served_route:    which of the two a server offers: a launcher (`vllm_ext.launch`) says so
                         in GET /launcher/status ("update_route"); any other server: "extension".
                         A launcher also says its tensor-parallel size: an engine whose workers are
                         not fed one PS rank each is refused by name before anything is sent (vLLM
                         would fail mid-sequence with an IndexError, or a rank would wait out its deadline)

Every worker's update_info carries the engine's sockets in PS rank order (`NativeUpdateInfo`); each
worker takes its own. A failed route stops the sequence (no finish: the version does not move), and
raises `NativeRouteError` naming the route, the HTTP status and the engine's answer. Over HTTP the
whole sequence has one deadline (`timeout_s`), and each route gets what is left of it (/resume has
`RESUME_TIMEOUT_S` of its own, so a late update never leaves the engine paused).

KV computed with the old weights must not be reused once the new ones are in. vLLM's pause in
abort/wait mode clears its prefix cache (nothing runs by then). In keep mode the frozen requests may
hold KV blocks of the old weights across the update (vLLM's /pause documents its cache clearing as
ignored for keep; 0.32 still clears, preempting them: this does not rely on either), so after finish,
before /resume, the prefix cache is reset with `reset_running_requests`:
the frozen requests give their blocks back and, on /resume, recompute their prompt and the tokens
they already have with the new weights (one prefill each), then go on; no cached block of the old
weights is left for a request that starts later. A reset vLLM refuses (`{"success": false}`) fails
the update (`NativeRouteError` naming /reset_prefix_cache) after the version moved; the engine is
resumed all the same. A keep-mode update that fails (a refused reset too) ends the frozen requests
before /resume (`/pause?mode=abort`: they finish with the tokens they have, all computed with the
old weights, and vLLM clears its caches), so none goes on with a half-loaded model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint_engine.types import (
    PAUSE_MODES,
    REQUESTED_ROUTES,
    UPDATE_ROUTES,
    PauseMode,
    ReqFunc,
    RequestedRoute,
    UpdateRoute,
    WeightVersion,
)
from ckpt_common.httpjson import HTTPError, post_json, status_json
from vllm_ext.extension_req import EngineRpcError, vllm_http_req_func
from vllm_ext.gate import finish_failure
from vllm_ext.launch_config import EXTENSION
from vllm_ext.weight_transfer.infos import NativeUpdateInfo

logger = logging.getLogger(__name__)

ROUTES = (
    "/pause",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/resume",
)
# keep mode's step after finish: vLLM preempts the frozen requests (they recompute with the new weights)
# and drops every cached block
RESET_KV_ROUTE = "/reset_prefix_cache?reset_running_requests=true"
RESUME_TIMEOUT_S = 30.0  # /resume has a deadline of its own: a late update must not leave the engine paused


class NativeRouteError(EngineRpcError):
    """A step of vLLM's weight-transfer sequence failed; `route` names it ("/update_weights", ...)."""

    def __init__(self, route: str, message: str):
        self.route = route
        super().__init__(message)


def update_payload(handles: Mapping[str, str], num_workers: int) -> list[dict[str, Any]]:
    """`/update_weights`' update_info: one entry per worker (vLLM indexes it by the worker's rank), each
    naming the engine's sockets in PS rank order; `select_handle` picks the worker's own."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    info = NativeUpdateInfo(zmq_handles=dict(handles)).to_dict()
    return [info for _ in range(num_workers)]


@dataclass(frozen=True)
class NativeSteps:
    """The calls of one engine's update; `pause`/`resume` None where the engine has none (offline LLM)."""

    where: str
    start: Callable[[], Any]
    update: Callable[[list[dict[str, Any]]], Any]
    finish: Callable[[str | None], Any]
    pause: Callable[[], Any] | None = None
    resume: Callable[[], Any] | None = None
    # where no pause cleared vLLM's caches (offline LLM): reset the prefix cache after the update (a
    # failed one too: it may have changed some layers), so no KV block of the old weights is reused
    reset_prefix_cache: Callable[[], Any] | None = None
    # pause mode keep: drop every KV block of the old weights, the frozen requests' too, after finish and
    # before resume; raises if the engine refuses (a failed update: best effort, before the resume)
    drop_kv: Callable[[], Any] | None = None
    # pause mode keep, after a failed update: end the frozen requests (with the tokens they have, all of
    # the old weights) instead of letting them go on with a half-loaded model; vLLM's abort pause also
    # clears its caches. Best effort; drop_kv is the fallback
    abort_frozen: Callable[[], Any] | None = None


def run_native_update(
    steps: NativeSteps, payload: list[dict[str, Any]], weight_version: str | None
) -> dict[str, float]:
    """pause -> start -> update -> finish(version) [-> drop_kv] -> resume; resume (best effort) also after a
    failure, after a best-effort drop_kv; the prefix cache reset (where the steps have one) after either.
    Returns each step's seconds ({"pause": ..., "start": ..., ...}), also in the log line."""
    t0 = time.monotonic()
    step_s: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any], *args: Any) -> None:
        t = time.monotonic()
        try:
            fn(*args)
        finally:
            step_s[name] = round(time.monotonic() - t, 4)

    paused = False
    kv_dropped = False
    try:
        if steps.pause is not None:
            timed("pause", steps.pause)
            paused = True
        timed("start", steps.start)
        timed("update", steps.update, payload)
        timed("finish", steps.finish, weight_version)
        if steps.drop_kv is not None:
            kv_dropped = True  # tried: a refused reset is not retried below
            timed("drop_kv", steps.drop_kv)
        if steps.resume is not None:
            paused = False
            timed("resume", steps.resume)
    finally:
        if steps.reset_prefix_cache is not None:
            try:
                timed("reset_prefix_cache", steps.reset_prefix_cache)
            except Exception as e:  # noqa: BLE001 - the update's own outcome is what the caller must see
                logger.warning("could not reset the prefix cache of %s: %s", steps.where, e)
        if paused and steps.abort_frozen is not None:  # a failed update: no frozen request goes on
            try:
                steps.abort_frozen()
                kv_dropped = True  # vLLM's abort pause clears its caches
            except Exception as e:  # noqa: BLE001 - the update's own failure is what the caller must see
                logger.warning("could not end the frozen requests of %s after a failed update: %s", steps.where, e)
        if paused and steps.drop_kv is not None and not kv_dropped:  # a failed update may have changed layers
            try:
                steps.drop_kv()
            except Exception as e:  # noqa: BLE001 - the update's own failure is what the caller must see
                logger.warning("could not drop the KV cache of %s after a failed update: %s", steps.where, e)
        if paused and steps.resume is not None:
            try:
                steps.resume()
            except Exception as e:  # noqa: BLE001 - the update's own failure is what the caller must see
                logger.error("could not resume %s after a failed update: %s", steps.where, e)
    logger.info(
        "%s: weights updated through vLLM's weight-transfer API in %.2f s (%s; version %s)",
        steps.where,
        time.monotonic() - t0,
        ", ".join(f"{name} {sec:.3f}" for name, sec in step_s.items()),
        weight_version,
    )
    return step_s


def http_steps(endpoint: str, *, pause_mode: PauseMode, deadline: float) -> NativeSteps:
    """The sequence over vLLM's dev-mode routes; each POST is bounded by what is left until `deadline`
    (a monotonic time); /resume has `RESUME_TIMEOUT_S` of its own, also once that deadline passed.
    `pause_mode="keep"` adds the KV drop after finish (`RESET_KV_ROUTE`)."""
    base = endpoint.rstrip("/")

    def post(route: str, body: dict, *, own_timeout_s: float | None = None) -> Any:
        timeout_s = own_timeout_s if own_timeout_s is not None else deadline - time.monotonic()
        if timeout_s <= 0:
            raise NativeRouteError(route, f"POST {base}{route}: the update's deadline passed before this step")
        try:
            return post_json(base + route, body, timeout_s=timeout_s)
        except HTTPError as e:
            hint = (
                " (the route exists only with VLLM_SERVER_DEV_MODE=1; /update_weights needs "
                '--weight-transfer-config \'{"backend": "checkpoint_engine"}\')'
                if e.status == 404
                else ""
            )
            raise NativeRouteError(
                route, f"POST {base}{route} answered HTTP {e.status}: {e.text[:500]}{hint}"
            ) from None
        except (RuntimeError, OSError) as e:  # unreachable, non-JSON, or the deadline ran out
            raise NativeRouteError(route, f"POST {base}{route} failed: {e}") from None

    def drop_kv() -> None:
        answer = post(RESET_KV_ROUTE, {})
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise NativeRouteError(
                RESET_KV_ROUTE,
                f"POST {base}{RESET_KV_ROUTE} answered {str(answer)[:300]}, not {{'success': True}}: vLLM kept "
                "KV blocks computed with the old weights (it refuses while blocks are still held, e.g. by a "
                "KV transfer in flight); the weights are updated, the requests the pause froze are ended "
                "(/pause?mode=abort) and the engine is resumed; a request that starts later may reuse that KV",
            )

    if pause_mode == "none":  # the caller keeps the engine idle (no request runs across the update)
        return NativeSteps(
            where=f"engine {base}",
            start=lambda: post("/start_weight_update", {}),
            update=lambda payload: post("/update_weights", {"update_info": payload}),
            finish=lambda version: post("/finish_weight_update", {"weight_version": version}),
            reset_prefix_cache=lambda: post("/reset_prefix_cache", {}),
        )
    return NativeSteps(
        where=f"engine {base}",
        pause=lambda: post(f"/pause?mode={pause_mode}", {}),
        start=lambda: post("/start_weight_update", {}),
        update=lambda payload: post("/update_weights", {"update_info": payload}),
        finish=lambda version: post("/finish_weight_update", {"weight_version": version}),
        resume=lambda: post("/resume", {}, own_timeout_s=RESUME_TIMEOUT_S),
        drop_kv=drop_kv if pause_mode == "keep" else None,
        abort_frozen=(lambda: post("/pause?mode=abort", {}, own_timeout_s=RESUME_TIMEOUT_S))
        if pause_mode == "keep"
        else None,
    )


def native_http_req_func(
    endpoint: str,
    *,
    rank: int | None = None,
    ranks_per_engine: int = 1,
    weight_version: WeightVersion = None,
    pause_mode: PauseMode = "abort",
    timeout_s: float = 600.0,
    step_times: list[dict[str, float]] | None = None,
) -> ReqFunc:
    """req_func for PS rank `rank` whose vLLM server (`ranks_per_engine` workers) is at `endpoint`.

    Only the first rank of each engine drives the routes (one call reaches all of its workers).
    `weight_version` is what `/weight_info` reports afterwards (e.g. the checkpoint's name; a callable:
    asked at each update).
    `pause_mode`: what happens to the requests running when the update starts: "abort" (they end at
    once, with what they have), "wait" (the update waits until they finish), "keep" (they freeze and
    go on after the update, recomputing their KV with the new weights: see the module's docstring),
    "none" (no /pause and no /resume, as through the worker extension: the caller keeps the engine
    idle; the prefix cache is reset after the update, a failed one too).
    `step_times`: a list that gets each completed update's seconds per route (`run_native_update`)."""
    if rank is None:
        rank = int(os.environ["RANK"])
    _check_args(ranks_per_engine=ranks_per_engine, timeout_s=timeout_s, pause_mode=pause_mode)
    first = rank // ranks_per_engine * ranks_per_engine

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        if rank != first:
            return
        mine = dict(socket_paths[first : first + ranks_per_engine])
        steps = http_steps(endpoint, pause_mode=pause_mode, deadline=time.monotonic() + timeout_s)
        step_s = run_native_update(steps, update_payload(mine, ranks_per_engine), version_now(weight_version))
        if step_times is not None:
            step_times.append(step_s)

    return req_func


def native_llm_req_func(llm, *, weight_version: str | None = None) -> ReqFunc:
    """req_func for an in-process `vllm.LLM` started with the backend (one PS rank per worker, every
    worker of this LLM). Its methods take no deadline: the engine side's own (`timeout_s` of the
    receiver settings) ends a wait for a PS that went silent, and the PS joins this call within its."""
    parallel = llm.llm_engine.vllm_config.parallel_config
    num_workers = parallel.world_size

    def finish(version: str | None) -> None:  # no weights_state to ask: vLLM's own finish, version and all
        llm.finish_weight_update(weight_version=version)

    if getattr(parallel, "worker_extension_cls", None) == EXTENSION:  # the workers' reports say a failure
        finish = checked_finish(
            llm.finish_weight_update, lambda: llm.collective_rpc("weights_state"), llm.update_weight_version
        )
    steps = NativeSteps(
        where="in-process LLM",
        start=llm.start_weight_update,
        update=lambda payload: llm.update_weights({"update_info": payload}),
        finish=finish,
        reset_prefix_cache=llm.reset_prefix_cache,
    )

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        run_native_update(steps, update_payload(dict(socket_paths), num_workers), weight_version)

    return req_func


def client_req_func(client, *, num_workers: int = 1, weight_version: str | None = None) -> ReqFunc:
    """req_func over a `VLLMWeightSyncClient` (vLLM's `HTTPVLLMWeightSyncClient`, a Ray client, or any
    object with its `start_weight_update` / `update_weights` / `finish_weight_update`); its deadlines
    are the client's own (the HTTP client's `timeout`)."""
    steps = NativeSteps(
        where=f"vLLM through {type(client).__name__}",
        start=client.start_weight_update,
        update=client.update_weights,
        finish=lambda version: client.finish_weight_update(weight_version=version),
    )

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        run_native_update(steps, update_payload(dict(socket_paths), num_workers), weight_version)

    return req_func


def checked_finish(
    finish: Callable[[], Any], reports: Callable[[], list], set_version: Callable[[str], Any]
) -> Callable[[str | None], None]:
    """A `NativeSteps.finish` for an engine whose workers run the worker extension: `finish()` (vLLM's,
    without a version), then the workers' `reports()` (the extension's `weights_state`), then
    `set_version(version)` only if no worker's finish failed. The backend's finish does not raise (a
    worker's exception there ends vLLM-CPU's engine core): it reports `finish_error`, raised here as a
    `NativeRouteError` naming /finish_weight_update, the version left where it was."""

    def run(version: str | None) -> None:
        finish()
        if (why := finish_failure(reports())) is not None:
            raise NativeRouteError("/finish_weight_update", why)
        if version is not None:
            set_version(version)

    return run


def version_now(weight_version: WeightVersion) -> str | None:
    """The version to report for the update starting now."""
    return weight_version() if callable(weight_version) else weight_version


def _check_args(*, ranks_per_engine: int, timeout_s: float, pause_mode: str) -> None:
    if isinstance(ranks_per_engine, bool) or not isinstance(ranks_per_engine, int) or ranks_per_engine < 1:
        raise ValueError(f"ranks_per_engine must be an integer >= 1, got {ranks_per_engine!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {list(PAUSE_MODES)}, got {pause_mode!r}")


def engine_req_func(
    endpoint: str,
    *,
    route: RequestedRoute,
    rank: int | None = None,
    ranks_per_engine: int = 1,
    timeout_s: float = 600.0,
    weight_version: WeightVersion = None,
    pause_mode: PauseMode = "abort",
    extension: ReqFunc | None = None,
) -> ReqFunc:
    """req_func for PS rank `rank` into the vLLM server at `endpoint` by `route`: "native"
    (`native_http_req_func`: pause, start, update, finish with `weight_version`, resume), "extension"
    (`vllm_ext.extension_req.vllm_http_req_func`: /collective_rpc, then a prefix-cache reset; `weight_version`
    and `pause_mode` do not apply there: the caller keeps the engine idle), or "auto": the one the
    server offers (`served_route`), asked at each update (a restarted server may offer another).
    `extension`: the req_func of the extension route instead of `vllm_http_req_func` (the daemon's
    MoonshotAI-compatible request)."""
    if route not in REQUESTED_ROUTES:
        raise ValueError(f"route must be one of {[*UPDATE_ROUTES, 'auto']}, got {route!r}")
    if rank is None:
        rank = int(os.environ["RANK"])
    native = native_http_req_func(
        endpoint,
        rank=rank,
        ranks_per_engine=ranks_per_engine,
        weight_version=weight_version,
        pause_mode=pause_mode,
        timeout_s=timeout_s,
    )
    if extension is None:
        extension = vllm_http_req_func(endpoint, rank=rank, ranks_per_engine=ranks_per_engine, timeout_s=timeout_s)
    sender = rank % ranks_per_engine == 0  # the engine's first rank asks (and sends)
    if route == "extension":
        return extension
    if route == "native":  # the route is given; the worker count is still checked, one GET per update

        def checked(socket_paths: Sequence[tuple[str, str]]) -> None:
            if sender:
                check_workers(endpoint, launcher_status(endpoint), ranks_per_engine)
            native(socket_paths)

        return checked

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        if not sender:
            return
        status = launcher_status(endpoint)
        check_workers(endpoint, status, ranks_per_engine)
        chosen = route_of(status)
        logger.info("update into %s through the %s route", endpoint, chosen)
        (native if chosen == "native" else extension)(socket_paths)

    return req_func


def served_route(endpoint: str, *, timeout_s: float = 5.0) -> UpdateRoute:
    """The route the server at `endpoint` takes updates by: "native" where it is a launcher whose vLLM runs
    this backend (GET /launcher/status answers "update_route": "native"), else "extension" (a plain
    `vllm serve` with the worker extension, the project's plain engine, an older launcher). An
    unreachable server raises `EngineRpcError`: there is nothing to update."""
    return route_of(launcher_status(endpoint, timeout_s=timeout_s))


def launcher_status(endpoint: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET /launcher/status of the server at `endpoint`: {} where it is no launcher (any answer but a
    200 JSON object). An unreachable server raises `EngineRpcError`."""
    url = endpoint.rstrip("/") + "/launcher/status"
    try:
        status, body = status_json("GET", url, timeout_s=timeout_s)
    except (RuntimeError, OSError) as e:
        raise EngineRpcError(f"GET {url} failed: {e}") from None
    return body if status == 200 and isinstance(body, dict) else {}


def route_of(status: Mapping[str, Any]) -> UpdateRoute:
    """The update route a launcher's status names; "extension" for any other server."""
    route = status.get("update_route")
    return route if route in UPDATE_ROUTES else "extension"


def check_workers(endpoint: str, status: Mapping[str, Any], ranks_per_engine: int) -> None:
    """Refuse an engine whose tensor-parallel workers are not fed one PS rank each (a launcher says its
    size; other servers are not checked): `EngineRpcError` naming both numbers. Asked by the `auto` and
    `native` routes before anything is sent (`extension` is MoonshotAI's request, sent as it was)."""
    tp = status.get("tensor_parallel_size")
    if isinstance(tp, int) and not isinstance(tp, bool) and tp != ranks_per_engine:
        raise EngineRpcError(
            f"the engine at {endpoint} runs {tp} tensor-parallel workers, but {ranks_per_engine} parameter-server "
            f"rank(s) feed it: each worker takes its weights from one rank of its own (ranks_per_engine = "
            f"the engine's tensor-parallel size; the daemon's managed engines are one worker each)"
        )
