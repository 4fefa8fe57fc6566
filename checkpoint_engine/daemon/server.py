"""The checkpoint-engine daemon: every torchrun rank runs a ParameterServer; rank 0 also serves an
HTTP API (127.0.0.1 or a unix socket by default; beyond loopback only with a bearer token) and relays
each command to all ranks. docs/daemon.md: every route, status code, the token and the metrics.

    HTTP client ──POST /checkpoints, /update, ...──▶ rank 0 aiohttp handler (never blocks the loop)
                                                       │ asyncio future, executor thread
                                                       ▼
                            command n ──TCPStore key cmd/n──▶ every rank: run on its ParameterServer
                            result    ◀──key res/n/<rank>─── (JSON; rank 0 gathers with a deadline)

Commands are JSON (never pickle). A command failing on any rank is reported with every rank's error.

Beside its own routes, rank 0 serves MoonshotAI checkpoint-engine's HTTP API (`compat_routes`) on the
same commands: one server for the whole job (their daemon ran one per rank), so each of those
routes is called once and acts on every rank; `files` are split across ranks as `POST /checkpoints`
does. Their answers: 200 with an empty body, 500 with the error text (a JSON string), 422 naming the
field of a bad request.

Managed engines (`--engine-cmd`, see checkpoint_engine/engines/host.py): each rank runs the one engine process of its
device. `POST /engines/start`, `POST /engines/stop` and `POST /update` without engine URLs are
relayed commands like the others; `GET /engines` reads every rank's engine record from the process
group's store (no command: it answers during a long update). With `--auto-heal`, a `Healer` thread
on rank 0 notices a failed engine there and relays a restart + `update(current, ranks=[its rank])`.

The rooms of the package (checkpoint_engine/daemon/):

    relay          Relay (commands and results through the store), EngineBoard (engine records)
    commands       CommandError, validate, phases, check/apply/undo/run, run_command (every rank), serve_rank
    driver         Driver: rank 0 runs each command's phases on every rank, one command at a time
    http           middlewares (the token, 503 while stopping, 500 on a fault), parse_json, read_body
    routes         make_app (our routes and their status codes, the /v1 ones mounted beside them)
    compat_routes  compat_routes (MoonshotAI's /v1 routes)
    prometheus     DaemonMetrics (GET /metrics, Prometheus text), ObservedDriver (commands counted)
    server         serve_http (rank 0's server, its healer, the shutdown); names are imported from the
                   module that defines them
"""

from __future__ import annotations

import asyncio
import logging

from checkpoint_engine.daemon.driver import Driver
from checkpoint_engine.daemon.heal import Healer
from checkpoint_engine.daemon.prometheus import DaemonMetrics, ObservedDriver
from checkpoint_engine.daemon.routes import make_app

logger = logging.getLogger(__name__)


def _clear_stale_socket(path: str) -> None:
    """Remove a unix socket file left by a dead server; refuse to take over a live one."""
    import os
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise RuntimeError(f"--uds {path} exists and is not a socket")
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:  # nobody listens: a leftover
            os.unlink(path)
            return
    raise RuntimeError(f"--uds {path}: another server is listening there")


async def serve_http(
    driver: Driver,
    host: str,
    port: int,
    uds: str | None,
    stop_timeout_s: float,
    *,
    token: str | None = None,
    ssl_context=None,
) -> None:
    """Rank 0's HTTP server until SIGTERM/SIGINT or POST /shutdown (from then on every route but the
    health checks answers 503); the shutdown (engines stopped, the other ranks told to exit) then has
    `stop_timeout_s`, after which the process dumps its stacks and exits 128 + signum. `token`: the
    bearer token every route but the health checks requires (`__main__` reads it; None: none);
    `ssl_context`: serve HTTPS (`DaemonConfig.ssl_context`)."""
    from aiohttp import web

    from ckpt_common.procs import force_exit_after

    stop = asyncio.Event()
    metrics = DaemonMetrics(driver.ps.world_size)
    runner = web.AppRunner(make_app(driver, stop, token=token, metrics=metrics))
    await runner.setup()
    if uds:
        _clear_stale_socket(uds)
    site = web.UnixSite(runner, uds) if uds else web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    where = uds or f"{'https' if ssl_context is not None else 'http'}://{host}:{port}"
    logger.info(
        "checkpoint-engine daemon serving on %s (world size %d; bearer token %s)",
        where,
        driver.ps.world_size,
        "required" if token is not None else "not required",
    )
    print(f"checkpoint-engine daemon ready on {where}", flush=True)
    loop = asyncio.get_running_loop()
    import signal

    def on_signal(signum: int) -> None:
        if not stop.is_set():
            force_exit_after(stop_timeout_s, signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    healer = None
    if driver.host is not None and driver.host.config.auto_heal:
        cfg = driver.host.config
        healer = Healer(ObservedDriver(driver, metrics), cfg.poll_interval_s, cfg.max_heal_attempts)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        if healer is not None:
            healer.stop()  # no new heals; one in progress finishes first (bounded by its own deadlines)
        # exit stops every engine; then the healer thread ends (a rank-0 engine it restarted has
        # PR_SET_PDEATHSIG on that thread: stopping it first keeps that engine from dying unasked)
        # half the stop deadline: a rank that a signal already ended (torchrun signals every rank) never answers
        await loop.run_in_executor(None, driver.run, {"op": "exit"}, stop_timeout_s / 2)
        if healer is not None:
            await loop.run_in_executor(None, healer.close, driver.host.config.start_timeout_s)
        if uds:
            import contextlib
            import os

            with contextlib.suppress(FileNotFoundError):
                os.unlink(uds)
