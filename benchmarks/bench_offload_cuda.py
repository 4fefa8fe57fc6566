"""Colocated switch, trainer side: a GPU trainer lends its device memory to the engines and takes it back.

    python benchmarks/bench_offload_cuda.py [--layers 16 --repeats 3]

A Llama-8B-like decoder's weights in float32 on the GPU (--layers of them) as trainable parameters,
with AdamW's two moments after one step (k1.5 trains in full precision here; 3 x the weights in
all). Measured in one run, median of --repeats:
  release_s  `trainer.offload.DeviceOffload.release`: every tensor to pinned host memory, the
             device's cache emptied (train -> inference, trainer side)
  reclaim_s  the tensors back on the device (inference -> train, trainer side)
  d2h_s, h2d_s  one copy of the same bytes between one device buffer and one pinned host buffer:
             the floor of any such move (ratio_release_to_d2h, ratio_reclaim_to_h2d)
The first release allocates the pinned host copies (reported apart: first_release_s); later ones
reuse them. The last line printed is one JSON object. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import decoder_specs

GIB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="decoder layers (16: ~8.4 GiB of bf16 weights)")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from trainer.offload import DeviceOffload

    if not torch.cuda.is_available():
        raise SystemExit("bench_offload_cuda needs a CUDA GPU")
    specs = decoder_specs(args.layers, hidden=4096, intermediate=14336, kv=1024, vocab=128256)
    # half the hidden size: the float32 weights and two moments of 16 layers fit beside the engines' share
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(*[max(1, d // 2) for d in shape], device="cuda")) for _, shape in specs]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    offload = DeviceOffload(model, lambda: opt)
    first = offload.release()
    after_release = first.device_allocated_bytes
    offload.reclaim()
    releases, reclaims = [], []
    for _ in range(args.repeats):
        releases.append(offload.release().seconds)
        reclaims.append(offload.reclaim().seconds)
    nbytes = first.moved_bytes
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
    release_s, reclaim_s = statistics.median(releases), statistics.median(reclaims)
    d2h_s, h2d_s = statistics.median(d2h), statistics.median(h2d)
    out = {
        "bench": "bench_offload_cuda",
        "gpu": torch.cuda.get_device_name(0),
        "moved_gib": round(nbytes / GIB, 3),
        "num_tensors": len(specs) * 3,
        "device_gib_before": round(held / GIB, 3),
        "device_gib_after_release": round(after_release / GIB, 3),
        "first_release_s": round(first.seconds, 4),
        "release_s": round(release_s, 4),
        "reclaim_s": round(reclaim_s, 4),
        "d2h_s": round(d2h_s, 4),
        "h2d_s": round(h2d_s, 4),
        "release_gib_per_s": round(nbytes / GIB / release_s, 2),
        "reclaim_gib_per_s": round(nbytes / GIB / reclaim_s, 2),
        "ratio_release_to_d2h": round(release_s / d2h_s, 3),
        "ratio_reclaim_to_h2d": round(reclaim_s / h2d_s, 3),
        "all_release_s": [round(x, 4) for x in releases],
        "all_reclaim_s": [round(x, 4) for x in reclaims],
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
