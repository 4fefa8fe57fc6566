"""What the weight-update benchmarks share (`bench_update.py` on CPU, `bench_update_cuda.py` on CUDA):
a synthetic decoder checkpoint's tensor list, the engine process (its weights, its update through
`update_weights_from_ipc`, its command loop over a pipe) and the rank's timed updates.

Imported as `_common` by the benchmark scripts (run from any folder: their own is first on sys.path,
and spawned engine processes inherit it). Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from collections.abc import Callable, Iterable


def decoder_specs(
    layers: int, hidden: int, intermediate: int, kv: int, vocab: int, *, qkv_bias: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama/Qwen2-like decoder's tensors, in checkpoint order (Qwen2: `qkv_bias`)."""
    h, i = hidden, intermediate
    specs = [("model.embed_tokens.weight", (vocab, h))]
    for layer in range(layers):
        p = f"model.layers.{layer}.self_attn."
        for proj, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            specs.append((p + proj + ".weight", (rows, h)))
            if qkv_bias:
                specs.append((p + proj + ".bias", (rows,)))
        p = f"model.layers.{layer}."
        specs += [
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return specs + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


# ---- engine process ---------------------------------------------------------------------------
class BenchEngine:
    """An engine process's update side: `update(address)` runs one `update_weights_from_ipc` and hands
    every received (name, tensor) to `put`; the IPC mappings stay open across updates, as in the plain
    and vLLM engines. `ctx` is its ZMQ context (for other protocols the benchmark measures)."""

    def __init__(self, put: Callable, device_index: int | None = None):
        import zmq

        from checkpoint_engine.state import EngineWeightState
        from checkpoint_engine.transport.shm import MappingCache

        self.put, self.device_index = put, device_index
        self.ctx, self.state, self.mappings = zmq.Context(), EngineWeightState(), MappingCache()

    def update(self, address: str) -> None:
        from checkpoint_engine.worker import update_weights_from_ipc

        update_weights_from_ipc(
            self.ctx,
            address,
            self.device_index,
            run=lambda named: [self.put(n, t) for n, t in named],
            state=self.state,
            timeout_s=300,
            mapping_cache=self.mappings,
        )


def serve(conn, handle: Callable[[dict], dict]) -> None:
    """The engine process's loop: JSON commands from its rank over `conn`; `handle(cmd)` is the reply,
    until {"op": "exit"}."""
    while True:
        cmd = json.loads(conn.recv_bytes())
        if cmd["op"] == "exit":
            return
        conn.send_bytes(json.dumps(handle(cmd)).encode())


# ---- rank side --------------------------------------------------------------------------------
def start_engine(target: Callable, *args):
    """`target(conn, *args)` in a spawned daemon process; (the rank's end of the pipe, the process)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return parent, proc


def ask(conn, cmd: dict) -> dict:
    """One command to the engine process and its reply."""
    conn.send_bytes(json.dumps(cmd).encode())
    return json.loads(conn.recv_bytes())


class EngineRequest:
    """`ParameterServer.update`'s request function for a rank whose engine process is at `conn`: the
    engine takes the update from this rank's socket; its reply (checked ok) is kept in `last`."""

    def __init__(self, conn, rank: int):
        self.conn, self.rank, self.last = conn, rank, {}

    def __call__(self, paths) -> None:
        self.last = ask(self.conn, {"op": "ours", "address": paths[self.rank][1]})
        assert self.last["ok"], self.last


def timed_updates(ps, name: str, req: Callable, times: int, **kwargs) -> tuple[list[float], object]:
    """`times` updates of checkpoint `name`, each between two barriers: (seconds of each, the last
    update's result)."""
    import torch.distributed as dist

    seconds, result = [], None
    for _ in range(times):
        dist.barrier()
        t0 = time.perf_counter()
        result = ps.update(name, req, **kwargs)
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
    return seconds, result


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Iterable[str]) -> None:
    """parser.error (exit 2, naming the flag) for any of `names` that is not > 0."""
    for name in names:
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")


def cpu_model() -> str:
    """This machine's CPU model name, for the benchmarks' JSON."""
    from trainer.cpu import cpu_info

    return cpu_info()[0] or "unknown"
