"""Where each bucket's bytes come from: one bucket source per update mode, behind one interface.

The pipeline (`pipeline.run_update`) is the same for every mode; the source decides which buffers
the engine maps and what happens to a bucket before the engine is told to read it:

    collective  owner copies its bucket into double-buffer half h (H2D on CUDA; on CPU it
                broadcasts straight from its registered chunk, which its engine maps), then
                broadcast(half h, src=owner) over gloo / NCCL
    local       nothing moves: every engine maps every owner's chunks read-only and reads the
                bucket in place (CPU, every rank on one host)
    p2p         Mooncake one-sided read from the owner's chunk into the receiver's half h
                (CUDA: into pinned staging, then H2D); the owners do no work
    p2p_engine  the same pull read by the engine itself (`engine_reads`): the rank sends where each
                tensor is in the owners' memory and the engine reads it into its parameters (CPU)
    relay       owners in another job (a trainer's memory, on another host): the job's first rank
                reads each bucket once over Mooncake and broadcasts it to the others, reading the
                next bucket while this one is broadcast; each byte crosses the owners' link once
                per update, however many hosts the job spans

A source is built for one update (`jobs.make_job`), opened once by the pipeline, then asked to
`fill` every bucket in order.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from checkpoint_engine import protocol as P
from checkpoint_engine.types import Mode

if TYPE_CHECKING:  # annotations only: this module imports no torch
    import torch
    import torch.distributed as dist

    from checkpoint_engine.buckets import Bucket
    from checkpoint_engine.host_memory import RegisteredCheckpoint, SharedTensorBuffer
    from checkpoint_engine.transport.devices import Transport
    from checkpoint_engine.transport.mooncake import P2PStore
    from checkpoint_engine.update_metrics import UpdateMetrics


@dataclass(frozen=True)
class EngineBuffers:
    """Which shared buffers this rank's engine maps, and where each bucket's tensors are in them.

    `handles[0]` is the double buffer when `double_buffer` is true. `base[owner]` is the index in
    `handles` of that owner's chunk 0: buckets of those owners are read in place, not from a half.
    """

    handles: tuple[P.BufferHandle, ...]
    base: dict[int, int] = field(default_factory=dict)
    double_buffer: bool = True
    p2p_host: str = ""  # with remote handles: the address the engine's transfer engine announces

    def reads_in_place(self, owner_rank: int) -> bool:
        return owner_rank in self.base

    @property
    def engine_reads(self) -> bool:
        """Some buffers are remote: the engine reads their tensors itself (P2P)."""
        return any(h.kind == "remote" for h in self.handles)

    def stable_buffers(self) -> tuple[int, ...]:
        """Registered chunks keep their bytes for the whole update; the double buffer is overwritten
        two buckets later. Remote chunks are not mapped at all (the engine reads them)."""
        start = 1 if self.double_buffer else 0
        return tuple(i for i in range(start, len(self.handles)) if self.handles[i].kind != "remote")

    def remote_plan(self, buckets: list[Bucket]) -> tuple[P.WireTensor, ...]:
        """With remote buffers: every tensor the engine will read itself, buckets in order (Hello's
        `tensors`: the engine finds where each lands before the first bucket). Else nothing."""
        if not self.engine_reads:
            return ()
        return tuple(t for b in buckets for t in self.wire(b, 0, None) if self.handles[t.buffer].kind == "remote")

    def wire(self, bucket: Bucket, half_offset: int, checksums: dict[str, int] | None) -> tuple[P.WireTensor, ...]:
        """Where the engine finds each tensor of `bucket` (buffer index, byte offset)."""
        direct = self.reads_in_place(bucket.owner_rank)
        out = []
        for t in bucket.tensors:
            if direct:
                buf, off = self.base[bucket.owner_rank] + t.chunk, t.offset_bytes
            else:
                buf, off = 0, half_offset + t.offset_bytes - bucket.start_bytes
            out.append(
                P.WireTensor(t.name, t.dtype, t.shape, buf, off, None if checksums is None else checksums[t.name])
            )
        return tuple(out)


class SourceJob(Protocol):
    """What a source reads of its update's job (`pipeline.UpdateJob` is one; the pipeline depends on
    the sources, not the other way round)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def half_stride(self) -> int: ...


