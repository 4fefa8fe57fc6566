"""The vLLM servers of a pool on this machine: their CPU shares, launcher command and processes.

::

    start_servers(config, model_dir, log_dir) ──▶ N x `python -m vllm_ext.launch --no-initial-push`
        (127.0.0.1, free ports, each vLLM worker bound to its share of the CPUs: cpu_binds) started at
        once, each waited for in turn until vLLM is healthy behind its closed gate
    EngineServer: one launcher child (log file, readiness, "does it answer", stop of its whole tree)
    LocalServers.restart(member): the same command on a new port (the pool's healer calls it)
    LocalServers.connect(member): the member's HTTP client once its gate is open
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from checkpoint_engine.engines.segment_ledger import SegmentLedger
from checkpoint_engine.engines.segment_ledger import sweep as sweep_segments
from ckpt_common.ports import free_port
from ckpt_common.procs import (
    die_with_parent,
    shm_segments,
    signal_noting_segments,
    wait_noting_segments,
)
from orchestrator.config import EngineConfig
from orchestrator.engine_pool.pool_members import STARTING, WAITING, Member

logger = logging.getLogger(__name__)

# Prompts per HTTP request to a pool engine. On 2 cores one request per prompt kept the servers' HTTP
# work (gate + vLLM's API server) the bottleneck: ~1-2k tokens/s for 2 engines vs ~6k with 32-64 per
# request; smaller batches give finer requeue and on_result granularity.
BATCH_SIZE = 32


def cpu_binds(cpus: Sequence[int], num_engines: int) -> list[str]:
    """Each engine's VLLM_CPU_OMP_THREADS_BIND: contiguous, near-equal shares of ``cpus``.

    vLLM's "auto" binding puts every single-worker server on the same first core (and keeps the last
    one for its scheduler), so N servers would share one core; with fewer CPUs than engines, engines
    share cores round-robin.
    vLLM binds its worker (the model's compute) there, and the launcher its engine core, which spins
    while the worker computes (vllm_ext.engine_core_cpus); the gate and vLLM's API server float over
    all CPUs: binding each server's whole process tree to its share measured 2-3x lower pool
    throughput here (the HTTP work then competes with the worker on its one core)."""
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
        *(["--no-weight-transfer"] if config.update_route == "extension" else []),
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
        *(["--enforce-eager"] if config.enforce_eager else []),
    ]


class EngineServer:
    """One launcher child (gate + vLLM) on 127.0.0.1; ends with the thread that started it (PDEATHSIG)."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        env: Mapping[str, str],
        log_path: pathlib.Path,
        segment_ledger_dir: str | None = None,
    ) -> None:
        sweep_segments(segment_ledger_dir)  # what servers killed along with their job left
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._tree: list[Any] = []  # psutil.Process of the launcher's descendants (vLLM), once healthy
        self._signalled = False  # SIGTERM sent (signal_stop)
        # the shared memory that tree mapped (removed after a stop), kept on disk too: if the job is
        # killed with its servers, the next server's start removes them (`segment_ledger.sweep`)
        self._ledger = SegmentLedger(f"server-{self.port}", segment_ledger_dir)
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
        from ckpt_common.httpjson import status_json

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

    def _descendants(self) -> list[Any]:
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def _remember_tree(self) -> None:
        """Note the launcher's descendants now and the shared memory they map (added to those noted)."""
        now = self._descendants()
        self._tree = list(dict.fromkeys([*self._tree, *now]))
        self._ledger.note(shm_segments([self.proc.pid, *(p.pid for p in now)]))

    def answers(self, timeout_s: float = 5.0) -> bool:
        """Does vLLM behind the gate answer (GET /v1/models; the gate says 502 when vLLM is gone)?"""
        from ckpt_common.httpjson import status_json

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

    def signal_stop(self) -> None:
        """Note the tree and its shared memory, then SIGTERM the launcher, once: a second SIGTERM while
        vLLM shuts down can crash the launcher, and a tree noted after the signal can be gone already."""
        if self._signalled or self.exited():
            return
        # a stop during the start comes before wait_ready() noted the tree
        self._tree = list(dict.fromkeys([*self._tree, *self._descendants()]))
        self._ledger.note(signal_noting_segments(self.proc, lambda: [self.proc.pid, *(p.pid for p in self._tree)]))
        self._signalled = True

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the launcher (it stops vLLM), then SIGKILL whatever of the tree is left; its exit code."""
        import psutil

        if not self.exited():
            self.signal_stop()  # no-op when the pool's close() signalled every launcher just before

            def running() -> list[int]:  # for the segments only: the processes to end are those noted
                return [self.proc.pid, *(p.pid for p in self._tree), *(p.pid for p in self._descendants())]

            exited, noted = wait_noting_segments(running, grace_s, done=self.exited)
            self._ledger.note(noted)
            if not exited:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for p in self._tree:  # a vLLM worker whose engine core is gone ignores SIGTERM
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs([p for p in self._tree if p.is_running()], timeout=5)
        self._ledger.unlink()  # those a killed launcher or vLLM process could not remove
        return self.proc.returncode


@dataclasses.dataclass
class LocalServers:
    """How a pool of local servers starts, restarts and connects its members (one log file each)."""

    config: EngineConfig
    model_dir: str
    log_root: pathlib.Path
    binds: list[str]
    env: dict[str, str]

    def server_for(self, member: Member) -> EngineServer:
        member_env = dict(self.env, VLLM_CPU_OMP_THREADS_BIND=self.binds[member.index])
        return EngineServer(
            lambda port: launch_command(self.model_dir, self.config, port),
            member_env,
            self.log_root / f"{member.name}.log",
        )

    def restart(self, member: Member, stop: threading.Event) -> None:
        if member.server is not None:
            member.server.stop(grace_s=5.0)
        member.server = self.server_for(member)
        member.server.wait_ready(self.config.start_timeout_s, stop)

    def connect(self, member: Member) -> Any:
        from orchestrator.engine_pool.vllm_http import http_client

        return http_client(self.config, member.server.endpoint, BATCH_SIZE)


def start_servers(
    config: EngineConfig, model_dir: str, log_dir: str | os.PathLike | None = None
) -> tuple[LocalServers, list[Member]]:
    """Start ``config.num_engines`` launcher servers at once and wait until each vLLM is healthy."""
    n = config.num_engines
    log_root = pathlib.Path(log_dir) if log_dir is not None else pathlib.Path(tempfile.mkdtemp(prefix="engines-"))
    log_root.mkdir(parents=True, exist_ok=True)
    binds = cpu_binds(sorted(os.sched_getaffinity(0)), n)
    if len(os.sched_getaffinity(0)) < n:
        logger.warning("%d engines on %d CPUs: engines share cores (%s)", n, len(os.sched_getaffinity(0)), binds)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(config.kv_cache_gib))
    servers = LocalServers(config, model_dir, log_root, binds, env)
    stop = threading.Event()
    members = [Member(i, state=STARTING) for i in range(n)]
    started = time.monotonic()
    try:
        for m in members:
            m.server = servers.server_for(m)
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
    return servers, members
