"""The `checkpoint_engine` backend's messages in vLLM's weight-transfer API, both sides (no torch, no vLLM).

vLLM's RL routes carry backend-specific JSON objects (`/init_weight_transfer_engine {"init_info": ...}`,
`/update_weights {"update_info": ...}`); the worker-side engine (`vllm_ext.weight_transfer.engine`) parses them
into these dataclasses and the ParameterServer side (`vllm_ext.weight_transfer.native_req`) builds them, so the two
sides share one definition:

    init_info    {}                                    nothing to set up: each update names its sockets
    update_info  {"zmq_handles": {device_id: address}}  the ZMQ sockets of this engine's PS ranks (rank
                                                          order); each worker picks its own
                                                          (`vllm_ext.worker_handle.select_handle`)

Engine-side settings (deadlines, reload mode) stay in vLLM's
`--additional-config '{"checkpoint_engine": {...}}'`, as for the worker extension. A bad message
raises a ValueError naming the field and what it must be; vLLM's server answers it with an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

BACKEND_NAME = "checkpoint_engine"  # `--weight-transfer-config '{"backend": "checkpoint_engine"}'`


def _check_fields(kind: str, cls: type, d: Any) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise ValueError(f"{kind} must be a JSON object, got {type(d).__name__}: {str(d)[:200]}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{kind} has unknown field(s) {unknown} for backend {BACKEND_NAME!r}; known: {known}")
    return dict(d)


@dataclass(frozen=True)
class NativeInitInfo:
    """`init_info` of `/init_weight_transfer_engine`: empty (the call only checks that the engine runs
    this backend; engine settings go in `--additional-config '{"checkpoint_engine": {...}}'`)."""

    @classmethod
    def from_dict(cls, d: Any) -> NativeInitInfo:
        return cls(**_check_fields("init_info", cls, d))

    def to_dict(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class NativeUpdateInfo:
    """`update_info` of `/update_weights` for one worker: the engine's PS sockets, in PS rank order."""

    zmq_handles: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        handles = self.zmq_handles
        if not isinstance(handles, Mapping) or not handles:
            raise ValueError(
                f"update_info.zmq_handles must be a non-empty {{device_id: zmq_address}} object, got {handles!r}"
            )
        bad = [k for k, v in handles.items() if not isinstance(k, str) or not isinstance(v, str) or not v]
        if bad:
            raise ValueError(
                f"update_info.zmq_handles[{bad[0]!r}] must map a device id (string) to a zmq address "
                f"(non-empty string), got {handles[bad[0]]!r}"
            )

    @classmethod
    def from_dict(cls, d: Any) -> NativeUpdateInfo:
        d = _check_fields("update_info", cls, d)
        if "zmq_handles" not in d:
            raise ValueError(
                "update_info.zmq_handles is required: the {device_id: zmq_address} of the engine's "
                "ParameterServer ranks (vllm_ext.weight_transfer.native_req builds it)"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {"zmq_handles": dict(self.zmq_handles)}