class SourceRun(Protocol):
    """What `fill` reads of the update in progress (`pipeline.UpdateRun` is one)."""

    @property
    def job(self) -> SourceJob: ...

    @property
    def metrics(self) -> UpdateMetrics: ...


class BucketSource(Protocol):
    """How one update mode gets a bucket's bytes to where this rank's engine reads them."""

    mode: ClassVar[Mode]

    def open(self, job: SourceJob) -> EngineBuffers:
        """Allocate what the mode needs for this update (kept by the source); say what the engine maps."""
        ...

    def fill(self, run: SourceRun, bucket: Bucket, half: int) -> None:
        """Make `bucket` readable by the engine: in the double buffer at byte `half`, or in place.
        Every rank taking part calls it for every bucket, in order (collectives run in lockstep)."""
        ...

    def close(self) -> None:
        """Give back what `open` took beyond the double buffer (the pipeline calls it after every
        update, failed ones included, before the double buffer is released)."""
        ...


# The alignment of each tensor in a relay's kept share (UpdateConfig.keep_relayed): a page, a multiple
# of every ParameterServerConfig.align_bytes up to it, so that register_checkpoint adopts the buffer
KEEP_ALIGN_BYTES = 4096

# Memory a transfer engine may still be writing into (a read in flight when its update failed):
# kept alive, and registered, so that the read never lands in memory reused for something else, until
# its readers are done and a grace period past the read deadline is over (swept at later updates).
PARK_GRACE_READ_TIMEOUTS = 2.0  # parked for this many of the store's read timeouts, at least


@dataclass
class _Parked:
    staging: torch.Tensor
    store: P2PStore
    threads: tuple[threading.Thread, ...]  # read-ahead threads that may still write into it
    until_s: float  # time.monotonic() before which it stays


_PARKED: list[_Parked] = []


def _sweep_parked(now_s: float | None = None) -> int:
    """Unregister and free the parked stagings whose readers are done and whose grace is over; how
    many were freed."""
    now_s = time.monotonic() if now_s is None else now_s
    freed = 0
    for p in list(_PARKED):
        if now_s < p.until_s or any(t.is_alive() for t in p.threads):
            continue
        _PARKED.remove(p)
        try:
            p.store.unregister(p.staging.data_ptr())
        except Exception as e:  # noqa: BLE001 - its transfer engine may be closed already
            logging.getLogger(__name__).debug("unregistering a parked staging: %s", e)
        freed += 1
    return freed


def _prefault_quietly(tensors: list[torch.Tensor]) -> None:
    """Populate `tensors`' pages (best effort: an error only costs the faults it would have saved)."""
    from checkpoint_engine.transport.prefault import prefault

    try:
        prefault(tensors)
    except Exception as e:  # noqa: BLE001 - the copies fault the pages in instead
        logging.getLogger(__name__).debug("prefault of a kept share failed: %s", e)


def _unregister_staging(
    store: P2PStore, staging: torch.Tensor | None, busy: bool, threads: tuple[threading.Thread, ...] = ()
) -> None:
    """Unregister a source's staging memory from its transfer engine, or park it while `busy`
    (`threads`: readers that may still write into it); parked ones whose time is over go first.

    Each update allocates its staging anew; a region left registered after its memory was freed makes
    a later registration that overlaps it fail ("Transfer Engine does not support overlapped memory
    region": seen on the relay's root at its third update, benchmarks/bench_hosts_rl.py)."""
    _sweep_parked()
    if staging is None:
        return
    if busy:
        grace_s = PARK_GRACE_READ_TIMEOUTS * float(store.cfg.read_timeout_s)
        _PARKED.append(_Parked(staging, store, tuple(t for t in threads if t.is_alive()), time.monotonic() + grace_s))
        logging.getLogger(__name__).warning(
            "a P2P read into this update's staging (%d bytes) may still be in flight: kept registered for "
            "%.0f s at least, and until its readers are done",
            staging.numel(),
            grace_s,
        )
        return
    store.unregister(staging.data_ptr())


