"""Push a model directory's weights into running vLLM servers (one parameter-server rank each).

    python -m vllm_ext.push --model DIR --engine-url http://127.0.0.1:8000
    torchrun --nproc-per-node 2 -m vllm_ext.push --model DIR --engine-url URL0 --engine-url URL1

Rank r reads its share of the tensors (every world_size-th, in name order) and serves the engine at
`--engine-url` number r // ranks_per_engine (ranks_per_engine = world size / number of URLs; more
than one per engine is for tensor-parallel engines, untested here); the broadcast gives every
engine the whole checkpoint.
The servers run `vllm serve ... --worker-extension-cls vllm_ext.worker.VllmColocateWorkerExtension`
with VLLM_SERVER_DEV_MODE=1 (or sit behind `python -m vllm_ext.launch`). The last line printed is
one JSON object; exit code 0 when the update completed, 3 when it was aborted, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

logger = logging.getLogger(__name__)


def load_shard(files: list[str], rank: int, world_size: int) -> dict:
    """This rank's tensors: every world_size-th name (sorted over all files), read from disk."""
    from safetensors import safe_open

    where: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                where[k] = f
    mine = sorted(where)[rank::world_size]
    out = {}
    for f in files:
        names = [k for k in mine if where[k] == f]
        if names:
            with safe_open(f, framework="pt") as fh:
                out.update({k: fh.get_tensor(k) for k in names})
    return out


def push(
    model_dir: str,
    engine_url: str,
    *,
    rank: int,
    world_size: int,
    master_port: int | None = None,
    ranks_per_engine: int = 1,
    checkpoint_name: str | None = None,
    bucket_size_bytes: int | None = None,
    timeout_s: float = 300.0,
    transport: str = "auto",
) -> dict:
    """Register this rank's shard, gather metas, update; return metrics. Raises on failure."""
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from vllm_ext.launch_config import model_safetensors_files
    from vllm_ext.req import vllm_http_req_func

    name = checkpoint_name or os.path.basename(os.path.normpath(model_dir))
    update = UpdateConfig(
        bucket_size_bytes=bucket_size_bytes,
        engine_connect_timeout_s=timeout_s,
        engine_timeout_s=timeout_s,
        req_func_timeout_s=timeout_s,
    )
    cfg = ParameterServerConfig(transport=transport, collective_timeout_s=timeout_s, update=update)
    ps = ParameterServer(
        rank=rank,
        world_size=world_size,
        master_addr="127.0.0.1" if master_port else None,
        master_port=master_port,
        config=cfg,
    )
    try:
        t0 = time.perf_counter()
        ps.register_checkpoint(name, named_tensors=load_shard(model_safetensors_files(model_dir), rank, world_size))
        ps.gather_metas(name)
        register_s = time.perf_counter() - t0
        metrics = ps.update(
            name, vllm_http_req_func(engine_url, rank=rank, ranks_per_engine=ranks_per_engine, timeout_s=timeout_s)
        )
        return {**metrics.to_dict(), "register_s": round(register_s, 4)}
    finally:
        ps.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vllm_ext.push", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="model directory with safetensors files")
    p.add_argument(
        "--engine-url",
        action="append",
        required=True,
        help="base URL of a vLLM server (repeat: one per engine, in rank order)",
    )
    p.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun), else 0")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE, else 1")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port when not under torchrun")
    p.add_argument("--checkpoint-name", default=None)
    p.add_argument("--bucket-size-bytes", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--transport", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world % len(args.engine_url):
        raise SystemExit(f"world size {world} is not a multiple of the {len(args.engine_url)} engine URLs")
    per_engine = world // len(args.engine_url)
    from ckpt_common.logs import setup_logging

    setup_logging("WARNING", rank=rank)
    try:
        out = push(
            args.model,
            args.engine_url[rank // per_engine],
            rank=rank,
            world_size=world,
            master_port=args.master_port,
            ranks_per_engine=per_engine,
            checkpoint_name=args.checkpoint_name,
            bucket_size_bytes=args.bucket_size_bytes,
            timeout_s=args.timeout_s,
            transport=args.transport,
        )
    except Exception as e:  # noqa: BLE001 - reported as the last line and the exit code
        from checkpoint_engine.errors import UpdateFailed

        print(json.dumps({"ok": False, "rank": rank, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 3 if isinstance(e, UpdateFailed) else 1
    print(json.dumps({"ok": True, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
