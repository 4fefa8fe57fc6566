"""Client side of "tell the engine to connect": req_func helpers over HTTP (no pickle).

Engines expose vLLM's `POST /collective_rpc` shape: {"method", "args", "kwargs", "timeout"}.
`request_inference_to_update` is call-compatible with MoonshotAI checkpoint-engine's helper;
`group_req_func` is the req_func behind that project's daemon route `POST /v1/checkpoints/NAME/update`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import urllib.parse
from collections.abc import Sequence

from checkpoint_engine.types import ReqFunc  # also importable from here

logger = logging.getLogger(__name__)



class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, uds: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._uds = uds

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._uds)


def post_json(url: str, body: dict, *, timeout_s: float, uds: str | None = None) -> dict:
    """POST JSON, return the decoded JSON answer; RuntimeError names the URL and the problem."""
    parts = urllib.parse.urlsplit(url)
    if uds:
        conn: http.client.HTTPConnection = _UnixHTTPConnection(uds, timeout_s)
    elif parts.scheme == "http":
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    else:
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    path = parts.path or "/"
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        raise RuntimeError(f"POST {url} failed: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    if resp.status >= 400:
        raise RuntimeError(f"POST {url} answered HTTP {resp.status}: {text[:2000]}")
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        raise RuntimeError(f"POST {url} answered non-JSON: {text[:500]!r}") from None


def request_inference_to_update(url: str, socket_paths: dict[str, str], timeout: float = 300.0,
                                uds: str | None = None) -> dict:
    """Ask an engine (vLLM dev server or plain engine) to run `update_weights_from_ipc` now."""
    return post_json(url, {"method": "update_weights_from_ipc", "args": [socket_paths], "timeout": timeout},
                     timeout_s=timeout + 10.0, uds=uds)


def http_req_func(endpoint: str, *, rank: int | None = None, ranks_per_engine: int = 1,
                  timeout_s: float = 300.0, uds: str | None = None) -> ReqFunc:
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
        mine = dict(socket_paths[first: first + ranks_per_engine])
        request_inference_to_update(url, mine, timeout=timeout_s, uds=uds)

    return req_func


def group_req_func(update_url: str | None, *, rank: int, group_ranks: Sequence[int], timeout_s: float = 300.0,
                   uds: str | None = None) -> ReqFunc:
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
        request_inference_to_update(update_url, dict(socket_paths[r] for r in group_ranks), timeout=timeout_s,
                                    uds=uds)

    return req_func