def _double_buffer(job: SourceJob, ckpt: RegisteredCheckpoint | None) -> tuple[torch.Tensor, EngineBuffers]:
    """The double buffer, plus this rank's own chunks when its engine can map them (CPU)."""
    shared, handle = job.transport.shared_buffer(2 * job.half_stride)
    handles, base = [handle], {}
    if job.transport.engines_map_host_chunks and ckpt is not None:
        base[job.rank] = 1
        handles += [c.handle for c in ckpt.chunks]
    return shared, EngineBuffers(tuple(handles), base)


@dataclass
class CollectiveSource:
    """Broadcast every bucket from its owner (any topology; on GPU always)."""

    ckpt: RegisteredCheckpoint | None  # this rank's shard (None when it owns no tensor)
    mode: ClassVar[Mode] = "collective"
    _shared: torch.Tensor | None = field(default=None, init=False, repr=False)
    _buffers: EngineBuffers | None = field(default=None, init=False, repr=False)

    def open(self, job: SourceJob) -> EngineBuffers:
        self._shared, self._buffers = _double_buffer(job, self.ckpt)
        return self._buffers

    def fill(self, run: SourceRun, bucket: Bucket, half: int) -> None:
        """Copy-in (when the engine cannot read the owner's chunk) and broadcast one bucket."""
        job, m = run.job, run.metrics
        dst = self._shared[half : half + bucket.size_bytes]
        if job.rank == bucket.owner_rank:
            src = self.ckpt.chunk(bucket.chunk)[bucket.start_bytes : bucket.start_bytes + bucket.size_bytes]
            if self._buffers.reads_in_place(bucket.owner_rank):
                dst = src  # CPU: broadcast straight from the registered chunk, which our engine maps
            else:
                t0 = time.perf_counter()
                job.transport.copy_in(dst, src)
                m.copy_in_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if job.world_size > 1:
            job.transport.broadcast(dst, bucket.owner_rank, job.group)
        job.transport.synchronize()
        m.broadcast_s += time.perf_counter() - t0

    def close(self) -> None:
        pass  # nothing beyond the double buffer


@dataclass
class LocalSource:
    """No data moves: every engine maps every owner's registered chunks and reads buckets in place."""

    chunk_handles: dict[int, list[P.BufferHandle]]  # owner rank -> memfd handles of its chunks
    mode: ClassVar[Mode] = "local"

    def open(self, job: SourceJob) -> EngineBuffers:
        handles: list[P.BufferHandle] = []
        base: dict[int, int] = {}
        for r in sorted(self.chunk_handles):
            base[r] = len(handles)
            handles += self.chunk_handles[r]
        return EngineBuffers(tuple(handles), base, double_buffer=False)

    def fill(self, run: SourceRun, bucket: Bucket, half: int) -> None:
        pass  # the engine reads the owner's chunk in place

    def close(self) -> None:
        pass


