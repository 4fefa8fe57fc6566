"""What streaming the pool's completions costs: tokens/s of one vLLM server, streamed vs one answer.

    python benchmarks/bench_stream.py [--prompts 128] [--max-tokens 96] [--rounds 8] [--batch-size 32]

A pool engine's answers stream (SSE), so the requests of an engine that dies keep the tokens they
already got (``PartialGeneration``, continued on another engine). Streaming sends one event per
token and prompt through vLLM's API server, the launcher's gate and the client, instead of one JSON
answer per batch. This starts one engine as the RL job's pool does (``EnginePool.start``: the
gated launcher, the demo's tiny model shape with random weights, version 0 pushed by the
checkpoint engine), then runs the same prompts through two clients of that server in alternating
rounds (one untimed warm-up each): ``HttpVllmEngine(stream=False)`` and ``(stream=True)``.
Prints tokens/s of each (median over rounds) and ``stream_to_plain_ratio`` (goal >= 0.9); the last
line is one JSON object.
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=128, help="prompts per round")
    p.add_argument("--max-tokens", type=int, default=96, help="max new tokens per prompt")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per client (alternating)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per POST (the pool's BATCH_SIZE)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--stream-interval-tokens",
        type=int,
        default=None,
        help="tokens per streamed event (default: the pool's, engine_http.STREAM_INTERVAL_TOKENS)",
    )
    return p.parse_args(argv)


def _round(engine, requests, sampling) -> tuple[float, int]:
    start = time.perf_counter()
    results = engine.generate(requests, sampling, timeout_s=600.0)
    return time.perf_counter() - start, sum(len(r.token_ids) for r in results)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ckpt_common.logs import setup_logging
    from ckpt_common.procs import exit_on_signals

    exit_on_signals()  # SIGTERM unwinds like Ctrl-C: the pool's close stops the server
    setup_logging("WARNING")
    import random

    from demo.tiny_model import TinyModelConfig, load_state_dict_from_dir, make_tiny_model
    from orchestrator.config import EngineConfig, SyncConfig
    from orchestrator.engine_pool.base import GenRequest, SamplingSettings
    from orchestrator.engine_pool.pool import EnginePool
    from orchestrator.engine_pool.pool_sync import PoolWeightSync
    from orchestrator.engine_pool.vllm_http import STREAM_INTERVAL_TOKENS, HttpVllmEngine
    from trainer.cpu import cpu_info

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-stream-"))
    model_dir = make_tiny_model(work / "model", TinyModelConfig.tiny(), seed=0)
    config = EngineConfig(num_engines=1, dtype="float32", max_num_seqs=args.prompts)
    pool = EnginePool.start(config, str(model_dir), log_dir=work / "logs")
    sync = None
    clients = {}
    try:
        sync = PoolWeightSync(SyncConfig(), pool)
        sync.push(load_state_dict_from_dir(model_dir), version=0)
        endpoint = next(iter(pool.endpoints().values()))
        one = EngineConfig(type="vllm_http", endpoint=endpoint)
        interval = args.stream_interval_tokens or STREAM_INTERVAL_TOKENS
        clients = {
            name: HttpVllmEngine(
                one, max_workers=8, batch_size=args.batch_size, stream=stream, stream_interval_tokens=interval
            )
            for name, stream in (("plain", False), ("stream", True))
        }
        rng = random.Random(0)
        requests = [
            GenRequest(f"p{i}", tuple(rng.randrange(3, 60) for _ in range(12)), args.max_tokens)
            for i in range(args.prompts)
        ]
        sampling = SamplingSettings(temperature=args.temperature)
        rates: dict[str, list[float]] = {name: [] for name in clients}
        for client in clients.values():
            _round(client, requests, sampling)  # warm-up
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                seconds, tokens = _round(clients[name], requests, sampling)
                rates[name].append(tokens / seconds)
                print(f"round {r + 1} {name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s")
        plain, stream = (statistics.median(rates[n]) for n in ("plain", "stream"))
        out = {
            "cpu": cpu_info()[0],
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "batch_size": args.batch_size,
            "stream_interval_tokens": interval,
            "rounds": args.rounds,
            "plain_tokens_per_s": round(plain, 1),
            "stream_tokens_per_s": round(stream, 1),
            "stream_to_plain_ratio": round(stream / plain, 3),
        }
    finally:
        for client in clients.values():
            client.close()
        if sync is not None:
            sync.close()
        pool.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
