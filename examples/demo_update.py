"""Weight-sync demo: every rank registers its shard of a generated checkpoint and pushes the whole
checkpoint into its own engine process; prints time and GiB/s per update.

    torchrun --nproc-per-node 2 examples/demo_update.py [--size-mib 512 --updates 3 --mode auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512, help="checkpoint size (bf16)")
    p.add_argument("--num-tensors", type=int, default=320)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--mode", choices=["auto", "collective", "local"], default="auto")
    p.add_argument("--engine-port-base", type=int, default=18700)
    return p.parse_args()


def start_engine(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkpoint_engine.engines.plain", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine on port {port} did not start") from None
            time.sleep(0.1)


def main() -> int:
    args = parse_args()
    import torch

    from checkpoint_engine.api import http_req_func
    from checkpoint_engine.checksum import tensor_checksum
    from checkpoint_engine.collectives import all_gather_obj
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from ckpt_common.logs import setup_logging

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup_logging("WARNING", rank)
    port = args.engine_port_base + rank
    engine = start_engine(port)
    url = f"http://127.0.0.1:{port}"
    try:
        numel = args.size_mib * 2**20 // 2 // args.num_tensors
        ps = ParameterServer(config=ParameterServerConfig(transport="cpu", update=UpdateConfig(mode=args.mode)))
        req = http_req_func(url, rank=rank)
        for step in range(args.updates):
            name = f"demo-v{step}"
            g = torch.Generator().manual_seed(step * 1000 + rank)
            mine = {
                f"layer.{i}.weight": torch.randn(numel // 64, 64, generator=g).to(torch.bfloat16)
                for i in range(rank, args.num_tensors, world)
            }
            ps.register_checkpoint(name, named_tensors=mine)
            ps.gather_metas(name)
            m = ps.update(name, req)
            digest = json.loads(
                urllib.request.urlopen(
                    urllib.request.Request(url + "/collective_rpc", data=b'{"method": "weights_digest"}'), timeout=60
                ).read()
            )["results"][0]
            ok = all(digest[k] == tensor_checksum(v) for k, v in mine.items())
            oks = all_gather_obj(ok, world)  # msgpack, no pickle
            if rank == 0:
                print(
                    f"update {step + 1}/{args.updates}: {m.total_bytes / 2**30:.3f} GiB, {m.num_tensors} tensors, "
                    f"{m.num_buckets} buckets, mode {m.mode}: {m.total_s:.3f} s = {m.gib_per_s:.2f} GiB/s; "
                    f"bit-exact on every engine: {all(oks)}",
                    flush=True,
                )
            ps.unregister_checkpoint(name)
        ps.close()
    finally:
        engine.terminate()
        engine.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
