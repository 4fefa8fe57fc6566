"""The lifecycle of the one engine process attached to each parameter-server rank (the daemon's
`--engine-cmd`), a watchdog on every rank and self-healing driven by rank 0.

The engine is an argv template the user gives (`{port}`, `{rank}`, `{device}` are filled in), e.g.
`python -m checkpoint_engine.plain_engine --port {port}` or `python -m vllm_ext.launch --model DIR
--no-initial-push --port {port}`: this module never imports an engine.

    stopped ──start──▶ starting ──first update──▶ updating ──ok──▶ serving ──update──▶ updating ...
                          │  (dummy weights: never       │ error                 │
                          │   reported as serving)       ▼                       │
                          │                          incomplete ──update──▶ updating
         any live state ──process exited──▶ failed ──restart (heal)──▶ starting
         any state ──stop──▶ stopped

How a death reaches rank 0, and the heal (the daemon wires it; see daemon.py):

    rank r: Watchdog thread ── proc.poll() every poll_interval_s ── exited? ──▶ state failed(exit code)
    every state change ──publish(record)──▶ process-group store key  ckpt-engines/engines/<r>
                                        └──▶ metadata store key      engines/<r>/lifecycle (etcd if given)
    rank 0: Healer thread ── reads every rank's record from the process-group store every poll_interval_s
            ── failed (and --auto-heal) ──▶ Driver.run({"op": "engine_start", "ranks": [r], "name": current,
                                                        "heal": true})   (queued behind any running command)
    every rank runs that command: rank r restarts its engine (dummy weights) and waits for health;
    all ranks agree on the outcome (keys agree/<n>/<rank> in the process-group store, waited for with
    the start's own deadline, not a gloo collective bound by the process group's timeout), then call
    update(current, ranks=[r]): rank r's engine pulls from the owners' memory; the other ranks return
    at once and their engines keep serving.

The process-group store (torchrun's TCPStore; two extra client connections per rank, records and
agreements, so neither waits behind the relay's blocking wait) carries the records because it is
shared by all ranks whatever the metadata store is (the in-process default is per process). Every
wait has a deadline: health (`start_timeout_s`), stop (`stop_grace_s`, then SIGKILL of the engine's
process group), the agreements (start deadline + margin), the update (its `timeout_s`).

Health: GET `health_path` answers 200 once the engine can take an update. For `vllm_ext.launch
--no-initial-push` that is `/version` (vLLM's own, proxied by the gate), not the gate's `/health`,
which opens only after the first update.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from checkpoint_engine.procs import die_with_parent

logger = logging.getLogger(__name__)

EngineState = Literal["starting", "serving", "updating", "incomplete", "stopped", "failed"]
STATES: tuple[str, ...] = get_args(EngineState)

# Allowed transitions. An engine serves only after a complete update: starting never goes to serving.
TRANSITIONS: dict[str, frozenset[str]] = {
    "stopped": frozenset({"starting"}),
    "starting": frozenset({"updating", "failed", "stopped"}),
    "updating": frozenset({"serving", "incomplete", "failed", "stopped"}),
    "serving": frozenset({"updating", "failed", "stopped"}),
    "incomplete": frozenset({"updating", "failed", "stopped"}),
    "failed": frozenset({"starting", "stopped"}),
}
UPDATABLE: frozenset[str] = frozenset({"starting", "serving", "incomplete"})  # healthy processes
STARTABLE: frozenset[str] = frozenset({"stopped", "failed"})
PLACEHOLDERS = ("{port}", "{rank}", "{device}")


class TransitionError(ValueError):
    """An engine state change the table does not allow."""


def check_transition(old: str, new: str) -> None:
    """Raise TransitionError unless `old -> new` is in the table (both must be known states)."""
    for s in (old, new):
        if s not in TRANSITIONS:
            raise TransitionError(f"unknown engine state {s!r}; known: {list(STATES)}")
    if new not in TRANSITIONS[old]:
        raise TransitionError(
            f"illegal engine state transition {old} -> {new}; "
            f"from {old} the engine may go to {sorted(TRANSITIONS[old])}"
        )


def parse_engine_cmd(text: str) -> tuple[str, ...]:
    """`--engine-cmd`: a JSON list of strings, or a shell-style string (split with shlex)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--engine-cmd must be a non-empty command template, got {text!r}")
    if text.lstrip().startswith("["):
        try:
            argv = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--engine-cmd looks like a JSON list but does not parse: {e}") from None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"--engine-cmd as JSON must be a list of strings, got {argv!r}")
    else:
        argv = shlex.split(text)
    cmd = tuple(argv)
    EngineConfig(cmd=cmd)  # validates the template
    return cmd


