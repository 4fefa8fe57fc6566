"""N rollout engines behind one ``RolloutEngine``: vLLM servers on this machine, synced and healed.

::

    EnginePool.start(config, model_dir): N x `python -m vllm_ext.launch --no-initial-push` (127.0.0.1,
        each vLLM worker bound to its share of the CPUs); the gate of each stays closed (no generation
        on dummy weights) until the first weight push
    PoolWeightSync.push(v): register once in the in-process ParameterServer (one CPU rank), then one
        `update` per engine that is up: each engine reads the PS's memfd chunks in place (local mode)
    EnginePool.generate(requests) ── queue ──▶ the serving engine with the fewest requests in flight,
        in batches of up to BATCH_SIZE prompts (one HTTP request); on_result(result) as each batch ends
        a request fails (connection error, 5xx) and the engine no longer answers, or its server
        exits ──▶ engine down: its in-flight requests go back to the front of the queue (a partial
        rollout keeps the segments it already has: they are in its prompt), the others keep going
    healer thread: down engine ──▶ what is left of it killed ──▶ the same launcher command on a new
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
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from checkpoint_engine.errors import HTTPError
from checkpoint_engine.procs import die_with_parent
from checkpoint_engine.types import ReqFunc
from orchestrator.config import EngineConfig, SyncConfig
from orchestrator.engine import GenRequest, GenResult, ResultCallback, RolloutEngine, SamplingSettings, check_requests
from orchestrator.repeat import RepeatConfig
from orchestrator.weight_sync import SyncResult, WeightSync

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
# Prompts per HTTP request to a pool engine. On 2 cores one request per prompt kept the servers' HTTP
# work (gate + vLLM's API server) the bottleneck: ~1-2k tokens/s for 2 engines vs ~6k with 32-64 per
# request; smaller batches give finer requeue and on_result granularity.
BATCH_SIZE = 32


# -- pure helpers ------------------------------------------------------------------------------------
def cpu_binds(cpus: Sequence[int], num_engines: int) -> list[str]:
    """Each engine's VLLM_CPU_OMP_THREADS_BIND: contiguous, near-equal shares of ``cpus``.

    vLLM's "auto" binding puts every single-worker server on the same first core (and keeps the last
    one for its scheduler), so N servers would share one core; with fewer CPUs than engines, engines
    share cores round-robin.
    Only vLLM's worker (the model's compute) is bound; the gate, vLLM's API server and engine core
    float over all CPUs: binding each server's whole process tree to its share measured 2-3x lower
    pool throughput here (the HTTP work then competes with the worker on its one core)."""
    if num_engines < 1 or not cpus:
        raise ValueError(f"need >= 1 engine and >= 1 CPU, got {num_engines} engines and CPUs {list(cpus)}")
    cpus = sorted(cpus)
    if len(cpus) < num_engines:
        return [str(cpus[i % len(cpus)]) for i in range(num_engines)]
    out, start = [], 0
    for i in range(num_engines):
        size = len(cpus) // num_engines + (1 if i < len(cpus) % num_engines else 0)
        out.append(",".join(str(c) for c in cpus[start : start + size]))
        start += size
    return out


def launch_command(model_dir: str, config: EngineConfig, port: int) -> list[str]:
    """The launcher command of one pool engine: gated, no initial push (the job's PS pushes every version)."""
    return [
        sys.executable,
        "-m",
        "vllm_ext.launch",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-initial-push",
        "--startup-timeout-s",
        str(float(config.start_timeout_s)),
        "--",
        "--dtype",
        config.dtype,
        "--max-model-len",
        str(config.max_model_len),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--block-size",
        str(config.block_size),
        "--seed",
        str(config.seed),
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching",
        "--disable-log-stats",
    ]


def _free_port() -> int:
    from vllm_ext.launch import free_port

    return free_port()


# -- one server process ------------------------------------------------------------------------------
class EngineServer:
    """One launcher child (gate + vLLM) on 127.0.0.1; ends with the thread that started it (PDEATHSIG)."""

    def __init__(self, command: Callable[[int], list[str]], env: Mapping[str, str], log_path: pathlib.Path) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._tree: list[Any] = []  # psutil.Process of the launcher's descendants (vLLM), once healthy
        with open(log_path, "a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting on port {self.port}\n")
            log.flush()
            self.proc = subprocess.Popen(
                command(self.port),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C to the job reaches the job, which stops its servers in order
                preexec_fn=die_with_parent,
            )

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def wait_ready(self, timeout_s: float, stop: threading.Event) -> float:
        """Wait until vLLM behind the gate is healthy (the gate itself stays closed until weights arrive)."""
        from checkpoint_engine.httpjson import status_json

        start = time.monotonic()
        while True:
            if self.exited():
                raise RuntimeError(
                    f"engine server on port {self.port} exited with code {self.proc.returncode} before it was "
                    f"ready; see {self.log_path}"
                )
            if stop.is_set():
                raise RuntimeError(f"engine server on port {self.port}: the pool is closing")
            try:
                status, body = status_json("GET", self.endpoint + "/launcher/status", timeout_s=2.0)
                if status == 200 and body.get("phase") in ("waiting_for_weights", "ready"):
                    self._remember_tree()
                    return time.monotonic() - start
            except OSError:
                pass  # the gate is not listening yet
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(
                    f"engine server on port {self.port} was not ready within {timeout_s:.0f} s (raise "
                    f"engine.start_timeout_s); see {self.log_path}"
                )
            stop.wait(0.5)  # readiness poll, bounded by the deadline above

    def _remember_tree(self) -> None:
        import psutil

        try:
            self._tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            self._tree = []

    def answers(self, timeout_s: float = 5.0) -> bool:
        """Does vLLM behind the gate answer (GET /v1/models; the gate says 502 when vLLM is gone)?"""
        from checkpoint_engine.httpjson import status_json

        if self.exited():
            return False
        try:
            status, _ = status_json("GET", self.endpoint + "/v1/models", timeout_s=timeout_s)
        except OSError:
            return False
        return status == 200

    def processes(self) -> list[Any]:
        """The vLLM processes under the launcher (``psutil.Process``, recorded when it became ready)."""
        return list(self._tree)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the launcher (it stops vLLM), then SIGKILL whatever of the tree is left; its exit code."""
        import psutil

        if not self.exited():
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for p in self._tree:  # a vLLM worker whose engine core is gone ignores SIGTERM
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs([p for p in self._tree if p.is_running()], timeout=5)
        return self.proc.returncode


# -- the pool ----------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Member:
    """One engine of the pool. ``epoch`` counts restarts: a failure seen by an old incarnation is ignored."""

    index: int
    engine: RolloutEngine | None = None
    server: EngineServer | None = None
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


@dataclasses.dataclass(eq=False)
class _Call:
    """One ``generate`` call: its queue, results and first error."""

    pending: collections.deque
    sampling: SamplingSettings
    repeat: RepeatConfig | None
    on_result: ResultCallback | None
    deadline: float
    results: dict = dataclasses.field(default_factory=dict)
    attempts: dict = dataclasses.field(default_factory=dict)
    error: BaseException | None = None
    abandoned: bool = False
    callback_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class EnginePool:
    """Spreads requests over the serving engines (fewest in flight first), requeues those of a dead one.

    ``restart(member)`` (None: no healing) replaces a down member's server and engine; ``bring_up``
    (set by ``PoolWeightSync``) then gives it the current weights and calls ``weights_in``."""

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
        if not members:
            raise ValueError("an engine pool needs at least one engine")
        self.members = list(members)
        self.max_inflight_per_engine = max_inflight_per_engine
        self.batch_size = batch_size  # requests (same max_tokens) per engine call: one HTTP request each
        self._restart = restart
        self._connect = connect
        self._bring_up: Callable[[Member], None] | None = None
        self._cond = threading.Condition()
        self._generate_lock = threading.Lock()  # one generate call at a time (the loop's use)
        self._closing = threading.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight_per_engine * len(self.members), thread_name_prefix="pool"
        )
        self.engine_failures = 0
        self.requests_requeued = 0
        self.engine_recoveries = 0
        self.recovery_s: list[float] = []
        self.heal_failures = 0
        self.log_dir: pathlib.Path | None = None
        self._heal_queue: queue.Queue = queue.Queue()
        self._watch_interval_s = watch_interval_s
        # The healer thread lives as long as the pool: servers it starts die with the thread (PDEATHSIG).
        self._healer = threading.Thread(target=self._heal_loop, name="engine-healer", daemon=True)
        self._healer.start()

    # -- construction from real servers --------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig, model_dir: str, *, log_dir: str | os.PathLike | None = None) -> EnginePool:
        """Start ``config.num_engines`` launcher servers at once and wait until each vLLM is healthy."""
        n = config.num_engines
        log_root = pathlib.Path(log_dir) if log_dir is not None else pathlib.Path(tempfile.mkdtemp(prefix="engines-"))
        log_root.mkdir(parents=True, exist_ok=True)
        binds = cpu_binds(sorted(os.sched_getaffinity(0)), n)
        if len(os.sched_getaffinity(0)) < n:
            logger.warning("%d engines on %d CPUs: engines share cores (%s)", n, len(os.sched_getaffinity(0)), binds)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(config.kv_cache_gib))

        def server_for(member: Member) -> EngineServer:
            member_env = dict(env, VLLM_CPU_OMP_THREADS_BIND=binds[member.index])
            return EngineServer(
                lambda port: launch_command(model_dir, config, port),
                member_env,
                log_root / f"{member.name}.log",
            )

        def connect(member: Member) -> RolloutEngine:
            from orchestrator.engine import HttpVllmEngine

            http = dataclasses.replace(config, type="vllm_http", endpoint=member.server.endpoint, num_engines=1)
            return HttpVllmEngine(http, max_workers=min(config.max_num_seqs, 256), batch_size=BATCH_SIZE)

        stop = threading.Event()

        def restart(member: Member) -> None:
            if member.server is not None:
                member.server.stop(grace_s=5.0)
            member.server = server_for(member)
            member.server.wait_ready(config.start_timeout_s, pool._closing)

        members = [Member(i, state=STARTING) for i in range(n)]
        started = time.monotonic()
        try:
            for m in members:
                m.server = server_for(m)
            for m in members:  # they start at once; wait for each in turn
                m.server.wait_ready(max(1.0, config.start_timeout_s - (time.monotonic() - started)), stop)
                m.state = WAITING
        except BaseException:
            for m in members:
                if m.server is not None:
                    m.server.stop(grace_s=5.0)
            raise
        logger.info(
            "%d engine servers healthy in %.1f s (%s; CPU binds %s; logs in %s)",
            n,
            time.monotonic() - started,
            ", ".join(m.server.endpoint for m in members),
            binds,
            log_root,
        )
        pool = cls(
            members,
            max_inflight_per_engine=min(config.max_num_seqs, 256),
            batch_size=BATCH_SIZE,
            restart=restart if config.self_heal else None,
            connect=connect,
        )
        pool.log_dir = log_root
        return pool

    # -- state changes --------------------------------------------------------------------------------
    def set_bring_up(self, bring_up: Callable[[Member], None]) -> None:
        self._bring_up = bring_up

    def sync_targets(self) -> list[tuple[Member, int]]:
        """Members a new version must reach now (serving or waiting for weights), with their epoch."""
        with self._cond:
            return [(m, m.epoch) for m in self.members if m.state in (WAITING, SERVING)]

    def weight_req_func_of(self, member: Member, timeout_s: float) -> ReqFunc:
        if member.server is not None:
            from vllm_ext.req import vllm_http_req_func

            return vllm_http_req_func(member.server.endpoint, rank=0, timeout_s=timeout_s)
        return member.engine.weight_req_func(timeout_s)

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

    # -- generation -----------------------------------------------------------------------------------
    def generate(
        self,
        requests: Sequence[GenRequest],
        sampling: SamplingSettings,
        *,
        repeat: RepeatConfig | None = None,
        on_result: ResultCallback | None = None,
        timeout_s: float = 900.0,
    ) -> list[GenResult]:
        check_requests(requests)
        if not requests:
            return []
        call = _Call(collections.deque(requests), sampling, repeat, on_result, time.monotonic() + timeout_s)
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
            self._batch_failed(call, member, epoch, batch, e)
            return
        error = None
        if call.on_result is not None and not call.abandoned:
            try:
                with call.callback_lock:  # callers' callbacks run one at a time, as with one engine
                    for result in results:
                        call.on_result(result)
            except Exception as e:  # noqa: BLE001 - the caller's own error ends its call
                error = e
        with self._cond:
            member.outstanding -= len(batch)
            if error is not None:
                call.error = call.error or error
            else:
                member.num_requests += len(batch)
                call.results.update((r.request_id, r) for r in results)
            self._cond.notify_all()

    def _batch_failed(self, call: _Call, member: Member, epoch: int, batch: list[GenRequest], e: Exception) -> None:
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
                    call.pending.extendleft(reversed(batch))
                    self.requests_requeued += len(batch)
            else:
                call.pending.extendleft(reversed(batch))  # front of the queue: older than what waits there
                self.requests_requeued += len(batch)
                self._mark_down_locked(member, epoch, f"request {first!r} failed: {e}")
            self._cond.notify_all()

    @staticmethod
    def _answers(member: Member) -> bool:
        if member.server is not None:
            return member.server.answers()
        probe = getattr(member.engine, "answers", None)
        return bool(probe()) if probe is not None else False

    # -- healing --------------------------------------------------------------------------------------
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
                "engine_recoveries": self.engine_recoveries,
                "recovery_s": [round(s, 3) for s in self.recovery_s],
            }

    def endpoints(self) -> dict[str, str]:
        with self._cond:
            return {m.name: m.server.endpoint for m in self.members if m.server is not None}

    def weight_req_func(self, timeout_s: float) -> ReqFunc:
        raise TypeError(
            "an engine pool takes one update per engine: sync it with orchestrator.engine_pool.PoolWeightSync"
        )

    def stop_healing(self, timeout_s: float = 30.0) -> None:
        self._closing.set()
        self._heal_queue.put(None)
        self._healer.join(timeout=timeout_s)

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
            if not s.exited():
                s.proc.send_signal(signal.SIGTERM)
        for s in servers:
            code = s.stop(grace_s=15.0)
            logger.info("engine server on port %d ended with code %s", s.port, code)
        self._heal_queue.put(None)
        self._healer.join(timeout=30.0)
        self._executor.shutdown(wait=False, cancel_futures=True)


# -- weight sync into every engine -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PoolSyncResult(SyncResult):
    engine_update_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per engine reached


class PoolWeightSync(WeightSync):
    """The in-process ParameterServer (one CPU rank) pushing each version into every engine of a pool.

    One registration per version, then one ``update`` per engine with that engine's req_func (each
    engine maps the PS's chunks and reads them in place). An engine whose update fails is marked down
    (the healer brings it back); the push fails only when no engine took the version. ``bring_up``
    (the healer's) updates one restarted engine to the current version under the same lock, so an
    engine never misses a version that was pushed while it restarted."""

    def __init__(self, config: SyncConfig, pool: EnginePool) -> None:
        super().__init__(config, req_func=None)
        self.pool = pool
        self.timeout_s = config.timeout_s
        self._lock = threading.Lock()
        self._version: int | None = None
        pool.set_bring_up(self.bring_up)

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> PoolSyncResult:
        name = f"policy-v{version}"
        with self._lock:
            start = time.monotonic()
            if name in self.ps.checkpoints():  # a retried push of the same version
                self.ps.unregister_checkpoint(name)
            self.ps.register_checkpoint(name, named_tensors=dict(named_tensors))
            self.ps.gather_metas(name)
            per_engine: dict[str, float] = {}
            metrics = None
            for member, epoch in self.pool.sync_targets():
                t0 = time.monotonic()
                try:
                    metrics = self.ps.update(name, self.pool.weight_req_func_of(member, self.timeout_s))
                except Exception as e:  # noqa: BLE001 - one engine's failure must not stop the others' update
                    self.pool.report_failure(member, epoch, f"weight update to v{version}: {e}")
                    continue
                per_engine[member.name] = round(time.monotonic() - t0, 4)
                self.pool.weights_in(member, version, epoch)
            if metrics is None:
                raise RuntimeError(
                    f"weights v{version} reached no engine of the pool ({self.pool.metrics()['engine_states']}); "
                    f"see the engine logs in {self.pool.log_dir}"
                )
            if self._current is not None and self._current != name:
                self.ps.unregister_checkpoint(self._current)
            self._current, self._version = name, version
            total_s = time.monotonic() - start
        logger.debug("weights v%d synced into %d engines in %.3f s: %s", version, len(per_engine), total_s, per_engine)
        return PoolSyncResult(
            version=version,
            total_s=total_s,
            update_s=sum(per_engine.values()),
            total_bytes=metrics.total_bytes,
            num_buckets=metrics.num_buckets,
            engine_update_s=per_engine,
        )

    def bring_up(self, member: Member) -> None:
        """Healer: the current version into ``member`` alone (nothing pushed yet: the next push does it)."""
        with self._lock:
            epoch = member.epoch
            if self._current is None:
                return
            self.ps.update(self._current, self.pool.weight_req_func_of(member, self.timeout_s))
            self.pool.weights_in(member, self._version, epoch)

    def close(self) -> None:
        self.pool.stop_healing()  # no bring_up may use the PS once it is closed
        super().close()
