"""POSIX shared-memory segments that hand a bucket buffer from a PS rank to its engine (CPU path).

Names carry the creator's pid; the creator unlinks a segment as soon as its engine has mapped it,
and on every exit path. `sweep_stale_segments` removes segments whose creator died.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "ckpt-engine-"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-r(\d+)-(\d+)$")
_live: set[str] = set()


def segment_path(rank: int, seq: int) -> str:
    return f"{SHM_DIR}/{PREFIX}{os.getpid()}-r{rank}-{seq}"


def check_shm_capacity(nbytes: int) -> None:
    """Fail clearly when /dev/shm cannot hold `nbytes` (containers often give it only 64 MiB)."""
    try:
        free = shutil.disk_usage(SHM_DIR).free
    except OSError as e:
        raise RuntimeError(f"{SHM_DIR} is not usable ({e}); the CPU path needs POSIX shared memory") from None
    if free < nbytes:
        raise RuntimeError(
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free but the update needs {nbytes / 2**20:.0f} MiB of "
            "shared buffers; enlarge /dev/shm (docker --shm-size, or a memory-backed emptyDir mounted "
            "at /dev/shm in Kubernetes) or set a smaller bucket_size_bytes"
        )


def create_segment(path: str, nbytes: int) -> torch.Tensor:
    """Create a new segment of `nbytes` and map it as a uint8 tensor."""
    if not path.startswith(f"{SHM_DIR}/{PREFIX}"):
        raise ValueError(f"segment path must start with {SHM_DIR}/{PREFIX}, got {path!r}")
    check_shm_capacity(nbytes)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _live.add(path)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def open_segment(path: str, nbytes: int) -> torch.Tensor:
    """Map an existing segment (engine side)."""
    if not path.startswith(f"{SHM_DIR}/{PREFIX}") or "/" in path[len(SHM_DIR) + 1:]:
        raise ValueError(f"refusing to map {path!r}: not a checkpoint-engine segment")
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise RuntimeError(f"shared buffer {path} does not exist (its parameter server rank exited?)") from None
    if size < nbytes:
        raise RuntimeError(f"shared buffer {path} has {size} bytes, expected {nbytes}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def unlink_segment(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    _live.discard(path)


def sweep_stale_segments() -> list[str]:
    """Unlink segments left behind by processes that no longer exist; return their paths."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        unlink_segment(f"{SHM_DIR}/{name}")
        removed.append(f"{SHM_DIR}/{name}")
    if removed:
        logger.warning("removed %d stale shared-memory segments: %s", len(removed), removed)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _unlink_all() -> None:
    for path in list(_live):
        unlink_segment(path)
