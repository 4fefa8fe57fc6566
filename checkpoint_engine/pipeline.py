"""The double-buffered broadcast update, run identically on every PS rank.

    for bucket i (shared buffer half h = i % 2):
        wait Ack(i-2) from my engine        # half h is free again
        agree: all ranks exchange status    # any failure -> every rank aborts
        owner: copy-in host chunk -> half h # memcpy (CPU) / H2D (CUDA)
        broadcast half h from owner         # gloo / NCCL, into every rank's shared buffer
        send Bucket(i, offsets) to engine   # engine loads bucket i while we move bucket i+1
    drain acks, agree, Done -> post_hook, agree, join req_func, agree

Every wait has a deadline. A failure anywhere (engine error or death, req_func error, a
collective failing because a rank died) ends the update on every live rank with an error that
names the rank and the cause, and each engine is told to abort.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from checkpoint_engine import protocol as P
from checkpoint_engine.config import UpdateConfig
from checkpoint_engine.errors import UpdateFailed  # also re-exported: callers import it from here
from checkpoint_engine.host_memory import RegisteredCheckpoint
from checkpoint_engine.link import EngineFailure, EngineLink
from checkpoint_engine.metrics import UpdateMetrics
from checkpoint_engine.p2p import P2PStore
from checkpoint_engine.plan import DEFAULT_ALIGN_BYTES, Bucket, align_up
from checkpoint_engine.transport import Transport
from checkpoint_engine.types import ReqFunc

logger = logging.getLogger(__name__)

REASON_BYTES = 384


class StatusExchange:
    """All participating ranks learn every one's error (if any) with one small all_gather."""

    def __init__(self, rank: int, members: list[int], group: dist.ProcessGroup | None):
        self.rank, self.members, self.group = rank, members, group
        self.world_size = len(members)

    def agree(self, error: str | None) -> None:
        if self.world_size == 1:
            if error:
                raise UpdateFailed({self.rank: error})
            return
        mine = torch.zeros(REASON_BYTES, dtype=torch.uint8)
        if error:
            raw = error.encode()[: REASON_BYTES - 1] or b"?"
            mine[0] = 1
            mine[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        failures = {
            self.members[i]: bytes(t[1:].tolist()).rstrip(b"\0").decode(errors="replace")
            for i, t in enumerate(out)
            if t[0]
        }
        if failures:
            raise UpdateFailed(failures)


ABORT_REQ_JOIN_S = 30.0  # how long an aborted update waits for req_func to return


class _ReqThread:
    def __init__(self, req_func: ReqFunc, addresses: list[tuple[str, str]]):
        self.error: str | None = None
        self._t = threading.Thread(target=self._run, args=(req_func, addresses), daemon=True, name="req_func")
        self._t.start()

    def _run(self, req_func: ReqFunc, addresses: list[tuple[str, str]]) -> None:
        try:
            req_func(addresses)
        except BaseException as e:  # noqa: BLE001 - reported through the status exchange
            self.error = f"req_func raised {type(e).__name__}: {e}"[: REASON_BYTES - 1]

    def join(self, timeout_s: float) -> str | None:
        self._t.join(timeout_s)
        if self._t.is_alive():
            return f"req_func did not return within {timeout_s:.0f} s"
        return self.error


@dataclass
class UpdateJob:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    checkpoint: str
    ckpt: RegisteredCheckpoint | None  # this rank's shard (None when it owns no tensor)
    buckets: list[Bucket]
    bucket_size_bytes: int
    checksums: dict[str, int] | None
    transport: Transport
    zmq_ctx: zmq.Context
    address: str
    addresses: list[tuple[str, str]]
    req_func: ReqFunc
    cfg: UpdateConfig
    update_id: str
    mode: str = "collective"  # "collective": broadcast; "local": engines read owners' chunks; "p2p": Mooncake reads
    rank_chunk_handles: dict[int, list[P.BufferHandle]] | None = None  # local mode: every rank's chunks
    pids: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    members: list[int] | None = None  # ranks taking part (P2P: the receivers); None: every rank
    p2p: P2PStore | None = None
    p2p_addrs: dict[int, str] | None = None  # owner rank -> transfer engine address
    chunk_ptrs: dict[int, list[int]] | None = None  # owner rank -> address of each chunk


class _Layout:
    """Which shared buffers this rank's engine maps, and where each bucket's tensors are in them."""

    def __init__(self, job: UpdateJob, double_buffer: P.BufferHandle | None):
        self.job = job
        self.handles: list[P.BufferHandle] = []
        self.base: dict[int, int] = {}  # owner rank -> index of its chunk 0 in handles
        if job.mode == "local":
            for r in sorted(job.rank_chunk_handles or {}):
                self.base[r] = len(self.handles)
                self.handles += job.rank_chunk_handles[r]
        else:
            self.handles.append(double_buffer)
            if job.transport.engines_map_host_chunks and job.ckpt is not None:
                self.base[job.rank] = 1
                self.handles += [c.handle for c in job.ckpt.chunks]

    def stable_buffers(self) -> tuple[int, ...]:
        """Registered chunks keep their bytes for the whole update; the double buffer (index 0
        outside local mode) is overwritten two buckets later."""
        first = 0 if self.job.mode == "local" else 1
        return tuple(range(first, len(self.handles)))

    def wire(self, bucket: Bucket, half_offset: int) -> tuple[P.WireTensor, ...]:
        direct = bucket.owner_rank in self.base
        out = []
        for t in bucket.tensors:
            if direct:
                buf, off = self.base[bucket.owner_rank] + t.chunk, t.offset_bytes
            else:
                buf, off = 0, half_offset + t.offset_bytes - bucket.start_bytes
            out.append(
                P.WireTensor(
                    t.name,
                    t.dtype,
                    t.shape,
                    buf,
                    off,
                    None if self.job.checksums is None else self.job.checksums[t.name],
                )
            )
        return tuple(out)


def run_broadcast_update(job: UpdateJob) -> UpdateMetrics:
    m = UpdateMetrics(
        job.checkpoint,
        job.rank,
        job.world_size,
        mode=job.mode,
        num_buckets=len(job.buckets),
        num_tensors=sum(len(b.tensors) for b in job.buckets),
        bucket_size_bytes=job.bucket_size_bytes,
        total_bytes=sum(t.nbytes for b in job.buckets for t in b.tensors),
    )
    t_start = time.perf_counter()
    status = StatusExchange(job.rank, job.members or list(range(job.world_size)), job.group)
    shared, handle, staging = None, None, None
    if job.mode != "local":
        shared, handle = job.transport.shared_buffer(2 * _half_stride(job))
    if job.mode == "p2p":
        staging = shared if job.transport.engines_map_host_chunks else job.transport.p2p_staging(2 * _half_stride(job))
        job.p2p.register(staging.data_ptr(), staging.numel())
    layout = _Layout(job, handle)
    link = EngineLink(job.zmq_ctx, job.address)
    req = _ReqThread(job.req_func, job.addresses)
    try:
        _connect(job, link, req, layout, status, m)
        _stream_buckets(job, link, req, shared, staging, layout, status, m)
        _finish(job, link, req, status, m)
        m.ok = True
        return m
    except BaseException as e:
        m.error = str(e)
        _abort_engine(link, str(e))
        # Let req_func finish (bounded): once the engine confirmed the abort its request returns, and
        # what req_func does afterwards (vLLM: reset the prefix cache of the now mixed weights) must
        # not be cut off by a caller that exits right after this raises.
        late = req.join(min(job.cfg.req_func_timeout_s, ABORT_REQ_JOIN_S))
        if late is not None:
            logger.warning("after the abort: %s", late)
        if isinstance(e, (UpdateFailed, KeyboardInterrupt)):
            raise
        raise RuntimeError(f"rank {job.rank}: weight update aborted: {_dead_ranks(job)}{type(e).__name__}: {e}") from e
    finally:
        m.total_s = time.perf_counter() - t_start
        link.close()
        if not job.cfg.keep_buffers:
            job.transport.release_shared()


def _connect(job, link, req, layout, status, m) -> None:
    t0 = time.perf_counter()
    err = None
    deadline = time.monotonic() + job.cfg.engine_connect_timeout_s
    try:
        link.send(
            P.Hello(
                update_id=job.update_id,
                checkpoint=job.checkpoint,
                num_buckets=len(job.buckets),
                buffers=tuple(layout.handles),
                verify_checksums=job.checksums is not None,
                stable_buffers=layout.stable_buffers(),
            ),
            deadline_s=deadline,
            check=lambda: req.error,
        )
        msg = link.recv(deadline, what="the engine to connect", check=lambda: req.error)
        if isinstance(msg, P.Error):
            err = f"engine could not start the update: {msg.reason}"
        elif not isinstance(msg, P.Ready):
            err = f"engine sent {type(msg).__name__} instead of Ready"
    except EngineFailure as e:
        err = e.describe()
    status.agree(err)
    m.setup_s = time.perf_counter() - t0


def _stream_buckets(job, link, req, shared, staging, layout, status, m) -> None:
    bar = None
    if job.cfg.progress and job.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=m.total_bytes, unit="B", unit_scale=True, desc=f"update {job.checkpoint}")
    acked = 0
    try:
        for i, bucket in enumerate(job.buckets):
            if i >= 2:
                acked = _wait_acks(job, link, req, acked, i - 1, m)  # Ack(i-2) frees half i % 2
            if i % job.cfg.agree_every_buckets == 0:
                t0 = time.perf_counter()
                status.agree(link.failure)
                m.agree_s += time.perf_counter() - t0
            half = (i % 2) * _half_stride(job)
            if job.mode == "p2p":
                _read_bucket(job, bucket, shared, staging, half, bucket.owner_rank in layout.base, m)
            elif job.mode == "collective":
                _move_bucket(job, bucket, shared, half, bucket.owner_rank in layout.base, m)
            if link.failure is None:  # the bucket still moved above: other ranks broadcast in lockstep
                try:
                    link.send(P.Bucket(index=i, tensors=layout.wire(bucket, half)))
                except EngineFailure as e:
                    link.failure = e.describe()  # spread to every rank at the next agreement
            if bar is not None:
                bar.update(sum(t.nbytes for t in bucket.tensors))
        _wait_acks(job, link, req, acked, len(job.buckets), m)
    finally:
        if bar is not None:
            bar.close()


