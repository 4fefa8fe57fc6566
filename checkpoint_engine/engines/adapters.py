"""Engine adapters: how the daemon asks a served inference engine to take an update, registered by the
engine's own package, so that the checkpoint engine names no engine.

The daemon's updates into served engines (``POST /update`` with ``endpoints``, a managed engine's
update, a heal) need a req_func for that engine's HTTP server, and which routes it offers (vLLM's
weight-transfer API, or the ``/collective_rpc`` extension route) is the engine's business. Its package
registers a factory of such req_funcs here (``register_engine_req_func``); the daemon's entry point
(``checkpoint_engine/__main__.py``, the one place that wires the daemon to vLLM) registers vLLM's,
``vllm_ext.weight_transfer.native_req.engine_req_func``, before any rank serves. Without a registered adapter
only the extension route works (the daemon's own ``/collective_rpc`` request, which the plain engine
serves too); a req_func of "native" or "auto" raises when it is run, naming what to register (an
update's check phase builds its req_func without running it, so an in-process daemon without an
adapter still registers, checks and runs updates that do not ask an engine).
"""

from __future__ import annotations

from typing import Protocol

from checkpoint_engine.errors import CheckpointEngineError
from checkpoint_engine.types import PauseMode, ReqFunc, RequestedRoute, WeightVersion


class EngineReqFuncFactory(Protocol):
    """The req_func of PS rank ``rank`` into the engine server at ``endpoint`` by ``route``;
    ``extension`` is the daemon's own request for the extension route."""

    def __call__(
        self,
        endpoint: str,
        *,
        route: RequestedRoute,
        rank: int,
        ranks_per_engine: int,
        timeout_s: float,
        weight_version: WeightVersion,
        pause_mode: PauseMode,
        extension: ReqFunc,
    ) -> ReqFunc: ...


_registered: EngineReqFuncFactory | None = None  # one per process: the engines a daemon serves are of one kind


def register_engine_req_func(factory: EngineReqFuncFactory | None) -> EngineReqFuncFactory | None:
    """Make ``factory`` the adapter of this process (None: none); returns the one it replaces."""
    global _registered
    previous, _registered = _registered, factory
    return previous


def registered_engine_req_func() -> EngineReqFuncFactory | None:
    """The adapter registered in this process, or None."""
    return _registered


def engine_req_func(
    endpoint: str,
    *,
    route: RequestedRoute,
    rank: int,
    ranks_per_engine: int,
    timeout_s: float,
    weight_version: WeightVersion,
    pause_mode: PauseMode = "abort",
    extension: ReqFunc,
) -> ReqFunc:
    """The registered adapter's req_func into ``endpoint``; without one, ``extension`` for the extension
    route, and for the others (they need the engine's own routes) one that raises CheckpointEngineError."""
    if _registered is not None:
        return _registered(
            endpoint,
            route=route,
            rank=rank,
            ranks_per_engine=ranks_per_engine,
            timeout_s=timeout_s,
            weight_version=weight_version,
            pause_mode=pause_mode,
            extension=extension,
        )
    if route == "extension":
        return extension

    def unregistered(socket_paths: list[tuple[str, str]]) -> None:
        raise CheckpointEngineError(
            f"update route {route!r} into {endpoint} needs an engine adapter and none is registered in this "
            "process: the daemon's entry point (python -m checkpoint_engine) registers vLLM's; elsewhere call "
            "checkpoint_engine.engines.adapters.register_engine_req_func(vllm_ext.weight_transfer.native_req."
            "engine_req_func), or ask for route 'extension'"
        )

    return unregistered
