"""P2P reads through Mooncake's transfer engine (RDMA on clusters, TCP elsewhere).

Owners register their host chunks once; a receiving rank reads bucket byte ranges straight from
the owners' memory (one-sided: the owners' engines and PS ranks do no work), so a restarted or new
engine recovers its weights without disturbing engines that are serving.

Reads are submitted asynchronously, one Mooncake batch per byte range, and their completion is
polled with a short sleep in between. Mooncake's synchronous calls (and its batch wait) spin on the
status until the transfer is done: the waiting thread then takes a core from the threads that move
the bytes, which over TCP on a few cores slows the read itself (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

CONNECT_BYTES = 8  # what `P2PStore.connect` reads to open the connection to a peer
POLL_S = 0.0005  # between two looks at the reads in flight
# Transfers one PendingReads keeps in flight; the rest wait in its queue and go out as earlier ones
# end. Mooncake's TCP transport queues at most 1024 transfers per peer and fails those past it
# (status -1); a sharded read of row-parallel tensors is one range per row, thousands per bucket.
MAX_IN_FLIGHT = 256
P2PProtocol = Literal["tcp", "rdma"]  # `P2PConfig.protocol`, daemon `--p2p-protocol`


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0,2-3' -> (0, 2, 3): the CPU list syntax of taskset -c and VLLM_CPU_OMP_THREADS_BIND."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part.strip()!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU list {text!r}: {part.strip()!r} is not a range of CPU numbers >= 0")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def parse_rank_cpu_lists(spec: str) -> list[tuple[int, ...]]:
    """The CPU lists of `spec`: one for every rank ('0-3'), or one per local rank separated by ';'
    ('0-3;4-7'). Every list is checked, so every rank fails alike on a bad one."""
    return [parse_cpu_list(part.strip()) for part in spec.split(";")]


def rank_cpus(spec: str, local_rank: int, local_world_size: int) -> tuple[int, ...]:
    """The CPUs of this rank's transfer-engine threads from `spec` (`parse_rank_cpu_lists`): the one
    list, or local rank's own (with '0-3;4-7', local rank 1 gets 4-7)."""
    lists = parse_rank_cpu_lists(spec)
    if len(lists) == 1:
        return lists[0]
    if len(lists) != local_world_size:
        raise ValueError(
            f"bad per-rank CPU lists {spec!r}: {len(lists)} lists for {local_world_size} local ranks "
            "(give one list for every rank, or one per local rank separated by ';')"
        )
    return lists[local_rank]


def is_cpu_set(cpus) -> bool:
    """A non-empty sequence of CPU numbers >= 0 (bools are not numbers here)."""
    return bool(cpus) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)


