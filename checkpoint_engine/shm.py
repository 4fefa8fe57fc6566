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
        raise RuntimeError(f"{what} needs {nbytes / 2**30:.2f} GiB of shared memory but only "
                           f"{avail / 2**30:.2f} GiB is available")


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


def map_readonly(ref: SegmentRef) -> torch.Tensor:
    """Engine side: map a PS segment read-only, pages populated up front."""
    try:
        fd = os.open(ref.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RuntimeError(f"shared segment {ref.path} is gone (its parameter server process exited?)") from None
    except PermissionError:
        raise RuntimeError(f"cannot open {ref.path}: the engine must run as the same user as the parameter "
                           "server and see its processes (same PID namespace)") from None
    try:
        size = os.fstat(fd).st_size
        if size < ref.size_bytes:
            raise RuntimeError(f"shared segment {ref.path} has {size} bytes, expected {ref.size_bytes}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, ref.size_bytes, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
        return torch.frombuffer(mm, dtype=torch.uint8)
