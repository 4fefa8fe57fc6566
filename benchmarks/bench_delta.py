"""Delta-update benchmark: how much of a cast model changes per RL step, and what a delta costs.

    python benchmarks/bench_delta.py [--params 50000000 --lr 8e-5,1e-6 --dtypes bfloat16,float8_e4m3fn]

SYNTHETIC: float32 master weights N(0,1)*0.02 cut into --tensors equal tensors, updated by Adam-like
steps on RANDOM gradients (N(0,1), fresh each step). Real gradients are correlated across steps and
across elements, so real changed shares differ; this measures the mechanics and the order of magnitude.

    w (float32) --Adam step (lr)--> w' ; cast both to the engine dtype
    cast(w), cast(w') --checkpoint_engine.sharding.delta.encode_version--> VersionDelta --apply_version--> engine copy

After --warmup-steps steps (the Adam moments settle), each of --repeats steps is one version; for each
(lr, engine dtype) it prints the median and spread (min..max) over those versions of:
  changed   changed values / all values
  ratio     delta bytes / full bytes (what choose_update compares with max_ratio)
  encode_s  encode_version: bit compare, the chosen encodings, CRC-32 of base and new
  apply_s   apply_version: CRC-32 of the engine's base, the writes, CRC-32 of the result
  copy_s    a full update's engine side: one copy_ of every tensor (no checksums)
The last line printed is one JSON object with these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import cpu_model, require_positive


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=50_000_000, help="float32 master parameters in all")
    p.add_argument("--tensors", type=int, default=50, help="equal tensors the parameters are cut into")
    p.add_argument("--lr", default="8e-5,1e-6", help="comma-separated: the demo's lr, a large model's lr")
    p.add_argument("--dtypes", default="bfloat16,float8_e4m3fn", help="engine dtypes (float8 only if torch has it)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="versions measured per lr")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    require_positive(p, args, ["params", "tensors", "repeats"])
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps={args.warmup_steps} must be >= 0")
    return args


class AdamLike:
    """Adam (beta1 0.9, beta2 0.999, eps 1e-8, bias-corrected) on random N(0,1) gradients."""

    def __init__(self, weights, lr: float, seed: int):
        import torch

        self.w, self.lr = weights, lr
        self.m = [torch.zeros_like(t) for t in weights]
        self.v = [torch.zeros_like(t) for t in weights]
        self.g = torch.Generator().manual_seed(seed)
        self.steps = 0

    def step(self) -> None:
        import torch

        self.steps += 1
        bc1, bc2 = 1 - 0.9**self.steps, 1 - 0.999**self.steps
        for w, m, v in zip(self.w, self.m, self.v):
            grad = torch.randn(w.shape, generator=self.g)
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=0.001)
            denom = v.div(bc2).sqrt_().add_(1e-8)
            w.addcdiv_(m, denom, value=-self.lr / bc1)


def spread(values: list[float]) -> dict:
    """Median and range, rounded to 6 decimals (shares to 1e-6, seconds to a microsecond)."""
    return {k: round(f(values), 6) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


def measure(args, lr: float, dtypes: list) -> list[dict]:
    """One lr: fresh weights, warm-up steps, then --repeats versions measured for every engine dtype."""
    import torch

    from checkpoint_engine.sharding.delta import apply_version, encode_version
    from ckpt_common.dtypes import dtype_name

    g = torch.Generator().manual_seed(args.seed)
    rows = args.params // args.tensors // 1024 or 1
    weights = [torch.randn(rows, 1024, generator=g) * 0.02 for _ in range(args.tensors)]
    opt = AdamLike(weights, lr, args.seed + 1)
    for _ in range(args.warmup_steps):
        opt.step()

    def cast(dtype):
        return {f"w{i}": w.to(dtype) for i, w in enumerate(weights)}

    prev = {dt: cast(dt) for dt in dtypes}
    figures = {dt: {k: [] for k in ("changed", "ratio", "encode_s", "apply_s", "copy_s")} for dt in dtypes}
    encodings = {dt: {} for dt in dtypes}
    for _ in range(args.repeats):
        opt.step()
        for dt in dtypes:
            new = cast(dt)
            t0 = time.perf_counter()
            delta = encode_version(prev[dt], new)
            t1 = time.perf_counter()
            engine = {n: t.clone() for n, t in prev[dt].items()}
            t2 = time.perf_counter()
            apply_version(engine, delta)
            t3 = time.perf_counter()
            full = {n: t.clone() for n, t in prev[dt].items()}
            t4 = time.perf_counter()
            for n, t in full.items():
                t.copy_(new[n])
            t5 = time.perf_counter()
            f = figures[dt]
            f["changed"].append(delta.changed_share)
            f["ratio"].append(delta.nbytes / delta.full_bytes)
            f["encode_s"].append(t1 - t0)
            f["apply_s"].append(t3 - t2)
            f["copy_s"].append(t5 - t4)
            for d in delta.tensors.values():
                encodings[dt][d.encoding] = encodings[dt].get(d.encoding, 0) + 1
            prev[dt] = new
    return [
        {
            "lr": lr,
            "dtype": dtype_name(dt),
            **{k: spread(v) for k, v in figures[dt].items()},
            "encodings": encodings[dt],
        }
        for dt in dtypes
    ]


def main() -> int:
    args = parse_args()
    import torch

    lrs = [float(x) for x in args.lr.split(",") if x]
    dtypes = [getattr(torch, n) for n in args.dtypes.split(",") if n and hasattr(torch, n)]
    skipped = [n for n in args.dtypes.split(",") if n and not hasattr(torch, n)]
    if skipped:
        print(f"skipped dtypes this torch lacks: {skipped}")
    params = (args.params // args.tensors // 1024 or 1) * 1024 * args.tensors
    print(f"{params:,} float32 parameters in {args.tensors} tensors; torch threads {torch.get_num_threads()}")
    results = []
    for lr in lrs:
        for row in measure(args, lr, dtypes):
            results.append(row)
            med = {k: row[k]["median"] for k in ("changed", "ratio", "encode_s", "apply_s", "copy_s")}
            print(
                f"lr {lr:g} {row['dtype']:>14}: changed {med['changed']:.4f} "
                f"({row['changed']['min']:.4f}..{row['changed']['max']:.4f})  "
                f"delta/full {med['ratio']:.4f}  encode {med['encode_s']:.3f}s "
                f"({row['encode_s']['min']:.3f}..{row['encode_s']['max']:.3f})  "
                f"apply {med['apply_s']:.3f}s ({row['apply_s']['min']:.3f}..{row['apply_s']['max']:.3f})  "
                f"full copy {med['copy_s']:.3f}s  encodings {row['encodings']}"
            )
    print(
        json.dumps(
            {
                "benchmark": "delta",
                "synthetic": "random N(0,1) gradients, Adam-like steps",
                "params": params,
                "tensors": args.tensors,
                "warmup_steps": args.warmup_steps,
                "repeats": args.repeats,
                "cpu": cpu_model(),
                "torch_threads": torch.get_num_threads(),
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