def _move_bucket(job, bucket: Bucket, shared, half: int, engine_reads_chunk: bool, m) -> None:
    """Copy-in (when the engine cannot read the owner's chunk) and broadcast one bucket."""
    dst = shared[half : half + bucket.size_bytes]
    if job.rank == bucket.owner_rank:
        src = job.ckpt.chunk(bucket.chunk)[bucket.start_bytes : bucket.start_bytes + bucket.size_bytes]
        if engine_reads_chunk:
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


def _read_bucket(job, bucket: Bucket, shared, staging, half: int, engine_reads_chunk: bool, m) -> None:
    """P2P: pull one bucket from its owner's registered memory (one-sided read) into half `half`."""
    if engine_reads_chunk:
        return  # our own shard: the engine reads it in place
    t0 = time.perf_counter()
    remote = job.chunk_ptrs[bucket.owner_rank][bucket.chunk] + bucket.start_bytes
    local = staging[half : half + bucket.size_bytes]
    job.p2p.read(job.p2p_addrs[bucket.owner_rank], local.data_ptr(), remote, bucket.size_bytes)
    m.broadcast_s += time.perf_counter() - t0
    if staging is not shared:  # CUDA: host staging -> device half
        t0 = time.perf_counter()
        job.transport.copy_in(shared[half : half + bucket.size_bytes], local)
        job.transport.synchronize()
        m.copy_in_s += time.perf_counter() - t0