@contextlib.contextmanager
def thread_cpus(cpus: tuple[int, ...] | None) -> Iterator[None]:
    """Run the block with the calling thread allowed on `cpus` (None: as it is), then restore its set.
    Threads started inside inherit the set: that is how Mooncake's own threads get it."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread (Linux)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise ValueError(f"cannot run on CPUs {list(cpus)}: {e} (this machine has {os.cpu_count()} CPUs)") from None
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class P2PConfig:
    host: str = "127.0.0.1"  # address the transfer engine announces to peers
    protocol: P2PProtocol = "tcp"
    device_name: str = ""  # RDMA device(s), e.g. "mlx5_0"; empty for tcp
    read_timeout_s: float = 300.0
    # CPUs the transfer engine's threads run on; None: those of the thread that creates the store.
    # An engine process whose main thread vLLM bound to its compute core would otherwise read every
    # byte on that one core.
    cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"p2p protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not self.host:
            raise ValueError("p2p host must be a non-empty address")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if self.cpus is not None and not (isinstance(self.cpus, tuple) and is_cpu_set(self.cpus)):
            raise ValueError(f"p2p cpus must be a non-empty tuple of CPU numbers >= 0, got {self.cpus!r}")


class PendingReads:
    """Reads from one peer in flight (`P2PStore.submit`): `poll` looks once, `wait` polls every
    POLL_S until all are done. Either raises once one failed or the deadline passed; after a failure
    the reads still in flight are waited for first, so their memory may be reused. At most
    MAX_IN_FLIGHT ranges are submitted at a time; each look submits more as earlier ones end."""

    def __init__(self, engine, remote_addr: str, nbytes: int, timeout_s: float, ranges=()):
        self._engine = engine
        self.remote_addr = remote_addr
        self.nbytes = nbytes
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.batches: list[int] = []
        self.refused = False  # a read could not be submitted
        self._failed: str | None = None
        self._queued = collections.deque(ranges)  # (local, remote, nbytes) not submitted yet
        self._feed()

    def _feed(self) -> None:
        """Submit queued ranges while fewer than MAX_IN_FLIGHT are in flight (none after a failure)."""
        while self._queued and len(self.batches) < MAX_IN_FLIGHT and not (self.refused or self._failed):
            local, remote, n = self._queued.popleft()
            # one batch per range: Mooncake's non-blocking status covers a batch's first range only
            batch = self._engine.batch_transfer_async_read(self.remote_addr, [local], [remote], [n])
            if not batch:  # not submitted (peer unreachable): the wait lets those that were finish, then fails
                self.refused = True
                break
            self.batches.append(batch)
        if self.refused or self._failed:
            self._queued.clear()

    def poll(self) -> bool:
        """True once every read is done; raises if one failed (RuntimeError) or time ran out (TimeoutError)."""
        pending = []
        for batch in self.batches:
            status = self._engine.transfer_check_status(batch)  # 1 done, 0 in flight, < 0 failed
            if status == 0:
                pending.append(batch)
            elif status != 1:
                self._failed = self._failed or f"status {status}"
        self.batches = pending
        self._feed()
        pending = self.batches
        if pending:
            if time.monotonic() > self.deadline:
                raise TimeoutError(
                    f"P2P read of {self.nbytes} bytes from {self.remote_addr} "
                    f"did not finish within {self.timeout_s:g} s"
                )
            return False
        if self.refused or self._failed:
            raise RuntimeError(
                f"P2P read of {self.nbytes} bytes from {self.remote_addr} failed "
                f"({'not submitted' if self.refused else self._failed}): "
                "is the owner's parameter server alive and its checkpoint still registered?"
            )
        return True

    def wait(self) -> None:
        while not self.poll():
            time.sleep(POLL_S)


class P2PStore:
    """One Mooncake TransferEngine per PS rank."""

    def __init__(self, cfg: P2PConfig):
        os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog is chatty at INFO
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "P2P updates need Mooncake's transfer engine: pip install mooncake-transfer-engine-non-cuda "
                f"(CPU machines) or mooncake-transfer-engine (CUDA) ({e})"
            ) from None
        self.cfg = cfg
        with thread_cpus(cfg.cpus):  # the threads Mooncake starts here inherit the set
            self._engine = TransferEngine()
            rc = self._engine.initialize(cfg.host, "P2PHANDSHAKE", cfg.protocol, cfg.device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to initialize on {cfg.host} ({cfg.protocol}): rc={rc}")
        self.addr = f"{cfg.host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._connected: set[str] = set()  # peers read from at least once
        self._scratch: ctypes.Array | None = None  # registered landing place of `connect`'s reads
        self._closing = threading.Event()
        self._preconnecting: list[threading.Thread] = []

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if ptr in self._registered:
                return
            rc = self._engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory({nbytes} bytes) failed: rc={rc}")
            self._registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            if self._registered.pop(ptr, None) is not None:
                self._engine.unregister_memory(ptr)

    def unregister_all(self) -> None:
        for ptr in list(self._registered):
            if self._scratch is None or ptr != ctypes.addressof(self._scratch):
                self.unregister(ptr)

    def read(self, remote_addr: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """Copy `nbytes` from `remote_ptr` at peer `remote_addr` into `local_ptr`, within the deadline."""
        self.read_batch(remote_addr, [local_ptr], [remote_ptr], [nbytes])

    def read_batch(self, remote_addr: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> None:
        """Several reads from one peer, all in flight at once (`lengths[i]` bytes from `remote_ptrs[i]`
        into `local_ptrs[i]`); returns when every one is done, within the deadline."""
        self.submit(remote_addr, local_ptrs, remote_ptrs, lengths).wait()

    def submit(
        self, remote_addr: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]
    ) -> PendingReads:
        """Start `read_batch`'s reads and return at once; the deadline starts now."""
        if not len(local_ptrs) == len(remote_ptrs) == len(lengths):
            raise ValueError(f"read_batch: {len(local_ptrs)} local, {len(remote_ptrs)} remote, {len(lengths)} lengths")
        ranges = list(zip(local_ptrs, remote_ptrs, lengths, strict=True))
        return PendingReads(self._engine, remote_addr, sum(lengths), self.cfg.read_timeout_s, ranges)

    def connect(self, remote_addr: str, remote_ptr: int) -> None:
        """Open the transfer engine's connection to peer `remote_addr` (segment handshake, TCP connect)
        with a read of a few bytes at `remote_ptr` (any registered address of that peer), once per peer.

        The first read from a peer pays this (measured 7-40 ms on 2 loaded cores, more than reading
        8 MB once connected); a pull starts it while its engine connects (`sources.P2PSource.open`)."""
        with self._connect_lock:
            if remote_addr in self._connected:
                return
            if self._scratch is None:
                scratch = ctypes.create_string_buffer(CONNECT_BYTES)
                self.register(ctypes.addressof(scratch), CONNECT_BYTES)
                self._scratch = scratch
            self.read(remote_addr, ctypes.addressof(self._scratch), remote_ptr, CONNECT_BYTES)
            self._connected.add(remote_addr)

    def connect_in_background(self, peers: list[tuple[str, int]]) -> None:
        """`connect` to each (address, registered pointer) of `peers` on a thread, so that a later pull
        (a heal, long after the metas were gathered) finds its connections open. Failures are only
        logged: the pull's own reads report a peer that cannot be read."""
        todo = [(a, p) for a, p in peers if a not in self._connected]
        if not todo or self._closing.is_set():
            return

        def run() -> None:
            for addr, ptr in todo:
                if self._closing.is_set():
                    return
                try:
                    self.connect(addr, ptr)
                except Exception as e:  # noqa: BLE001 - see the docstring
                    logger.debug("P2P pre-connect to %s: %s", addr, e)

        t = threading.Thread(target=run, daemon=True, name="p2p-preconnect")
        self._preconnecting = [x for x in self._preconnecting if x.is_alive()] + [t]
        t.start()

    def close(self, join_timeout_s: float = 5.0) -> None:
        self._closing.set()
        for t in self._preconnecting:  # a connect in flight reads into the scratch buffer unregistered below
            t.join(join_timeout_s)
        for ptr in list(self._registered):
            self.unregister(ptr)
        self._scratch = None
        self._connected.clear()
