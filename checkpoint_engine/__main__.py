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

from checkpoint_engine.daemon.config import TOKEN_ENV, DaemonConfig, engine_flags
from ckpt_common.cli_config import ConfigArgs, add_config_args


def _parser() -> tuple[argparse.ArgumentParser, ConfigArgs]:
    """The command line: DaemonConfig's fields as flags (defaults and help from the dataclass)."""
    p = argparse.ArgumentParser(
        prog="python -m checkpoint_engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return p, add_config_args(p, DaemonConfig)


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed flags, with `config` (DaemonConfig), `token`, `p2p_cpu_list` (this rank's CPUs) and
    `engine_config` (None without --engine-cmd). A bad value exits 2 naming its flag."""
    p, spec = _parser()
    args = p.parse_args(argv)
    cfg: DaemonConfig = spec.build(args, p)  # the field checks (DaemonConfig.__post_init__)
    args.config = cfg
    try:
        args.token = load_token(cfg.token_file, os.environ)
    except ValueError as e:
        p.error(str(e))
    from ckpt_common.ports import is_loopback

    if args.token is None and not cfg.uds and not is_loopback(cfg.host):
        p.error(
            f"--host {cfg.host} is not a loopback address: the daemon needs a bearer token there; give "
            f"--token-file PATH or set {TOKEN_ENV} (or bind 127.0.0.1, or serve on --uds PATH)"
        )
    from checkpoint_engine.daemon.relay import relay_key_required

    master = os.environ.get("MASTER_ADDR")
    if args.token is None and relay_key_required(master):
        p.error(
            f"the ranks' store is at MASTER_ADDR={master}, which other hosts may reach: the daemon signs the "
            f"commands it relays there with its bearer token; give --token-file PATH or set {TOKEN_ENV}"
        )
    args.p2p_cpu_list = None
    if cfg.p2p_cpus is not None:
        from checkpoint_engine.transport.mooncake import rank_cpus

        try:  # torchrun sets these; checked here so that a bad list fails before any rank starts work
            args.p2p_cpu_list = rank_cpus(
                cfg.p2p_cpus, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            )
        except ValueError as e:
            p.error(f"--p2p-cpus: {e}")
    try:
        args.engine_config = cfg.engine_config()
    except ValueError as e:
        unnamed = [flag for flag in engine_flags(str(e)) if flag not in str(e)]
        p.error(f"{e} (flag: {', '.join(unnamed)})" if unnamed else str(e))
    return args


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

    from checkpoint_engine.daemon.commands import serve_rank
    from checkpoint_engine.daemon.driver import Driver
    from checkpoint_engine.daemon.relay import EngineBoard, Relay, relay_key
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
    cfg: DaemonConfig = args.config
    setup_logging(cfg.log_level, rank)
    register_engine_adapter()
    from ckpt_common.procs import signal_when_orphaned

    signal_when_orphaned()  # a SIGKILLed torchrun: stop as on its SIGTERM (engines included)
    ps = ParameterServer(config=cfg.ps_config(args.p2p_cpu_list))
    host = None
    try:
        ps.init_process_group()
        store = dist.distributed_c10d._get_default_store()
        key = relay_key(args.token)
        relay = Relay(store, rank, ps.world_size, result_timeout_s=cfg.collective_timeout_s + 60, key=key)
        board = None
        if args.engine_config is not None:
            per = args.engine_config.ranks_per_engine
            board = EngineBoard(store, ps.world_size, per)
            try:
                host = engines.EngineHost(
                    rank,
                    ps.world_size,
                    args.engine_config,
                    device=_engine_device(cfg.transport, per),
                    publish=_engine_publisher(board, ps, rank),
                    store=dist.PrefixStore("ckpt-engines-agree/", store.clone()),
                )
            except ValueError as e:  # the engine groups do not fit the ranks started (every rank says so)
                print(f"error: {e}", file=sys.stderr)
                return 2
        if rank == 0:
            driver = Driver(ps, relay, host, board)
            serve = serve_http(
                driver, cfg.host, cfg.port, cfg.uds, cfg.stop_timeout_s, token=args.token, ssl_context=cfg.ssl_context()
            )
            asyncio.run(serve)
        else:
            from ckpt_common.procs import exit_on_signals, stop_deadline

            exit_on_signals()  # SIGTERM unwinds through `finally`: this rank's engine is stopped
            stop_deadline(cfg.stop_timeout_s)
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


def register_engine_adapter() -> None:
    """The served engines' adapter for this process: vLLM's (`vllm_ext.weight_transfer.native_req`: the native
    and auto update routes; the plain engine takes the extension route, which needs none). This entry
    point is the one module of the checkpoint engine that imports vllm_ext: the daemon's commands and
    engine host ask `checkpoint_engine.engines.adapters` and name no engine. No vLLM import here."""
    from checkpoint_engine.engines.adapters import register_engine_req_func
    from vllm_ext.weight_transfer.native_req import engine_req_func

    register_engine_req_func(engine_req_func)


def _engine_device(transport: str, ranks_per_engine: int = 1) -> str:
    """The `{device}` of this rank's engine: the GPUs of its group's ranks with the CUDA transport
    (`cuda:N`, or `cuda:N,N+1` for 2 ranks per engine), else cpu. A group lives on one host."""
    import torch

    from checkpoint_engine.engines.config import group_device

    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local_size and local_size % ranks_per_engine:
        raise ValueError(
            f"--ranks-per-engine {ranks_per_engine} must divide the ranks per host ({local_size}, torchrun's "
            "--nproc-per-node): an engine's workers run on one host"
        )
    if transport == "cuda" or (transport == "auto" and torch.cuda.is_available()):
        return group_device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}", ranks_per_engine)
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
