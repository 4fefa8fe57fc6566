"""Thin process-group functions over `torch.distributed` (MoonshotAI's `checkpoint_engine.distributed`).

Scripts written for MoonshotAI's checkpoint-engine do

    import checkpoint_engine.distributed as dist
    dist.use_backend(None)           # None / "": torch.distributed, the only backend here
    ps = ParameterServer(auto_pg=True); ps.init_process_group(); dist.barrier()

Every function forwards to `torch.distributed`; the only module state is the name of the chosen
backend. `init_process_group` picks gloo on CPU and NCCL when CUDA is available unless a `backend`
keyword says otherwise.

`all_gather_object` is torch's own: it pickles `obj` and unpickles what the other ranks of this job
sent. That is torch's behaviour among the trusted ranks of one job; the parameter server itself
never uses it (its own exchanges are msgpack, `collectives.py`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _td

SUPPORTED_BACKENDS = ("torch",)  # None or "" select it too

_backend = "torch"


def use_backend(name: str | None) -> None:
    """Choose the distributed backend: None, "" or "torch" = torch.distributed (the only one here)."""
    global _backend
    if name is None or name == "" or name == "torch":
        _backend = "torch"
        return
    raise ValueError(
        f"unsupported distributed backend {name!r}: this checkpoint engine supports "
        f"{', '.join(map(repr, SUPPORTED_BACKENDS))} (or None / '' for the default, torch.distributed)"
    )


def backend() -> str:
    return _backend


def init_process_group(
    rank: int | None = None, world_size: int | None = None, store: _td.Store | None = None, **kw: Any
) -> None:
    """Create the default process group; `backend` defaults to nccl with CUDA, else gloo.

    With no `store` and no `init_method`, torch reads torchrun's environment (MASTER_ADDR/PORT).
    """
    kw.setdefault("backend", "nccl" if torch.cuda.is_available() else "gloo")
    timeout = kw.get("timeout")
    if timeout is not None and not isinstance(timeout, timedelta):
        kw["timeout"] = timedelta(seconds=float(timeout))
    if rank is not None:
        kw["rank"] = rank
    if world_size is not None:
        kw["world_size"] = world_size
    if store is not None:
        kw["store"] = store
    _td.init_process_group(**kw)


def destroy_process_group(group: _td.ProcessGroup | None = None) -> None:
    _td.destroy_process_group(group)


def is_initialized() -> bool:
    return _td.is_initialized()


def get_rank(group: _td.ProcessGroup | None = None) -> int:
    return _td.get_rank(group)


def get_world_size(group: _td.ProcessGroup | None = None) -> int:
    return _td.get_world_size(group)


def all_gather_object(object_list: list, obj: Any, group: _td.ProcessGroup | None = None) -> None:
    """torch's all_gather_object (pickle between this job's own ranks; see the module docstring)."""
    _td.all_gather_object(object_list, obj, group=group)


def all_reduce(
    tensor: torch.Tensor, op: _td.ReduceOp.RedOpType = _td.ReduceOp.SUM, group: _td.ProcessGroup | None = None
) -> None:
    _td.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, src: int = 0, group: _td.ProcessGroup | None = None) -> None:
    _td.broadcast(tensor, src=src, group=group)


def barrier(group: _td.ProcessGroup | None = None) -> None:
    _td.barrier(group=group)


def new_group(ranks: list[int] | None = None, **kw: Any) -> _td.ProcessGroup:
    return _td.new_group(ranks, **kw)