def render_cmd(cmd: Sequence[str], *, port: int, rank: int, device: str) -> list[str]:
    """The argv of one engine: each placeholder replaced (other braces, e.g. JSON args, stay as they are)."""
    values = {"{port}": str(port), "{rank}": str(rank), "{device}": device}
    out = []
    for arg in cmd:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


# torchrun's variables describe the daemon's process group, which the engine is no member of (an
# engine that starts its own torch.distributed group, as vLLM does, must not pick them up)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
TORCHRUN_VARS += ("ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def engine_env(environ: dict[str, str] | None = None, device: str = "cpu") -> dict[str, str]:
    """The daemon's environment without torchrun's process-group variables; a GPU engine sees only
    its rank's device (`cuda:N` -> CUDA_VISIBLE_DEVICES naming that GPU, within the daemon's own list)."""
    env = dict(os.environ if environ is None else environ)
    for key in list(env):
        if key in TORCHRUN_VARS or key.startswith(("TORCHELASTIC_", "TORCH_NCCL_ASYNC")):
            del env[key]
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and index >= len(visible):
            raise ValueError(f"device {device} is not among CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
        env["CUDA_VISIBLE_DEVICES"] = visible[index].strip() if visible else str(index)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class EngineConfig:
    cmd: tuple[str, ...]  # argv template with {port} (required), {rank}, {device}
    health_path: str = "/health"  # GET answers 200 once the engine can take updates
    host: str = "127.0.0.1"  # where the engine listens (the template's own flags decide; used for the URL)
    start_timeout_s: float = 300.0  # process start until healthy
    stop_grace_s: float = 5.0  # SIGTERM -> SIGKILL
    poll_interval_s: float = 0.2  # watchdog and healer period
    update_timeout_s: float = 300.0  # an update of managed engines (heals included), unless the request says
    auto_heal: bool = True
    max_heal_attempts: int = 3  # consecutive failed heals of one engine before the healer gives up
    log_dir: str | None = None  # engine logs (engine-r<rank>.log); None: a fresh temporary folder

    def __post_init__(self) -> None:
        from checkpoint_engine.validate import check_int, check_number

        if not isinstance(self.cmd, tuple) or not self.cmd or not all(isinstance(a, str) and a for a in self.cmd):
            raise ValueError(f"EngineConfig.cmd={self.cmd!r} must be a non-empty tuple of non-empty strings")
        if not any("{port}" in a for a in self.cmd):
            raise ValueError(
                f"EngineConfig.cmd={list(self.cmd)!r} has no {{port}} placeholder: the daemon picks a free port "
                "per engine and must pass it, e.g. '... --port {port}'"
            )
        if not self.health_path.startswith("/"):
            raise ValueError(f"EngineConfig.health_path={self.health_path!r} must start with '/'")
        for name in ("start_timeout_s", "stop_grace_s", "poll_interval_s", "update_timeout_s"):
            check_number(f"EngineConfig.{name}", getattr(self, name))
        check_int("EngineConfig.max_heal_attempts", self.max_heal_attempts, low=0)


class ManagedEngine:
    """One engine process and its state; every state change goes to `publish(record)`.

    Thread-safe: the command thread (start/update/stop) and the watchdog (`check_alive`) share a lock.
    """

    def __init__(
        self, rank: int, config: EngineConfig, *, device: str = "cpu", publish: Callable[[dict], None] | None = None
    ):
        self.rank, self.config, self.device = rank, config, device
        self._publish = publish or (lambda record: None)
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._log = None
        self.log_dir = config.log_dir or tempfile.mkdtemp(prefix=f"ckpt-engine-r{rank}-")
        self.log_path = os.path.join(self.log_dir, f"engine-r{rank}.log")
        self.state: str = "stopped"
        self.checkpoint: str | None = None  # the weights it serves in full (None unless serving/updating)
        self.pid: int | None = None
        self.url: str | None = None
        self.restarts = 0
        self.exit_code: int | None = None
        self.last_error: str | None = None
        self.since = time.time()
        self.failed_at: float | None = None  # monotonic time of the last failure (for recovery_s)
        self.recovery_s: float | None = None  # failure -> serving again, of the last heal
        self.last_failure: dict | None = None  # kept across restarts: {"reason", "exit_code", "at"}
        self._served_before: str | None = None  # the checkpoint served when the running update began
        self.healthy = False
        self._emit()

    # -- state ------------------------------------------------------------------------------
    def record(self) -> dict:
        with self._lock:
            return {
                "rank": self.rank,
                "state": self.state,
                "checkpoint": self.checkpoint,
                "pid": self.pid,
                "url": self.url,
                "healthy": self.healthy,
                "restarts": self.restarts,
                "exit_code": self.exit_code,
                "last_error": self.last_error,
                "recovery_s": self.recovery_s,
                "last_failure": self.last_failure,
                "since": self.since,
                "log_path": self.log_path,
            }

    def _emit(self) -> None:
        self._publish(self.record())

    def _set(self, new: str, **fields) -> None:
        check_transition(self.state, new)
        logger.info("rank %d: engine %s -> %s", self.rank, self.state, new)
        self.state, self.since = new, time.time()
        for k, v in fields.items():
            setattr(self, k, v)
        self._emit()

    def _fail(self, reason: str, exit_code: int | None) -> None:
        """-> failed, unless already failed or stopped (the watchdog and a waiter may both notice)."""
        if self.state in ("failed", "stopped"):
            return
        self.failed_at = time.monotonic()
        self.last_failure = {"reason": reason, "exit_code": exit_code, "at": time.time()}
        self._set("failed", exit_code=exit_code, last_error=reason, healthy=False, checkpoint=None)
        logger.error("rank %d: engine failed: %s", self.rank, reason)

    # -- process ----------------------------------------------------------------------------
    def poll(self) -> int | None:
        """The exit code once the process has ended (None while it runs or before any start)."""
        with self._lock:
            return None if self._proc is None else self._proc.poll()

    def start(self) -> None:
        """Start the process (free port, log file); state -> starting. Call `wait_healthy` next."""
        with self._lock:
            if self.state not in STARTABLE:
                raise RuntimeError(
                    f"rank {self.rank}: the engine is {self.state}; "
                    "stop it first (POST /engines/stop) to start it again"
                )
            restart = self.state == "failed"
            self._terminate()  # what a failed run left in its process group
            port = free_port(self.config.host)
            argv = render_cmd(self.config.cmd, port=port, rank=self.rank, device=self.device)
            self._close_log()
            self._log = open(self.log_path, "a")  # open for the process's lifetime
            self._log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {shlex.join(argv)}\n")
            self._log.flush()
            self._set(
                "starting",
                url=f"http://{self.config.host}:{port}",
                pid=None,
                exit_code=None,
                last_error=None,
                healthy=False,
                checkpoint=None,
                restarts=self.restarts + int(restart),
            )
            try:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    env=engine_env(device=self.device),
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent,  # the engine ends with this thread (the daemon's)
                    start_new_session=True,  # its own process group: a stop reaches its children too
                )
            except OSError as e:
                self._proc = None
                self._fail(f"cannot run {argv[0]!r}: {e} (check --engine-cmd)", None)
                raise RuntimeError(f"rank {self.rank}: {self.last_error}") from None
            self.pid = self._proc.pid
            self._emit()

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll GET url + health_path until it answers 200; RuntimeError (state failed) when the process
        exits first or the deadline passes (the process is then stopped)."""
        from checkpoint_engine.httpjson import status_json

        timeout_s = self.config.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        url = f"{self.url}{self.config.health_path}"
        while True:
            with self._lock:
                if self.state != "starting":  # the watchdog noticed a death first
                    raise RuntimeError(f"rank {self.rank}: engine {self.state} while starting: {self.last_error}")
                code = self._proc.poll() if self._proc is not None else None
                if code is not None:
                    self._fail(f"engine exited with code {code} before it was healthy; {self._log_tail()}", code)
                    raise RuntimeError(f"rank {self.rank}: {self.last_error}")
            try:
                status, _ = status_json("GET", url, timeout_s=2.0)
                if status == 200:
                    with self._lock:
                        self.healthy = True
                        self._emit()
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                with self._lock:
                    self._terminate()
                    self._fail(
                        f"engine not healthy at {url} within {timeout_s:g} s (raise start_timeout_s if it "
                        f"is slow to start); {self._log_tail()}",
                        self.poll(),
                    )
                raise RuntimeError(f"rank {self.rank}: {self.last_error}")
            time.sleep(0.05)

    def check_alive(self) -> int | None:
        """The watchdog's probe: a live engine whose process ended -> failed. Returns the exit code then."""
        with self._lock:
            if self._proc is None or self.state in ("stopped", "failed"):
                return None
            code = self._proc.poll()
            if code is None:
                return None
            self._fail(f"engine process {self._proc.pid} exited with code {code} ({self._log_tail()})", code)
            return code

    def abandon(self, reason: str) -> None:
        """Stop the process and report the engine failed (a start the other ranks gave up on)."""
        with self._lock:
            self._terminate()
            self._fail(reason, self.poll())

    def stop(self) -> None:
        """SIGTERM, SIGKILL after `stop_grace_s`, always reaped; state -> stopped."""
        with self._lock:
            self._terminate()
            self._close_log()
            if self.state != "stopped":
                self._set("stopped", pid=None, healthy=False, checkpoint=None)

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        grace_s = self.config.stop_grace_s
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d: engine %d ignored SIGTERM for %.1f s: SIGKILL", self.rank, proc.pid, grace_s)
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait(grace_s)
        # children the engine left in its process group (e.g. a launcher's servers): TERM, then KILL
        if _killpg(proc.pid, signal.SIGTERM):
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _killpg(proc.pid, 0):
                time.sleep(0.05)
            _killpg(proc.pid, signal.SIGKILL)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self, num_bytes: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - num_bytes))
                tail = f.read().decode(errors="replace").strip()
        except OSError:
            return f"log {self.log_path} unreadable"
        return f"log {self.log_path}, last lines: {tail[-num_bytes:]}"

    # -- updates ----------------------------------------------------------------------------
    def update_refusal(self) -> str | None:
        """Why the engine cannot take an update now (None: it can)."""
        with self._lock:
            if self.state in UPDATABLE and self.healthy:
                return None
            return f"rank {self.rank}: the engine is {self.state} and cannot take an update" + (
                "; start it first (POST /engines/start)" if self.state in STARTABLE else ""
            )

    def begin_update(self, checkpoint: str) -> None:
        with self._lock:
            refusal = self.update_refusal()
            if refusal is not None:
                raise RuntimeError(refusal)
            self._served_before = self.checkpoint if self.state == "serving" else None
            self._set("updating")

    def end_update(self, checkpoint: str, error: str | None, *, engine_untouched: bool = False) -> None:
        """updating -> serving (error None) or incomplete; failed when the process is gone.

        `engine_untouched`: the update failed before any weight reached the engine (a bad request):
        an engine that served a checkpoint goes back to serving it, one with dummy weights is incomplete."""
        with self._lock:
            if self.state != "updating":  # the watchdog marked it failed meanwhile
                return
            code = self._proc.poll() if self._proc is not None else None
            if code is not None:
                self._fail(f"engine exited with code {code} during the update of {checkpoint!r}: {error}", code)
            elif error is not None and engine_untouched and self._served_before is not None:
                self._set("serving", checkpoint=self._served_before, last_error=f"update to {checkpoint!r}: {error}")
            elif error is None:
                recovery = None if self.failed_at is None else round(time.monotonic() - self.failed_at, 3)
                self.failed_at = None
                self._set(
                    "serving",
                    checkpoint=checkpoint,
                    last_error=None,
                    recovery_s=recovery if recovery is not None else self.recovery_s,
                )
            else:
                self._set("incomplete", checkpoint=None, last_error=f"update to {checkpoint!r} failed: {error}")


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a process group; False when it has no member left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by someone else's process
        return False


