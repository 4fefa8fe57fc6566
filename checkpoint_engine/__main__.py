"""`torchrun --nproc-per-node N -m checkpoint_engine`: the weight-sync daemon (see daemon/server.py).

Rank 0 serves the HTTP API; every rank holds its shard of each registered checkpoint.
  POST /checkpoints  {"name", "files": [...]}    register (files are split across ranks) + gather metas
  POST /update       {"name", "endpoints": URL | [URL per engine], "ranks_per_engine": 1, "timeout_s",
                      "ranks": null | [receiver ranks] (P2P through Mooncake; needs --p2p-host)}
  GET  /metas/NAME, POST /metas                  export / import global metas (JSON) for P2P recovery
  GET  /checkpoints                              what is registered, the last update's metrics
  DELETE /checkpoints/NAME, GET /health, POST /shutdown
  GET  /metrics                                  Prometheus text: updates, bytes, stage seconds, engines, heals
Bound beyond loopback (--host other than 127.0.0.1/::1/localhost, no --uds) every route but /health and
/v1/healthz needs "Authorization: Bearer TOKEN"; the token comes from --token-file PATH or the
environment variable CKPT_ENGINE_TOKEN (enforced on loopback too when given). Status codes: 400 bad
request, 401 token, 404 unknown checkpoint, 409 conflict or busy, 500 fault, 503 stopping (docs/daemon.md).
Managed engines (--engine-cmd 'python -m ENGINE ... --port {port}'; {rank} {device} {rendezvous} {p2p_host}
also filled in):
  POST /engines/start {"ranks": null | [...], "name": null | NAME}  start (dummy weights), then push NAME
                                                 (default: the current checkpoint) before reporting serving
  POST /engines/stop  {"ranks": null | [...]}     SIGTERM, SIGKILL after a grace period
  POST /engines/sleep {"ranks", "level": 1 | 2}   vLLM's sleep mode (CUDA, --enable-sleep-mode): serving -> sleeping
  POST /engines/wake  {"ranks", "name"?}          sleeping -> serving; level-2 sleepers (no weights) take NAME
  GET  /engines                                  every rank's engine: state, checkpoint, pid, url, restarts
  POST /update {"name", "ranks"?}                without "endpoints": the managed engines
  --auto-heal (default): a dead engine is restarted and pulls the current checkpoint (update ranks=[r])
MoonshotAI checkpoint-engine's routes (200 + empty body, 500 + error text), each acting on every rank:
  POST /v1/checkpoints/NAME/files {"files": [...]}  register (files split across ranks), no gather
  POST /v1/checkpoints/NAME/gather-metas           gather metas
  POST /v1/checkpoints/NAME/update {"ranks": [], "update_url": URL | null, "inference_group_ranks": [],
                                    "timeout": 300.0, "uds": PATH | null}
  DELETE /v1/checkpoints/NAME, GET /v1/healthz
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    from checkpoint_engine.types import REQUESTED_MODES

    p = argparse.ArgumentParser(
        prog="python -m checkpoint_engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="HTTP bind address (default: loopback only; any other address needs a bearer token)",
    )
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--uds", default=None, help="serve on this unix socket instead of TCP")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help=f"a file holding the bearer token clients must send (Authorization: Bearer TOKEN) on every route "
        f"but the health checks; else the environment variable {TOKEN_ENV}. Required when --host is not a "
        "loopback address",
    )
    p.add_argument("--transport", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--bucket-size-mib", type=int, default=None)
    p.add_argument("--mode", choices=REQUESTED_MODES, default="auto")
    p.add_argument("--collective-timeout-s", type=float, default=300.0)
    p.add_argument("--metrics-jsonl", default=None, help="append one JSON line per update (per rank)")
    p.add_argument("--progress", action="store_true", help="progress bar on rank 0 during updates")
    p.add_argument(
        "--metadata-url", default=None, help="etcd://host:port/prefix for global metadata (default: in-process)"
    )
    p.add_argument("--p2p-host", default=None, help="start Mooncake's transfer engine on this address (P2P)")
    p.add_argument("--p2p-protocol", choices=["tcp", "rdma"], default="tcp")
    p.add_argument("--p2p-device", default="", help="RDMA device names for Mooncake (rdma protocol)")
    p.add_argument(
        "--p2p-cpus",
        default=None,
        help="the CPUs the rank's transfer-engine threads run on: one list for every rank ('0-3') or one "
        "per local rank separated by ';' ('0-3;4-7'); default: those the rank may run on. Keeps the "
        "threads that serve the owners' reads off the cores of the engines generating meanwhile",
    )
    p.add_argument(
        "--p2p-reader",
        choices=["rank", "engine"],
        default="rank",
        help="who reads a P2P pull: the PS rank (into its shared buffer) or the engine (into its parameters; CPU)",
    )
    p.add_argument(
        "--engine-cmd",
        default=None,
        help="the engine each rank manages: a JSON list or a shell-style string with {port} (and {rank}, "
        "{device}, {rendezvous}: the address of its load step, {p2p_host}: this daemon's --p2p-host), e.g. "
        "'python -m checkpoint_engine.engines.plain --port {port}'",
    )
    p.add_argument(
        "--auto-heal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a dead managed engine and bring it to the current checkpoint",
    )
    p.add_argument(
        "--engine-url-host",
        default=None,
        help="host or IP in the engine URLs the daemon publishes (GET /engines, etcd), for rollout clients on "
        "other hosts, e.g. the pod IP; the engine command must listen there too (e.g. --host 0.0.0.0). "
        "Default: 127.0.0.1",
    )
    p.add_argument("--engine-health-path", default="/health", help="GET path answering 200 once an engine is up")
    p.add_argument("--engine-start-timeout-s", type=float, default=300.0, help="engine start -> healthy deadline")
    p.add_argument("--engine-log-dir", default=None, help="engine logs (default: a temporary folder per rank)")
    p.add_argument(
        "--stop-timeout-s",
        type=float,
        default=20.0,
        help="SIGTERM/SIGINT -> exit deadline (engines stopped, other ranks told); past it a rank writes its "
        "threads' stacks to stderr and exits 128+signal (default 20, under torchrun's 30 s before SIGKILL)",
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.stop_timeout_s <= 0:
        p.error(f"--stop-timeout-s must be > 0, got {args.stop_timeout_s}")
    try:
        args.token = load_token(args.token_file, os.environ)
    except ValueError as e:
        p.error(str(e))
    from ckpt_common.ports import is_loopback

    if args.token is None and not args.uds and not is_loopback(args.host):
        p.error(
            f"--host {args.host} is not a loopback address: the daemon needs a bearer token there; give "
            f"--token-file PATH or set {TOKEN_ENV} (or bind 127.0.0.1, or serve on --uds PATH)"
        )
    args.p2p_cpu_list = None
    if args.p2p_cpus is not None:
        from checkpoint_engine.transport.mooncake import rank_cpus

        if not args.p2p_host:
            p.error("--p2p-cpus places the transfer engine's threads: it needs --p2p-host")
        try:  # torchrun sets these; checked here so that a bad list fails before any rank starts work
            args.p2p_cpu_list = rank_cpus(
                args.p2p_cpus, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            )
        except ValueError as e:
            p.error(f"--p2p-cpus: {e}")
    if args.engine_cmd is not None:
        from checkpoint_engine.engines.config import EngineConfig, parse_engine_cmd

        try:
            args.engine_config = EngineConfig(
                cmd=parse_engine_cmd(args.engine_cmd),
                health_path=args.engine_health_path,
                url_host=args.engine_url_host,
                start_timeout_s=args.engine_start_timeout_s,
                auto_heal=args.auto_heal,
                log_dir=args.engine_log_dir,
                update_timeout_s=args.collective_timeout_s,
                p2p_host=args.p2p_host,
            )
        except ValueError as e:
            p.error(str(e))
    else:
        args.engine_config = None
    return args


TOKEN_ENV = "CKPT_ENGINE_TOKEN"


def load_token(token_file: str | None, environ) -> str | None:
    """The bearer token: the first line of `token_file`, else `environ[TOKEN_ENV]`, else None.

    Surrounding whitespace (a Secret's trailing newline) is dropped; ValueError for a file that
    cannot be read, an empty token, or one with characters an HTTP header cannot carry."""
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token, where = f.read().strip(), f"--token-file {token_file}"
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--token-file {token_file}: cannot read it: {type(e).__name__}: {e}") from None
    elif environ.get(TOKEN_ENV) is not None:
        token, where = environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    else:
        return None
    if not token:
        raise ValueError(f"{where}: the bearer token is empty")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(f"{where}: the bearer token must be printable ASCII without spaces")
    return token


def main(argv=None) -> int:
    args = parse_args(argv)
    import asyncio
    import logging
    import threading

    import torch.distributed as dist

    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.daemon.commands import serve_rank
    from checkpoint_engine.daemon.driver import Driver
    from checkpoint_engine.daemon.relay import EngineBoard, Relay
    from checkpoint_engine.daemon.server import serve_http
    from checkpoint_engine.engines import host as engines
    from checkpoint_engine.ps import ParameterServer
    from ckpt_common.logs import setup_logging

    try:
        import aiohttp  # noqa: F401 - rank 0's HTTP server
    except ImportError:
        print("error: the daemon needs aiohttp: pip install aiohttp (or the package's [server] extra)", file=sys.stderr)
        return 2
    for var in ("RANK", "WORLD_SIZE"):
        if var not in os.environ:
            print(
                f"error: ${var} is not set: launch with torchrun --nproc-per-node N -m checkpoint_engine",
                file=sys.stderr,
            )
            return 2
    rank = int(os.environ["RANK"])
    setup_logging(args.log_level, rank)
    from ckpt_common.procs import signal_when_orphaned

    signal_when_orphaned()  # a SIGKILLed torchrun: stop as on its SIGTERM (engines included)
    bucket = None if args.bucket_size_mib is None else args.bucket_size_mib * 2**20
    from checkpoint_engine.transport.mooncake import P2PConfig

    p2p = (
        P2PConfig(args.p2p_host, args.p2p_protocol, args.p2p_device, cpus=args.p2p_cpu_list) if args.p2p_host else None
    )
    cfg = ParameterServerConfig(
        transport=args.transport,
        collective_timeout_s=args.collective_timeout_s,
        p2p=p2p,
        metadata_url=args.metadata_url,
        update=UpdateConfig(
            bucket_size_bytes=bucket,
            mode=args.mode,
            p2p_reader=args.p2p_reader,
            metrics_path=args.metrics_jsonl,
            progress=args.progress,
        ),
    )
    ps = ParameterServer(config=cfg)
    host = None
    try:
        ps.init_process_group()
        store = dist.distributed_c10d._get_default_store()
        relay = Relay(store, rank, ps.world_size, result_timeout_s=args.collective_timeout_s + 60)
        board = None
        if args.engine_config is not None:
            board = EngineBoard(store, ps.world_size)
            host = engines.EngineHost(
                rank,
                ps.world_size,
                args.engine_config,
                device=_engine_device(args.transport),
                publish=_engine_publisher(board, ps, rank),
                store=dist.PrefixStore("ckpt-engines-agree/", store.clone()),
            )
        if rank == 0:
            driver = Driver(ps, relay, host, board)
            asyncio.run(serve_http(driver, args.host, args.port, args.uds, args.stop_timeout_s, token=args.token))
        else:
            from ckpt_common.procs import exit_on_signals, stop_deadline

            exit_on_signals()  # SIGTERM unwinds through `finally`: this rank's engine is stopped
            stop_deadline(args.stop_timeout_s)
            try:
                serve_rank(ps, relay, threading.Event(), host)
            finally:
                relay.leave()
        logging.getLogger(__name__).info("rank %d: exiting", rank)
    finally:
        if host is not None:
            host.close()  # engines end with the daemon, whatever ended it
        ps.close()
    return 0


def _engine_device(transport: str) -> str:
    """The `{device}` of this rank's engine: the rank's GPU with the CUDA transport, else cpu."""
    import torch

    if transport == "cuda" or (transport == "auto" and torch.cuda.is_available()):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def _engine_publisher(board, ps, rank: int):
    """Each engine record goes to the process-group store (rank 0 reads it) and the metadata store (etcd)."""
    import json
    import logging

    log = logging.getLogger(__name__)

    def publish(record: dict) -> None:
        board.put(record)
        try:
            ps.registry.store.put(f"engines/{rank}/lifecycle", json.dumps(record))
        except Exception as e:  # noqa: BLE001 - etcd down must not stop the watchdog; the record is on the board
            log.warning("rank %d: engine record not published to the metadata store: %s: %s", rank, type(e).__name__, e)

    return publish


if __name__ == "__main__":
    sys.exit(main())
