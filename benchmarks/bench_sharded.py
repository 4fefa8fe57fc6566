"""Sharded vs broadcast engine reads at tensor parallel 2, on real Mooncake transfer engines (TCP loopback).

    python benchmarks/bench_sharded.py [--size-gib 0.5] [--pairs 5] [--bucket-mib 64] [--row-parallel rows]

One process holds an owner and two engine "ranks". The owner (a P2PStore) registers one flat uint8
buffer holding every tensor of a synthetic Qwen2-like bf16 checkpoint (random bytes, 4 KiB-aligned
offsets). Each rank is an `EngineReads` with its own P2PStore; it reads the checkpoint bucket by bucket
(`begin`, `start`/`finish` with the next bucket in flight, `end`) into its scratch, as an engine
rank reading a pull itself does. Modes:

    broadcast  every rank reads every tensor whole (`set_slices(None)`): what a rank gets today
    sharded    every rank reads only the slices its TP loaders consume (`set_slices(plan slices)`,
               `sharding.shard_plan.plan_hf` at TP 2): column-parallel and vocab tensors are one byte
               range each, row-parallel ones (o_proj, down_proj: split along dim 1) one range per row
    sharded-whole  (--row-parallel whole, or the third mode of --compare-row-parallel, on by default)
               sharded, but row-parallel tensors read whole (a rank's rows span the whole tensor: their
               covering range is the tensor less under one row): few large reads, not thousands of small

Both ranks run concurrently on threads (--sequential: one after the other). The modes alternate in
pairs (AB, BA, ...: `--pairs`), after one untimed warm-up per mode that also checks the bytes: every
slice a rank consumes, as it landed in the scratch, equals the owner's bytes there.

Output: a table per mode (wall time of both ranks' update: median and min-max over the pairs; bytes
each rank read as counted by the reader's `stats.scratch_bytes`, and as a fraction of the whole model;
read ranges per rank from the plan via `byte_ranges`; each rank's `stats.read_s` and, of it, the
seconds in P2PStore.submit and PendingReads.poll, i.e. Python handling the ranges), the time ratio
to broadcast per pair (median, min, max), then the LAST line: one JSON object (the headline
"sharded" is the --row-parallel variant; the other one's figures carry a sharded_whole_ or
sharded_rows_ prefix). A time ratio well under 1 means sharding pays on this transport; sharded-whole
well under sharded means row-sized reads dominate over TCP, and the PS should lay out row-parallel
tensors per rank (so each rank's part is one range).

Mooncake's TCP transport queues at most 1024 transfers per peer by default and fails the ones past
it (status -1); P2PStore keeps at most MAX_IN_FLIGHT (256) of one read's ranges in flight and submits
the rest as those end, so Mooncake's default holds. --mc-tcp-queue N raises Mooncake's bound before
the transfer engines start (0, the default: Mooncake's own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time

MODEL = dict(hidden=1024, heads=16, kv_heads=8, ffn=2816, vocab=32000)  # Qwen2-like; kv heads divide TP 2
ALIGN = 4096  # owner-buffer offset of every tensor
TP = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=0.5, help="checkpoint size to aim for (sets the layers)")
    p.add_argument("--layers", type=int, default=None, help="number of decoder layers (overrides --size-gib)")
    p.add_argument("--bucket-mib", type=float, default=64.0, help="bucket size (whole tensors, checkpoint order)")
    p.add_argument("--pairs", type=int, default=5, help="timed pairs of runs per mode (AB BA ...)")
    p.add_argument(
        "--row-parallel",
        choices=("rows", "whole"),
        default="rows",
        help="sharded mode's reads of o_proj/down_proj: one range per row, or the whole tensor",
    )
    p.add_argument(
        "--compare-row-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the other --row-parallel variant, as a third mode in the rotation",
    )
    p.add_argument("--sequential", action="store_true", help="run the two ranks one after the other")
    p.add_argument("--timeout-s", type=float, default=120.0, help="bound on every read and every rank's update")
    p.add_argument(
        "--mc-tcp-queue",
        type=int,
        default=0,
        help="Mooncake's per-peer TCP queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and "
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER, unless already set in the environment); "
        "0: Mooncake's default (1024)",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("size_gib", "bucket_mib", "pairs", "timeout_s"):
        if not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be > 0")
    if not 0 <= a.mc_tcp_queue <= 65535:
        p.error(f"--mc-tcp-queue={a.mc_tcp_queue} must be in 0..65535 (Mooncake's bound)")
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers={a.layers} must be >= 1")
    return a


def model_shape(args):
    """The ModelShape: MODEL's widths, layers from --layers or to reach --size-gib (at least 1)."""
    from ckpt_common.layout.shapes import ModelShape, hf_param_shapes

    def shape(layers: int):
        return ModelShape(
            num_layers=layers, hidden_size=MODEL["hidden"], num_attention_heads=MODEL["heads"],
            num_query_groups=MODEL["kv_heads"], head_dim=MODEL["hidden"] // MODEL["heads"],
            ffn_hidden_size=MODEL["ffn"], vocab_size=MODEL["vocab"],
        )  # fmt: skip

    if args.layers is not None:
        return shape(args.layers)

    def nbytes(layers: int) -> int:
        return sum(2 * _prod(s) for s in hf_param_shapes(shape(layers)).values())

    per_layer = nbytes(2) - nbytes(1)
    rest = nbytes(1) - per_layer  # embeddings, lm_head, final norm
    layers = max(1, round((args.size_gib * 2**30 - rest) / per_layer))
    return shape(layers)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def is_row_parallel(name: str) -> bool:
    return name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))