def _dead_ranks(job: UpdateJob, settle_s: float = 2.0) -> str:
    """Name the ranks on this host whose process is gone (a collective failing usually means one died).

    A peer's sockets close while it is still exiting, so look for up to `settle_s`.
    """
    import socket

    import psutil

    here = socket.gethostname()
    local = [(r, pid) for r, (pid, host) in enumerate(zip(job.pids, job.hosts)) if r != job.rank and host == here]
    deadline = time.monotonic() + settle_s
    while True:
        dead = []
        for r, pid in local:
            try:
                gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            except psutil.Error:
                gone = False
            if gone:
                dead.append(f"rank {r} (pid {pid}) is gone")
        if dead or not local or time.monotonic() > deadline:
            return "; ".join(dead) + "; " if dead else ""
        time.sleep(0.05)


def _half_stride(job: UpdateJob) -> int:
    return align_up(job.bucket_size_bytes, DEFAULT_ALIGN_BYTES)


def _wait_acks(job, link, req, acked: int, upto: int, m) -> int:
    """Collect acks until buckets [0, upto) are acknowledged; an engine error is recorded on link."""
    t0 = time.perf_counter()
    try:
        while acked < upto and link.failure is None:
            msg = link.recv(
                time.monotonic() + job.cfg.engine_timeout_s,
                what=f"the engine to load bucket {acked}",
                check=lambda: req.error,
            )
            if isinstance(msg, P.Ack) and msg.index == acked:
                acked += 1
            elif isinstance(msg, P.Error):
                link.failure = f"engine failed on {msg.reason}"
            else:
                link.failure = f"engine sent unexpected {msg} while bucket {acked} was loading"
    except EngineFailure as e:
        link.failure = e.describe()
    m.engine_wait_s += time.perf_counter() - t0
    return acked


def _finish(job, link, req, status, m) -> None:
    t0 = time.perf_counter()
    status.agree(link.failure)
    err = None
    link.send(P.Done(update_id=job.update_id))
    try:
        msg = link.recv(
            time.monotonic() + job.cfg.engine_timeout_s, what="the engine's post-update hook", check=lambda: req.error
        )
        if isinstance(msg, P.Error):
            err = f"engine failed in {msg.reason}"
        elif not (isinstance(msg, P.Ack) and msg.index == P.DONE_ACK):
            err = f"engine sent unexpected {msg} after Done"
    except EngineFailure as e:
        err = e.describe()
    status.agree(err)
    status.agree(req.join(job.cfg.req_func_timeout_s))
    m.finish_s = time.perf_counter() - t0


def _abort_engine(link: EngineLink, reason: str, timeout_s: float = 5.0) -> None:
    """Tell the engine to abort and wait (bounded) until it confirms its state is `incomplete`."""
    deadline = time.monotonic() + timeout_s
    try:
        link.send(P.Abort(reason=reason[:1000]))
        while True:
            msg = link.recv(deadline, what="the engine to confirm the abort")
            if isinstance(msg, P.Ack) and msg.index == P.ABORT_ACK:
                return
    except Exception as e:  # noqa: BLE001 - best effort: the engine may be gone already
        logger.warning("rank engine did not confirm the abort: %s", e)
