"""req_func helpers that tell vLLM engines to receive an update, over HTTP or in process.

    ParameterServer.update(name, req_func) ──(background thread, every rank)──▶ req_func(socket_paths)
        vllm_http_req_func: POST {endpoint}/collective_rpc {"method": "update_weights_from_ipc", ...}
                            then POST {endpoint}/reset_prefix_cache
        llm_req_func:       llm.collective_rpc("update_weights_from_ipc", ...); llm.reset_prefix_cache()
        rpc_req_func:       the same over any collective_rpc/reset pair (the orchestrator's AsyncLLM)

The HTTP route exists only when the server runs with `VLLM_SERVER_DEV_MODE=1`. After an update
(or an aborted one, which may have changed some layers) the prefix cache is reset: KV blocks
computed with the old weights must not be reused for new requests.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from checkpoint_engine.types import ReqFunc
from ckpt_common.httpjson import HTTPError, post_json, status_json

logger = logging.getLogger(__name__)

UPDATE_METHOD = "update_weights_from_ipc"


class EngineRpcError(RuntimeError):
    """A vLLM engine answered an RPC with an error, or could not be reached."""


def collective_rpc(
    endpoint: str, method: str, *, args: Sequence[Any] = (), kwargs: dict | None = None, timeout_s: float = 60.0
) -> list:
    """POST /collective_rpc; return the per-worker results. `timeout_s` bounds the RPC and the HTTP wait."""
    url = endpoint.rstrip("/") + "/collective_rpc"
    body = {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": timeout_s}
    try:
        answer = post_json(url, body, timeout_s=timeout_s + 15.0)
    except HTTPError as e:
        if e.status == 404:
            raise EngineRpcError(
                f"{url} does not exist: start `vllm serve` with VLLM_SERVER_DEV_MODE=1 "
                f"(dev mode enables /collective_rpc)"
            ) from None
        if e.status == 503 and "weights" in e.text:
            raise EngineRpcError(f"{method} on {endpoint}: {e}") from None
        raise EngineRpcError(f"{method} on {endpoint} failed: {e}") from None
    except RuntimeError as e:
        raise EngineRpcError(f"{method} on {endpoint} failed: {e}") from None
    if not isinstance(answer, dict) or "results" not in answer:
        raise EngineRpcError(f"{method} on {endpoint}: unexpected answer {str(answer)[:300]}")
    return answer["results"]


def reset_prefix_cache_http(endpoint: str, *, timeout_s: float = 30.0) -> bool:
    """Reset the engine's prefix cache, retrying while running requests hold blocks (until `timeout_s`)."""
    url = endpoint.rstrip("/") + "/reset_prefix_cache"
    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    while True:
        try:
            ok = bool(post_json(url, {}, timeout_s=max(1.0, deadline - time.monotonic())).get("success", True))
        except RuntimeError as e:
            raise EngineRpcError(f"resetting the prefix cache of {endpoint} failed: {e}") from None
        if ok or time.monotonic() + delay_s > deadline:
            if not ok:
                logger.warning("prefix cache of %s still in use after %.0f s; not reset", endpoint, timeout_s)
            return ok
        time.sleep(delay_s)  # running requests still hold blocks: poll with backoff until the deadline
        delay_s = min(delay_s * 2, 1.0)


def check_reports(results: list, where: str) -> list[dict]:
    """Every worker must report a completed update."""
    reports = [r for r in results if isinstance(r, dict)]
    if len(reports) != len(results) or not reports:
        raise EngineRpcError(f"{where}: unexpected update results {str(results)[:300]}")
    failed = [r["update_error"] for r in reports if r.get("update_error")]
    if failed:  # a tensor-parallel worker answers its failure instead of raising (vllm_ext.worker)
        raise EngineRpcError(f"{where}: update failed on {len(failed)} worker(s): {failed[0]}")
    bad = [r for r in reports if r.get("status") != "ready"]
    if bad:
        raise EngineRpcError(f"{where}: update not completed: {bad[0].get('status')} ({bad[0].get('last_error')})")
    return reports


def vllm_http_req_func(
    endpoint: str,
    *,
    rank: int | None = None,
    ranks_per_engine: int = 1,
    timeout_s: float = 600.0,
    reset_prefix_cache: bool = True,
) -> ReqFunc:
    """req_func for PS rank `rank` whose vLLM server (serving `ranks_per_engine` devices) is at `endpoint`.

    Only the first rank of each engine sends the request (one `collective_rpc` reaches all of that
    engine's workers), carrying the socket paths of its ranks in rank order.
    """
    if rank is None:
        rank = int(os.environ["RANK"])
    if ranks_per_engine < 1:
        raise ValueError(f"ranks_per_engine must be >= 1, got {ranks_per_engine}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    first = rank // ranks_per_engine * ranks_per_engine

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        if rank != first:
            return
        mine = dict(socket_paths[first : first + ranks_per_engine])
        try:
            results = collective_rpc(endpoint, UPDATE_METHOD, args=[mine], timeout_s=timeout_s)
        finally:
            if reset_prefix_cache:
                _reset_best_effort(lambda: reset_prefix_cache_http(endpoint), endpoint)
        check_reports(results, f"engine {endpoint}")

    return req_func


def llm_req_func(llm, *, timeout_s: float = 600.0, reset_prefix_cache: bool = True) -> ReqFunc:
    """req_func for an in-process `vllm.LLM` (one PS rank per LLM; call `ps.update` while it is idle)."""
    return rpc_req_func(
        llm.collective_rpc,
        llm.reset_prefix_cache if reset_prefix_cache else None,
        "in-process LLM",
        timeout_s=timeout_s,
    )


def rpc_req_func(
    collective_rpc: Callable[..., Sequence],
    reset_prefix_cache: Callable[[], Any] | None,
    where: str,
    *,
    timeout_s: float,
) -> ReqFunc:
    """req_func over an in-process engine's `collective_rpc(method, timeout=, args=)` (vllm.LLM's shape;
    an AsyncLLM's caller wraps its coroutines), then `reset_prefix_cache()` (best effort) unless None."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        try:
            results = collective_rpc(UPDATE_METHOD, timeout=timeout_s, args=(dict(socket_paths),))
        finally:
            if reset_prefix_cache is not None:
                _reset_best_effort(reset_prefix_cache, where)
        check_reports(list(results), where)

    return req_func


def _reset_best_effort(reset: Callable[[], Any], where: str) -> None:
    try:
        reset()
    except Exception as e:  # noqa: BLE001 - the update's own outcome is what the caller must see
        logger.warning("could not reset the prefix cache of %s: %s", where, e)


def get_json(url: str, *, timeout_s: float = 10.0) -> tuple[int, dict]:
    """GET a JSON document; return (HTTP status, body). Connection errors raise OSError."""
    return status_json("GET", url, timeout_s=timeout_s)


def wait_until_healthy(
    endpoint: str, *, timeout_s: float, is_alive: Callable[[], bool] | None = None, interval_s: float = 0.1
) -> float:
    """Poll GET {endpoint}/health every `interval_s` until 200; return the seconds waited.
    Raises TimeoutError/RuntimeError."""
    start = time.monotonic()
    while True:
        if is_alive is not None and not is_alive():
            raise RuntimeError(f"the engine behind {endpoint} exited before it became healthy")
        try:
            status, _ = get_json(endpoint.rstrip("/") + "/health", timeout_s=2.0)
            if status == 200:
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{endpoint} did not become healthy within {timeout_s:.0f} s")
        time.sleep(interval_s)  # polling interval of a readiness probe, bounded by the deadline above
