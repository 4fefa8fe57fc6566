"""Anonymous shared memory (memfd) for handing bytes from a PS rank to engines on its host (CPU path).

A segment never has a name in /dev/shm: it lives as long as some process holds its fd or a
mapping, so a crashed run leaves nothing behind, and the /dev/shm size limit of containers does
not apply. Engines map a segment read-only through `/proc/<pid>/fd/<fd>` of the PS process (same
host, same user, shared PID namespace: e.g. `shareProcessNamespace: true` for pod sidecars).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentRef:
    pid: int
    fd: int
    size_bytes: int

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


def check_memory(nbytes: int, what: str) -> None:
    avail = psutil.virtual_memory().available
    if nbytes > avail:
        raise RuntimeError(
            f"{what} needs {nbytes / 2**30:.2f} GiB of shared memory but only {avail / 2**30:.2f} GiB is available"
        )


class Segment:
    """A memfd segment mapped read-write by its creator."""

    def __init__(self, nbytes: int, tag: str):
        if nbytes <= 0:
            raise ValueError(f"segment size must be positive, got {nbytes}")
        check_memory(nbytes, tag)
        self.fd = os.memfd_create(f"ckpt-engine-{tag}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._mm = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.ref = SegmentRef(os.getpid(), self.fd, nbytes)

    def close(self) -> None:
        self.tensor = None
        try:
            self._mm.close()
        except BufferError:  # views still alive somewhere: the mapping goes when they do
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def _open_segment(ref: SegmentRef, writable: bool = False) -> int:
    try:
        return os.open(ref.path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RuntimeError(f"shared segment {ref.path} is gone (its parameter server process exited?)") from None
    except PermissionError:
        raise RuntimeError(
            f"cannot open {ref.path}: the engine must run as the same user as the parameter "
            "server and see its processes (same PID namespace)"
        ) from None


def map_readonly(ref: SegmentRef) -> torch.Tensor:
    """Engine side: map a PS segment read-only, pages populated up front."""
    return _map_fd(_open_segment(ref), ref)[0]


def map_writable(ref: SegmentRef) -> torch.Tensor:
    """Writer side: map another process's segment read-write (``MAP_SHARED``: the owner and every
    other mapping see the writes). Used by the trainer ranks that fill a ``SharedTensorBuffer``
    created in the parameter server's process. Pages are not populated up front: a writer touches
    only its own slices."""
    fd = _open_segment(ref, writable=True)
    try:
        size = os.fstat(fd).st_size
        if size < ref.size_bytes:
            raise RuntimeError(f"shared segment {ref.path} has {size} bytes, expected {ref.size_bytes}")
        mm = mmap.mmap(fd, ref.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _map_fd(fd: int, ref: SegmentRef) -> tuple[torch.Tensor, tuple[int, int]]:
    """Map ``fd`` (closed here) read-only; the tensor and the segment's (st_dev, st_ino)."""
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size < ref.size_bytes:
            raise RuntimeError(f"shared segment {ref.path} has {size} bytes, expected {ref.size_bytes}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, ref.size_bytes, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
        return torch.frombuffer(mm, dtype=torch.uint8), (st.st_dev, st.st_ino)


class MappingCache:
    """Engine side: read-only mappings of PS segments kept across updates.

    Mapping a segment costs page-table set-up for every page (about 0.15 s per GiB here), paid on
    every update without this cache. A PS keeps its double buffer across updates, and its host
    chunks while a checkpoint stays registered (or longer, when it reuses freed chunks for the next
    checkpoint), so the same segments come back. A cached mapping is only reused when the
    segment behind ``/proc/<pid>/fd/<fd>`` is still the same file (device and inode compared):
    a closed descriptor number that the PS reused for another segment is mapped afresh.

    Mappings not used by the last ``keep_updates`` updates are dropped at ``end_update`` (a
    mapping keeps its segment's memory alive after the PS released it).
    """

    def __init__(self, keep_updates: int = 2) -> None:
        if keep_updates < 1:
            raise ValueError(f"keep_updates={keep_updates!r} must be >= 1")
        self.keep_updates = keep_updates
        self._maps: dict[tuple, tuple[tuple[int, int] | None, torch.Tensor, int]] = {}
        self._update = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._maps)

    def open(self, ref: SegmentRef) -> torch.Tensor:
        key = (ref.pid, ref.fd, ref.size_bytes)
        cached = self._maps.get(key)
        if cached is not None:
            try:
                st = os.stat(ref.path)
                identity = (st.st_dev, st.st_ino)
            except OSError:
                identity = None
            if identity == cached[0]:
                self.hits += 1
                self._maps[key] = (cached[0], cached[1], self._update)
                return cached[1]
            del self._maps[key]
        self.misses += 1
        tensor, identity = _map_fd(_open_segment(ref), ref)
        self._maps[key] = (identity, tensor, self._update)
        return tensor

    def open_cuda(self, args: tuple, size_bytes: int, opener: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A CUDA IPC buffer (``_share_cuda_`` arguments), kept open across updates like a segment.

        Opening maps the allocation into this process: about 50 ms per update for a 2 x 1 GiB double
        buffer on an H100, a quarter of an 8 GiB update. The key is the allocation's IPC handle and
        offset; while this process holds the mapping the producer cannot free the allocation (its
        CUDA IPC reference counter stays above zero), so a key never names a different buffer.
        """
        key = ("cuda", args[0], bytes(args[1]), args[3], size_bytes)
        cached = self._maps.get(key)
        if cached is not None:
            # Each share counts one more consumer on the producer side; the mapping held here already
            # keeps the allocation alive, so give that count back (as torch.multiprocessing does).
            torch.UntypedStorage._release_ipc_counter_cuda(args[4], args[5])
            self.hits += 1
            self._maps[key] = (cached[0], cached[1], self._update)
            return cached[1]
        self.misses += 1
        tensor = opener()
        self._maps[key] = (None, tensor, self._update)
        return tensor

    def end_update(self) -> None:
        """Drop the mappings that the last ``keep_updates`` updates did not use."""
        oldest = self._update - self.keep_updates + 1
        for key in [k for k, (_, _, used) in self._maps.items() if used < oldest]:
            del self._maps[key]
        self._update += 1

    def clear(self) -> None:
        self._maps.clear()
