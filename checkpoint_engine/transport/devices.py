"""Device backends for the data path, injected into the pipeline.

    CpuTransport:  host chunks and the double buffer in memfd segments (engines on the host map
                   them read-only); broadcast = gloo
    CudaTransport: host chunks pinned; double buffer in device memory shared by CUDA IPC; H2D copy
                   on a side stream; broadcast = NCCL

The engine side only needs `open_buffer` (maps a BufferHandle as a uint8 tensor).
"""

from __future__ import annotations

import logging
import resource
import socket
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from checkpoint_engine.protocol import BufferHandle
from checkpoint_engine.transport import shm

logger = logging.getLogger(__name__)


class HostChunk:
    """Registered host memory: the tensor, how an engine on this host may map it, how to free it."""

    def __init__(self, tensor: torch.Tensor, handle: BufferHandle | None, close: Callable[[], None] | None = None):
        self.tensor, self.handle, self._close = tensor, handle, close

    def close(self) -> None:
        self.tensor = None
        if self._close is not None:
            self._close()
            self._close = None


class Transport(Protocol):
    backend: str  # torch.distributed backend name
    engines_map_host_chunks: bool  # engines can read registered chunks directly (no copy-in)

    def device_id(self, rank: int) -> str: ...
    def alloc_host(self, nbytes: int) -> HostChunk: ...
    def shared_buffer(self, nbytes: int) -> tuple[torch.Tensor, BufferHandle]: ...
    def release_shared(self) -> None: ...
    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def broadcast(
        self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None, timeout_s: float | None = None
    ) -> None: ...
    def synchronize(self) -> None: ...


class CpuTransport:
    backend = "gloo"
    engines_map_host_chunks = True

    def __init__(self) -> None:
        self._shared: shm.Segment | None = None

    def device_id(self, rank: int) -> str:
        return f"cpu-{socket.gethostname()}-{rank}"

    def alloc_host(self, nbytes: int) -> HostChunk:
        seg = shm.Segment(nbytes, "chunk")
        return HostChunk(seg.tensor, _fd_handle(seg), seg.close)

    def shared_buffer(self, nbytes: int) -> tuple[torch.Tensor, BufferHandle]:
        """The double buffer, kept across updates (page faults are paid once)."""
        if self._shared is None or self._shared.ref.size_bytes < nbytes:
            self.release_shared()
            self._shared = shm.Segment(nbytes, "buffer")
        return self._shared.tensor, _fd_handle(self._shared)

    def release_shared(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def broadcast(
        self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None, timeout_s: float | None = None
    ) -> None:
        """gloo's broadcast, waited for at most `timeout_s`: a peer whose host dropped off the network
        leaves the sender blocked in a TCP send that gloo's own timeout does not end."""
        broadcast_within(t, src, group, timeout_s)

    def synchronize(self) -> None:
        pass


class BroadcastTimeout(TimeoutError):
    """A bucket's broadcast did not finish in time (a peer's host is unreachable, or the peer hangs)."""


# Broadcasts given up on: gloo's work object waits for its operation when freed, so one dropped with
# the exception's frames would block the thread that drops it. Kept here instead (a process whose
# peers are cut off leaves its process group unusable; it reports the failure and is restarted).
_ABANDONED: list = []


def broadcast_within(t: torch.Tensor, src: int, group: dist.ProcessGroup | None, timeout_s: float | None) -> None:
    if timeout_s is None:
        dist.broadcast(t, src=src, group=group)
        return
    from datetime import timedelta

    work = dist.broadcast(t, src=src, group=group, async_op=True)
    try:
        done = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        _ABANDONED.append(work)
        del work
        raise BroadcastTimeout(f"the broadcast from rank {src} did not finish within {timeout_s:g} s: {e}") from None
    if done is False:
        _ABANDONED.append(work)
        raise BroadcastTimeout(f"the broadcast from rank {src} did not finish within {timeout_s:g} s")


def _fd_handle(seg: shm.Segment) -> BufferHandle:
    return BufferHandle(kind="fd", size_bytes=seg.ref.size_bytes, pid=seg.ref.pid, fd=seg.ref.fd)


class CudaTransport:
    """GPU path: pinned host memory, H2D into a device double buffer shared over CUDA IPC, NCCL."""

    backend = "nccl"
    engines_map_host_chunks = False

    def __init__(self, local_rank: int):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransport needs a CUDA device")
        self.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(self.device)
        self._copy_stream = torch.cuda.Stream(self.device)
        self._shared: torch.Tensor | None = None

    def device_id(self, rank: int) -> str:
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def alloc_host(self, nbytes: int) -> HostChunk:
        try:
            return HostChunk(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None)
        except RuntimeError as e:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            raise RuntimeError(
                f"pinning {nbytes / 2**30:.2f} GiB of host memory failed ({e}); locked-memory limit "
                f"(ulimit -l) is {soft if soft >= 0 else 'unlimited'} bytes: raise it for the container"
            ) from None

    def shared_buffer(self, nbytes: int) -> tuple[torch.Tensor, BufferHandle]:
        if self._shared is None or self._shared.numel() < nbytes:
            self.release_shared()
            self._shared = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        args = self._shared.untyped_storage()._share_cuda_()
        return self._shared, BufferHandle(kind="cuda", size_bytes=self._shared.numel(), cuda_args=tuple(args))

    def release_shared(self) -> None:
        self._shared = None
        self._staging = None
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()

    def p2p_staging(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory that P2P reads land in before the H2D copy."""
        if getattr(self, "_staging", None) is None or self._staging.tensor.numel() < nbytes:
            self._staging = self.alloc_host(nbytes)
        return self._staging.tensor

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # H2D on a side stream, then make the current stream (which NCCL follows) wait for it.
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)

    def broadcast(
        self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None, timeout_s: float | None = None
    ) -> None:
        broadcast_within(t, src, group, timeout_s)

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


def open_buffer(
    handle: BufferHandle, device_id: int | None, mapping_cache: shm.MappingCache | None = None
) -> torch.Tensor:
    """Engine side: map one of the PS's shared buffers (per update, or kept across updates by `mapping_cache`)."""
    if handle.kind == "fd":
        ref = shm.SegmentRef(handle.pid, handle.fd, handle.size_bytes)
        return mapping_cache.open(ref) if mapping_cache is not None else shm.map_readonly(ref)
    if not torch.cuda.is_available():
        raise RuntimeError("the parameter server sent a CUDA IPC buffer but this engine has no CUDA device")
    args = list(handle.cuda_args)
    if device_id is not None:
        args[0] = device_id  # processes may see the GPU under different indices (CUDA_VISIBLE_DEVICES)
    # Opening an IPC handle needs an initialized CUDA context in this process: an engine that has
    # not touched the GPU yet (a fresh process) would crash inside the driver call otherwise.
    torch.cuda.init()

    def open_now() -> torch.Tensor:
        storage = torch.UntypedStorage._new_shared_cuda(*args)
        buf = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", args[0]))
        buf.set_(storage, 0, (handle.size_bytes,), (1,))
        return buf

    if mapping_cache is not None:
        return mapping_cache.open_cuda(tuple(args), handle.size_bytes, open_now)
    return open_now()
