"""Broadcast-update benchmark: ours vs the hardware bound vs the common per-tensor approach.

    torchrun --nproc-per-node 2 benchmarks/bench_update.py [--layers 25 --hidden 1536 ...]

Each rank owns half of a synthetic bf16 checkpoint (Qwen2-like shapes, >= 1 GiB, >= 300 tensors) and
has its own engine process that copies every received tensor into its own weights. Measured in
one run (median of --repeats after a warm-up):
  update_s  ParameterServer.update (double-buffered: copy-in, gloo broadcast into shm, engine load)
  bound_s   one gloo broadcast of all the bytes as a single tensor + one memcpy of them
  memcpy_s  one memcpy of all the bytes on every rank at once: the floor of local mode, where
            nothing is broadcast and each engine copies every tensor from the owners' memory
            (local_ratio_to_memcpy, goal <= 1.2)
  naive_s   per tensor: gloo broadcast from its owner, then one ZMQ message with its bytes to the
            engine, which copies it into place
The last line printed (rank 0) is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from _common import BenchEngine, EngineRequest, decoder_specs, serve, start_engine, timed_updates


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=25)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-size-mib", type=int, default=None)
    p.add_argument("--tmp", default="/tmp/ckpt-engine-bench")
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument(
        "--modes",
        default="auto,collective",
        help="update modes to measure (auto, collective, local, p2p); the first one is `update_s` "
        "(auto = local on one host)",
    )
    return p.parse_args(argv)


def tensor_specs(a) -> list[tuple[str, tuple[int, ...]]]:
    return decoder_specs(a.layers, a.hidden, a.intermediate, max(a.hidden // 6, 64), a.vocab, qkv_bias=True)


def write_shard(path: str, specs, seed: int) -> None:
    """Stream a bf16 safetensors file tensor by tensor (peak memory: one tensor)."""
    import math
    import struct

    import torch

    header, off = {}, 0
    for name, shape in specs:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape in specs:
            f.write(torch.randn(shape, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes())


# ---- engine process ---------------------------------------------------------------------------
def engine_main(conn) -> None:
    import torch
    import zmq

    torch.set_num_threads(1)
    weights = {}

    def put(name, t):
        dst = weights.get(name)
        if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
            weights[name] = t.clone()
        else:
            dst.copy_(t)

    engine = BenchEngine(put)

    def handle(cmd: dict) -> dict:
        if cmd["op"] == "ours":
            engine.update(cmd["address"])
        elif cmd["op"] == "naive":
            sock = engine.ctx.socket(zmq.PAIR)
            sock.connect(cmd["address"])
            while True:
                frames = sock.recv_multipart(copy=False)
                if len(frames) == 1:
                    break
                meta = json.loads(frames[0].bytes)
                buf = torch.frombuffer(frames[1].buffer, dtype=torch.bfloat16).view(meta["shape"])
                put(meta["name"], buf)
            sock.send(b"ok")
            sock.close()
        return {"ok": True, "version": engine.state.version}

    serve(conn, handle)


# ---- measurements -----------------------------------------------------------------------------
class RssSampler:
    def __init__(self):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def measure_naive(ps, name, rank, world, conn, seq) -> float:
    import torch
    import torch.distributed as dist
    import zmq

    g = ps._global[name]
    address = f"ipc://@ckpt-engine-bench-naive-{os.getpid()}-{seq}"
    sock = ps._zmq_ctx.socket(zmq.PAIR)
    sock.bind(address)
    dist.barrier()
    t0 = time.perf_counter()
    conn.send_bytes(json.dumps({"op": "naive", "address": address}).encode())
    ckpt = ps._checkpoints[name]
    order = sorted(((m.name, r, m) for r, ms in g.rank_metas.items() for m in ms))
    for tname, owner, meta in order:
        buf = ckpt.view(meta) if owner == rank else torch.empty(meta.shape, dtype=torch.bfloat16)
        dist.broadcast(buf, src=owner)
        sock.send_multipart(
            [
                json.dumps({"name": tname, "shape": list(meta.shape)}).encode(),
                memoryview(buf.view(torch.uint8).numpy()),
            ],
            copy=False,
        )
    sock.send(b"done")
    if not sock.poll(300_000):
        raise TimeoutError("naive engine did not finish")
    sock.recv()
    json.loads(conn.recv_bytes())
    dist.barrier()
    dt = time.perf_counter() - t0
    sock.close(linger=0)
    return dt


def measure_copy(total_bytes: int, broadcast: bool) -> float:
    """Every rank copies all the bytes once, at the same time, after one gloo broadcast of them from
    rank 0 when `broadcast` (the bound of a broadcast update). Without it: what each engine must do
    at least in local mode (it reads every tensor straight from the owners' memory into its weights)."""
    import torch
    import torch.distributed as dist

    a = torch.empty(total_bytes, dtype=torch.uint8)
    b = torch.empty(total_bytes, dtype=torch.uint8)
    a.fill_(1)
    b.fill_(0)
    dist.barrier()
    t0 = time.perf_counter()
    if broadcast:
        dist.broadcast(a, src=0)
    b.copy_(a)
    dist.barrier()
    return time.perf_counter() - t0


def main() -> int:
    args = parse_args()
    from ckpt_common.procs import exit_on_signals

    exit_on_signals()  # SIGTERM unwinds like Ctrl-C: the finally blocks stop every server started
    import torch
    import torch.distributed as dist

    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    specs = tensor_specs(args)
    mine = [s for i, s in enumerate(specs) if i % world == rank]
    os.makedirs(args.tmp, exist_ok=True)
    path = f"{args.tmp}/shard-{rank}.safetensors"
    write_shard(path, mine, seed=rank)

    parent, engine = start_engine(engine_main)

    bucket = None if args.bucket_size_mib is None else args.bucket_size_mib * 2**20
    from checkpoint_engine.transport.mooncake import P2PConfig

    modes = args.modes.split(",")
    cfg = ParameterServerConfig(
        transport="cpu", update=UpdateConfig(bucket_size_bytes=bucket), p2p=P2PConfig() if "p2p" in modes else None
    )
    ps = ParameterServer(config=cfg)
    import psutil

    baseline_rss = psutil.Process().memory_info().rss
    ps.register_checkpoint("bench", files=[path])
    os.unlink(path)
    ps.gather_metas("bench")
    registered = ps._checkpoints["bench"].nbytes
    total = sum(m.nbytes for ms in ps._global["bench"].rank_metas.values() for m in ms)
    num_tensors = sum(len(ms) for ms in ps._global["bench"].rank_metas.values())

    req = EngineRequest(parent, rank)
    from dataclasses import replace

    timings: dict[str, list[float]] = {}
    last: dict[str, object] = {}
    with RssSampler() as rss:
        for mode in modes:
            ps.config = replace(ps.config, update=replace(ps.config.update, mode="auto" if mode == "p2p" else mode))
            ranks = list(range(world)) if mode == "p2p" else None
            timings[mode], last[mode] = timed_updates(ps, "bench", req, args.repeats + 1, ranks=ranks)
    m = last[modes[0]]
    buffers = 2 * m.bucket_size_bytes if ("collective" in timings or "p2p" in timings) else 0
    bound = [measure_copy(total, broadcast=True) for _ in range(args.repeats + 1)]
    memcpy = [measure_copy(total, broadcast=False) for _ in range(args.repeats + 1)]
    naive = (
        [] if args.skip_naive else [measure_naive(ps, "bench", rank, world, parent, i) for i in range(args.repeats + 1)]
    )
    parent.send_bytes(json.dumps({"op": "exit"}).encode())
    engine.join(30)

    peak = torch.tensor([rss.peak - baseline_rss, registered + buffers], dtype=torch.int64)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        update_s = statistics.median(timings[modes[0]][1:])
        bound_s = statistics.median(bound[1:])
        result = {
            "bench": "bench_update",
            "world_size": world,
            "total_gib": round(total / 2**30, 3),
            "num_tensors": num_tensors,
            "bucket_size_mib": round(m.bucket_size_bytes / 2**20, 1),
            "num_buckets": m.num_buckets,
            "mode": m.mode,
            "update_s": round(update_s, 4),
            "update_gib_per_s": round(total / 2**30 / update_s, 3),
            "bound_s": round(bound_s, 4),
            "ratio_to_bound": round(update_s / bound_s, 3),
        }
        for mode, ts in timings.items():
            med = statistics.median(ts[1:])
            result[f"{last[mode].mode}_update_s"] = round(med, 4)
            result[f"{last[mode].mode}_ratio_to_bound"] = round(med / bound_s, 3)
            if last[mode].mode == "local":  # nothing is broadcast: the floor is one memcpy per engine
                result["memcpy_s"] = round(statistics.median(memcpy[1:]), 4)
                result["local_ratio_to_memcpy"] = round(med / statistics.median(memcpy[1:]), 3)
            result[f"{last[mode].mode}_all_s"] = [round(x, 4) for x in ts]
            result[f"{last[mode].mode}_stages_s"] = {
                k: round(getattr(last[mode], k), 4)
                for k in (
                    "open_s",
                    "setup_s",
                    "copy_in_s",
                    "broadcast_s",
                    "engine_wait_s",
                    "agree_s",
                    "finish_s",
                    "close_s",
                )
            }
        result.update(
            {
                "peak_rss_gib": [round(int(p[0]) / 2**30, 3) for p in peaks],
                "registered_plus_buffers_gib": [round(int(p[1]) / 2**30, 3) for p in peaks],
                "rss_overhead": [round(int(p[0]) / int(p[1]) - 1, 3) for p in peaks],
            }
        )
        if naive:
            naive_s = statistics.median(naive[1:])
            result.update(naive_s=round(naive_s, 4), speedup_vs_naive=round(naive_s / update_s, 3))
        result["targets"] = {
            "ratio_to_bound<=1.3": result["ratio_to_bound"] <= 1.3,
            "speedup_vs_naive>=2": result.get("speedup_vs_naive", 0) >= 2,
            "rss_overhead<=0.10": max(result["rss_overhead"]) <= 0.10,
        }
        if "local_ratio_to_memcpy" in result:
            result["targets"]["local_ratio_to_memcpy<=1.2"] = result["local_ratio_to_memcpy"] <= 1.2
        print(json.dumps(result), flush=True)
    ps.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
