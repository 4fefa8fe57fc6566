"""A pool's members and their life: states, failures, the healer thread, weights arriving.

::

    STARTING (process up, vLLM not healthy) ──▶ WAITING (healthy, no weights: gate closed)
        ──weights_in──▶ SERVING (takes requests) ──report_failure / server exited──▶ DOWN
        ──healer thread: restart(member) (new process, epoch + 1)──▶ HEALING ──▶ WAITING
        ──bring_up (the current version into it alone) ──▶ SERVING      (a heal that fails
        MAX_HEAL_ATTEMPTS times: FAILED)       close() ──▶ CLOSED

``epoch`` counts a member's restarts: a failure or weights reported for an old incarnation are ignored.
``PoolMembers`` is the part of ``EnginePool`` that changes states; the pool adds generation on top.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from checkpoint_engine.types import ReqFunc
from orchestrator.engine_pool.base import RolloutEngine

logger = logging.getLogger(__name__)

# Member states: STARTING (process up, vLLM not healthy yet) -> WAITING (healthy, no weights: gate closed)
# -> SERVING (weights in, takes requests) -> DOWN (failed; queued for the healer) -> HEALING -> WAITING ...
STARTING, WAITING, SERVING, DOWN, HEALING, FAILED, CLOSED = (
    "starting",
    "waiting_for_weights",
    "serving",
    "down",
    "healing",
    "failed",
    "closed",
)
MAX_REQUEST_ATTEMPTS = 3  # a request that fails on engines that still answer is a bad request, not a dead engine
MAX_HEAL_ATTEMPTS = 3


@dataclasses.dataclass(eq=False)
class Member:
    """One engine of the pool. ``epoch`` counts restarts: a failure seen by an old incarnation is ignored."""

    index: int
    engine: RolloutEngine | None = None
    server: Any = None  # engine_server.EngineServer of a local pool
    state: str = SERVING
    epoch: int = 0
    outstanding: int = 0
    num_requests: int = 0
    num_failures: int = 0
    heal_attempts: int = 0
    version: int | None = None
    down_since: float | None = None

    @property
    def name(self) -> str:
        return f"engine{self.index}"


class PoolMembers:
    """The members, their lock and states, and the healer thread that restarts the ones that are down.

    ``restart(member)`` (None: no healing) replaces a down member's server and engine; ``bring_up``
    (set by the weight sync) then gives it the current weights and calls ``weights_in``; ``connect``
    makes the client of a member whose server took its first weights."""

    def __init__(
        self,
        members: Sequence[Member],
        *,
        restart: Callable[[Member], None] | None = None,
        connect: Callable[[Member], RolloutEngine] | None = None,
        watch_interval_s: float = 0.5,
    ) -> None:
        if not members:
            raise ValueError("an engine pool needs at least one engine")
        self.members = list(members)
        self._restart = restart
        self._connect = connect
        self._bring_up: Callable[[Member], None] | None = None
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self.engine_failures = 0
        self.engine_recoveries = 0
        self.recovery_s: list[float] = []
        self.heal_failures = 0
        self._heal_queue: queue.Queue = queue.Queue()
        self._watch_interval_s = watch_interval_s
        self._healer = threading.Thread(target=self._heal_loop, name="engine-healer", daemon=True)

    def _start_healer(self) -> None:
        """Once the pool is built. The healer thread lives as long as the pool: servers it starts die
        with the thread (PDEATHSIG)."""
        self._healer.start()

    # -- state changes --------------------------------------------------------------------------------
    def set_bring_up(self, bring_up: Callable[[Member], None]) -> None:
        self._bring_up = bring_up

    def sync_targets(self) -> list[tuple[Member, int]]:
        """Members a new version must reach now (serving or waiting for weights), with their epoch."""
        with self._cond:
            return [(m, m.epoch) for m in self.members if m.state in (WAITING, SERVING)]

    def weight_req_func_of(self, member: Member, timeout_s: float, weight_version: str | None = None) -> ReqFunc:
        """The update of ``member``: through the route its launcher offers (``served_route``: vLLM's
        weight-transfer routes unless the pool started it with --no-weight-transfer), ``weight_version``
        what vLLM reports afterwards."""
        if member.server is not None:
            from vllm_ext.weight_transfer.native_req import engine_req_func

            return engine_req_func(
                member.server.endpoint, route="auto", rank=0, timeout_s=timeout_s, weight_version=weight_version
            )
        return member.engine.weight_req_func(timeout_s, weight_version)

    def weights_in(self, member: Member, version: int | None, epoch: int) -> None:
        """``member`` (incarnation ``epoch``) holds weights ``version`` now: it serves."""
        engine = member.engine
        if engine is None and self._connect is not None:
            engine = self._connect(member)  # the gate is open now: the server answers /v1/models
        with self._cond:
            if member.epoch != epoch or member.state not in (WAITING, SERVING, HEALING):
                return
            member.engine, member.version, member.state = engine, version, SERVING
            self._cond.notify_all()

    def report_failure(self, member: Member, epoch: int, reason: str) -> None:
        """Mark ``member`` down (once per incarnation) and hand it to the healer."""
        with self._cond:
            self._mark_down_locked(member, epoch, reason)

    def _mark_down_locked(self, member: Member, epoch: int, reason: str) -> bool:
        if member.epoch != epoch or member.state not in (STARTING, WAITING, SERVING):
            return False
        member.state, member.down_since = DOWN, time.monotonic()
        member.num_failures += 1
        self.engine_failures += 1
        logger.warning("%s is down: %s", member.name, reason)
        if self._restart is not None and not self._closing.is_set():
            self._heal_queue.put(member)
        self._cond.notify_all()
        return True

    def _heal_loop(self) -> None:
        while not self._closing.is_set():
            try:
                member = self._heal_queue.get(timeout=self._watch_interval_s)
            except queue.Empty:
                self._watch()
                continue
            if member is None:
                return
            self._heal(member)

    def _watch(self) -> None:
        """Notice a server that exited while no request was on it."""
        with self._cond:
            for m in self.members:
                if m.server is not None and m.state in (WAITING, SERVING) and m.server.exited():
                    self._mark_down_locked(m, m.epoch, f"its server exited with code {m.server.proc.returncode}")

    def _heal(self, member: Member) -> None:
        with self._cond:
            if member.state != DOWN or self._closing.is_set():
                return
            member.state = HEALING
            member.heal_attempts += 1
            old_engine, member.engine = member.engine, None
        if old_engine is not None and hasattr(old_engine, "close"):
            old_engine.close()
        start = member.down_since or time.monotonic()
        try:
            self._restart(member)
            with self._cond:
                member.epoch += 1
                epoch = member.epoch
                member.state = WAITING
            if self._bring_up is not None:
                self._bring_up(member)  # the current version into it alone, then weights_in -> SERVING
            elif self._connect is None:
                self.weights_in(member, member.version, epoch)  # nothing to push (scripted engines)
        except Exception as e:  # noqa: BLE001 - a failed heal is retried, then the engine stays failed
            with self._cond:
                self.heal_failures += 1
                again = member.heal_attempts < MAX_HEAL_ATTEMPTS and not self._closing.is_set()
                member.state = DOWN if again else FAILED
                if again:
                    self._heal_queue.put(member)
                self._cond.notify_all()
            logger.error("restarting %s failed (attempt %d): %s", member.name, member.heal_attempts, e)
            return
        with self._cond:
            if member.state != SERVING:  # no version pushed yet: the next push serves it
                return
            member.heal_attempts = 0
            self.engine_recoveries += 1
            self.recovery_s.append(time.monotonic() - start)
            self._cond.notify_all()
        logger.warning("%s recovered in %.1f s (version %s)", member.name, self.recovery_s[-1], member.version)

    def wait_serving(self, timeout_s: float) -> bool:
        """Wait (bounded) until every member serves; True if they do."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(m.state != SERVING for m in self.members):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or all(m.state in (SERVING, FAILED, CLOSED) for m in self.members):
                    return all(m.state == SERVING for m in self.members)
                self._cond.wait(timeout=min(remaining, 1.0))
        return True

    def stop_healing(self, timeout_s: float = 30.0) -> None:
        self._closing.set()
        self._heal_queue.put(None)
        self._healer.join(timeout=timeout_s)
