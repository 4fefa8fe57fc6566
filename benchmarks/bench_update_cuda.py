"""CUDA weight-update benchmark: pinned host chunks -> device double buffer -> CUDA IPC -> engine.

    torchrun --nproc-per-node 1 benchmarks/bench_update_cuda.py [--layers 16 --bucket-sizes-mib 2048,1024]

One rank per GPU. Each rank owns a shard of a synthetic bf16 checkpoint (Llama-8B-like shapes:
hidden 4096, intermediate 14336, GQA 8 of 32 heads, vocab 128256; --layers of them) registered in
pinned host memory, and has an engine process that keeps its weights on the GPU and copies every
received tensor into them. Measured in one run, median of --repeats after a warm-up:
  update_s  ParameterServer.update per bucket size (collective mode: H2D copy-in on a side stream
            into one half of the device double buffer, NCCL broadcast, engine copies the views
            into its weights while the next bucket is copied in)
  h2d_s     one H2D copy of all the bytes from one pinned buffer into one device buffer: the floor
            of any update that starts from host memory (ratio_to_h2d = update_s / h2d_s)
  d2d_s     one device-to-device copy of all the bytes: the engine's own copy, at least
  naive_s   per tensor `.to("cuda")` from pageable host memory inside the engine (a loader reading
            tensors one by one, without pinned memory or a pipeline)
The last line printed (rank 0) is one JSON object. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from _common import BenchEngine, EngineRequest, ask, decoder_specs, serve, start_engine, timed_updates

GIB = 2**30
PHASES = ("open_s", "setup_s", "copy_in_s", "broadcast_s", "engine_wait_s", "agree_s", "finish_s", "close_s", "total_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="decoder layers (16: ~8.4 GiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--bucket-sizes-mib",
        default="2048,1024,4096",
        help="comma-separated; the first is update_s (each >= the largest tensor, 1002 MiB)",
    )
    p.add_argument("--skip-naive", action="store_true")
    return p.parse_args(argv)


def tensor_specs(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    return decoder_specs(layers, hidden=4096, intermediate=14336, kv=1024, vocab=128256)


def int_sum(t) -> int:
    import torch

    return int(t.contiguous().view(torch.int16).to(torch.int64).sum())


def engine_main(conn, device_index: int) -> None:
    """Engine process: weights on the GPU, filled by ``update_weights_from_ipc`` or tensor by tensor."""
    import torch

    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    weights = {}

    def put(name, t):
        dst = weights.get(name)
        if dst is None:
            weights[name] = t.to(device, copy=True)
        else:
            dst.copy_(t, non_blocking=True)

    engine = BenchEngine(put, device_index)  # the IPC buffers stay open across updates

    def handle(cmd: dict) -> dict:
        if cmd["op"] == "ours":
            engine.update(cmd["address"])
            torch.cuda.synchronize(device)
            return {"ok": True, "version": engine.state.version, "cache_hits": engine.mappings.hits}
        if cmd["op"] == "checksum":  # exact integer sums of a few tensors' bits: did the bytes arrive?
            return {"ok": True, "sums": {n: int_sum(weights[n]) for n in cmd["names"]}}
        # "naive": the engine reads a pageable host copy of its shard tensor by tensor
        specs = [tuple(s) for s in cmd["specs"]]
        host = {n: torch.ones(shape, dtype=torch.bfloat16) for n, shape in specs}
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for n, t in host.items():
            put(n, t)
        torch.cuda.synchronize(device)
        return {"ok": True, "seconds": time.perf_counter() - t0}

    serve(conn, handle)


def timed_copy(dst, src) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    args = parse_args()
    from ckpt_common.procs import exit_on_signals

    exit_on_signals()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_update_cuda needs a CUDA GPU (the CPU path is benchmarks/bench_update.py)")
    from dataclasses import replace

    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    bucket_sizes = [int(x) * 2**20 for x in args.bucket_sizes_mib.split(",")]
    specs = [s for i, s in enumerate(tensor_specs(args.layers)) if i % world == rank]
    gen = torch.Generator().manual_seed(rank)
    mine = {n: torch.empty(shape, dtype=torch.bfloat16).uniform_(-1, 1, generator=gen) for n, shape in specs}

    parent, engine = start_engine(engine_main, local_rank)
    try:
        ps = ParameterServer(config=ParameterServerConfig(transport="cuda", update=UpdateConfig(mode="collective")))
        ps.init_process_group()
        t0 = time.perf_counter()
        ps.register_checkpoint("bench", named_tensors=mine)
        register_s = time.perf_counter() - t0
        ps.gather_metas("bench")
        g = ps._global["bench"]
        total = sum(m.nbytes for ms in g.rank_metas.values() for m in ms)
        num_tensors = sum(len(ms) for ms in g.rank_metas.values())

        req = EngineRequest(parent, rank)
        updates: dict[int, list[float]] = {}
        gpu_peak_mib: dict[int, float] = {}
        phases: dict[int, dict] = {}
        for size in bucket_sizes:
            ps.config = replace(ps.config, update=replace(ps.config.update, bucket_size_bytes=size))
            torch.cuda.reset_peak_memory_stats()
            updates[size], _ = timed_updates(ps, "bench", req, args.repeats + 1)
            gpu_peak_mib[size] = torch.cuda.max_memory_allocated() / 2**20
            m = ps.last_metrics.to_dict()  # the last repeat's stage times (this rank)
            phases[size] = {k: m[k] for k in PHASES}

        names = [n for n, _ in specs[:3]]
        sums = ask(parent, {"op": "checksum", "names": names})["sums"]
        bytes_ok = all(sums[n] == int_sum(mine[n]) for n in names)

        ps.close()
        del mine
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(1)
        dev_a = torch.empty(total, dtype=torch.uint8, device="cuda")
        dev_b = torch.empty_like(dev_a)
        h2d = [timed_copy(dev_a, pinned) for _ in range(args.repeats + 1)]
        d2d = [timed_copy(dev_b, dev_a) for _ in range(args.repeats + 1)]
        del pinned, dev_a, dev_b
        torch.cuda.empty_cache()
        naive_s = None
        if not args.skip_naive:
            naive_s = ask(parent, {"op": "naive", "specs": specs})["seconds"]
        parent.send_bytes(json.dumps({"op": "exit"}).encode())
        engine.join(60)
    finally:
        if engine.is_alive():
            engine.kill()

    if rank == 0:
        med = {s: statistics.median(ts[1:]) for s, ts in updates.items()}
        first = bucket_sizes[0]
        h2d_s, d2d_s = statistics.median(h2d[1:]), statistics.median(d2d[1:])
        result = {
            "bench": "bench_update_cuda",
            "gpu": torch.cuda.get_device_name(),
            "world_size": world,
            "total_gib": round(total / GIB, 3),
            "num_tensors": num_tensors,
            "register_s": round(register_s, 3),
            "bytes_ok": bytes_ok,
            "engine_ipc_cache_hits": req.last["cache_hits"],
            "bucket_size_mib": first // 2**20,
            "update_s": round(med[first], 4),
            "update_gib_per_s": round(total / GIB / med[first], 2),
            "h2d_s": round(h2d_s, 4),
            "h2d_gib_per_s": round(total / GIB / h2d_s, 2),
            "d2d_s": round(d2d_s, 4),
            "ratio_to_h2d": round(med[first] / h2d_s, 3),
            "by_bucket": {
                str(s // 2**20): {
                    "update_s": round(med[s], 4),
                    "ratio_to_h2d": round(med[s] / h2d_s, 3),
                    "ps_gpu_peak_mib": round(gpu_peak_mib[s], 1),
                    "all_s": [round(x, 4) for x in updates[s]],
                    "phases_s": phases[s],
                }
                for s in bucket_sizes
            },
        }
        if naive_s is not None:
            result["naive_s"] = round(naive_s, 4)
            result["speedup_vs_naive"] = round(naive_s / med[first], 2)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
