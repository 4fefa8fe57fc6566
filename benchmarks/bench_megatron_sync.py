"""Megatron -> HF conversion speed vs a plain memcpy of the same bytes (one process, CPU).

    python benchmarks/bench_megatron_sync.py [--layers 8 --hidden 1024 --tp 2 --pp 1 --dtype bfloat16]

A synthetic Qwen2-shaped checkpoint (GQA, qkv bias, untied embeddings) is sharded the Megatron way
(trainer.megatron.convert.hf_to_megatron) for every (pp, tp) rank; then, best of --repeats:
  convert_s        megatron_to_hf into preallocated HF tensors (what a sync does: merge TP shards,
                   un-interleave QKV, split fc1 into gate/up, straight into host memory)
  convert_alloc_s  the same, allocating the HF tensors (first-touch pages included)
  to_megatron_s    hf_to_megatron (the inverse, allocating), for reference
  memcpy_s         one copy of all the bytes, flat buffer to flat buffer (the floor)
  memcpy_s is the faster of a 1-thread and a --threads memcpy
ratio_convert_vs_memcpy = memcpy_s / convert_s (1.0 = as fast as memcpy; target >= 0.5).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads of the process (0: torch's default)")
    p.add_argument("--copy-threads", type=int, default=1,
                   help="threads of the conversion's copies (convert.copy_threads_context; 0: the process's)")
    return p.parse_args(argv)


def _best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from trainer.megatron.convert import ModelShape, Parallelism, hf_param_shapes, hf_to_megatron, megatron_to_hf

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = ModelShape(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       num_query_groups=args.kv_heads, head_dim=args.hidden // args.heads,
                       ffn_hidden_size=args.ffn, vocab_size=args.vocab)
    parallel = Parallelism(tp_size=args.tp, pp_size=args.pp)
    shapes = hf_param_shapes(shape)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    flat_src = torch.empty(total, dtype=dtype).normal_()
    hf, offset = {}, 0
    for name, dims in shapes.items():
        n = torch.Size(dims).numel()
        hf[name] = flat_src[offset:offset + n].view(dims)
        offset += n
    num_bytes = total * dtype.itemsize
    shards = hf_to_megatron(hf, shape, parallel)

    flat_dst = torch.empty_like(flat_src)
    flat_dst.copy_(flat_src)  # touch every page once
    out, offset = {}, 0
    for name, dims in shapes.items():
        n = torch.Size(dims).numel()
        out[name] = flat_dst[offset:offset + n].view(dims)
        offset += n

    memcpy_threads_s = _best_of(args.repeats, lambda: flat_dst.copy_(flat_src))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    memcpy_1_thread_s = _best_of(args.repeats, lambda: flat_dst.copy_(flat_src))
    torch.set_num_threads(threads)
    memcpy_s = min(memcpy_threads_s, memcpy_1_thread_s)
    copy_threads = args.copy_threads or None
    flat_dst.zero_()
    convert_s = _best_of(args.repeats, lambda: megatron_to_hf(shards, shape, parallel, out=out,
                                                              copy_threads=copy_threads))
    if not torch.equal(flat_dst, flat_src):
        raise RuntimeError("conversion into preallocated tensors is not bit-exact")
    convert_alloc_s = _best_of(args.repeats, lambda: megatron_to_hf(shards, shape, parallel,
                                                                    copy_threads=copy_threads))
    to_megatron_s = _best_of(args.repeats, lambda: hf_to_megatron(hf, shape, parallel, copy_threads=copy_threads))
    gib = num_bytes / 2**30
    result = {
        "bench": "megatron_sync", "dtype": args.dtype, "tp": args.tp, "pp": args.pp,
        "num_tensors": len(shapes), "size_gib": round(gib, 3), "torch_threads": threads,
        "copy_threads": args.copy_threads, "memcpy_1_thread_s": round(memcpy_1_thread_s, 4),
        "memcpy_threads_s": round(memcpy_threads_s, 4),
        "memcpy_s": round(memcpy_s, 4), "convert_s": round(convert_s, 4),
        "convert_alloc_s": round(convert_alloc_s, 4), "to_megatron_s": round(to_megatron_s, 4),
        "memcpy_gib_s": round(gib / memcpy_s, 2), "convert_gib_s": round(gib / convert_s, 2),
        "convert_alloc_gib_s": round(gib / convert_alloc_s, 2), "to_megatron_gib_s": round(gib / to_megatron_s, 2),
        "ratio_convert_vs_memcpy": round(memcpy_s / convert_s, 3),
        "ratio_convert_alloc_vs_memcpy": round(memcpy_s / convert_alloc_s, 3),
    }
    print(f"{gib:.2f} GiB in {len(shapes)} tensors, TP={args.tp} PP={args.pp}, {args.dtype}: "
          f"memcpy {result['memcpy_gib_s']} GiB/s, convert {result['convert_gib_s']} GiB/s "
          f"(allocating: {result['convert_alloc_gib_s']}), HF->Megatron {result['to_megatron_gib_s']} GiB/s")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
