"""Client side of "tell the engine to connect": req_func helpers over HTTP (no pickle).

Engines expose vLLM's `POST /collective_rpc` shape: {"method", "args", "kwargs", "timeout"}.
`request_inference_to_update` is call-compatible with MoonshotAI checkpoint-engine's helper;
`group_req_func` is the req_func behind that project's daemon route `POST /v1/checkpoints/NAME/update`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from checkpoint_engine.types import ReqFunc
from ckpt_common.httpjson import post_json

__all__ = ["group_req_func", "http_req_func", "request_inference_to_update"]

logger = logging.getLogger(__name__)


def request_inference_to_update(
    url: str, socket_paths: dict[str, str], timeout: float = 300.0, uds: str | None = None
) -> dict:
    """Ask an engine (vLLM dev server or plain engine) to run `update_weights_from_ipc` now."""
    return post_json(
        url,
        {"method": "update_weights_from_ipc", "args": [socket_paths], "timeout": timeout},
        timeout_s=timeout + 10.0,
        uds=uds,
    )


def http_req_func(
    endpoint: str,
    *,
    rank: int | None = None,
    ranks_per_engine: int = 1,
    timeout_s: float = 300.0,
    uds: str | None = None,
) -> ReqFunc:
    """req_func for rank `rank` whose engine (serving `ranks_per_engine` devices) is at `endpoint`.

    Only the first rank of each engine sends the request, carrying its devices' socket paths.
    """
    if rank is None:
        rank = int(os.environ["RANK"])
    if ranks_per_engine < 1:
        raise ValueError(f"ranks_per_engine must be >= 1, got {ranks_per_engine}")
    first = rank // ranks_per_engine * ranks_per_engine
    url = endpoint.rstrip("/") + "/collective_rpc"

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        if rank != first:
            return
        mine = dict(socket_paths[first : first + ranks_per_engine])
        request_inference_to_update(url, mine, timeout=timeout_s, uds=uds)

    return req_func


def group_req_func(
    update_url: str | None, *, rank: int, group_ranks: Sequence[int], timeout_s: float = 300.0, uds: str | None = None
) -> ReqFunc:
    """req_func of MoonshotAI's update route: one engine at `update_url` serves the devices of
    `group_ranks`; the group's first rank sends their socket paths (in the order given).

    `update_url=None`: nothing is sent (the engines are told by someone else).
    """
    if not group_ranks:
        raise ValueError("group_ranks must name at least one rank")
    sender = min(group_ranks)

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        if update_url is None or rank != sender:
            return
        bad = [r for r in group_ranks if not 0 <= r < len(socket_paths)]
        if bad:
            raise ValueError(f"inference_group_ranks {bad} are outside the {len(socket_paths)} ranks of this job")
        request_inference_to_update(update_url, dict(socket_paths[r] for r in group_ranks), timeout=timeout_s, uds=uds)

    return req_func
