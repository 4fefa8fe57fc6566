"""Fast startup: vLLM starts while the parameter server loads the checkpoint; vLLM's load step takes it from the PS.

    python -m vllm_ext.launch --model DIR [--port 8000] [--gate-wait-s 60] [-- <vllm serve args>]

    t=0 ─┬─ gate (public port): answers 503 (or holds requests) until the weights are in
         ├─ vllm serve DIR --load-format checkpoint_engine --worker-extension-cls ... (127.0.0.1, internal port)
         └─ parameter server: register DIR/*.safetensors in host memory, gather metas
    vLLM reaches its load step + checkpoint registered ─▶ ps.update(...) into the load step
    (vllm_ext.loader) ─▶ vLLM packs, compiles, becomes healthy ─▶ gate opens

`--initial-mode push` starts vLLM with dummy weights instead and pushes once it is healthy (any
vLLM, no loader registration; slower: dummy initialisation and a second packing on the path).

Later updates go through the same public port, by either route (both proxied): vLLM's own weight-transfer
routes (/pause, /start_weight_update, /update_weights, /finish_weight_update, /resume; vLLM runs with
`--weight-transfer-config '{"backend": "checkpoint_engine"}'` unless --no-weight-transfer, and GET
/launcher/status says "update_route": "native") or the worker extension's `POST /collective_rpc`. With
`--no-initial-push` the launcher only gates: the gate opens when an external parameter server
(e.g. the trainer's) completes the first update. With `--load-rendezvous ADDR` vLLM's load step
waits at ADDR for an external parameter server (the checkpoint-engine daemon's `{rendezvous}`), so
a managed engine also starts without dummy weights and packs its weights once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from checkpoint_engine.engines.segment_ledger import SegmentLedger
from checkpoint_engine.engines.segment_ledger import sweep as sweep_segments
from ckpt_common.cli_config import ConfigArgs, add_config_args
from ckpt_common.logs import add_log_level_flag
from ckpt_common.ports import free_port
from ckpt_common.procs import (
    descendants,
    die_with_parent,
    end_processes,
    live_pids,
    shm_segments,
    terminate_noting_segments,
)

# the settings and command assembly live in launch_config; importers may keep using vllm_ext.launch
from vllm_ext.launch_config import EXTENSION as EXTENSION
from vllm_ext.launch_config import RESERVED_VLLM_FLAGS as RESERVED_VLLM_FLAGS
from vllm_ext.launch_config import LaunchConfig, lower_thread_priority, model_safetensors_files, vllm_command, vllm_env
from vllm_ext.launch_config import engine_settings as engine_settings
from vllm_ext.launch_config import tensor_parallel_size as tensor_parallel_size

logger = logging.getLogger(__name__)
GATE_STOP_S = 6.0  # close(): how long the gate's server may take to end (its open streams cut at half)
STOP_DURING_START_GRACE_S = 5.0  # close() before vLLM serves: SIGKILL to its API server after this


class Launcher:
    """Owns the vLLM process, the gate server and (until the first push) the parameter server."""

    def __init__(self, cfg: LaunchConfig):
        from vllm_ext.gate import Gate
        from vllm_ext.launch_config import with_installed_vllm

        self.cfg = cfg = with_installed_vllm(cfg)
        self.engine_port = cfg.engine_port or free_port()
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.gate = Gate()
        self.proc: subprocess.Popen | None = None
        self._server = None
        self._gate_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ps = None
        self._ps_lock = threading.Lock()
        self._ps_error: BaseException | None = None
        self._supervising = False
        self._closing = False  # close() began: a signal no longer unwinds
        self._rendezvous_dir: str | None = None
        self.rendezvous: str | None = None
        self._load_metrics: dict | None = None
        self._load_report: dict = {}  # the engine's report at the end of its load step
        self._load_error: BaseException | None = None
        self._engine_tree: dict[int, float] = {}  # vLLM's processes seen so far ({pid: create_time})
        # the shared memory vLLM mapped once healthy (removed at close), kept on disk too: for the next
        # start after a SIGKILL of us all (`segment_ledger.sweep`)
        self._ledger = SegmentLedger("launcher")

    # -- pieces ---------------------------------------------------------------------------
    def start_gate(self) -> None:
        import uvicorn

        from vllm_ext.gate import make_app

        app = make_app(
            self.gate,
            self.engine_url,
            wait_s=self.cfg.gate_wait_s,
            remote_serving_only=self.cfg.gate_remote_routes == "serving",
            status_extra={
                "update_route": self.cfg.update_route,
                "tensor_parallel_size": tensor_parallel_size(self.cfg.vllm_args),
            },
        )
        config = uvicorn.Config(
            app,
            host=self.cfg.host,
            port=self.cfg.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=GATE_STOP_S / 2,  # streams still open at close are cut after this
        )
        self._server = uvicorn.Server(config)
        self._gate_thread = threading.Thread(target=self._server.run, daemon=True, name="gate")
        self._gate_thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gate could not listen on {self.cfg.host}:{self.cfg.port} within 30 s")
            time.sleep(0.02)
        logger.info("gate listening on http://%s:%d (engine on %s)", self.cfg.host, self.cfg.port, self.engine_url)

    def start_engine(self) -> None:
        env = vllm_env(self.cfg, dict(os.environ))
        if self.cfg.load_rendezvous is not None:
            self.rendezvous = self.cfg.load_rendezvous
        elif self.cfg.initial_push and self.cfg.initial_mode == "load":
            import tempfile

            self._rendezvous_dir = tempfile.mkdtemp(prefix="ckpt-engine-")  # 0700: only this user reaches it
            self.rendezvous = f"ipc://{self._rendezvous_dir}/load.sock"
        cmd = vllm_command(self.cfg, self.engine_port, self.rendezvous)
        sweep_segments()  # what engines killed along with their launcher or daemon left
        logger.info("starting: %s", " ".join(cmd))
        # vLLM stays in this launcher's process group: whoever stops the group (the daemon, a Ctrl-C)
        # reaches vLLM's engine core and workers too, even after this launcher was SIGKILLed. If the
        # launcher alone dies, vLLM gets SIGTERM (PDEATHSIG).
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        threading.Thread(target=self._record_engine_tree, daemon=True, name="engine-tree").start()

    def _record_engine_tree(self, interval_s: float = 1.0) -> None:
        """Thread: note vLLM's processes while it runs, so close() can end the ones its front end leaves."""
        proc = self.proc
        while proc.poll() is None:
            self._engine_tree.update(descendants(proc.pid))
            time.sleep(interval_s)

    def register_checkpoint(self) -> None:
        """Runs in a thread while vLLM starts, at low CPU priority (it has a minute; vLLM is the long pole)."""
        lower_thread_priority(self.cfg.register_nice)
        try:
            from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
            from checkpoint_engine.ps import ParameterServer

            t0 = time.perf_counter()
            update = UpdateConfig(
                bucket_size_bytes=self.cfg.bucket_size_bytes,
                req_func_timeout_s=self.cfg.push_timeout_s,
                engine_timeout_s=self.cfg.push_timeout_s,
            )
            ps = ParameterServer(
                rank=0, world_size=1, config=ParameterServerConfig(transport=self.cfg.transport, update=update)
            )
            ps.register_checkpoint(self.cfg.name, files=model_safetensors_files(self.cfg.model))
            ps.gather_metas(self.cfg.name)
            self._ps = ps
            logger.info("checkpoint %r registered in %.2f s", self.cfg.name, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - re-raised by push()
            self._ps_error = e

    def push(self, registering: threading.Thread) -> dict:
        from vllm_ext.weight_transfer.native_req import engine_req_func

        registering.join(self.cfg.push_timeout_s)
        if registering.is_alive():
            raise TimeoutError(f"registering the checkpoint took more than {self.cfg.push_timeout_s:.0f} s")
        if self._ps_error is not None:
            raise RuntimeError(f"registering {self.cfg.model} failed: {self._ps_error}") from self._ps_error
        self.gate.set_phase("pushing_weights", f"pushing checkpoint {self.cfg.name!r} into the engine")
        req = engine_req_func(
            self.engine_url,
            route=self.cfg.update_route,
            rank=0,
            timeout_s=self.cfg.push_timeout_s,
            weight_version=self.cfg.name,
        )
        return self._ps.update(self.cfg.name, req).to_dict()

    def load_into_engine(self, registering: threading.Thread) -> None:
        """Thread: once registered, wait for vLLM's load step and update the engine through it."""
        from checkpoint_engine.transport.load_rendezvous import loader_req_func, wait_for_loader

        try:
            registering.join(self.cfg.startup_timeout_s)
            if registering.is_alive():
                raise TimeoutError(f"registering the checkpoint took more than {self.cfg.startup_timeout_s:.0f} s")
            if self._ps_error is not None:
                raise RuntimeError(f"registering {self.cfg.model} failed: {self._ps_error}") from self._ps_error
            alive = lambda: self.proc is not None and self.proc.poll() is None
            wait_for_loader(self.rendezvous, timeout_s=self.cfg.startup_timeout_s, is_alive=alive)
            self.gate.set_phase("loading_weights", f"vLLM's load step receives checkpoint {self.cfg.name!r}")
            engine: dict = {}
            metrics = self._ps.update(
                self.cfg.name,
                loader_req_func(self.rendezvous, timeout_s=self.cfg.push_timeout_s, is_alive=alive, result=engine),
            ).to_dict()
            self._load_report = engine
            self._load_metrics = {
                **metrics,
                "engine_version": engine.get("version"),
                "engine_side": engine.get("last_update"),
            }
            # vLLM copied the weights into its own parameters: give the host copy back now, before vLLM
            # allocates its KV cache (on a VM that backs memory lazily, fresh pages cost ~4x to touch).
            self.release_ps()
            self.gate.set_phase("finishing_engine_start", "weights loaded; vLLM finishes its start (compile, KV cache)")
        except BaseException as e:  # noqa: BLE001 - re-raised by run()
            self._load_error = e

    def release_ps(self) -> None:
        """The host copy is not needed once the engine holds the weights (idempotent, any thread)."""
        with self._ps_lock:
            ps, self._ps = self._ps, None
        if ps is not None:
            ps.close()

    def refresh_gate(self) -> bool:
        """Record the workers' weight reports at the gate (which opens on loaded weights); True when they
        show loaded weights (also when the gate was open already)."""
        from vllm_ext.extension_req import collective_rpc
        from vllm_ext.gate import weights_loaded

        reports = collective_rpc(self.engine_url, "weights_state", timeout_s=30.0)
        self.gate.observe(reports)
        return weights_loaded(reports)

    # -- lifecycle ------------------------------------------------------------------------
    def run(self) -> int:
        from vllm_ext.extension_req import wait_until_healthy

        self.start_engine()  # first: vLLM's start is the long pole
        registering = threading.Thread(target=self.register_checkpoint, daemon=True, name="register")
        loading = threading.Thread(target=self.load_into_engine, args=(registering,), daemon=True, name="load")
        if self.cfg.own_ps:
            registering.start()
            if self.rendezvous is not None:
                loading.start()
        # The gate starts now, at normal priority, while vLLM starts in its own processes (~0.3 s of
        # imports). At idle priority, on the core vLLM's start keeps busy, it ran in the first idle
        # gaps instead: the load step's pull (the engine waiting on its reads), which it then slowed.
        self.start_gate()
        if self.cfg.load_rendezvous is not None:
            return self._run_external_load()
        if self.rendezvous is not None:  # vLLM answers nothing before its load step: no health polls until then
            bound_s = 2 * self.cfg.startup_timeout_s + self.cfg.push_timeout_s  # the load thread's own deadlines
            loading.join(bound_s)
            if loading.is_alive():
                raise TimeoutError(f"vLLM's load step did not end within {bound_s:.0f} s")
            if self._load_error is not None:
                raise RuntimeError(f"loading the weights into vLLM failed: {self._load_error}") from self._load_error
        waited_s = wait_until_healthy(
            self.engine_url,
            timeout_s=self.cfg.startup_timeout_s,
            is_alive=lambda: self.proc.poll() is None,
            interval_s=0.02 if self.rendezvous is not None else 0.1,
        )
        logger.info("engine healthy after %.1f s", waited_s)
        if self.rendezvous is not None:
            # The load step's own report (version 1) opens the gate at once; the workers' report then
            # confirms it (an engine that disagrees is stopped: the launcher exits non-zero).
            self.gate.observe([self._load_report])
            if not self.refresh_gate():
                raise RuntimeError(f"vLLM loaded the weights but reports {self.gate.snapshot()['weights']}")
            logger.info("weights loaded in vLLM's load step: %s", json.dumps(self._load_metrics))
        elif self.cfg.initial_push:
            metrics = self.push(registering)
            if not self.refresh_gate():
                raise RuntimeError(f"the push completed but the engine reports {self.gate.snapshot()['weights']}")
            self.release_ps()  # after the gate opened: freeing host memory is not on the critical path
            logger.info("weights pushed: %s", json.dumps(metrics))
        else:
            self.gate.set_phase("waiting_for_weights", "waiting for an external parameter server to push weights")
        return self._supervise()

    def _run_external_load(self) -> int:
        """vLLM waits in its load step for an external PS; the gate opens once vLLM is healthy and its
        workers report the loaded weights."""
        from vllm_ext.extension_req import wait_until_healthy

        self.gate.set_phase(
            "waiting_for_weights", f"vLLM's load step waits for a parameter server at {self.cfg.load_rendezvous}"
        )
        # the load step waits up to startup_timeout_s for the PS, then vLLM finishes its start
        waited_s = wait_until_healthy(
            self.engine_url,
            timeout_s=2 * self.cfg.startup_timeout_s,
            is_alive=lambda: self.proc.poll() is None,
            interval_s=0.05,
        )
        if not self.refresh_gate():
            raise RuntimeError(f"vLLM is healthy but reports {self.gate.snapshot()['weights']}")
        logger.info("engine healthy with the loaded weights after %.1f s", waited_s)
        return self._supervise()

    def _supervise(self) -> int:
        """Wait for vLLM to exit or for a stop signal; poll the gate while it is closed or refuses
        generation after a failed update (an update that did not pass through it: the next one's
        reports let it serve again)."""
        self._supervising = True
        self._ledger.note(shm_segments([self.proc.pid, *descendants(self.proc.pid)]))
        while not self._stop.is_set():
            code = self.proc.poll()
            if code is not None:
                logger.error("vLLM exited with code %s", code)
                return code or 1
            # closed, refusing after a failed update, or an update passed whose outcome no report showed yet
            if not self.gate.is_open or self.gate.refusal is not None or self.gate.outcome_due:
                try:
                    self.refresh_gate()
                except Exception as e:  # noqa: BLE001 - the engine may be busy receiving; retry
                    logger.debug("weights_state poll failed: %s", e)
            self._stop.wait(2.0)
        return 0

    def stop(self, signum: int, _frame=None) -> None:
        """Signal handler: end supervision; during start-up, unwind at once (close() stops vLLM).
        Only the first signal unwinds: a second one (a supervisor that repeats its SIGTERM, a Ctrl-C
        after it) must not break off close() while it stops vLLM and notes its shared memory."""
        first = not self._stop.is_set()
        self._stop.set()
        if first and not self._supervising and not self._closing:
            raise SystemExit(128 + signum)
        if not first:
            logger.info("signal %d while stopping: already stopping", signum)

    def close(self, grace_s: float = 30.0) -> None:
        """Stop vLLM: SIGTERM, SIGKILL after `grace_s`; then end its engine processes still alive."""
        self._closing = True
        if self.proc is not None:
            proc = self.proc

            def running() -> list[int]:
                if proc.poll() is not None:
                    return live_pids(self._engine_tree)
                self._engine_tree.update(descendants(proc.pid))
                return [proc.pid, *live_pids(self._engine_tree)]

            if not self._supervising and proc.poll() is None:
                # stopped during vLLM's start: its API server sits out SIGTERM until it serves (the
                # whole grace, measured), and nothing of a start is worth a graceful stop. Its engine
                # processes get the signal at once too (they stop in a second or two), and the API
                # server is killed after a short grace; the ledger removes what it leaves in /dev/shm.
                self._ledger.note(shm_segments(running()))
                for pid in live_pids(self._engine_tree):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                grace_s = min(grace_s, STOP_DURING_START_GRACE_S)
            # noted until vLLM has exited as well: a stop during its start comes before _supervise() noted any
            exited, noted = terminate_noting_segments(proc, running, grace_s)
            self._ledger.note(noted)
            if not exited:
                proc.kill()
                proc.wait(10)
            left = end_processes(self._engine_tree, grace_s=10.0)
            if left:
                logger.warning("vLLM left %d process(es) running; ended: %s", len(left), ", ".join(left))
            removed = self._ledger.unlink()  # what a killed vLLM process could not remove
            if removed:
                logger.info("removed %d shared-memory segment(s) vLLM left: %s", len(removed), ", ".join(removed))
        if self._server is not None:
            self._server.should_exit = True
        if self._gate_thread is not None:
            # the gate's loop ends before the interpreter does: a thread still running during the
            # interpreter's shutdown can crash it, and the launcher would exit on SIGSEGV, not 0
            self._gate_thread.join(GATE_STOP_S)
        self.release_ps()
        if self._rendezvous_dir is not None:
            import shutil

            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


def _parser() -> tuple[argparse.ArgumentParser, ConfigArgs]:
    """The command line: LaunchConfig's fields as flags (defaults and help from the dataclass), plus
    --log-level and the `vllm serve` arguments after `--`."""
    p = argparse.ArgumentParser(
        prog="python -m vllm_ext.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    spec = add_config_args(p, LaunchConfig, exclude=("vllm_args",))
    add_log_level_flag(p)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after `--`: arguments for `vllm serve`")
    return p, spec


def build_parser() -> argparse.ArgumentParser:
    return _parser()[0]


def main(argv: list[str] | None = None) -> int:
    parser, spec = _parser()
    args = parser.parse_args(argv)
    vllm_args = tuple(args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args)
    cfg = spec.build(args, parser, vllm_args=vllm_args)  # a bad value: exit 2 naming the flag
    from ckpt_common.logs import setup_logging

    setup_logging(args.log_level)
    launcher = Launcher(cfg)
    signal.signal(signal.SIGTERM, launcher.stop)
    signal.signal(signal.SIGINT, launcher.stop)
    try:
        return launcher.run()
    except Exception as e:  # noqa: BLE001 - a clear one-line reason for the operator, then exit non-zero
        logger.error("launch failed: %s: %s", type(e).__name__, e)
        return 1
    finally:
        launcher.close()


if __name__ == "__main__":
    sys.exit(main())
