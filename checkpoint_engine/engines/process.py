"""One engine process and its lifecycle state (`ManagedEngine`): start with a free port and a log
file, wait until healthy, watch for its exit (`Watchdog`: a thread probing it every poll), stop
(SIGTERM, then SIGKILL of its process group).
Every state change goes through the table of `engine_states` and is published as a record.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

from checkpoint_engine.engines.config import EngineConfig, engine_env, render_cmd
from checkpoint_engine.engines.segment_ledger import SegmentLedger
from checkpoint_engine.engines.segment_ledger import sweep as sweep_segments
from checkpoint_engine.engines.states import SLEEP_LEVELS, SLEEPABLE, STARTABLE, UPDATABLE, check_transition
from checkpoint_engine.transport.load_rendezvous import PullHint, write_pull_hint
from ckpt_common.ports import free_port
from ckpt_common.procs import (
    die_with_parent,
    group_pids,
    group_shm_segments,
    terminate_noting_segments,
    wait_noting_segments,
)

logger = logging.getLogger(__name__)


class ManagedEngine:
    """One engine process and its state; every state change goes to `publish(record)`.

    Thread-safe: the command thread (start/update/stop) and the watchdog (`check_alive`) share a lock.
    """

    def __init__(
        self,
        rank: int,
        config: EngineConfig,
        *,
        device: str = "cpu",
        publish: Callable[[dict], None] | None = None,
        ranks: list[int] | None = None,
    ):
        self.rank, self.config, self.device = rank, config, device
        self.ranks = list(ranks) if ranks else [rank]  # the PS ranks whose devices it serves (its workers)
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
        self._rendezvous_dir: str | None = None  # private folder of the load-step socket ({rendezvous})
        # named shared memory its processes mapped once healthy, kept on disk too: if this daemon is
        # killed with its engine, the next start removes them (`segment_ledger.sweep`)
        self._ledger = SegmentLedger(f"engine-r{rank}", config.segment_ledger_dir)
        self.rendezvous: str | None = None  # where the running engine's load step listens
        # what its load step will pull (owners, tensors), left beside the rendezvous at start: an engine
        # that reads the owners itself connects and places the tensors while it starts (`PullHint`)
        self.load_hint = PullHint()
        self.sleep_level: int | None = None  # while sleeping: 1 (weights kept in host memory) or 2 (dropped)
        self._emit()

    # -- state ------------------------------------------------------------------------------
    def record(self) -> dict:
        with self._lock:
            return {
                "rank": self.rank,
                "ranks": self.ranks,
                "state": self.state,
                "checkpoint": self.checkpoint,
                "pid": self.pid,
                "url": self.published_url,
                "healthy": self.healthy,
                "restarts": self.restarts,
                "exit_code": self.exit_code,
                "last_error": self.last_error,
                "recovery_s": self.recovery_s,
                "last_failure": self.last_failure,
                "sleep_level": self.sleep_level,
                "since": self.since,
                "log_path": self.log_path,
            }

    @property
    def published_url(self) -> str | None:
        """The URL clients use (`url_host` when set); `self.url` is the daemon's own way in."""
        if self.url is None or self.config.url_host is None:
            return self.url
        host = f"[{self.config.url_host}]" if ":" in self.config.url_host else self.config.url_host
        return f"http://{host}:{self.url.rsplit(':', 1)[1]}"

    def _emit(self) -> None:
        self._publish(self.record())

    def _set(self, new: str, **fields) -> None:
        check_transition(self.state, new)
        if new != "sleeping":
            fields.setdefault("sleep_level", None)
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
        asleep_at = self.sleep_level if self.state == "sleeping" else None  # the healer puts it back to sleep
        self.last_failure = {"reason": reason, "exit_code": exit_code, "at": time.time(), "sleep_level": asleep_at}
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
            sweep_segments(self.config.segment_ledger_dir)  # what engines killed along with their daemon left
            port = free_port(self.config.host)
            self.rendezvous = self._new_rendezvous() if self.config.loads_from_ps else None
            if self.rendezvous is not None:
                write_pull_hint(self.rendezvous, self.load_hint)
            argv = render_cmd(
                self.config.cmd,
                port=port,
                rank=self.rank,
                device=self.device,
                rendezvous=self.rendezvous,
                p2p_host=self.config.p2p_host,
                ranks_per_engine=self.config.ranks_per_engine,
            )
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

    def _new_rendezvous(self) -> str:
        """A fresh ipc:// address in a folder only this user can reach (a stale socket of a killed run removed)."""
        if self._rendezvous_dir is None or not os.path.isdir(self._rendezvous_dir):
            self._rendezvous_dir = tempfile.mkdtemp(prefix=f"ckpt-load-r{self.rank}-")  # 0700
        path = os.path.join(self._rendezvous_dir, "load.sock")
        if os.path.exists(path):
            os.unlink(path)
        return f"ipc://{path}"

    def wait_load_step(self, timeout_s: float | None = None) -> None:
        """Wait until the starting engine listens in its load step ({rendezvous}); RuntimeError (state
        failed, process stopped) when it exits first or the deadline passes."""
        from checkpoint_engine.transport.load_rendezvous import LoaderRendezvousError, wait_for_loader

        timeout_s = self.config.start_timeout_s if timeout_s is None else timeout_s
        if self.rendezvous is None:
            raise RuntimeError(f"rank {self.rank}: the engine command has no {{rendezvous}}: it has no load step")
        try:
            wait_for_loader(self.rendezvous, timeout_s=timeout_s, is_alive=lambda: self.poll() is None)
        except LoaderRendezvousError as e:
            with self._lock:
                self._terminate()
                if self.state == "starting":
                    self._fail(f"engine did not reach its load step: {e}; {self._log_tail()}", self.poll())
            raise RuntimeError(f"rank {self.rank}: {self.last_error or e}") from None

    def begin_load(self, checkpoint: str) -> None:
        """starting -> updating: the PS updates the engine's load step (its first weights)."""
        with self._lock:
            if self.state != "starting" or self.rendezvous is None:
                raise RuntimeError(f"rank {self.rank}: the engine is {self.state}, not waiting in its load step")
            self._served_before = None
            self._set("updating")

    def wait_healthy(self, timeout_s: float | None = None, *, state: str = "starting") -> None:
        """Poll GET url + health_path until it answers 200 while the engine is in `state` (starting; or
        updating: the load step's weights are in and vLLM finishes its start); RuntimeError (state
        failed) when the process exits first or the deadline passes (the process is then stopped)."""
        from ckpt_common.httpjson import status_json

        timeout_s = self.config.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        url = f"{self.url}{self.config.health_path}"
        while True:
            with self._lock:
                if self.state != state:  # the watchdog noticed a death first
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
                        # what the engine's processes share by name: removed if they die without doing it
                        self._ledger.note(group_shm_segments(self._proc.pid) if self._proc is not None else set())
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
            # what it left in its process group (an inference server's engine processes) starts stopping
            # now; the next start() makes sure it is gone before a new engine takes the device
            self._ledger.note(group_shm_segments(self._proc.pid))
            _killpg(self._proc.pid, signal.SIGTERM)
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
            if self._rendezvous_dir is not None:
                shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
                self._rendezvous_dir = self.rendezvous = None
            if self.state != "stopped":
                self._set("stopped", pid=None, healthy=False, checkpoint=None)

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        grace_s = self.config.stop_grace_s

        def running() -> list[int]:
            proc.poll()  # reaps the engine once it exits
            return group_pids(proc.pid)

        # noted until the group has ended: a stop during the start comes before wait_healthy() noted any
        exited, noted = terminate_noting_segments(proc, running, grace_s)
        self._ledger.note(noted)
        if not exited:
            logger.warning("rank %d: engine %d ignored SIGTERM for %.1f s: SIGKILL", self.rank, proc.pid, grace_s)
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace_s)
        # children the engine left in its process group (e.g. a launcher's servers): TERM, then KILL
        if _killpg(proc.pid, signal.SIGTERM):
            # until the group is gone, zombies included (their parents still exiting)
            _, noted = wait_noting_segments(running, grace_s, done=lambda: not _killpg(proc.pid, 0))
            self._ledger.note(noted)
            _killpg(proc.pid, signal.SIGKILL)
        removed = self._ledger.unlink()  # a killed engine's (vLLM's message queues)
        if removed:
            logger.info("rank %d: removed %d shared-memory segments the engine left", self.rank, len(removed))

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

    # -- sleep (vLLM's sleep mode: CUDA) ---------------------------------------------------------
    SLEEP_PATH, WAKE_PATH = "/sleep", "/wake_up"  # vLLM's routes (VLLM_SERVER_DEV_MODE, --enable-sleep-mode)

    def sleep(self, level: int, timeout_s: float) -> None:
        """serving -> sleeping: POST /sleep?level=N. Level 1 moves the weights to host memory and drops the
        KV cache; level 2 drops both (the next wake needs an update). RuntimeError naming the engine's
        answer when it refuses (vLLM on CUDA without --enable-sleep-mode); it then keeps serving."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
        with self._lock:
            if self.state not in SLEEPABLE:
                raise RuntimeError(f"rank {self.rank}: the engine is {self.state}; only a serving engine can sleep")
            url = f"{self.url}{self.SLEEP_PATH}?level={level}"
        self._post(
            url,
            timeout_s,
            "the engine refused to sleep ({answer}); vLLM sleeps only on CUDA, started with --enable-sleep-mode",
        )
        with self._lock:
            if self.state == "serving":  # else the watchdog marked it failed meanwhile
                self._set("sleeping", sleep_level=level, checkpoint=self.checkpoint if level == 1 else None)

    def wake(self, timeout_s: float, *, weights_only: bool = False) -> None:
        """sleeping -> serving (level 1: its weights are back) or incomplete (level 2: no weights until an
        update): POST /wake_up. `weights_only` (level 2): POST /wake_up?tags=weights, so the update can
        write its weights while the KV cache still sleeps and nothing is generated; `finish_wake()` after it."""
        with self._lock:
            if self.state != "sleeping":
                raise RuntimeError(f"rank {self.rank}: the engine is {self.state}, not sleeping")
            level = self.sleep_level
        if weights_only and level != 2:
            raise ValueError(f"rank {self.rank}: a weights-only wake is for a level-2 sleep, not level {level}")
        self._post_wake(timeout_s, "?tags=weights" if weights_only else "")
        with self._lock:
            if self.state == "sleeping":  # else the watchdog marked it failed meanwhile
                if level == 1:
                    self._set("serving", last_error=None)
                else:
                    self._set("incomplete", checkpoint=None, last_error="woke from a level-2 sleep: no weights yet")

    def finish_wake(self, timeout_s: float) -> None:
        """The rest of a weights-only wake: POST /wake_up?tags=kv_cache (the state is the update's)."""
        self._post_wake(timeout_s, "?tags=kv_cache")

    def _post_wake(self, timeout_s: float, query: str) -> None:
        self._post(f"{self.url}{self.WAKE_PATH}{query}", timeout_s, "the engine did not wake ({answer})")

    def _post(self, url: str, timeout_s: float, refused: str) -> None:
        """POST to the engine; RuntimeError unless it answers 200 (`refused` formats {answer})."""
        from ckpt_common.httpjson import status_json

        try:
            status, answer = status_json("POST", url, timeout_s=timeout_s)
        except OSError as e:
            raise RuntimeError(f"rank {self.rank}: POST {url} failed: {e}") from None
        if status != 200:
            raise RuntimeError(f"rank {self.rank}: " + refused.format(answer=f"POST {url} answered {status}: {answer}"))

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


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a process group; False when it has no member left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by someone else's process
        return False
