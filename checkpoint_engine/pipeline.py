"""The double-buffered update, run identically on every PS rank taking part (`run_update`).

    Hello(buffers the source chose) -> Ready               # engine maps them (or reuses its mappings)
    for bucket i (double buffer half h, plan.double_buffer_schedule):
        wait for the Ack that frees half h  # the last bucket filling h; in place: Ack(i-2), none
                                            # when the engine reads remote buffers itself
        agree: all ranks exchange status    # every agree_every_buckets buckets; any failure -> all abort
        source.fill(bucket i, half h)       # collective: copy-in + broadcast; local: nothing; p2p: read
        send Bucket(i, offsets) to engine   # engine loads bucket i while we fill bucket i+1
    drain acks, agree, Done -> post_hook, agree, join req_func, agree

The loop is the same for every mode; what moves the bytes is the job's `BucketSource` (sources.py).
Every wait has a deadline. A failure anywhere (engine error or death, req_func error, a
collective failing because a rank died) ends the update on every live rank with an error that
names the rank and the cause, and each engine is told to abort. A rank that fails before its engine
connected tells the others at once (`StatusExchange.tell_early`, through the process group's store):
a rank whose engine was to connect on that rank's request stops waiting then, not at its deadline.
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
from checkpoint_engine.buckets import DEFAULT_ALIGN_BYTES, Bucket, align_up, double_buffer_schedule
from checkpoint_engine.config import UpdateConfig
from checkpoint_engine.errors import UpdateFailed
from checkpoint_engine.link import EngineFailure, EngineLink
from checkpoint_engine.sources import BucketSource, EngineBuffers
from checkpoint_engine.transport.devices import Transport
from checkpoint_engine.types import Mode, ReqFunc
from checkpoint_engine.update_metrics import UpdateMetrics

logger = logging.getLogger(__name__)

REASON_BYTES = 384


EARLY_POLL_S = 0.25  # how often a rank waiting for its engine to connect asks whether a peer failed


class StatusExchange:
    """All participating ranks learn every one's error (if any) with one small all_gather.

    Before the first agreement a rank may wait for its engine to connect while a peer has already
    failed (its req_func raised: the request that would have made this rank's engine connect never
    went out). `tell_early` leaves the failure in the process group's store (torchrun's TCPStore)
    under the update's key, and `early_failure` (polled by the waiting ranks) finds it, so they stop
    waiting at once instead of at the connect deadline. Without a store, the deadline still holds."""

    def __init__(self, rank: int, members: list[int], group: dist.ProcessGroup | None, key: str = ""):
        self.rank, self.members, self.group = rank, members, group
        self.world_size = len(members)
        self._store = _group_store() if self.world_size > 1 and key else None
        self._key = f"ckpt-update-early/{key}"
        self._next_poll = 0.0

    def tell_early(self, error: str) -> None:
        """Leave this rank's failure where the peers waiting for their engines look (best effort)."""
        if self._store is None:
            return
        try:
            self._store.set(f"{self._key}/{self.rank}", error[: REASON_BYTES - 1])
            self._store.add(f"{self._key}/count", 1)
        except Exception as e:  # noqa: BLE001 - the agreement that follows reports the failure anyway
            logger.debug("rank %d: could not post an early failure: %s", self.rank, e)

    def early_failure(self) -> str | None:
        """A peer's failure posted by `tell_early`, at most every EARLY_POLL_S; None if none (yet)."""
        now = time.monotonic()
        if self._store is None or now < self._next_poll:
            return None
        self._next_poll = now + EARLY_POLL_S
        try:
            if self._store.add(f"{self._key}/count", 0) == 0:
                return None
            for r in self.members:
                key = f"{self._key}/{r}"
                if r != self.rank and self._store.check([key]):
                    reason = self._store.get(key).decode(errors="replace")
                    return f"rank {r} failed before its engine connected ({reason})"
        except Exception as e:  # noqa: BLE001 - no store to ask: wait for the deadline as before
            logger.debug("rank %d: could not read early failures: %s", self.rank, e)
        return None

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
    """One update on this rank: what every mode shares. What differs by mode is in `source`."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None: every rank (default group); a pull: the receivers' subgroup
    members: list[int]  # ranks taking part, in group order
    checkpoint: str
    buckets: list[Bucket]
    bucket_size_bytes: int
    checksums: dict[str, int] | None
    source: BucketSource
    transport: Transport
    zmq_ctx: zmq.Context
    address: str  # this rank's engine link
    addresses: list[tuple[str, str]]  # every rank's (device id, engine link address), for req_func
    req_func: ReqFunc
    cfg: UpdateConfig
    update_id: str
    pids: tuple[int, ...] = ()  # every rank's PS process: dead-rank checks after a failure
    hosts: tuple[str, ...] = ()

    @property
    def mode(self) -> Mode:
        return self.source.mode

    @property
    def half_stride(self) -> int:
        """Bytes from the start of one double-buffer half to the next."""
        return align_up(self.bucket_size_bytes, DEFAULT_ALIGN_BYTES)


@dataclass
class UpdateRun:
    """One update in progress: the job, the engine's buffers and link, the req_func thread, the
    cross-rank status agreement and the metrics the stages add to."""

    job: UpdateJob
    buffers: EngineBuffers
    link: EngineLink
    req: _ReqThread
    status: StatusExchange
    metrics: UpdateMetrics

    def connect(self) -> None:
        """Hello -> Ready from the engine (it maps the buffers), then agree."""
        job, link = self.job, self.link
        t0 = time.perf_counter()
        err = None
        deadline = time.monotonic() + job.cfg.engine_connect_timeout_s
        try:
            link.send(
                P.Hello(
                    update_id=job.update_id,
                    checkpoint=job.checkpoint,
                    num_buckets=len(job.buckets),
                    buffers=self.buffers.handles,
                    verify_checksums=job.checksums is not None,
                    stable_buffers=self.buffers.stable_buffers(),
                    p2p_host=self.buffers.p2p_host,
                    tensors=self.buffers.remote_plan(job.buckets),
                ),
                deadline_s=deadline,
                check=self._connect_check,
            )
            msg = link.recv(deadline, what="the engine to connect", check=self._connect_check)
            if isinstance(msg, P.Error):
                err = f"engine could not start the update: {msg.reason}"
            elif not isinstance(msg, P.Ready):
                err = f"engine sent {type(msg).__name__} instead of Ready"
        except EngineFailure as e:
            err = e.describe()
        if err and not self._peer_failed:
            self.status.tell_early(err)  # peers still waiting for their engines stop now
        self.status.agree(err)
        self.metrics.setup_s = time.perf_counter() - t0

    _peer_failed = False

    def _connect_check(self) -> str | None:
        """What ends the wait for the engine early: this rank's req_func failing, or a peer's failure."""
        if self.req.error:
            return self.req.error
        peer = self.status.early_failure()
        if peer:
            self._peer_failed = True
        return peer

    def stream_buckets(self) -> None:
        """The double-buffered loop: wait for the half to be free, agree, fill it, send Bucket."""
        job, link, m = self.job, self.link, self.metrics
        bar = None
        if job.cfg.progress and job.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=m.total_bytes, unit="B", unit_scale=True, desc=f"update {job.checkpoint}")
        acked = 0
        in_place = [not self.buffers.double_buffer or self.buffers.reads_in_place(b.owner_rank) for b in job.buckets]
        # An engine that reads remote buffers itself began every placed read at Hello: holding its
        # Buckets back would only add a round trip per bucket, so they all go out at once.
        lag = max(len(job.buckets), 1) if self.buffers.engine_reads else 2
        schedule = double_buffer_schedule(in_place, lag)
        try:
            for i, bucket in enumerate(job.buckets):
                which, acks_needed = schedule[i]
                if acks_needed > acked:
                    acked = self.wait_acks(acked, acks_needed)  # frees the half this bucket fills
                if i % job.cfg.agree_every_buckets == 0:
                    t0 = time.perf_counter()
                    self.status.agree(link.failure)
                    m.agree_s += time.perf_counter() - t0
                half = (which or 0) * job.half_stride  # unused by buckets read in place
                job.source.fill(self, bucket, half)  # even after a failure: other ranks broadcast in lockstep
                if link.failure is None:
                    try:
                        link.send(P.Bucket(index=i, tensors=self.buffers.wire(bucket, half, job.checksums)))
                    except EngineFailure as e:
                        link.failure = e.describe()  # spread to every rank at the next agreement
                if bar is not None:
                    bar.update(sum(t.nbytes for t in bucket.tensors))
            self.wait_acks(acked, len(job.buckets))
        finally:
            if bar is not None:
                bar.close()

    def wait_acks(self, acked: int, upto: int) -> int:
        """Collect acks until buckets [0, upto) are acknowledged; an engine error is recorded on link."""
        link, req = self.link, self.req
        t0 = time.perf_counter()
        try:
            while acked < upto and link.failure is None:
                msg = link.recv(
                    time.monotonic() + self.job.cfg.engine_timeout_s,
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
        self.metrics.engine_wait_s += time.perf_counter() - t0
        return acked

    def finish(self) -> None:
        """Agree, Done -> the engine's post_hook -> Ack(DONE_ACK), agree, join req_func, agree."""
        job, link, req, status = self.job, self.link, self.req, self.status
        t0 = time.perf_counter()
        status.agree(link.failure)
        err = None
        link.send(P.Done(update_id=job.update_id))
        try:
            msg = link.recv(
                time.monotonic() + job.cfg.engine_timeout_s,
                what="the engine's post-update hook",
                check=lambda: req.error,
            )
            if isinstance(msg, P.Error):
                err = f"engine failed in {msg.reason}"
            elif not (isinstance(msg, P.Ack) and msg.index == P.DONE_ACK):
                err = f"engine sent unexpected {msg} after Done"
        except EngineFailure as e:
            err = e.describe()
        status.agree(err)
        status.agree(req.join(job.cfg.req_func_timeout_s))
        self.metrics.finish_s = time.perf_counter() - t0


def run_update(job: UpdateJob) -> UpdateMetrics:
    """Push `job.checkpoint` into this rank's engine; every rank taking part runs it in lockstep."""
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
    status = StatusExchange(job.rank, job.members, job.group, key=_early_key(job))
    buffers = job.source.open(job)
    link = EngineLink(job.zmq_ctx, job.address)
    m.open_s = time.perf_counter() - t_start
    req = _ReqThread(job.req_func, job.addresses)
    run = UpdateRun(job, buffers, link, req, status, m)
    try:
        run.connect()
        run.stream_buckets()
        run.finish()
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
        t_close = time.perf_counter()
        link.close()
        job.source.close()  # before the buffers go: a transfer engine must not keep freed memory registered
        if not job.cfg.keep_buffers:
            job.transport.release_shared()
        m.close_s = time.perf_counter() - t_close
        m.total_s = time.perf_counter() - t_start


def _early_key(job: UpdateJob) -> str:
    """The same on every rank of this update: the first member's engine link (PS process, sequence)."""
    return job.addresses[job.members[0]][1].rsplit("/", 1)[-1]


def _group_store():
    """The default process group's store (torchrun's TCPStore), or None."""
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a group without a store: the connect deadline still holds
        return None


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
