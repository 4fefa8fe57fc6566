"""One PS rank of a multi-process test (run by tests/integration/dist/harness.run_ranks, or under
torchrun: without --rank, the rank and world come from torchrun's RANK and WORLD_SIZE and the process
group from its MASTER_ADDR/MASTER_PORT).

Exit codes: 0 all steps verified; 3 an update raised (message printed as `UPDATE_ERROR: ...`);
1 anything else (verification failure, crash).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

from checkpoint_engine.api import http_req_func
from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.ps import ParameterServer

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def make_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """~40 tensors: mixed dtypes, odd sizes, a 0-d and an empty tensor, int8 before floats."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(36):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g)))
        if dtype == torch.int8:
            t = torch.randint(-128, 127, shape, generator=g, dtype=torch.int8)
        else:
            t = torch.randn(shape, generator=g).to(dtype)
        out[f"layers.{i}.w"] = t
    out["scalar"] = torch.tensor(float(seed), dtype=torch.float32)
    out["empty"] = torch.empty(0, 5, dtype=torch.float16)
    out["odd.int8"] = torch.randint(-5, 5, (7,), generator=g, dtype=torch.int8)
    out["big"] = torch.randn(100, 101, generator=g).to(torch.bfloat16)
    return out


def shard(ckpt: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    return {k: v for i, (k, v) in enumerate(sorted(ckpt.items())) if i % world == rank}


def register(ps, name, tensors, source: str, tmp: str, rank: int) -> None:
    if source == "named":
        ps.register_checkpoint(name, named_tensors=tensors)
        return
    from safetensors.torch import save_file

    keys = sorted(tensors)
    in_file = keys if source == "files" else keys[::2]
    path = f"{tmp}/{name}-r{rank}-{time.monotonic_ns()}.safetensors"
    save_file({k: tensors[k].contiguous() for k in in_file}, path)
    ps.register_checkpoint(name, files=[path], named_tensors={k: tensors[k] for k in keys if k not in in_file})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=None, help="default: torchrun's RANK")
    p.add_argument("--world", type=int, default=None, help="default: torchrun's WORLD_SIZE")
    p.add_argument("--master-port", type=int, default=None, help="default: torchrun's (env://)")
    p.add_argument("--engine-url", required=True, help="this rank's engine; a comma-separated list: one per rank")
    p.add_argument("--steps", default="A1,B2,A1,A3", help="checkpoint name + seed per update")
    p.add_argument("--source", default="both", choices=["files", "named", "both"])
    p.add_argument("--tmp", required=True)
    p.add_argument("--bucket-size", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("--req-func-raise", action="store_true")
    p.add_argument(
        "--first-req-func-raise",
        action="store_true",
        help="rank 0's req_func raises, the others' send nothing (as for one engine of every rank, whose "
        "request rank 0 sends): their engines never connect",
    )
    p.add_argument("--checksums", action="store_true")
    p.add_argument("--mode", default="collective", choices=["auto", "collective", "local"])
    p.add_argument("--transport", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--p2p-recover",
        type=int,
        default=None,
        help="after the steps: this rank's engine restarts empty and recovers by P2P alone",
    )
    p.add_argument("--p2p-reader", default="rank", choices=["rank", "engine"], help="who reads the P2P pull")
    p.add_argument("--tamper-metas", action="store_true", help="last rank loads metas that differ")
    p.add_argument("--dup-name", action="store_true", help="last rank also registers a name rank 0 owns")
    p.add_argument("--bad-file-rank", type=int, default=None, help="this rank registers a file that is not safetensors")
    args = p.parse_args()
    if args.rank is None:  # under torchrun
        args.rank, args.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "," in args.engine_url:  # one command line for every rank (torchrun)
        args.engine_url = args.engine_url.split(",")[args.rank]
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from checkpoint_engine.transport.mooncake import P2PConfig

    cfg = ParameterServerConfig(
        transport=args.transport,
        p2p=P2PConfig() if args.p2p_recover is not None else None,
        collective_timeout_s=args.timeout_s,
        verify_checksums=args.checksums,
        update=UpdateConfig(
            bucket_size_bytes=args.bucket_size,
            engine_timeout_s=args.timeout_s,
            engine_connect_timeout_s=args.timeout_s,
            mode=args.mode,
            agree_every_buckets=2,
            p2p_reader=args.p2p_reader,
        ),
    )
    ps = ParameterServer(
        rank=args.rank,
        world_size=args.world,
        master_addr="127.0.0.1" if args.master_port is not None else None,
        master_port=args.master_port,
        config=cfg,
    )
    req = http_req_func(args.engine_url, rank=args.rank, timeout_s=args.timeout_s)
    if args.req_func_raise and args.rank == args.world - 1:

        def req(_paths):
            raise ConnectionError("injected: engine endpoint unreachable")

    if args.first_req_func_raise:

        def req(_paths, first=args.rank == 0):
            if first:
                raise ConnectionError("injected: the engine's endpoint is unreachable")

    registered: dict[str, int] = {}
    for n, step in enumerate(args.steps.split(",")):
        name, seed = step[0], int(step[1:])
        full = make_checkpoint(seed)
        if registered.get(name) != seed:
            if name in registered:
                ps.unregister_checkpoint(name)
            mine = shard(full, args.rank, args.world)
            if args.dup_name and args.rank == args.world - 1:
                mine["layers.0.w"] = full["layers.0.w"]
            if args.bad_file_rank == args.rank:
                bad = f"{args.tmp}/not-safetensors-r{args.rank}.safetensors"
                with open(bad, "w") as f:
                    f.write("this is not a safetensors file\n")
                ps.register_checkpoint(name, files=[bad])  # raises: the process exits 1
            register(ps, name, mine, args.source, args.tmp, args.rank)
            registered[name] = seed
            try:
                ps.gather_metas(name)
            except Exception as e:  # noqa: BLE001 - reported to the test
                print(f"GATHER_ERROR: {type(e).__name__}: {e}", flush=True)
                ps.close()
                return 4
            if args.tamper_metas and args.rank == args.world - 1:
                metas = ps.get_metas(name)
                metas["ranks"]["0"] = metas["ranks"]["0"][1:]
                ps.load_metas(metas)
        print(f"STEP_BEGIN {n}", flush=True)
        try:
            m = ps.update(name, req)
        except Exception as e:  # noqa: BLE001 - reported to the test
            print(f"UPDATE_ERROR: {type(e).__name__}: {e}", flush=True)
            ps.close()
            return 3
        from tests.integration.dist.harness import rpc

        digest = rpc(args.engine_url, "weights_digest")
        expected = {k: tensor_checksum(v) for k, v in full.items()}
        if digest != expected:
            bad = sorted(k for k in expected if digest.get(k) != expected[k])
            print(f"MISMATCH at step {n} ({step}): {bad[:10]}", flush=True)
            return 1
        state = rpc(args.engine_url, "weights_state")
        if m.mode != (args.mode if args.mode != "auto" else ("local" if args.transport == "cpu" else "collective")):
            print(f"BAD MODE {m.mode}", flush=True)
            return 1
        if state["version"] != n + 1 or state["status"] != "ready" or state["checkpoint"] != name:
            print(f"BAD STATE at step {n}: {state}", flush=True)
            return 1
        print(f"STEP_OK {n} {step} {json.dumps(m.to_dict())}", flush=True)
    if args.p2p_recover is not None:
        return p2p_recover(ps, args, req, full, name, n + 1)
    ps.close()
    return 0


def p2p_recover(ps, args, req, full, name, num_updates) -> int:
    from tests.integration.dist.harness import rpc

    target = args.p2p_recover
    mode = "p2p" if args.p2p_reader == "rank" else "p2p_engine"
    if args.rank == target:
        rpc(args.engine_url, "reset_weights")  # as if the engine had just restarted
    m = ps.update(name, req, ranks=[target])
    import torch.distributed as dist

    dist.barrier()  # owners serve the P2P reads from their memory: keep them alive until the receiver is done
    state = rpc(args.engine_url, "weights_state")
    digest = rpc(args.engine_url, "weights_digest")
    expected = {k: tensor_checksum(v) for k, v in full.items()}
    if args.rank == target and args.p2p_reader == "engine":
        # the engine read the pull itself: the owners' tensors into scratch (it held nothing after the reset)
        reads = state.get("engine_reads") or {}
        others = sum(v.numel() * v.element_size() for k, v in full.items() if k not in shard(full, target, args.world))
        if reads.get("scratch_bytes") != others or reads.get("placed_bytes") != 0:
            print(f"P2P_BAD engine reads {reads}, expected {others} bytes into scratch", flush=True)
            return 1
        # once more, now into the tensors it holds: every byte lands in place
        m = ps.update(name, req, ranks=[target])
        state = rpc(args.engine_url, "weights_state")
        reads = state.get("engine_reads") or {}
        if reads.get("placed_bytes") != others or reads.get("scratch_bytes") != 0:
            print(f"P2P_BAD engine reads {reads}, expected {others} bytes in place", flush=True)
            return 1
        digest = rpc(args.engine_url, "weights_digest")
    elif args.p2p_reader == "engine":
        m = ps.update(name, req, ranks=[target])
    dist.barrier()
    if args.rank == target:
        version = 2 if args.p2p_reader == "engine" else 1
        ok = m is not None and m.mode == mode and state["version"] == version and digest == expected
    else:  # not a receiver: returned at once, engine untouched
        ok = m is None and state["version"] == num_updates and digest == expected
    print(f"P2P_{'OK' if ok else 'BAD'} rank {args.rank} {state} {None if m is None else m.to_dict()}", flush=True)
    ps.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
