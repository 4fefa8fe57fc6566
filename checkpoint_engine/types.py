"""Small types shared across the packages (light: no torch, no zmq).

`ReqFunc` is the callback `ParameterServer.update(name, req_func)` runs on a background thread of
every rank: it receives every rank's `(device_uuid, zmq_address)` in rank order and tells the
engines to connect (over HTTP, in process, or not at all).

The update modes' names, said once (the config, the metrics, the CLI and the bucket sources all
import them from here):

    collective  the owner broadcasts each bucket (any topology; on GPU always)
    local       every engine reads every owner's chunks in place (CPU, one host)
    p2p         a Mooncake one-sided read from the owner's chunk, through this rank
    p2p_engine  the same pull read by the engine itself (`UpdateConfig.p2p_reader="engine"`)
    relay       a pull from owners in another job (the trainer's memory), read once by the job's
                first rank and broadcast to the others: each byte crosses the owners' link once

An update's config may ask for `SelectableMode` (or "auto": let `jobs.choose_mode` pick); "p2p" is
never asked for: a pull takes it when local reads are impossible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

ReqFunc = Callable[[list[tuple[str, str]]], None]

SelectableMode = Literal["collective", "local"]
Mode = Literal[SelectableMode, "p2p", "p2p_engine", "relay"]  # what an update runs as (Literal flattens)
MODES: tuple[Mode, ...] = get_args(Mode)
RequestedMode = Literal["auto", SelectableMode, "relay"]  # `UpdateConfig.mode`, daemon `--mode`
REQUESTED_MODES: tuple[RequestedMode, ...] = get_args(RequestedMode)

# How an update reaches a vLLM server (vllm_ext.weight_transfer.native_req): vLLM's weight-transfer routes
# (the checkpoint_engine backend) or the worker extension's /collective_rpc; "auto": the one the
# server says it offers. The daemon's --engine-update-route and POST /update's "route" take these.
UpdateRoute = Literal["native", "extension"]
UPDATE_ROUTES: tuple[UpdateRoute, ...] = get_args(UpdateRoute)
RequestedRoute = Literal["auto", UpdateRoute]
REQUESTED_ROUTES: tuple[RequestedRoute, ...] = get_args(RequestedRoute)
# What the requests running when a native update starts see (vLLM's /pause?mode=; "none": no pause)
PauseMode = Literal["abort", "wait", "keep", "none"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
# What an engine reports (vLLM's /weight_info) after an update: a name, or a callable asked at each
# update (a job whose req_func outlives one version: `orchestrator.engine_pool.weight_sync`), or None
# (the version stays)
WeightVersion = str | Callable[[], str | None] | None
