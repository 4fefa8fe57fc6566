"""Which update handle is this vLLM worker's, and its tensor-parallel rank: what the worker extension
(`vllm_ext.worker`, every update) and the `checkpoint_engine` load format (`vllm_ext.loader`, the
initial load) both need. Imports no vLLM at module import.
"""

from __future__ import annotations

from collections.abc import Mapping


def select_handle(zmq_handles: Mapping[str, str], *, device_uuid: str | None, tp_rank: int) -> str:
    """Pick this worker's ZMQ address: by device UUID (CUDA), else the only one, else by TP rank.

    `checkpoint_engine.api.http_req_func` sends the handles of an engine's ranks in rank order, so
    on CPU (no UUIDs) the i-th handle belongs to the worker of tensor-parallel rank i.
    """
    if not isinstance(zmq_handles, Mapping) or not zmq_handles:
        raise ValueError(f"zmq_handles must be a non-empty {{device_id: zmq_address}} dict, got {zmq_handles!r}")
    if device_uuid is not None and device_uuid in zmq_handles:
        return zmq_handles[device_uuid]
    handles = list(zmq_handles.values())
    if len(handles) == 1:
        return handles[0]
    if 0 <= tp_rank < len(handles):
        return handles[tp_rank]
    raise ValueError(f"no handle for this worker (device {device_uuid}, tp rank {tp_rank}) among {sorted(zmq_handles)}")


def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and size ((0, 1) when vLLM's groups are not set up)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError, RuntimeError):
        return 0, 1