class Watchdog:
    """A thread that probes the engine every `interval_s` (a death is noticed within that period)."""

    def __init__(self, engine: ManagedEngine, interval_s: float):
        self.engine, self.interval_s = engine, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-watchdog-r{engine.rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.engine.check_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s * 5 + 1)


# -- the daemon's engine commands (every rank runs each one; rank 0 relays them) ---------------------
class EngineHost:
    """This rank's managed engine, its watchdog, and the store the ranks agree through.

    `store`: a torch.distributed Store shared by all ranks (its own client connection); None only
    with one rank."""

    AGREE_MARGIN_S = 30.0

    def __init__(self, rank: int, world_size: int, config: EngineConfig, *, device: str, publish, store=None):
        if store is None and world_size > 1:
            raise ValueError(f"EngineHost of {world_size} ranks needs a store shared by the ranks")
        self.rank, self.world_size, self.config, self.store = rank, world_size, config, store
        self.engine = ManagedEngine(rank, config, device=device, publish=publish)
        self.watchdog = Watchdog(self.engine, config.poll_interval_s)
        self._num_agreements = 0  # every rank runs the same commands, so the counts match

    @property
    def start_agreement_timeout_s(self) -> float:
        """Longer than any rank's own start deadline (health wait, then a stop), so no rank is late."""
        return self.config.start_timeout_s + 2 * self.config.stop_grace_s + self.AGREE_MARGIN_S

    def close(self) -> None:
        self.watchdog.close()
        self.engine.stop()


