"""The processes of a multi-host weight sync, one per role, for tests and benchmarks in the testbed
(`testing/hosts.py`): the trainer's memory as the source, parameter-server ranks on inference hosts.

    python -m testing.host_roles trainer --host-ip IP --size-mib M --name v1 --metas-out PATH
        A trainer's world of one: a ParameterServer with Mooncake at IP registers M MiB of float32
        tensors it holds in memory (made here from a seed; no file), gathers their metas, writes them
        (a few KB of JSON: the tensors' names, shapes and addresses, never their bytes) to PATH, and
        serves reads until SIGTERM.
        With --delta-versions K: K+1 bf16 (--engine-dtype fp8: block-scaled) versions after AdamW
        steps; the first registered in full, each later one as the delta from the one before
        (`checkpoint_engine.sharding.delta_sync`), then one delta that changes nothing (NAME.d<K+1>:
        an update's fixed cost).
    python -m testing.host_roles inference --rank R --world-size W --master-addr A --master-port P
            --host-ip IP --engine-url URL --metas PATH [--mode relay|auto] [--timeout-s T]
        Rank R of the inference hosts' world: loads the trainer's metas and updates its engine (a plain
        engine at URL on its host) from the trainer's memory; rank 0 prints one JSON line:
        {"e2e_s": seconds from every rank ready to every engine holding the version, "mode", ...}.

Every wait has a deadline (--timeout-s); a failed update exits 1 after printing {"error": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _trainer(args) -> int:
    import signal

    import torch

    from checkpoint_engine.checksum import tensor_checksum
    from checkpoint_engine.config import ParameterServerConfig
    from checkpoint_engine.ps import ParameterServer
    from checkpoint_engine.transport.mooncake import P2PConfig

    n = max(1, args.tensors)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = ParameterServerConfig(transport="cpu", p2p=P2PConfig(host=args.host_ip, read_timeout_s=args.timeout_s))
    ps = ParameterServer(rank=0, world_size=1, config=cfg)

    def register(name: str, named: dict, metas_out: str) -> None:
        ps.register_checkpoint(name, named_tensors=named)
        ps.gather_metas(name)
        tmp = metas_out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(ps.get_metas(name), fh)
        os.replace(tmp, metas_out)

    if args.delta_versions:
        versions = _delta_versions(args, n, gen)
        tensors = versions[0]
    else:
        per = args.size_mib * 2**20 // 4 // n
        tensors = {f"layers.{i}.weight": torch.randn(per, generator=gen) for i in range(n)}
    register(args.name, tensors, args.metas_out)
    ready = {"ready": True, "bytes": sum(t.nbytes for t in tensors.values())}
    ready["digest"] = {name: tensor_checksum(t) for name, t in tensors.items()}
    if args.delta_versions:
        from checkpoint_engine.sharding.delta import encode_version
        from checkpoint_engine.sharding.delta_sync import to_wire

        ready["deltas"] = []
        for k in range(1, len(versions)):
            name, base = f"{args.name}.d{k}", args.name if k == 1 else f"{args.name}.d{k - 1}"
            delta = encode_version(versions[k - 1], versions[k], compress=True)
            wire = to_wire(delta, base, name)
            metas_out = f"{args.metas_out}.d{k}"
            register(name, wire, metas_out)
            ready["deltas"].append(
                {
                    "name": name,
                    "metas": metas_out,
                    "wire_bytes": sum(t.nbytes for t in wire.values()),
                    "changed_share": round(delta.changed_share, 6),
                    "digest": {n_: tensor_checksum(t) for n_, t in versions[k].items()},
                }
            )
    print(json.dumps(ready), flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    deadline = time.monotonic() + args.serve_s
    while not stop and time.monotonic() < deadline:
        time.sleep(0.2)
    ps.close()
    return 0


def _delta_versions(args, n: int, gen) -> list[dict]:
    """`args.delta_versions` + 1 versions of `n` weights as the engine holds them (about `size_mib`
    MiB each): float32 masters drawn N(0, 0.02), one AdamW step of lr `args.lr` on random gradients
    between two versions (synthetic steps, not an RL run's), each version their cast to
    `args.engine_dtype`: bf16, or fp8 in 128x128 blocks with a float32 scale each (1024 columns)."""
    import torch

    from testing.weight_versions import adamw_versions, fp8_block_cast

    if args.engine_dtype == "fp8":
        cols = 1024
        rows = max(128, args.size_mib * 2**20 // n // cols // 128 * 128)
        shape: tuple[int, ...] = (rows, cols)
        cast = fp8_block_cast
    else:
        shape = (args.size_mib * 2**20 // 2 // n,)

        def cast(name, w):
            return {name: w.to(torch.bfloat16)}

    master = {f"layers.{i}.weight": (torch.randn(shape, generator=gen) * 0.02).requires_grad_(True) for i in range(n)}
    versions = adamw_versions(master, args.delta_versions + 1, args.lr, gen, cast)
    # one more delta with nothing changed: what an update costs beside its bytes (the fixed cost)
    return [*versions, versions[-1]]


def _inference(args) -> int:
    import faulthandler
    from datetime import timedelta

    # a rank still running well past every deadline shows where it waits (a test's failure says why)
    faulthandler.dump_traceback_later(3 * args.timeout_s + 30, exit=False)

    import torch.distributed as dist

    from checkpoint_engine.api import http_req_func
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from checkpoint_engine.transport.mooncake import P2PConfig

    update = UpdateConfig(
        mode=args.mode,
        keep_relayed=args.keep_relayed,
        bucket_size_bytes=args.bucket_mib * 2**20 or None,  # 0: the planner's choice
        engine_timeout_s=args.timeout_s,
        engine_connect_timeout_s=args.timeout_s,
        req_func_timeout_s=args.timeout_s,
    )
    cfg = ParameterServerConfig(
        transport="cpu",
        p2p=P2PConfig(host=args.host_ip, read_timeout_s=args.timeout_s),
        collective_timeout_s=args.timeout_s,
        update=update,
    )
    ps = ParameterServer(
        rank=args.rank,
        world_size=args.world_size,
        master_addr=args.master_addr,
        master_port=args.master_port,
        config=cfg,
    )
    ps.init_process_group(timeout=timedelta(seconds=args.timeout_s))
    deadline = time.monotonic() + args.timeout_s
    while not os.path.exists(args.metas):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no metas at {args.metas} within {args.timeout_s:g} s")
        time.sleep(0.1)
    with open(args.metas) as fh:
        metas = json.load(fh)
    ps.load_metas(metas)
    req = http_req_func(args.engine_url, rank=args.rank, timeout_s=args.timeout_s)
    dist.barrier()
    t0 = time.perf_counter()
    error = None
    try:
        ps.update(metas["checkpoint"], req)
    except Exception as e:  # noqa: BLE001 - reported as JSON, exit 1
        error = f"{type(e).__name__}: {e}"
    t_local = time.perf_counter() - t0
    if error is None:
        dist.barrier()
    e2e = time.perf_counter() - t0
    m = ps.last_metrics
    out = {
        "rank": args.rank,
        "e2e_s": round(e2e, 4),
        "local_s": round(t_local, 4),
        "mode": getattr(m, "mode", None),
        "total_bytes": getattr(m, "total_bytes", None),
        "error": error,
    }
    print(json.dumps(out), flush=True)
    if error is not None:  # its process group may hold operations with a cut-off peer: no clean close
        sys.stderr.flush()
        os._exit(1)
    ps.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    t = sub.add_parser("trainer")
    t.add_argument("--host-ip", required=True)
    t.add_argument("--size-mib", type=int, default=512)
    t.add_argument("--tensors", type=int, default=32)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--name", default="v1")
    t.add_argument("--metas-out", required=True)
    t.add_argument("--timeout-s", type=float, default=120.0)
    t.add_argument("--serve-s", type=float, default=3600.0, help="serve reads this long at most")
    t.add_argument(
        "--delta-versions",
        type=int,
        default=0,
        help="K > 0: bf16 versions, the first full (--name), then K deltas NAME.d1..d K each from the one "
        "before (metas at METAS_OUT.dK; the ready line lists them)",
    )
    t.add_argument("--lr", type=float, default=1e-6, help="the AdamW learning rate between delta versions")
    t.add_argument("--engine-dtype", default="bf16", choices=["bf16", "fp8"], help="the delta versions' dtype")
    i = sub.add_parser("inference")
    i.add_argument("--rank", type=int, required=True)
    i.add_argument("--world-size", type=int, required=True)
    i.add_argument("--master-addr", required=True)
    i.add_argument("--master-port", type=int, required=True)
    i.add_argument("--host-ip", required=True)
    i.add_argument("--engine-url", required=True)
    i.add_argument("--metas", required=True)
    i.add_argument("--mode", default="relay", choices=["relay", "auto", "collective"])
    i.add_argument(
        "--no-keep-relayed",
        dest="keep_relayed",
        action="store_false",
        help="relay: the ranks keep no share of the version (UpdateConfig.keep_relayed off)",
    )
    i.add_argument("--bucket-mib", type=int, default=32, help="0: the parameter server's choice")
    i.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    from ckpt_common.logs import setup_logging

    setup_logging(os.environ.get("CKPT_LOG_LEVEL", "WARNING"))
    return _trainer(args) if args.role == "trainer" else _inference(args)


if __name__ == "__main__":
    sys.exit(main())
