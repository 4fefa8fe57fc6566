"""Checkpoint-engine update into a running vLLM server vs vLLM's own reload and start from disk.

    python benchmarks/bench_vllm_update.py [--size-gib 0.55] [--repeats 3] [--out-dir DIR]

One run, side by side, on one generated checkpoint (>= 0.5 GiB, bf16, tiny vocabulary):
  1. disk start: `vllm serve DIR` loads the checkpoint itself   -> disk_start_ready_s (first answer)
  2. on that server, alternating `--repeats` times:
       vLLM's in-place reload from the safetensors on disk       -> reload_from_disk_s (median)
       parameter server (host memory) -> update_weights_from_ipc -> update_s (median)
  3. fast start: `python -m vllm_ext.launch --model DIR` (dummy weights + push), a request held at
     the gate from the start                                      -> fast_start_ready_s
Every answer is checked token for token against the disk-started server's first answer.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPTS = ["12+34=", "Hello world\n"]
MAX_TOKENS = 8
ENGINE_ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--seed", "0")


def first_answer_s(server, url: str, model: str, t0: float, timeout_s: float) -> tuple[float, list]:
    """Poll completions until one answers 200; seconds since t0 and the token ids."""
    from vllm_ext.testing import post_completions

    deadline = time.monotonic() + timeout_s
    while True:
        if not server.alive():
            raise RuntimeError(f"server exited; log:\n{server.log_tail()}")
        try:
            status, body = post_completions(url, model, PROMPTS, MAX_TOKENS, timeout_s=timeout_s)
            if status == 200:
                ids = [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]
                return time.monotonic() - t0, ids
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from {url} within {timeout_s:.0f} s")
        time.sleep(0.05)  # readiness polling interval, bounded by the deadline


def measure_updates(url: str, model_dir: Path, repeats: int, reference: list) -> dict:
    from checkpoint_engine.config import ParameterServerConfig
    from checkpoint_engine.ps import ParameterServer
    from vllm_ext.launch import model_safetensors_files
    from vllm_ext.req import collective_rpc, vllm_http_req_func
    from vllm_ext.testing import completion_token_ids

    ps = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu"))
    t0 = time.perf_counter()
    ps.register_checkpoint("bench", files=model_safetensors_files(str(model_dir)))
    ps.gather_metas("bench")
    register_s = time.perf_counter() - t0
    req = vllm_http_req_func(url, rank=0, timeout_s=600.0)
    disk, update, engine_side = [], [], []
    try:
        ps.update("bench", req)  # warm-up: allocates the engine's cache once (reused by later updates)
        for _ in range(repeats):
            t0 = time.perf_counter()
            collective_rpc(url, "reload_weights", kwargs={"weights_path": str(model_dir)}, timeout_s=600.0)
            disk.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ps.update("bench", req)
            update.append(time.perf_counter() - t0)
            engine_side.append(collective_rpc(url, "weights_state")[0]["last_update"])
        correct = completion_token_ids(url, str(model_dir), PROMPTS, MAX_TOKENS) == reference
    finally:
        ps.close()
    return {"reload_from_disk_s": statistics.median(disk), "update_s": statistics.median(update),
            "reload_from_disk_runs_s": [round(x, 4) for x in disk], "update_runs_s": [round(x, 4) for x in update],
            "ps_register_s": round(register_s, 3), "engine_side_last": engine_side[-1], "update_correct": correct}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=0.55)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default="/tmp/bench_vllm_update")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    args = p.parse_args()
    if args.size_gib < 0.5:
        raise SystemExit("--size-gib must be >= 0.5 (the benchmark's contract)")

    from vllm_ext.launch import free_port
    from vllm_ext.testing import LaunchedServer, ServerProcess, child_env, vllm_serve_command
    from vllm_ext.tiny_model import TinyModelConfig, make_tiny_model

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TinyModelConfig.for_size_bytes(int(args.size_gib * 2**30), dtype="bfloat16", init_std=0.1)
    model_dir = make_tiny_model(out / "model", cfg, seed=3)
    size_gib = cfg.size_bytes() / 2**30
    print(f"checkpoint: {size_gib:.3f} GiB, {cfg.num_layers} layers, hidden {cfg.hidden_size}", flush=True)

    port = free_port()
    t0 = time.monotonic()
    disk = ServerProcess(vllm_serve_command(model_dir, port, vllm_args=ENGINE_ARGS), f"http://127.0.0.1:{port}",
                         out / "disk_start.log", env=child_env(VLLM_SERVER_DEV_MODE="1"))
    try:
        disk_start_s, reference = first_answer_s(disk, disk.url, str(model_dir), t0, args.startup_timeout_s)
        print(f"disk start: first answer after {disk_start_s:.1f} s", flush=True)
        upd = measure_updates(disk.url, model_dir, args.repeats, reference)
        print(f"update {upd['update_s']:.3f} s vs reload from disk {upd['reload_from_disk_s']:.3f} s", flush=True)
    finally:
        disk.stop()

    t0 = time.monotonic()
    fast = LaunchedServer(model_dir, out / "fast_start.log", gate_wait_s=args.startup_timeout_s, vllm_args=ENGINE_ARGS)
    try:
        fast.wait_listening()
        fast_start_s, answer = first_answer_s(fast, fast.url, str(model_dir), t0, args.startup_timeout_s)
        print(f"fast start: first answer after {fast_start_s:.1f} s", flush=True)
    finally:
        fast.stop()

    result = {
        "checkpoint_gib": round(size_gib, 4),
        "update_s": round(upd["update_s"], 4),
        "reload_from_disk_s": round(upd["reload_from_disk_s"], 4),
        "ratio_vs_disk_reload": round(upd["update_s"] / upd["reload_from_disk_s"], 3),
        "fast_start_ready_s": round(fast_start_s, 2),
        "disk_start_ready_s": round(disk_start_s, 2),
        "ratio_fast_vs_disk_start": round(fast_start_s / disk_start_s, 3),
        "update_correct": upd["update_correct"],
        "fast_start_correct": answer == reference,
        "update_runs_s": upd["update_runs_s"],
        "reload_from_disk_runs_s": upd["reload_from_disk_runs_s"],
        "engine_side_last": upd["engine_side_last"],
        "ps_register_s": upd["ps_register_s"],
    }
    print(json.dumps(result), flush=True)
    return 0 if result["update_correct"] and result["fast_start_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