def rank_slices(plan, shapes: dict, rank: int, row_parallel: str) -> dict:
    """name -> the slices rank `rank` consumes (plan order); row-parallel tensors whole with 'whole'."""
    from checkpoint_engine.sharding.slices import SourceSlice

    out = {}
    for s in plan.slices((rank, 0)):
        out[s.name] = (SourceSlice(s.name),) if row_parallel == "whole" and is_row_parallel(s.name) else (s,)
    for name in shapes:  # a tensor this rank consumes none of is not read at all (EngineReads would read it whole)
        out.setdefault(name, ())
    return out


def read_ranges(slices: dict | None, shapes: dict) -> int:
    """How many byte ranges a rank reads: one per tensor when whole, else `byte_ranges` of its slices."""
    from checkpoint_engine.sharding.shard_plan import byte_ranges

    if slices is None:
        return len(shapes)
    return sum(len(byte_ranges(s, shapes[n], "bfloat16")) for n, ss in slices.items() for s in ss)


def timed_store(cfg):
    """A P2PStore that adds up, per update, the seconds spent handing reads to Mooncake (`submit_s`:
    one Mooncake batch per byte range) and looking at their status (`poll_s`: every look checks each
    batch still in flight): tells the cost of many small ranges in Python from the transfer itself."""
    from checkpoint_engine.transport.mooncake import P2PStore

    class TimedStore(P2PStore):
        submit_s = 0.0
        poll_s = 0.0

        def submit(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                pending = super().submit(*a, **kw)
            finally:
                self.submit_s += time.perf_counter() - t0
            poll = pending.poll

            def timed_poll() -> bool:
                t1 = time.perf_counter()
                try:
                    return poll()
                finally:
                    self.poll_s += time.perf_counter() - t1

            pending.poll = timed_poll  # wait() calls self.poll: the instance attribute
            return pending

    return TimedStore(cfg)


class Rank:
    """One engine rank: its EngineReads (own transfer engine), reading the owner's checkpoint in buckets."""

    def __init__(self, index: int, timeout_s: float, stores: list):
        from checkpoint_engine.transport.engine_reads import EngineReads

        def factory(cfg):  # keep the store: its submit time is read per update, and it is closed at the end
            self.store = timed_store(cfg)
            stores.append(self.store)
            return self.store

        self.store = None
        self.index = index
        self.reads = EngineReads(read_timeout_s=timeout_s, store_factory=factory)
        self.stats = None
        self.error: BaseException | None = None

    def update(self, handles, tensors, buckets, slices_fn, check=None) -> None:
        """One update: begin, every bucket (the next one's reads submitted before this one is waited
        for, as the worker does), end. `check(rank, views)` sees each bucket's views before the bucket
        after next reuses their scratch."""
        r = self.reads
        if self.store is not None:
            self.store.submit_s = self.store.poll_s = 0.0
        r.set_slices(slices_fn)
        r.begin(handles, "127.0.0.1", tensors)
        try:
            cur = r.start(handles, buckets[0])
            for i in range(len(buckets)):
                nxt = r.start(handles, buckets[i + 1]) if i + 1 < len(buckets) else None
                views = cur.finish()
                if check is not None:
                    check(self.index, views)
                cur = nxt
        finally:
            r.end()
        self.stats = r.stats

    def run(self, *a, **kw) -> None:
        try:
            self.update(*a, **kw)
        except BaseException as e:  # noqa: BLE001 - reported by the caller, naming the rank
            self.error = e


def run_update(ranks, args, handles, tensors, buckets, slices_of, check=None) -> float:
    """Both ranks' update (threads, or one after the other); wall seconds. Every wait is bounded."""
    t0 = time.perf_counter()
    calls = [(rk, (handles, tensors, buckets, slices_of[rk.index]), {"check": check}) for rk in ranks]
    if args.sequential:
        for rk, a, kw in calls:
            rk.update(*a, **kw)
    else:
        threads = [threading.Thread(target=rk.run, args=a, kwargs=kw, daemon=True) for rk, a, kw in calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + args.timeout_s * 2
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"an engine rank's update did not finish within {args.timeout_s * 2:g} s")
        for rk in ranks:
            if rk.error is not None:
                err, rk.error = rk.error, None
                raise RuntimeError(f"engine rank {rk.index}: {type(err).__name__}: {err}") from err
    return time.perf_counter() - t0


def make_checker(owner_buf, offsets: dict, slices_of_mode: list, checked: list):
    """check(rank, views): every slice the rank consumes equals the owner's bytes there (compared as
    int16: random bf16 bytes hold NaNs, which never compare equal)."""
    import torch

    def check(rank: int, views) -> None:
        wanted = slices_of_mode[rank]
        for name, view in views:
            src = owner_buf[offsets[name] : offsets[name] + view.numel() * 2].view(torch.int16).view(view.shape)
            got = view.view(torch.int16)
            for s in wanted[name] if wanted is not None else (None,):
                if s is None or s.whole:
                    a, b = got, src
                else:
                    a, b = got.narrow(s.dim, s.start, s.stop - s.start), src.narrow(s.dim, s.start, s.stop - s.start)
                if not torch.equal(a, b):
                    raise AssertionError(f"rank {rank}: {name} slice {s} differs from the owner's bytes")
                checked[rank] += 1

    return check


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.3f}  [{min(xs):.3f} .. {max(xs):.3f}]"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from _common import cpu_model

    from checkpoint_engine import protocol as P
    from checkpoint_engine.sharding.shard_plan import plan_hf, slice_nbytes
    from checkpoint_engine.sharding.slices import EngineLayout
    from checkpoint_engine.transport.mooncake import P2PConfig, P2PStore
    from ckpt_common.layout.shapes import hf_param_shapes

    torch.set_num_threads(1)
    # Mooncake reads its TCP queue bounds when a transfer engine starts: set them before the first one.
    # EngineReads submits one Mooncake transfer per byte range, all of a bucket (two buckets) at once;
    # a row-parallel tensor's slice is one range per row, thousands, past the default queue of 1024.
    if args.mc_tcp_queue:
        for var in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
            os.environ.setdefault(var, str(args.mc_tcp_queue))
    mc_queue = os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "default (1024)")
    shape = model_shape(args)
    shapes = hf_param_shapes(shape)
    plan = plan_hf(shape, EngineLayout(tp_size=TP))

    # the owner's flat buffer: every tensor at an ALIGN-aligned offset, random bytes
    offsets, end = {}, 0
    for name, s in shapes.items():
        offsets[name] = end
        end = -(-(end + 2 * _prod(s)) // ALIGN) * ALIGN
    model_bytes = sum(2 * _prod(s) for s in shapes.values())
    owner_buf = torch.empty(end, dtype=torch.uint8)
    owner_buf.random_(0, 256, generator=torch.Generator().manual_seed(args.seed))

    stores: list = []
    owner = P2PStore(P2PConfig(read_timeout_s=args.timeout_s))
    stores.append(owner)
    try:
        owner.register(owner_buf.data_ptr(), owner_buf.numel())
        handles = (
            P.BufferHandle(kind="remote", size_bytes=owner_buf.numel(), peer=owner.addr, ptr=owner_buf.data_ptr()),
        )
        tensors = tuple(P.WireTensor(n, "bfloat16", tuple(s), 0, offsets[n]) for n, s in shapes.items())
        buckets, size = [[]], 0  # whole tensors in checkpoint order, <= bucket size (a bigger one alone)
        limit = int(args.bucket_mib * 2**20)
        for t in tensors:
            n = 2 * _prod(t.shape)
            if buckets[-1] and size + n > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += n

        other = "whole" if args.row_parallel == "rows" else "rows"
        sharded_name = "sharded" if args.row_parallel == "rows" else "sharded-whole"
        modes = {"broadcast": [None] * TP}  # mode -> per-rank slices (None: whole tensors)
        modes[sharded_name] = [rank_slices(plan, shapes, r, args.row_parallel) for r in range(TP)]
        if args.compare_row_parallel:
            modes["sharded" if other == "rows" else "sharded-whole"] = [
                rank_slices(plan, shapes, r, other) for r in range(TP)
            ]
        # one slices function per (mode, rank), kept: EngineReads asks it once per name while it is set
        fns = {m: [None if sl is None else (lambda items, sl=sl: {n: sl[n] for n, _, _ in items}) for sl in per]
               for m, per in modes.items()}  # fmt: skip
        ranges = {m: [read_ranges(sl, shapes) for sl in per] for m, per in modes.items()}

        ranks = [Rank(r, args.timeout_s, stores) for r in range(TP)]
        print(
            f"model: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_attention_heads} heads "
            f"({shape.num_query_groups} kv), ffn {shape.ffn_hidden_size}, vocab {shape.vocab_size}: "
            f"{len(shapes)} tensors, {model_bytes / 2**30:.3f} GiB bf16, {len(buckets)} buckets of <= "
            f"{args.bucket_mib:g} MiB; TP {TP}, ranks {'sequential' if args.sequential else 'concurrent'}; "
            f"Mooncake TCP queue per peer {mc_queue}",
            flush=True,
        )

        # warm-up per mode (untimed): opens the connections, and checks every consumed slice's bytes
        read_bytes: dict[str, list[int]] = {}
        for m in modes:
            checked = [0] * TP
            check = make_checker(owner_buf, offsets, modes[m], checked)
            dt = run_update(ranks, args, handles, tensors, buckets, fns[m], check=check)
            read_bytes[m] = [rk.stats.scratch_bytes for rk in ranks]
            for rk in ranks:  # the reader's count against the slices it was given (whole: the model)
                sl = modes[m][rk.index]
                want = (
                    model_bytes
                    if sl is None
                    else sum(slice_nbytes(s, shapes[n], "bfloat16") for n, ss in sl.items() for s in ss)
                )
                if rk.stats.scratch_bytes != want:
                    raise AssertionError(
                        f"{m} rank {rk.index}: read {rk.stats.scratch_bytes} bytes, slices hold {want}"
                    )
            print(f"warm-up {m:14s} {dt:7.3f} s, bytes checked: {checked} slices per rank", flush=True)

        # timed: the modes in alternating order, AB BA ... (ABC CBA ... with a third)
        order = list(modes)
        times: dict[str, list[float]] = {m: [] for m in modes}
        per_rank_read_s: dict[str, list[list[float]]] = {m: [[] for _ in range(TP)] for m in modes}
        per_rank_submit_s: dict[str, list[list[float]]] = {m: [[] for _ in range(TP)] for m in modes}
        per_rank_poll_s: dict[str, list[list[float]]] = {m: [[] for _ in range(TP)] for m in modes}
        for i in range(args.pairs):
            for m in order if i % 2 == 0 else order[::-1]:
                times[m].append(run_update(ranks, args, handles, tensors, buckets, fns[m]))
                for rk in ranks:
                    per_rank_read_s[m][rk.index].append(rk.stats.read_s)
                    per_rank_submit_s[m][rk.index].append(rk.store.submit_s)
                    per_rank_poll_s[m][rk.index].append(rk.store.poll_s)
                    if rk.stats.scratch_bytes != read_bytes[m][rk.index]:
                        raise AssertionError(f"{m} rank {rk.index}: read {rk.stats.scratch_bytes} bytes this time")
    finally:
        for store in stores[1:] + stores[:1]:  # readers first, then the owner
            store.close()
        # drop the transfer engines now: their destructors log, and the JSON line must come last
        ranks = stores = owner = rk = store = None  # rk, store: the last loops' items
        gc.collect()

    print()
    print(f"{'mode':14s} {'wall s: median [min .. max]':30s} {'read GiB/rank':>16s} {'of model':>14s} "
          f"{'ranges/rank':>16s} {'read_s/rank':>14s} {'submit_s/rank':>14s} {'poll_s/rank':>14s}")  # fmt: skip
    for m in modes:
        gib = "/".join(f"{b / 2**30:.3f}" for b in read_bytes[m])
        frac = "/".join(f"{b / model_bytes:.3f}" for b in read_bytes[m])
        rng = "/".join(str(x) for x in ranges[m])
        rs = "/".join(f"{statistics.median(x):.3f}" for x in per_rank_read_s[m])
        ss = "/".join(f"{statistics.median(x):.3f}" for x in per_rank_submit_s[m])
        ps = "/".join(f"{statistics.median(x):.3f}" for x in per_rank_poll_s[m])
        print(f"{m:14s} {spread(times[m]):30s} {gib:>16s} {frac:>14s} {rng:>16s} {rs:>14s} {ss:>14s} {ps:>14s}")
    print(
        "(medians; read_s: EngineReads.stats.read_s, submitting + waiting; of it, submit_s inside "
        "P2PStore.submit, poll_s inside PendingReads.poll: Python's share of handling the ranges)"
    )
    ratios = {m: [a / b for a, b in zip(times[m], times["broadcast"], strict=True)] for m in modes if m != "broadcast"}
    for m, rs in ratios.items():
        print(f"time ratio {m}/broadcast per pair: {spread(rs)}   ({', '.join(f'{x:.3f}' for x in rs)})")

    head = ratios[sharded_name]
    result = {
        "bench": "bench_sharded",
        "model_bytes": model_bytes,
        "num_tensors": len(shapes),
        "layers": shape.num_layers,
        "tp": TP,
        "bucket_mib": args.bucket_mib,
        "concurrent": not args.sequential,
        "row_parallel": args.row_parallel,
        "bytes_per_rank": read_bytes[sharded_name],
        "bytes_per_rank_ratio": [round(b / model_bytes, 4) for b in read_bytes[sharded_name]],
        "sharded_s_median": round(statistics.median(times[sharded_name]), 4),
        "broadcast_s_median": round(statistics.median(times["broadcast"]), 4),
        "time_ratio_median": round(statistics.median(head), 4),
        "time_ratio_min": round(min(head), 4),
        "time_ratio_max": round(max(head), 4),
        "pairs": args.pairs,
        "read_ranges_per_rank": ranges[sharded_name],
        "broadcast_read_ranges_per_rank": ranges["broadcast"],
    }
    if args.compare_row_parallel:
        alt = next(m for m in modes if m not in ("broadcast", sharded_name))
        key = "sharded_whole" if alt == "sharded-whole" else "sharded_rows"
        result.update({
            f"{key}_s_median": round(statistics.median(times[alt]), 4),
            f"{key}_time_ratio_median": round(statistics.median(ratios[alt]), 4),
            f"{key}_time_ratio_min": round(min(ratios[alt]), 4),
            f"{key}_time_ratio_max": round(max(ratios[alt]), 4),
            f"{key}_bytes_per_rank_ratio": [round(b / model_bytes, 4) for b in read_bytes[alt]],
            f"{key}_read_ranges_per_rank": ranges[alt],
        })  # fmt: skip
    result["mc_tcp_max_queued_transfers_per_peer"] = mc_queue
    result["cpu"] = cpu_model()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
