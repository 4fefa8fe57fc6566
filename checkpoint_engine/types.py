"""Small types shared across the packages (light: no torch, no zmq).

`ReqFunc` is the callback `ParameterServer.update(name, req_func)` runs on a background thread of
every rank: it receives every rank's `(device_uuid, zmq_address)` in rank order and tells the
engines to connect (over HTTP, in process, or not at all).
"""

from __future__ import annotations

from collections.abc import Callable

ReqFunc = Callable[[list[tuple[str, str]]], None]
