"""A vLLM engine's start on a CPU host with its processes forked (the launcher's default) vs spawned (vLLM's).

    python benchmarks/bench_vllm_start.py [--pairs 3] [--model-size-mib 256] [--rounds 3]

vLLM on CPU spawns its engine core and worker, and each imports vLLM again; the launcher forks them
from vLLM's API server instead (vllm_ext/start_method.py). Each pair starts the fast-start launcher
(`python -m vllm_ext.launch`, eager, the tests' engine settings) once per method, in turns, on one
generated model, and measures:

  start_s        launch -> the gate's /health answers 200 (weights loaded, vLLM serving)
  tokens_per_s   greedy batches of `--prompts` x `--max-tokens` (`--rounds`, after one warm-up)

Every engine must answer the same prompts with the same tokens, and its worker must have started as
asked (a forked one logs it). Medians per method and the
ratios fork / spawn; the last line is one JSON object. ~5 minutes at the defaults on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from _common import cpu_model, require_positive  # benchmarks/ is first on sys.path

METHODS = ("fork", "spawn")
CHECK_PROMPTS = ["12+34=", "Hello world\n", "The quick brown fox"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="starts per method, in turns")
    p.add_argument("--rounds", type=int, default=3, help="timed generation batches per start")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt")
    p.add_argument("--model-size-mib", type=int, default=256, help="model size (float32)")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="deadline of each engine start")
    args = p.parse_args(argv)
    require_positive(p, args, ("pairs", "rounds", "prompts", "max_tokens", "model_size_mib", "start_timeout_s"))
    return args


def forked_worker(log: pathlib.Path) -> bool:
    """Did the launcher's vLLM fork its worker (vllm_ext.start_method logs it) rather than spawn it?"""
    return "forked worker VllmWorker-" in log.read_text(errors="replace")


def one_start(method: str, model: pathlib.Path, log: pathlib.Path, args) -> dict:
    from testing.vllm_servers import LaunchedServer, completion_token_ids  # the tests' engine settings

    t0 = time.monotonic()
    server = LaunchedServer(model, log, engine_timeout_s=args.start_timeout_s, extra=("--vllm-start-method", method))
    try:
        server.wait_for("/health", timeout_s=args.start_timeout_s)
        start_s = time.monotonic() - t0
        if forked_worker(log) != (method == "fork"):
            raise RuntimeError(f"asked for {method}, vLLM's worker was {'forked' if method == 'spawn' else 'spawned'}")
        tokens = completion_token_ids(server.url, str(model), CHECK_PROMPTS, 12)
        batch = [f"p{i} " for i in range(args.prompts)]
        completion_token_ids(server.url, str(model), batch, args.max_tokens)  # warm-up
        rates = []
        for _ in range(args.rounds):
            t1 = time.monotonic()
            completion_token_ids(server.url, str(model), batch, args.max_tokens, timeout_s=600.0)
            rates.append(args.prompts * args.max_tokens / (time.monotonic() - t1))
    finally:
        code = server.stop()
    if code not in (0, -15, 143):
        raise RuntimeError(f"the {method} launcher exited with {code}; log {log}")
    out = {"method": method, "start_s": round(start_s, 2), "tokens_per_s": round(statistics.median(rates), 1)}
    print(json.dumps(out), flush=True)
    return out | {"tokens": tokens}


def main(argv=None) -> None:
    args = parse_args(argv)
    from demo.tiny_model import TinyModelConfig, make_tiny_model

    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-start-") as tmp:
        work = pathlib.Path(tmp)
        model = make_tiny_model(
            work / "model", TinyModelConfig.for_size_bytes(args.model_size_mib * 2**20, dtype="float32"), seed=0
        )
        for pair in range(args.pairs):
            for method in METHODS:
                runs[method].append(one_start(method, model, work / f"{method}-{pair}.log", args))
    answers = {json.dumps(r.pop("tokens")) for rs in runs.values() for r in rs}
    if len(answers) != 1:
        raise RuntimeError(f"the engines answered differently: {sorted(answers)}")

    def med(method: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[method]), 2)

    result = {
        "cpu": cpu_model(),
        "model_size_mib": args.model_size_mib,
        "runs": runs,
        **{f"{m}_start_s": med(m, "start_s") for m in METHODS},
        **{f"{m}_tokens_per_s": med(m, "tokens_per_s") for m in METHODS},
        "same_tokens": True,
    }
    result["ratio_start_fork_vs_spawn"] = round(result["fork_start_s"] / result["spawn_start_s"], 3)
    result["ratio_tokens_per_s_fork_vs_spawn"] = round(result["fork_tokens_per_s"] / result["spawn_tokens_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
