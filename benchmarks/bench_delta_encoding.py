"""Delta-encoding benchmark: encode and apply speed next to a memcpy, and bytes with and without zstd.

    python benchmarks/bench_delta_encoding.py [--rows 2048 --cols 4096 --shares 0.01,0.1,0.33 --runs 5]

One weight of --rows x --cols, N(0, 0.02), as the engine holds it: bf16 (a cast), and fp8 e4m3 quantised
in 128x128 blocks with one float32 scale per block (amax / 448). Version v+1 changes a --shares share of
its values, at uniformly random places, by one step of the last bit (what an RL step with a small
learning rate does: a value crosses a rounding edge). Per (dtype, share), --runs paired runs, each:

    full     dst.copy_(src) of the whole tensor (the memcpy a full update's engine side does; the median
             of 5 copies, timed in the same run)
    encode   checkpoint_engine.sharding.delta.encode(base, new) (+ compress=True: zstd per part)
    apply    apply(copy of base, delta): checks, CRC-32 of base, writes, CRC-32 of the result

and prints, median (min..max) over the runs, encode and apply throughput as ratios to that run's copy
(copy time / encode time: 1.0 = as fast as a memcpy), the encoding chosen, and the encoded bytes /
full bytes without and with zstd, and each payload part's compressed / raw bytes. The last line printed
is one JSON object with these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import cpu_model, require_positive


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096, help="rows of the weight (a multiple of 128 for fp8 blocks)")
    p.add_argument("--cols", type=int, default=4096, help="columns of the weight (a multiple of 128)")
    p.add_argument("--shares", default="0.01,0.1,0.33", help="comma-separated changed shares")
    p.add_argument("--runs", type=int, default=7, help="paired runs per case")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared machine a parallel op waits for the busiest core)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    require_positive(p, args, ["rows", "cols", "runs", "threads"])
    if args.rows % 128 or args.cols % 128:
        p.error(f"--rows={args.rows} and --cols={args.cols} must be multiples of 128 (fp8 blocks)")
    return args


def spread(values: list[float]) -> dict:
    return {k: round(f(values), 4) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


def fp8_blocks(w, block: int = 128):
    """(fp8 e4m3 weight, float32 scale per block): each 128x128 block scaled so its amax is 448."""
    import torch

    r, c = w.shape
    blocks = w.reshape(r // block, block, c // block, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(r, c)
    return q, scale.float()


def step(base, share: float, gen):
    """`base` with a `share` of its values moved by one unit of the last bit, at random places."""
    import torch

    new = base.clone()
    n = base.numel()
    idx = torch.randperm(n, generator=gen)[: round(share * n)]
    width = {1: torch.uint8, 2: torch.int16}[base.element_size()]
    bits = new.reshape(-1).view(width)
    bits[idx] ^= 1
    return new


def part_ratios(raw, packed) -> list:
    """Compressed / raw bytes of each payload part (1.0 where zstd was not kept)."""
    return [
        round(p.numel() * p.element_size() / max(r.numel() * r.element_size(), 1), 4)
        for r, p in zip(raw.payload, packed.payload)
    ]


def measure(base, new, runs: int) -> dict:
    import torch

    from checkpoint_engine.sharding.delta import apply, encode

    dst = torch.empty_like(base)
    figures = {k: [] for k in ("encode", "encode_zstd", "apply", "apply_zstd", "copy_ms")}
    apply(base.clone(), encode(base, new, compress=True))  # warm-up: the first touch of dst, allocator
    dst.copy_(new)
    for _ in range(runs):
        copies = []
        for _ in range(5):  # one copy of a few MB is too short to time alone on a shared machine
            t0 = time.perf_counter()
            dst.copy_(new)
            copies.append(time.perf_counter() - t0)
        copy_s = statistics.median(copies)
        figures["copy_ms"].append(copy_s * 1e3)
        t0 = time.perf_counter()
        raw = encode(base, new)
        t1 = time.perf_counter()
        packed = encode(base, new, compress=True)
        t2 = time.perf_counter()
        for delta, key in ((raw, "apply"), (packed, "apply_zstd")):
            target = base.clone()
            t3 = time.perf_counter()
            apply(target, delta)
            figures[key].append(copy_s / (time.perf_counter() - t3))
            assert torch.equal(target.view(torch.uint8), new.view(torch.uint8))
        figures["encode"].append(copy_s / (t1 - t0))
        figures["encode_zstd"].append(copy_s / (t2 - t1))
    full = raw.full_bytes
    return {
        "encoding": raw.encoding,
        "gap_width": raw.gap_width,
        "bytes_vs_full": round(raw.nbytes / full, 4),
        "bytes_vs_full_zstd": round(packed.nbytes / full, 4),
        "part_zstd_ratio": part_ratios(raw, packed),
        "copy_ms": spread(figures.pop("copy_ms")),
        **{f"{k}_vs_memcpy": spread(v) for k, v in figures.items()},
    }


def main() -> int:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    shares = [float(x) for x in args.shares.split(",") if x]
    gen = torch.Generator().manual_seed(args.seed)
    w = torch.randn(args.rows, args.cols, generator=gen) * 0.02
    q, scale = fp8_blocks(w)
    tables = {"bfloat16": w.to(torch.bfloat16), "float8_e4m3fn": q}
    print(
        f"{args.rows}x{args.cols} weight; fp8 with {scale.numel()} float32 block scales; "
        f"torch threads {torch.get_num_threads()}"
    )
    results = []
    for dtype, base in tables.items():
        for share in shares:
            row = {"dtype": dtype, "share": share, **measure(base, step(base, share, gen), args.runs)}
            results.append(row)
            e, a = row["encode_vs_memcpy"], row["apply_vs_memcpy"]
            print(
                f"{dtype:>14} {share:>5.0%}: {row['encoding']:>7} (w {row['gap_width']})  "
                f"bytes/full {row['bytes_vs_full']:.4f}, zstd {row['bytes_vs_full_zstd']:.4f} "
                f"(parts {row['part_zstd_ratio']})  encode {e['median']:.3f}x memcpy "
                f"({e['min']:.3f}..{e['max']:.3f}), zstd {row['encode_zstd_vs_memcpy']['median']:.3f}x  "
                f"apply {a['median']:.3f}x ({a['min']:.3f}..{a['max']:.3f}), "
                f"zstd {row['apply_zstd_vs_memcpy']['median']:.3f}x"
            )
    print(
        json.dumps(
            {
                "benchmark": "delta_encoding",
                "synthetic": "N(0,0.02) weight, uniformly random last-bit changes",
                "shape": [args.rows, args.cols],
                "runs": args.runs,
                "cpu": cpu_model(),
                "torch_threads": torch.get_num_threads(),
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
