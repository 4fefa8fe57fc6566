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

Then, side by side in one run, the weight handoff from --handoff-tp trainer ranks (default 2; 0
skips) to the ParameterServer, with real processes: this one is TP rank 0 and holds the PS (CPU
transport, world 1, reuse_host_memory as the RL loop's WeightSync); it starts the other ranks over
gloo. Each rank holds its Megatron shard in --shard-dtype (the trainer's float32 parameters), the
HF checkpoint is --dtype. Best of --repeats, each a full sync's handoff:
  handoff_s        shared-memory handoff (what MegatronTrainer.named_tensors + register do now):
                   rank 0 sends the free buffer's (pid, fd, size); every rank writes its own slices
                   (convert.write_rank_slices, cast included) into ONE SharedTensorBuffer in HF
                   layout; barrier; register_checkpoint adopts the buffer (no copy)
  handoff_write_s / handoff_register_s   its two parts; handoff_first_s: the first one (fresh pages)
  gather_total_s   the old path: rank 1.. send their shards to rank 0 over gloo (gather_s), rank 0
                   megatron_to_hf into persistent buffers and casts to --dtype (gather_convert_s),
                   register_checkpoint copies into the PS's chunks (gather_register_s)
  ratio_handoff_vs_memcpy = memcpy_s / handoff_s; speedup_handoff_vs_gather = gather_total_s / handoff_s

    python benchmarks/bench_megatron_sync.py --vllm [--model-dir DIR] [--steps 3]

adds the trainer-step-end to vLLM-serving split, measured the way the RL loop syncs
(orchestrator.engine_pool.weight_sync: an in-process ParameterServer, CPU transport) from a MegatronTrainer (TP=1,
this process) into a real vLLM LLM (CPU, started on dummy weights) after each of --steps training steps:
  step_convert_s   trainer.named_tensors(): every TP rank (--trainer-tp) writes its HF slices into
                   the trainer's shared HF buffer (write_rank_slices), barrier
  step_register_s  ParameterServer.register_checkpoint (adopts that buffer: no copy) + gather_metas
  step_update_s    ParameterServer.update: buckets to the engine and its in-place reload
  step_serve_s     the first greedy request (1 token) served after the update
  step_total_s     the sum (median over steps for every field)
(default model: the tiny demo shape, written to a temporary dir.)
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
    p.add_argument(
        "--copy-threads",
        type=int,
        default=1,
        help="threads of the conversion's copies (convert.copy_threads_context; 0: the process's)",
    )
    p.add_argument("--handoff-tp", type=int, default=2, help="trainer TP ranks of the handoff comparison (0: skip it)")
    p.add_argument("--shard-dtype", choices=("bfloat16", "float32", "float16"), default="float32")
    p.add_argument("--handoff-worker", type=int, default=None, help=argparse.SUPPRESS)  # a follower rank
    p.add_argument("--handoff-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--vllm",
        action="store_true",
        help="also time trainer step end -> vLLM serving (convert / register / update / serve)",
    )
    p.add_argument("--model-dir", default=None, help="--vllm: HF model dir (default: a tiny demo-shaped model)")
    p.add_argument("--steps", type=int, default=3, help="--vllm: training steps, one sync after each")
    p.add_argument(
        "--trainer-tp",
        type=int,
        default=1,
        help="--vllm: the trainer's TP size (> 1: this process is rank 0 and starts the others; "
        "convert then includes their writes into the shared buffer)",
    )
    return p.parse_args(argv)


def step_to_serving(model_dir: str | None, steps: int, trainer_tp: int = 1) -> dict:
    """Median seconds per stage from the end of a Megatron training step to vLLM serving the new weights."""
    import os
    import statistics
    import sys
    import tempfile

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(pathlib_path(__file__).resolve().parents[1]))  # testing/: run from a checkout
    from vllm import SamplingParams

    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from testing.vllm_servers import cpu_llm
    from trainer.base import TrainerConfig
    from trainer.factory import make_trainer
    from vllm_ext.extension_req import llm_req_func

    tmp = None
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = str(make_tiny_model(pathlib_path(tmp.name) / "model", TinyModelConfig.tiny(), seed=0))
    llm = cpu_llm(model_dir)  # dummy weights
    trainer = make_trainer("megatron", model_dir, TrainerConfig(lr=1e-4, autocast_dtype="float32"), tp_size=trainer_tp)
    ps = ParameterServer(
        rank=0,
        world_size=1,
        config=ParameterServerConfig(transport="cpu", update=UpdateConfig(), reuse_host_memory=True),
    )
    req = llm_req_func(llm, timeout_s=300.0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts, responses = [(1, 20, 21, 22)] * 4, [(30, 31, 32, 33, 34, 35)] * 4
    fields: dict[str, list[float]] = {k: [] for k in ("convert", "register", "update", "serve")}
    previous = None
    try:
        for step in range(steps + 1):  # step 0 warms the engine's mappings and the PS's host memory
            trainer.step(-trainer.sequence_logprobs(prompts, responses).mean())
            t0 = time.perf_counter()
            named = trainer.named_tensors()
            t1 = time.perf_counter()
            name = f"policy-v{step}"
            ps.register_checkpoint(name, named_tensors=named)
            ps.gather_metas(name)
            t2 = time.perf_counter()
            ps.update(name, req)
            t3 = time.perf_counter()
            llm.generate([{"prompt_token_ids": [1, 20, 21]}], params, use_tqdm=False)
            t4 = time.perf_counter()
            if previous is not None:
                ps.unregister_checkpoint(previous)
            previous = name
            if step:
                for key, value in zip(fields, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    fields[key].append(value)
        num_bytes = sum(t.numel() * t.element_size() for t in named.values())
    finally:
        ps.close()
        trainer.close()
        llm.llm_engine.engine_core.shutdown()  # its shutdown logs before the result lines, not after
        if tmp is not None:
            tmp.cleanup()
    out = {f"step_{key}_s": round(statistics.median(values), 4) for key, values in fields.items()}
    out["step_total_s"] = round(sum(out.values()), 4)
    out.update(step_model_mib=round(num_bytes / 2**20, 1), step_count=steps, step_trainer_tp=trainer_tp)
    return out


def _model_shape(args):
    from ckpt_common.layout.shapes import ModelShape

    return ModelShape(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        head_dim=args.hidden // args.heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
    )


def _handoff_rank(args, rank: int, port: int) -> dict | None:
    """One trainer rank of the handoff comparison (rank 0: this process, with the PS; returns the times)."""
    import statistics

    import torch
    import torch.distributed as dist

    from checkpoint_engine.buckets import layout_tensors
    from checkpoint_engine.config import ParameterServerConfig
    from checkpoint_engine.host_memory import SharedTensorBuffer
    from checkpoint_engine.transport import shm
    from ckpt_common.dtypes import dtype_name
    from ckpt_common.layout.shapes import Parallelism, hf_param_shapes
    from trainer.megatron.convert import hf_to_megatron, megatron_to_hf, write_rank_slices

    tp = args.handoff_tp
    torch.set_num_threads(1)  # the trainer's ranks share the CPUs (TrainerConfig: usable_cpus // tp)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    shape, parallel = _model_shape(args), Parallelism(tp_size=tp)
    hf_dtype, shard_dtype = getattr(torch, args.dtype), getattr(torch, args.shard_dtype)
    shapes = hf_param_shapes(shape)
    g = torch.Generator().manual_seed(0)  # every rank builds the same model, keeps its own shard
    hf = {n: torch.randn(d, generator=g, dtype=torch.float32).to(shard_dtype) for n, d in shapes.items()}
    shards = hf_to_megatron(hf, shape, parallel, ranks=[(0, r) for r in range(tp)] if rank == 0 else [(0, rank)])
    shard = shards[(0, rank)]
    others = [{n: torch.empty_like(t) for n, t in shards[(0, r)].items()} for r in range(1, tp) if rank == 0]
    del hf, shards
    specs = [(n, dtype_name(hf_dtype), d) for n, d in shapes.items()]
    layout = layout_tensors(specs)
    ps = None
    if rank == 0:
        from checkpoint_engine.ps import ParameterServer

        ps = ParameterServer(
            rank=0, world_size=1, config=ParameterServerConfig(transport="cpu", reuse_host_memory=True)
        )
        buffers: list[SharedTensorBuffer] = []
        merged: dict[str, torch.Tensor] = {}
    mapped: dict[tuple, dict] = {}
    times: dict[str, list[float]] = {k: [] for k in ("write", "register", "gather", "convert", "gregister")}
    previous: dict[str, str | None] = {"new": None, "old": None}
    for i in range(args.repeats + 1):
        # new: the shared-memory handoff
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            buf = next((b for b in buffers if b.adopted_by is None), None)
            if buf is None:
                buf = SharedTensorBuffer(specs, tag="bench-hf")
                buffers.append(buf)
            box = torch.tensor([buf.ref.pid, buf.ref.fd, buf.ref.size_bytes], dtype=torch.int64)
            views = buf.tensors
        else:
            box = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(box, src=0)
        if rank:
            key = tuple(int(v) for v in box)
            if key not in mapped:
                mapped[key] = SharedTensorBuffer.views(shm.map_writable(shm.SegmentRef(*key)), layout)
            views = mapped[key]
        write_rank_slices(shard, views, shape, parallel, (0, rank))
        dist.barrier()
        t1 = time.perf_counter()
        if rank == 0:
            name = f"new-{i}"
            ps.register_checkpoint(name, named_tensors=dict(views))
            assert ps._checkpoints[name].adopted
            if previous["new"]:
                ps.unregister_checkpoint(previous["new"])
            previous["new"] = name
        t2 = time.perf_counter()
        # old: gather the shards to rank 0, convert, cast, register (copy)
        dist.barrier()
        t3 = time.perf_counter()
        if rank:
            for n in sorted(shard):
                dist.send(shard[n], dst=0)
        else:
            for src, received in enumerate(others, start=1):
                for n in sorted(received):
                    dist.recv(received[n], src=src)
        t4 = time.perf_counter()
        if rank == 0:
            shards = {(0, 0): shard, **{(0, r): others[r - 1] for r in range(1, tp)}}
            out = megatron_to_hf(shards, shape, parallel, out=merged)
            merged.update(out)
            named = {n: t.to(hf_dtype) for n, t in out.items()}
            t5 = time.perf_counter()
            name = f"old-{i}"
            ps.register_checkpoint(name, named_tensors=named)
            assert not ps._checkpoints[name].adopted
            if previous["old"]:
                ps.unregister_checkpoint(previous["old"])
            previous["old"] = name
            t6 = time.perf_counter()
            if i == 0:
                new, old = ps._checkpoints[previous["new"]], ps._checkpoints[name]
                by_name = {m.name: m for m in new.layout.metas}
                if not all(torch.equal(new.view(by_name[m.name]), old.view(m)) for m in old.layout.metas):
                    raise RuntimeError("the shared-memory handoff differs from gather + convert")
                first = (t1 - t0, t2 - t1)
            else:
                for key, value in zip(times, (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5)):
                    times[key].append(value)
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        return None
    ps.close()
    for b in buffers:
        b.close()
    best = {k: min(v) for k, v in times.items()}
    median_handoff = statistics.median(w + r for w, r in zip(times["write"], times["register"]))
    handoff = min(w + r for w, r in zip(times["write"], times["register"]))
    gathered = min(a + b + c for a, b, c in zip(times["gather"], times["convert"], times["gregister"]))
    return {
        "handoff_tp": tp,
        "shard_dtype": args.shard_dtype,
        "handoff_s": round(handoff, 4),
        "handoff_median_s": round(median_handoff, 4),
        "handoff_write_s": round(best["write"], 4),
        "handoff_register_s": round(best["register"], 5),
        "handoff_first_s": round(sum(first), 4),
        "gather_total_s": round(gathered, 4),
        "gather_s": round(best["gather"], 4),
        "gather_convert_s": round(best["convert"], 4),
        "gather_register_s": round(best["gregister"], 4),
        "speedup_handoff_vs_gather": round(gathered / handoff, 2),
    }


def handoff_side_by_side(args) -> dict:
    """Start the follower ranks, run rank 0 here; their exit codes are checked."""
    import os
    import pathlib
    import subprocess
    import sys

    from ckpt_common.ports import free_port

    port = free_port()
    repo = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    argv = sys.argv[1:] if args.argv is None else args.argv
    followers = [
        subprocess.Popen(
            [sys.executable, __file__, *argv, "--handoff-worker", str(r), "--handoff-port", str(port)], env=env
        )
        for r in range(1, args.handoff_tp)
    ]
    try:
        result = _handoff_rank(args, 0, port)
    finally:
        for proc in followers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    bad = [p.returncode for p in followers if p.returncode != 0]
    if bad:
        raise RuntimeError(f"handoff follower ranks failed: exit codes {bad}")
    return result


def pathlib_path(path: str):
    import pathlib

    return pathlib.Path(path)


def _best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.argv = argv
    if args.handoff_worker is not None:
        _handoff_rank(args, args.handoff_worker, args.handoff_port)
        return {}
    import torch

    from ckpt_common.layout.shapes import Parallelism, hf_param_shapes
    from trainer.megatron.convert import hf_to_megatron, megatron_to_hf

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = _model_shape(args)
    parallel = Parallelism(tp_size=args.tp, pp_size=args.pp)
    shapes = hf_param_shapes(shape)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    flat_src = torch.empty(total, dtype=dtype).normal_()
    hf, offset = {}, 0
    for name, dims in shapes.items():
        n = torch.Size(dims).numel()
        hf[name] = flat_src[offset : offset + n].view(dims)
        offset += n
    num_bytes = total * dtype.itemsize
    shards = hf_to_megatron(hf, shape, parallel)

    flat_dst = torch.empty_like(flat_src)
    flat_dst.copy_(flat_src)  # touch every page once
    out, offset = {}, 0
    for name, dims in shapes.items():
        n = torch.Size(dims).numel()
        out[name] = flat_dst[offset : offset + n].view(dims)
        offset += n

    memcpy_threads_s = _best_of(args.repeats, lambda: flat_dst.copy_(flat_src))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    memcpy_1_thread_s = _best_of(args.repeats, lambda: flat_dst.copy_(flat_src))
    torch.set_num_threads(threads)
    memcpy_s = min(memcpy_threads_s, memcpy_1_thread_s)
    copy_threads = args.copy_threads or None
    flat_dst.zero_()
    convert_s = _best_of(
        args.repeats, lambda: megatron_to_hf(shards, shape, parallel, out=out, copy_threads=copy_threads)
    )
    if not torch.equal(flat_dst, flat_src):
        raise RuntimeError("conversion into preallocated tensors is not bit-exact")
    convert_alloc_s = _best_of(args.repeats, lambda: megatron_to_hf(shards, shape, parallel, copy_threads=copy_threads))
    to_megatron_s = _best_of(args.repeats, lambda: hf_to_megatron(hf, shape, parallel, copy_threads=copy_threads))
    gib = num_bytes / 2**30
    result = {
        "bench": "megatron_sync",
        "dtype": args.dtype,
        "tp": args.tp,
        "pp": args.pp,
        "num_tensors": len(shapes),
        "size_gib": round(gib, 3),
        "torch_threads": threads,
        "copy_threads": args.copy_threads,
        "memcpy_1_thread_s": round(memcpy_1_thread_s, 4),
        "memcpy_threads_s": round(memcpy_threads_s, 4),
        "memcpy_s": round(memcpy_s, 4),
        "convert_s": round(convert_s, 4),
        "convert_alloc_s": round(convert_alloc_s, 4),
        "to_megatron_s": round(to_megatron_s, 4),
        "memcpy_gib_s": round(gib / memcpy_s, 2),
        "convert_gib_s": round(gib / convert_s, 2),
        "convert_alloc_gib_s": round(gib / convert_alloc_s, 2),
        "to_megatron_gib_s": round(gib / to_megatron_s, 2),
        "ratio_convert_vs_memcpy": round(memcpy_s / convert_s, 3),
        "ratio_convert_alloc_vs_memcpy": round(memcpy_s / convert_alloc_s, 3),
    }
    shards = hf = flat_src = flat_dst = out = None  # free the single-process part's memory
    if args.handoff_tp > 1:
        result.update(handoff_side_by_side(args))
        result["ratio_handoff_vs_memcpy"] = round(memcpy_s / result["handoff_s"], 3)
        result["ratio_gather_vs_memcpy"] = round(memcpy_s / result["gather_total_s"], 3)
        print(
            f"TP={args.handoff_tp} handoff to the PS ({args.shard_dtype} shards -> {args.dtype} HF): shared memory "
            f"{result['handoff_s']} s (write {result['handoff_write_s']}, register {result['handoff_register_s']}) "
            f"vs gather {result['gather_s']} + convert {result['gather_convert_s']} + register "
            f"{result['gather_register_s']} = {result['gather_total_s']} s; memcpy {memcpy_s:.4f} s"
        )
    if args.vllm:
        result.update(step_to_serving(args.model_dir, args.steps, args.trainer_tp))
        print(
            f"step end -> vLLM serving ({result['step_model_mib']} MiB): convert {result['step_convert_s']} s, "
            f"register {result['step_register_s']} s, update {result['step_update_s']} s, "
            f"first request {result['step_serve_s']} s"
        )
    print(
        f"{gib:.2f} GiB in {len(shapes)} tensors, TP={args.tp} PP={args.pp}, {args.dtype}: "
        f"memcpy {result['memcpy_gib_s']} GiB/s, convert {result['convert_gib_s']} GiB/s "
        f"(allocating: {result['convert_alloc_gib_s']}), HF->Megatron {result['to_megatron_gib_s']} GiB/s"
    )
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