@dataclass
class P2PSource:
    """Pull every bucket from its owner's registered memory with a Mooncake one-sided read."""

    ckpt: RegisteredCheckpoint | None  # our own shard when the owners are this job: read in place
    store: P2PStore
    owner_addrs: dict[int, str]  # owner rank -> transfer engine address
    chunk_ptrs: dict[int, list[int]]  # owner rank -> address of each of its chunks
    mode: ClassVar[Mode] = "p2p"
    _shared: torch.Tensor | None = field(default=None, init=False, repr=False)
    _staging: torch.Tensor | None = field(default=None, init=False, repr=False)
    _buffers: EngineBuffers | None = field(default=None, init=False, repr=False)
    _connecting: list[threading.Thread] = field(default_factory=list, init=False, repr=False)
    _read_failed: bool = field(default=False, init=False, repr=False)

    def open(self, job: SourceJob) -> EngineBuffers:
        self._shared, self._buffers = _double_buffer(job, self.ckpt)
        # CPU: reads land in the double buffer itself; CUDA: in pinned host staging, then H2D
        tr = job.transport
        self._staging = self._shared if tr.engines_map_host_chunks else tr.p2p_staging(2 * job.half_stride)
        self.store.register(self._staging.data_ptr(), self._staging.numel())
        # Connect to every owner we will read from while the pipeline connects the engine (Hello ->
        # Ready): a peer's first read pays the transfer engine's handshake.
        self._connecting = [
            threading.Thread(target=self._connect, args=(self.owner_addrs[r], ptrs[0]), daemon=True, name="p2p-connect")
            for r, ptrs in sorted(self.chunk_ptrs.items())
            if ptrs and r in self.owner_addrs and not self._buffers.reads_in_place(r)
        ]
        for t in self._connecting:
            t.start()
        return self._buffers

    def _connect(self, addr: str, ptr: int) -> None:
        try:
            self.store.connect(addr, ptr)
        except Exception as e:  # noqa: BLE001 - the bucket reads report a peer that cannot be read
            logging.getLogger(__name__).debug("P2P connect to %s: %s", addr, e)

    def fill(self, run: SourceRun, bucket: Bucket, half: int) -> None:
        """Read one bucket into half `half` (our own shard: nothing, the engine reads it in place)."""
        if self._buffers.reads_in_place(bucket.owner_rank):
            return
        job, m = run.job, run.metrics
        t0 = time.perf_counter()
        while self._connecting:  # the connections opened in `open` (each bounded by the read deadline)
            self._connecting.pop().join(self.store.cfg.read_timeout_s)
        remote = self.chunk_ptrs[bucket.owner_rank][bucket.chunk] + bucket.start_bytes
        local = self._staging[half : half + bucket.size_bytes]
        try:
            self.store.read(self.owner_addrs[bucket.owner_rank], local.data_ptr(), remote, bucket.size_bytes)
        except BaseException:
            self._read_failed = True  # past its deadline the transfer engine may still write there
            raise
        m.broadcast_s += time.perf_counter() - t0
        if self._staging is not self._shared:  # CUDA: host staging -> device half
            t0 = time.perf_counter()
            job.transport.copy_in(self._shared[half : half + bucket.size_bytes], local)
            job.transport.synchronize()
            m.copy_in_s += time.perf_counter() - t0

    def close(self) -> None:
        _unregister_staging(self.store, self._staging, busy=self._read_failed)
        self._staging = None


@dataclass
class EngineP2PSource:
    """A pull the engine reads itself: the owners' chunks go to the engine as remote buffers, the
    engine's transfer engine reads each bucket into the parameters; our own shard is mapped (CPU)."""

    ckpt: RegisteredCheckpoint | None
    p2p_host: str  # this rank's transfer-engine address: the engine beside it announces the same
    owner_addrs: dict[int, str]
    chunk_ptrs: dict[int, list[int]]
    chunk_handles: dict[int, list[P.BufferHandle]]  # for the owners' chunk sizes
    mode: ClassVar[Mode] = "p2p_engine"

    def open(self, job: SourceJob) -> EngineBuffers:
        if not job.transport.engines_map_host_chunks:
            raise ValueError("p2p_reader='engine' reads into host memory: CUDA engines pull through their rank")
        handles: list[P.BufferHandle] = []
        base: dict[int, int] = {}
        if self.ckpt is not None:
            base[job.rank] = 0
            handles += [c.handle for c in self.ckpt.chunks]
        for r, ptrs in sorted(self.chunk_ptrs.items()):
            if r in base:
                continue
            sizes = [h.size_bytes for h in self.chunk_handles.get(r, [])]
            if len(sizes) != len(ptrs) or r not in self.owner_addrs:
                raise ValueError(f"owner rank {r}: its chunk sizes or P2P address are missing from the metas")
            base[r] = len(handles)
            handles += [
                P.BufferHandle(kind="remote", size_bytes=n, peer=self.owner_addrs[r], ptr=p)
                for n, p in zip(sizes, ptrs, strict=True)
            ]
        return EngineBuffers(tuple(handles), base, double_buffer=False, p2p_host=self.p2p_host)

    def fill(self, run: SourceRun, bucket: Bucket, half: int) -> None:
        pass  # the engine reads the bucket itself

    def close(self) -> None:
        pass  # the engine's transfer engine holds its own registrations


