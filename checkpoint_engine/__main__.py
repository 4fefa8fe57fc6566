"""`torchrun --nproc-per-node N -m checkpoint_engine`: the weight-sync daemon (see daemon.py).

Rank 0 serves the HTTP API; every rank holds its shard of each registered checkpoint.
  POST /checkpoints  {"name", "files": [...]}    register (files are split across ranks) + gather metas
  POST /update       {"name", "endpoints": URL | [URL per engine], "ranks_per_engine": 1, "timeout_s",
                      "ranks": null | [receiver ranks] (P2P through Mooncake; needs --p2p-host)}
  GET  /metas/NAME, POST /metas                  export / import global metas (JSON) for P2P recovery
  GET  /checkpoints                              what is registered, the last update's metrics
  DELETE /checkpoints/NAME, GET /health, POST /shutdown
MoonshotAI checkpoint-engine's routes (200 + empty body, 500 + error text), each acting on every rank:
  POST /v1/checkpoints/NAME/files {"files": [...]}  register (files split across ranks), no gather
  POST /v1/checkpoints/NAME/gather-metas           gather metas
  POST /v1/checkpoints/NAME/update {"ranks": [], "update_url": URL | null, "inference_group_ranks": [],
                                    "timeout": 300.0, "uds": PATH | null}
  DELETE /v1/checkpoints/NAME, GET /v1/healthz
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m checkpoint_engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--uds", default=None, help="serve on this unix socket instead of TCP")
    p.add_argument("--transport", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--bucket-size-mib", type=int, default=None)
    p.add_argument("--mode", choices=["auto", "collective", "local"], default="auto")
    p.add_argument("--collective-timeout-s", type=float, default=300.0)
    p.add_argument("--metrics-jsonl", default=None, help="append one JSON line per update (per rank)")
    p.add_argument("--progress", action="store_true", help="progress bar on rank 0 during updates")
    p.add_argument(
        "--metadata-url", default=None, help="etcd://host:port/prefix for global metadata (default: in-process)"
    )
    p.add_argument("--p2p-host", default=None, help="start Mooncake's transfer engine on this address (P2P)")
    p.add_argument("--p2p-protocol", choices=["tcp", "rdma"], default="tcp")
    p.add_argument("--p2p-device", default="", help="RDMA device names for Mooncake (rdma protocol)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import asyncio
    import logging
    import os
    import threading

    import torch.distributed as dist

    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.daemon import Driver, Relay, serve_http, serve_rank
    from checkpoint_engine.logs import setup_logging
    from checkpoint_engine.ps import ParameterServer

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
    bucket = None if args.bucket_size_mib is None else args.bucket_size_mib * 2**20
    from checkpoint_engine.p2p import P2PConfig

    p2p = P2PConfig(args.p2p_host, args.p2p_protocol, args.p2p_device) if args.p2p_host else None
    cfg = ParameterServerConfig(
        transport=args.transport,
        collective_timeout_s=args.collective_timeout_s,
        p2p=p2p,
        metadata_url=args.metadata_url,
        update=UpdateConfig(
            bucket_size_bytes=bucket, mode=args.mode, metrics_path=args.metrics_jsonl, progress=args.progress
        ),
    )
    ps = ParameterServer(config=cfg)
    try:
        ps.init_process_group()
        relay = Relay(
            dist.distributed_c10d._get_default_store(),
            rank,
            ps.world_size,
            result_timeout_s=args.collective_timeout_s + 60,
        )
        if rank == 0:
            asyncio.run(serve_http(Driver(ps, relay), args.host, args.port, args.uds))
        else:
            serve_rank(ps, relay, threading.Event())
        logging.getLogger(__name__).info("rank %d: exiting", rank)
    finally:
        ps.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