def _agree(host: EngineHost, error: str | None, timeout_s: float) -> dict[int, str]:
    """Every rank's error of a step, {rank: error} of the failed ones, agreed through the store.

    Not a gloo collective: a rank whose engine takes minutes to start would otherwise run the others
    into the process group's timeout; here the deadline is the step's own."""
    if host.world_size == 1:
        return {host.rank: error} if error else {}
    from datetime import timedelta

    import torch.distributed as dist

    n = host._num_agreements
    host._num_agreements += 1
    keys = [f"agree/{n}/{r}" for r in range(host.world_size)]
    host.store.set(keys[host.rank], json.dumps(error))
    try:
        host.store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        pass  # the missing ranks are named below
    failed = {}
    for r, key in enumerate(keys):
        if not host.store.check([key]):
            failed[r] = f"rank {r} did not report within {timeout_s:g} s"
        elif (e := json.loads(host.store.get(key))) is not None:
            failed[r] = e
    return failed


def engine_start(host: EngineHost, ps, cmd: dict) -> dict:
    """Start the engines of `ranks` (dummy weights), wait until healthy; with `name`, push it to them."""
    ranks = cmd.get("ranks") or list(range(host.world_size))
    error = None
    if host.rank in ranks:
        try:
            host.engine.start()
            host.engine.wait_healthy()
        except RuntimeError as e:
            error = str(e)
    failed = _agree(host, error, host.start_agreement_timeout_s)
    if failed:
        why = f"engines of ranks {sorted(failed)} did not start"
        if cmd.get("heal") and error is None and host.rank in ranks:
            host.engine.abandon(f"heal abandoned: {why}")  # failed again: the healer retries (bounded)
        if host.rank in failed:
            raise RuntimeError(failed[host.rank])
        return {"engine": host.engine.record(), "update": f"skipped: {why}"}
    result = {"engine": host.engine.record()}
    if cmd.get("name"):
        result["update"] = managed_update(host, ps, cmd["name"], ranks, cmd.get("timeout_s"))
        result["engine"] = host.engine.record()
    return result


