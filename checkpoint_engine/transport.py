"""Device backends for the data path, injected into the pipeline.

    CpuTransport:  host chunks in plain memory; shared buffer = POSIX shm; broadcast = gloo
    CudaTransport: host chunks pinned;  shared buffer = device memory + CUDA IPC; H2D copy; NCCL

The engine side only needs `open_shared_buffer` (maps a BufferHandle as a uint8 tensor).
"""

from __future__ import annotations

import logging
import resource
import socket
from typing import Protocol

import torch
import torch.distributed as dist

from checkpoint_engine import shm
from checkpoint_engine.protocol import BufferHandle

logger = logging.getLogger(__name__)


class Transport(Protocol):
    backend: str  # torch.distributed backend name

    def device_id(self, rank: int) -> str: ...
    def alloc_host(self, nbytes: int) -> torch.Tensor: ...
    def alloc_shared(self, nbytes: int, rank: int, seq: int) -> tuple[torch.Tensor, BufferHandle]: ...
    def peer_mapped(self, handle: BufferHandle) -> None: ...
    def free_shared(self, handle: BufferHandle) -> None: ...
    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def broadcast(self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None: ...
    def synchronize(self) -> None: ...


class CpuTransport:
    backend = "gloo"

    def device_id(self, rank: int) -> str:
        return f"cpu-{socket.gethostname()}-{rank}"

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_shared(self, nbytes: int, rank: int, seq: int) -> tuple[torch.Tensor, BufferHandle]:
        path = shm.segment_path(rank, seq)
        return shm.create_segment(path, nbytes), BufferHandle(kind="shm", size_bytes=nbytes, path=path)

    def peer_mapped(self, handle: BufferHandle) -> None:
        shm.unlink_segment(handle.path)

    def free_shared(self, handle: BufferHandle) -> None:
        shm.unlink_segment(handle.path)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def broadcast(self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
        dist.broadcast(t, src=src, group=group)

    def synchronize(self) -> None:
        pass


class CudaTransport:
    """GPU path: pinned host memory, H2D into a device double buffer shared over CUDA IPC, NCCL."""

    backend = "nccl"

    def __init__(self, local_rank: int):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransport needs a CUDA device")
        self.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(self.device)
        self._copy_stream = torch.cuda.Stream(self.device)

    def device_id(self, rank: int) -> str:
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            raise RuntimeError(
                f"pinning {nbytes / 2**30:.2f} GiB of host memory failed ({e}); locked-memory limit "
                f"(ulimit -l) is {soft if soft >= 0 else 'unlimited'} bytes: raise it for the container"
            ) from None

    def alloc_shared(self, nbytes: int, rank: int, seq: int) -> tuple[torch.Tensor, BufferHandle]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        args = buf.untyped_storage()._share_cuda_()
        return buf, BufferHandle(kind="cuda", size_bytes=nbytes, cuda_args=tuple(args))

    def peer_mapped(self, handle: BufferHandle) -> None:
        pass

    def free_shared(self, handle: BufferHandle) -> None:
        torch.cuda.ipc_collect()

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # H2D on a side stream, then make the compute stream (used by NCCL) wait for it.
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)

    def broadcast(self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
        dist.broadcast(t, src=src, group=group)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


def make_transport(kind: str, local_rank: int) -> Transport:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return CpuTransport()
    if kind == "cuda":
        return CudaTransport(local_rank)
    raise ValueError(f"transport must be 'auto', 'cpu' or 'cuda', got {kind!r}")


def open_shared_buffer(handle: BufferHandle, device_id: int | None) -> torch.Tensor:
    """Engine side: map the PS rank's shared buffer once per update."""
    if handle.kind == "shm":
        return shm.open_segment(handle.path, handle.size_bytes)
    if not torch.cuda.is_available():
        raise RuntimeError("the parameter server sent a CUDA IPC buffer but this engine has no CUDA device")
    args = list(handle.cuda_args)
    if device_id is not None:
        args[0] = device_id  # processes may see the GPU under different indices (CUDA_VISIBLE_DEVICES)
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    buf = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", args[0]))
    buf.set_(storage, 0, (handle.size_bytes,), (1,))
    return buf