@dataclass
class RelaySource:
    """Read every bucket once from the owners (another job, e.g. the trainer) on the job's first rank
    and broadcast it to every rank of the job; the next bucket's read overlaps this one's broadcast.

    Root (job.members[0]): staging[k % 2] <- Mooncake read of bucket k (a thread, one bucket ahead);
    half <- staging (memcpy), then broadcast(half, src=root). Other ranks: broadcast into their half.
    A failed read is recorded on the root's link (the next agreement aborts the update on every rank)
    and the root still broadcasts, so no rank waits in a broadcast that never comes."""

    store: P2PStore
    owner_addrs: dict[int, str]
    chunk_ptrs: dict[int, list[int]]
    owner_hosts: dict[int, str] = field(default_factory=dict)
    mode: ClassVar[Mode] = "relay"
    _shared: torch.Tensor | None = field(default=None, init=False, repr=False)
    _staging: torch.Tensor | None = field(default=None, init=False, repr=False)
    _buffers: EngineBuffers | None = field(default=None, init=False, repr=False)
    _root: int = field(default=0, init=False)
    _index: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _buckets: list = field(default_factory=list, init=False, repr=False)
    _ahead: dict[int, tuple[threading.Thread, list]] = field(default_factory=dict, init=False, repr=False)
    _half_stride: int = field(default=0, init=False)
    _read_failed: bool = field(default=False, init=False, repr=False)
    read_bytes: int = field(default=0, init=False)
    # UpdateConfig.keep_relayed: the tensors of the buckets this rank keeps, written into one shared
    # buffer as they pass (its segment becomes the registered chunk: one copy), and which buckets are in
    _kept_buffer: SharedTensorBuffer | None = field(default=None, init=False, repr=False)
    _kept_buckets: set[int] = field(default_factory=set, init=False, repr=False)
    _keep_slot: tuple[int, int] | None = field(default=None, init=False, repr=False)  # (my index, members)

    def open(self, job: SourceJob) -> EngineBuffers:
        self._shared, self._buffers = _double_buffer(job, None)
        self._root = min(job.members) if getattr(job, "members", None) else 0
        self._buckets = list(getattr(job, "buckets", []))
        self._index = {id(b): i for i, b in enumerate(self._buckets)}
        self._half_stride = job.half_stride
        self.discard_kept()
        members = list(getattr(job, "members", None) or [job.rank])
        cfg = getattr(job, "cfg", None)
        keep = cfg is not None and cfg.keep_relayed and len(members) == getattr(job, "world_size", len(members))
        self._keep_slot = (members.index(job.rank), len(members)) if keep else None
        if keep:
            from checkpoint_engine.host_memory import SharedTensorBuffer

            mine, n = self._keep_slot
            specs = [
                (t.name, t.dtype, tuple(t.shape))
                for k, b in enumerate(self._buckets)
                if k % n == mine
                for t in b.tensors
            ]
            if specs:  # a rank with no bucket to keep (fewer buckets than ranks) registers nothing
                self._kept_buffer = SharedTensorBuffer(specs, align_bytes=KEEP_ALIGN_BYTES, tag="kept")
                # its pages populated beside the transfer, which waits on the link: first-touch faults
                # in the copies cost ~1 s per 0.25 GiB in the testbed (benchmarks/RESULTS.md, session 50)
                threading.Thread(
                    target=_prefault_quietly, args=(list(self._kept_buffer.tensors.values()),), daemon=True
                ).start()
        if job.rank == self._root:
            import torch

            self._staging = torch.empty(2 * job.half_stride, dtype=torch.uint8)
            self.store.register(self._staging.data_ptr(), self._staging.numel())
            if self._buckets:
                self._start_read(0)
        return self._buffers

    def _read(self, k: int, out: list) -> None:
        bucket = self._buckets[k]
        try:
            remote = self.chunk_ptrs[bucket.owner_rank][bucket.chunk] + bucket.start_bytes
            local = self._staging[(k % 2) * self._half_stride :][: bucket.size_bytes]
            self.store.read(self.owner_addrs[bucket.owner_rank], local.data_ptr(), remote, bucket.size_bytes)
        except Exception as e:  # noqa: BLE001 - reported on the link, spread at the next agreement
            self._read_failed = True  # past its deadline the transfer engine may still write there
            host = self.owner_hosts.get(bucket.owner_rank, "?")
            out.append(
                f"relay read of bucket {k} from owner rank {bucket.owner_rank} (host {host}, "
                f"{self.owner_addrs.get(bucket.owner_rank)}) failed: {type(e).__name__}: {e}"
            )

    def _start_read(self, k: int) -> None:
        out: list = []
        t = threading.Thread(target=self._read, args=(k, out), daemon=True, name=f"relay-read-{k}")
        t.start()
        self._ahead[k] = (t, out)

    def _broadcast(self, job: SourceJob, dst: torch.Tensor, k: int) -> None:
        """Bucket k from the root to every rank, within the job's per-bucket deadline; a timeout names
        the ranks and hosts that may be cut off."""
        from checkpoint_engine.transport.devices import BroadcastTimeout

        timeout_s = job.cfg.engine_timeout_s if hasattr(job, "cfg") else None
        if timeout_s is not None and job.rank != self._root:  # the root may first wait for its read
            timeout_s += self.store.cfg.read_timeout_s
        try:
            job.transport.broadcast(dst, self._root, job.group, timeout_s=timeout_s)
        except BroadcastTimeout as e:
            hosts = getattr(job, "hosts", ())
            others = [r for r in getattr(job, "members", []) if r != job.rank]
            where = ", ".join(f"rank {r} on {hosts[r] if r < len(hosts) else '?'}" for r in others)
            raise BroadcastTimeout(
                f"relay of bucket {k} between rank {job.rank} and {where or 'the other ranks'}: {e} "
                "(a host partitioned from the others?)"
            ) from e

    def fill(self, run: SourceRun, bucket: Bucket, half: int) -> None:
        job, m = run.job, run.metrics
        dst = self._shared[half : half + bucket.size_bytes]
        k = self._index[id(bucket)]
        if job.rank == self._root:
            t0 = time.perf_counter()
            thread, out = self._ahead.pop(k, (None, ["not read: an earlier relay read failed"]))
            if thread is not None:
                thread.join(self.store.cfg.read_timeout_s + 5)
            if thread is not None and thread.is_alive():
                out.append(f"relay read of bucket {k} did not finish within {self.store.cfg.read_timeout_s:g} s")
            m.broadcast_s += time.perf_counter() - t0  # waiting for the owners' bytes
            if k + 1 < len(self._buckets) and not out:
                self._start_read(k + 1)  # the owners' link works while this bucket is broadcast
            link = getattr(run, "link", None)
            if out and link is not None and link.failure is None:
                link.failure = out[0]
            if not out:
                t0 = time.perf_counter()
                dst.copy_(self._staging[(k % 2) * self._half_stride :][: bucket.size_bytes])
                m.copy_in_s += time.perf_counter() - t0
                self.read_bytes += bucket.size_bytes
        t0 = time.perf_counter()
        if job.world_size > 1:
            self._broadcast(job, dst, k)
        job.transport.synchronize()
        m.broadcast_s += time.perf_counter() - t0
        if self._kept_buffer is not None and k % self._keep_slot[1] == self._keep_slot[0]:
            import torch

            t0 = time.perf_counter()  # this rank's share of the version, for heals: into the chunk-to-be
            for t in bucket.tensors:
                start = t.offset_bytes - bucket.start_bytes
                self._kept_buffer.tensors[t.name].view(-1).view(torch.uint8).copy_(dst[start : start + t.nbytes])
            self._kept_buckets.add(k)
            m.copy_in_s += time.perf_counter() - t0

    @property
    def keeps(self) -> bool:
        """Whether this update keeps a share of the version on every rank (decided in `open`)."""
        return self._keep_slot is not None

    def kept_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the buckets this rank kept (name -> its view of the shared buffer, which
        `register_checkpoint` adopts on the CPU transport and copies on others)."""
        if self._kept_buffer is None:
            return {}
        return {
            t.name: self._kept_buffer.tensors[t.name]
            for k in sorted(self._kept_buckets)
            for t in self._buckets[k].tensors
        }

    def discard_kept(self) -> None:
        """Done with the kept share: a buffer a checkpoint adopted is freed when that is unregistered,
        any other now."""
        if self._kept_buffer is not None:
            self._kept_buffer.close()
        self._kept_buffer = None
        self._kept_buckets.clear()

    def close(self) -> None:
        """The root's staging unregistered, unless a read-ahead thread or a failed read may still
        write into it (an update that failed mid-read): then it stays parked."""
        threads = tuple(t for t, _ in self._ahead.values())
        busy = self._read_failed or any(t.is_alive() for t in threads)
        self._ahead.clear()
        _unregister_staging(self.store, self._staging, busy=busy, threads=threads)
        self._staging = None
