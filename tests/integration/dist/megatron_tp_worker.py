"""One rank of tests/integration/dist/test_megatron_tp.py, run under torchrun (gloo on CPU), world = tp * pp.

Every rank builds the same random tiny Qwen2 (HF names), converts its own (pp, tp) shard, loads it
into its megatron-core GPTModel stage and runs one micro-batch forward and backward. Stages hand
activations and gradients to each other with gloo send/recv (megatron's own pipeline schedules
hard-code CUDA: total_num_tokens on device="cuda", torch.cuda.synchronize() in p2p). The last
stage compares its gathered logits with HF transformers'. Every rank then sends its shard to
rank 0, which converts all shards back: they must equal the HF state dict exactly.
Gradients are gathered the same way, converted to HF layout and compared with HF's for the same loss.
Each rank writes rank<k>.json into --out; the exit code is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import warnings

SEQ_LEN, BATCH = 24, 2


def _stage_forward(model, ids, positions, first: bool, last: bool, hidden_size: int, train: bool):
    """This stage's output (logits on the last stage, else hidden [s, b, h]) and its received input."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    received = None
    if not first:
        received = torch.empty(ids.shape[1], ids.shape[0], hidden_size)
        dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(train)
        model.set_input_tensor(received)
    out = model(ids, positions, None)
    if not last:
        dist.send(out.detach().contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
    return out, received


def _stage_backward(out, received, ids, first: bool, last: bool) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if last:
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=parallel_state.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if not first:
        dist.send(received.grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank())


def _gather_shards_to_rank0(mine, rank_of, state, shape, parallel):
    """Rank 0 receives every rank's Megatron tensors (sorted names; shapes known from the conversion)."""
    import torch
    import torch.distributed as dist

    from trainer.megatron.convert import hf_to_megatron

    world = dist.get_world_size()
    if dist.get_rank() != 0:
        for name in sorted(mine):
            dist.send(mine[name].contiguous(), dst=0)
        return None
    shards = {rank_of[0]: mine}
    for src in range(1, world):
        template = hf_to_megatron(state, shape, parallel, ranks=[rank_of[src]])[rank_of[src]]
        received = {}
        for name in sorted(template):
            received[name] = torch.empty_like(template[name])
            dist.recv(received[name], src=src)
        shards[rank_of[src]] = received
    return shards


def _hf_grads(hf_config, state, ids):
    import torch
    import transformers

    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf_config)).train()
    model.load_state_dict(state, strict=True)
    logits = model(ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--atol", type=float, default=1e-5, help="max |logits - HF logits|")
    parser.add_argument("--grad-atol", type=float, default=1e-6, help="max |grad - HF grad| (HF layout)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import torch
    import torch.distributed as dist

    from ckpt_common.layout.shapes import ModelShape
    from demo.tiny_model import VOCAB_SIZE
    from tests.unit.trainer.tiny import tiny_hf
    from trainer.megatron import model as mg_model
    from trainer.megatron.convert import megatron_to_hf

    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank}
    started = time.monotonic()
    mg_model.init_parallel(args.tp, args.pp)
    try:
        hf_config, state = tiny_hf()
        config = mg_model.MegatronModelConfig(tp_size=args.tp, pp_size=args.pp)
        shape = ModelShape.from_hf_config(hf_config)
        model, norm_style = mg_model.build_gpt_model(hf_config, config)
        mg_model.load_hf_weights(model, state, hf_config, config, norm_style)
        pp_rank, tp_rank = mg_model.this_rank()
        first, last = pp_rank == 0, pp_rank == args.pp - 1
        result["this_rank"] = [pp_rank, tp_rank]

        # no <pad> (id 0) in the input: HF's embedding has padding_idx=pad_token_id (no gradient for
        # that row), megatron's has none; the logits agree either way, the gradients only without it
        ids = torch.randint(1, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(7))
        positions = torch.arange(SEQ_LEN).expand_as(ids)
        model.eval()
        with torch.no_grad():
            logits, _ = _stage_forward(model, ids, positions, first, last, shape.hidden_size, train=False)
        if last:
            import transformers

            reference_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf_config)).eval()
            reference_model.load_state_dict(state, strict=True)
            with torch.no_grad():
                reference = reference_model(ids).logits
            result["logits_max_abs_diff"] = (logits - reference).abs().max().item()
            result["logits_ok"] = logits.shape == reference.shape and result["logits_max_abs_diff"] <= args.atol

        model.train()  # backward through the TP layers and across the stages (own loss on gathered logits)
        out, received = _stage_forward(
            model, ids[:, :-1], positions[:, :-1], first, last, shape.hidden_size, train=True
        )
        _stage_backward(out, received, ids, first, last)
        result["grads_finite"] = all(
            p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters()
        )

        ranks = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, torch.tensor([pp_rank, tp_rank]))
        rank_of = {r: tuple(int(v) for v in t) for r, t in enumerate(ranks)}
        shards = _gather_shards_to_rank0(mg_model.megatron_state(model), rank_of, state, shape, config.parallelism)
        grads = _gather_shards_to_rank0(
            {n: p.grad for n, p in model.named_parameters()}, rank_of, state, shape, config.parallelism
        )
        if shards is not None:
            back = megatron_to_hf(shards, shape, config.parallelism)
            result["round_trip_exact"] = set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
            # the gradients, converted to HF layout like the weights, equal HF's for the same loss
            hf_grads = megatron_to_hf(grads, shape, config.parallelism)
            reference = _hf_grads(hf_config, state, ids)
            result["grads_max_abs_diff"] = max((hf_grads[n] - reference[n]).abs().max().item() for n in reference)
            result["grads_ok"] = result["grads_max_abs_diff"] <= args.grad_atol
    finally:
        mg_model.close_parallel()
    result["seconds"] = round(time.monotonic() - started, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    ok = result["grads_finite"] and all(result.get(k, True) for k in ("logits_ok", "round_trip_exact", "grads_ok"))
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
