"""N rollout engines behind one ``RolloutEngine``: vLLM servers on this machine, synced and healed.

::

    EnginePool.start(config, model_dir) (engine_server.py): N x `python -m vllm_ext.launch
        --no-initial-push` (127.0.0.1, each vLLM worker bound to its share of the CPUs); the gate of
        each stays closed (no generation on dummy weights) until the first weight push
    PoolWeightSync.push(v) (pool_sync.py): register once in the in-process ParameterServer (one CPU rank), then one
        `update` per engine that is up: each engine reads the PS's memfd chunks in place (local mode)
    EnginePool.generate(requests) ── queue ──▶ the serving engine with the fewest requests in flight,
        in batches of up to BATCH_SIZE prompts (one HTTP request); on_result(result) as each batch ends
        a request fails (connection error, 5xx) and the engine no longer answers, or its server
        exits ──▶ engine down: its in-flight requests go back to the front of the queue, the others
        keep going; the answers stream, so each request keeps the tokens it already got and goes back
        as a continuation (those tokens join its prompt; its result carries them again)
    healer thread (pool_members.py): down engine ──▶ what is left of it killed ──▶ the same launcher command on a new
        port ──▶ vLLM healthy (gate closed) ──▶ one update of the CURRENT version into it alone
        ──▶ back in the pool (`engine_recoveries`, `recovery_s`)

Why one PS rank: everything here is on one host, and with the CPU transport an engine reads the
registered chunks in place, so one rank serves every engine (one update each, in turn; an engine's
own reload dominates an update). Several hosts (or one rank per inference device) is the
checkpoint-engine daemon's job (`torchrun -m checkpoint_engine`, one rank per device, broadcast or
P2P), not this embedded default.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from checkpoint_engine.types import ReqFunc
from ckpt_common.httpjson import HTTPError
from orchestrator.config import EngineConfig
from orchestrator.engine_pool.base import (
    GenCall,
    GenRequest,
    GenResult,
    PartialGeneration,
    ResultCallback,
    RolloutEngine,
    SamplingSettings,
    continuation,
)
from orchestrator.engine_pool.pool_members import (
    CLOSED,
    DOWN,
    HEALING,
    MAX_REQUEST_ATTEMPTS,
    SERVING,
    STARTING,
    WAITING,
    Member,
    PoolMembers,
)
from orchestrator.engine_pool.pool_servers import BATCH_SIZE, start_servers
from orchestrator.repeat import RepeatConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Call:
    """One ``generate`` call: its queue, results and first error."""

    pending: collections.deque
    sampling: SamplingSettings
    repeat: RepeatConfig | None
    on_result: ResultCallback | None
    deadline: float
    originals: dict = dataclasses.field(default_factory=dict)  # request id -> the caller's request
    kept: dict = dataclasses.field(default_factory=dict)  # request id -> tokens kept from broken-off streams
    results: dict = dataclasses.field(default_factory=dict)
    attempts: dict = dataclasses.field(default_factory=dict)
    error: BaseException | None = None
    abandoned: bool = False
    callback_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class EnginePool(PoolMembers, RolloutEngine):
    """Spreads requests over the serving engines (fewest in flight first), requeues those of a dead one.

    Members, their states and healing: ``PoolMembers``; weights: ``pool_sync.PoolWeightSync``."""

    def __init__(
        self,
        members: Sequence[Member],
        *,
        max_inflight_per_engine: int = 256,
        batch_size: int = 1,
        restart: Callable[[Member], None] | None = None,
        connect: Callable[[Member], RolloutEngine] | None = None,
        watch_interval_s: float = 0.5,
    ) -> None:
        super().__init__(members, restart=restart, connect=connect, watch_interval_s=watch_interval_s)
        self.max_inflight_per_engine = max_inflight_per_engine
        self.batch_size = batch_size  # requests (same max_tokens) per engine call: one HTTP request each
        self._generate_lock = threading.Lock()  # one generate call at a time (the loop's use)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight_per_engine * len(self.members), thread_name_prefix="pool"
        )
        self.requests_requeued = 0
        self.tokens_kept_on_requeue = 0
        self.log_dir: pathlib.Path | None = None
        self._start_healer()

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str, *, log_dir: str | os.PathLike | None = None) -> EnginePool:
        """Start ``config.num_engines`` launcher servers at once and wait until each vLLM is healthy."""
        servers, members = start_servers(config, model_dir, log_dir)
        pool = cls(
            members,
            max_inflight_per_engine=min(config.max_num_seqs, 256),
            batch_size=BATCH_SIZE,
            restart=(lambda member: servers.restart(member, pool._closing)) if config.self_heal else None,
            connect=servers.connect,
        )
        pool.log_dir = servers.log_root
        return pool

    # -- generation -----------------------------------------------------------------------------------
    def _generate(self, gen: GenCall) -> list[GenResult]:
        requests, timeout_s = gen.requests, gen.timeout_s
        call = _Call(collections.deque(requests), gen.sampling, gen.repeat, gen.on_result, time.monotonic() + timeout_s)
        call.originals = {r.request_id: r for r in requests}
        with self._generate_lock, self._cond:
            try:
                while len(call.results) < len(requests):
                    if call.error is not None:
                        raise call.error
                    self._dispatch_locked(call)
                    remaining = call.deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"{len(requests) - len(call.results)} of {len(requests)} requests did not finish "
                            f"within {timeout_s:.0f} s ({self._describe_locked()})"
                        )
                    if call.pending and not self._can_serve_locked():
                        raise RuntimeError(
                            f"every engine is down and none is being restarted ({self._describe_locked()}); "
                            f"see the engine logs{f' in {self.log_dir}' if self.log_dir else ''}"
                        )
                    self._cond.wait(timeout=min(remaining, 1.0))
            finally:
                call.abandoned = len(call.results) < len(requests)
        return [call.results[r.request_id] for r in requests]

    def _can_serve_locked(self) -> bool:
        return any(m.state in (SERVING, WAITING, STARTING, HEALING) for m in self.members) or any(
            m.state == DOWN and self._restart is not None for m in self.members
        )

    def _dispatch_locked(self, call: _Call) -> None:
        num_serving = sum(m.state == SERVING for m in self.members)
        share = -(-len(call.pending) // max(1, num_serving))  # a short queue still spreads over every engine
        while call.pending:
            live = [m for m in self.members if m.state == SERVING and m.outstanding < self.max_inflight_per_engine]
            if not live:
                return
            member = min(live, key=lambda m: (m.outstanding, m.num_requests, m.index))
            # a batch: the oldest request and the next ones with its max_tokens
            size = min(self.batch_size, self.max_inflight_per_engine - member.outstanding, share)
            first = call.pending.popleft()
            batch = [first]
            for request in list(call.pending):
                if len(batch) >= size:
                    break
                if request.max_tokens == first.max_tokens:
                    call.pending.remove(request)
                    batch.append(request)
            member.outstanding += len(batch)
            self._executor.submit(self._run, call, member, member.epoch, member.engine, batch)

    def _run(self, call: _Call, member: Member, epoch: int, engine: RolloutEngine, batch: list[GenRequest]) -> None:
        """Executor thread: one batch of requests on one engine."""
        try:
            remaining = max(1.0, call.deadline - time.monotonic())
            results = engine.generate(batch, call.sampling, repeat=call.repeat, timeout_s=remaining)
        except Exception as e:  # noqa: BLE001 - sorted below: dead engine (requeue) or bad request (fail the call)
            requeue = self._keep_partial(call, batch, e) if isinstance(e, PartialGeneration) else batch
            self._batch_failed(call, member, epoch, batch, requeue, e)
            return
        results, error = self._deliver(call, results)
        with self._cond:
            member.outstanding -= len(batch)
            if error is None:
                member.num_requests += len(batch)
            self._cond.notify_all()

    def _deliver(self, call: _Call, results: list[GenResult]) -> tuple[list[GenResult], BaseException | None]:
        """Finished results: the tokens kept from broken-off streams in front, the caller's callback run,
        recorded in the call (or the callback's error recorded instead)."""
        results = [
            dataclasses.replace(r, token_ids=(*call.kept[r.request_id], *r.token_ids))
            if r.request_id in call.kept
            else r
            for r in results
        ]
        error = None
        if call.on_result is not None and not call.abandoned:
            try:
                with call.callback_lock:  # callers' callbacks run one at a time, as with one engine
                    for result in results:
                        call.on_result(result)
            except Exception as e:  # noqa: BLE001 - the caller's own error ends its call
                error = e
        with self._cond:
            if error is not None:
                call.error = call.error or error
            else:
                call.results.update((r.request_id, r) for r in results)
        return results, error

    def _keep_partial(self, call: _Call, batch: list[GenRequest], e: PartialGeneration) -> list[GenRequest]:
        """A batch broke off: deliver what finished, return the others as continuations of what they got."""
        finished = {r.request_id for r in e.finished}
        done = list(e.finished)
        requeue = []
        for request in batch:
            rid = request.request_id
            if rid in finished:
                continue
            new = tuple(e.partial.get(rid, ()))
            original = call.originals[rid]
            kept = (*call.kept.get(rid, ()), *new)[: original.max_tokens]
            with self._cond:
                call.kept[rid] = kept
                self.tokens_kept_on_requeue += len(new)
            if len(kept) == original.max_tokens:  # cut right after its last token: it is complete
                done.append(GenResult(rid, (), "length"))
            else:
                requeue.append(continuation(original, kept))
        self._deliver(call, done)
        return requeue

    def _batch_failed(
        self,
        call: _Call,
        member: Member,
        epoch: int,
        batch: list[GenRequest],
        requeue: list[GenRequest],
        e: Exception,
    ) -> None:
        rejected = isinstance(e, HTTPError) and e.status < 500  # the engine answered: the request is at fault
        # A failed request on an engine that still answers is retried a few times, then fails the call;
        # an engine that no longer answers (or whose server exited) is down.
        with self._cond:
            known_down = member.epoch != epoch or member.state != SERVING
        alive = not rejected and not known_down and self._answers(member)
        first = batch[0].request_id
        with self._cond:
            member.outstanding -= len(batch)
            if rejected:
                call.error = call.error or e
            elif alive:
                tries = call.attempts[first] = call.attempts.get(first, 0) + 1
                if tries >= MAX_REQUEST_ATTEMPTS:
                    call.error = call.error or RuntimeError(
                        f"request {first!r} failed {tries} times on engines that still answer: {e}"
                    )
                else:
                    call.pending.extendleft(reversed(requeue))
                    self.requests_requeued += len(requeue)
            else:
                call.pending.extendleft(reversed(requeue))  # front of the queue: older than what waits there
                self.requests_requeued += len(requeue)
                self._mark_down_locked(member, epoch, f"request {first!r} failed: {e}")
            self._cond.notify_all()

    @staticmethod
    def _answers(member: Member) -> bool:
        if member.server is not None:
            return member.server.answers()
        probe = getattr(member.engine, "answers", None)
        return bool(probe()) if probe is not None else False

    # -- reporting and the rest of the protocol ---------------------------------------------------------
    def _describe_locked(self) -> str:
        return ", ".join(f"{m.name}: {m.state}" for m in self.members)

    def metrics(self) -> dict[str, Any]:
        """Counts since the pool started: requests per engine, failures, requeues, recoveries."""
        with self._cond:
            return {
                "num_engines": len(self.members),
                "engines_serving": sum(m.state == SERVING for m in self.members),
                "engine_requests": {m.name: m.num_requests for m in self.members},
                "engine_states": {m.name: m.state for m in self.members},
                "engine_failures": self.engine_failures,
                "requests_requeued": self.requests_requeued,
                "tokens_kept_on_requeue": self.tokens_kept_on_requeue,
                "engine_recoveries": self.engine_recoveries,
                "recovery_s": [round(s, 3) for s in self.recovery_s],
            }

    def endpoints(self) -> dict[str, str]:
        with self._cond:
            return {m.name: m.server.endpoint for m in self.members if m.server is not None}

    def weight_req_func(self, timeout_s: float, weight_version=None) -> ReqFunc:
        raise TypeError(
            "an engine pool takes one update per engine: sync it with orchestrator.engine_pool.pool_sync.PoolWeightSync"
        )

    def close(self) -> None:
        self._closing.set()
        with self._cond:
            members = list(self.members)
            for m in members:
                m.state = CLOSED
            self._cond.notify_all()
        for m in members:
            if m.engine is not None and hasattr(m.engine, "close"):
                m.engine.close()
        servers = [m.server for m in members if m.server is not None]
        for s in servers:  # SIGTERM every launcher first: they stop their vLLM in parallel
            s.signal_stop()
        for s in servers:
            code = s.stop(grace_s=15.0)
            logger.info("engine server on port %d ended with code %s", s.port, code)
        self._heal_queue.put(None)
        self._healer.join(timeout=30.0)
        self._executor.shutdown(wait=False, cancel_futures=True)