def managed_update(host: EngineHost, ps, name: str, ranks: list[int] | None, timeout_s: float | None) -> dict:
    """`ps.update(name)` into the managed engines of `ranks` (all by default): updating -> serving/incomplete.

    Every rank calls it. The receivers first agree that each of their engines can take an update, so
    a stopped engine refuses the update on all ranks instead of leaving the others in a collective."""
    from checkpoint_engine.api import http_req_func

    members = sorted(set(ranks)) if ranks else list(range(host.world_size))
    mine = host.rank in members
    refused = _agree(host, host.engine.update_refusal() if mine else None, host.AGREE_MARGIN_S)
    if refused:
        raise RuntimeError(
            refused.get(host.rank) or f"update refused: the engines of ranks {sorted(refused)} cannot take updates"
        )
    if mine:
        try:
            host.engine.begin_update(name)
        except RuntimeError:
            pass  # it died since the agreement: the update below fails on every rank through its engine
    timeout_s = float(timeout_s or host.config.update_timeout_s)
    req_func = (
        http_req_func(host.engine.url, rank=host.rank, ranks_per_engine=1, timeout_s=timeout_s)
        if mine
        else (lambda paths: None)
    )
    pull_ranks = None if len(members) == host.world_size else members
    try:
        metrics = ps.update(name, req_func, timeout=timeout_s, ranks=pull_ranks)
    except Exception as e:
        if mine:  # a ValueError is a request the PS refused before contacting any engine
            host.engine.end_update(name, f"{type(e).__name__}: {e}", engine_untouched=isinstance(e, ValueError))
        raise
    if mine:
        host.engine.end_update(name, None)
    return metrics.to_dict() if metrics is not None else {"skipped": "not a receiver"}


def engine_stop(host: EngineHost, cmd: dict) -> dict:
    ranks = cmd.get("ranks") or list(range(host.world_size))
    if host.rank in ranks:
        host.engine.stop()
    return {"engine": host.engine.record()}
