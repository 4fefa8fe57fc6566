"""One rank of tests/dist/test_megatron_tp.py, run under torchrun (gloo on CPU).

Every rank builds the same random tiny Qwen2 (HF names), converts its own TP shard, loads it into a
megatron-core GPTModel, and compares the gathered logits with HF transformers'. The shards are then
all-gathered over the TP group and converted back: they must equal the HF state dict exactly.
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--atol", type=float, default=1e-5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import torch
    import torch.distributed as dist
    import transformers

    from tests.unit.trainer.test_megatron_model import tiny_hf
    from trainer.megatron import model as mg_model
    from trainer.megatron.convert import ModelShape, Parallelism, megatron_to_hf
    from vllm_ext.tiny_model import VOCAB_SIZE

    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank}
    started = time.monotonic()
    mg_model.init_parallel(args.tp)
    try:
        hf_config, state = tiny_hf()
        config = mg_model.MegatronModelConfig(tp_size=args.tp)
        model, norm_style = mg_model.build_gpt_model(hf_config, config)
        mg_model.load_hf_weights(model, state, hf_config, config, norm_style)
        result["this_rank"] = list(mg_model.this_rank())

        ids = torch.randint(0, VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(7))
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        model.eval()
        with torch.no_grad():
            logits = model(ids, positions, None)
        reference_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf_config)).eval()
        reference_model.load_state_dict(state, strict=True)
        with torch.no_grad():
            reference = reference_model(ids).logits
        result["logits_max_abs_diff"] = (logits - reference).abs().max().item()
        result["logits_ok"] = logits.shape == reference.shape and result["logits_max_abs_diff"] <= args.atol

        # backward through the TP layers (own loss on the gathered logits)
        model.train()
        out = model(ids[:, :-1], positions[:, :-1], None)
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        result["grads_finite"] = all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                                     for p in model.parameters())

        # gather every TP shard (all are the same shape on every rank) and convert back to HF
        mine = mg_model.megatron_state(model)
        shards: dict = {(0, r): {} for r in range(args.tp)}
        for name in sorted(mine):
            parts = [torch.empty_like(mine[name]) for _ in range(args.tp)]
            dist.all_gather(parts, mine[name].contiguous())
            for r, part in enumerate(parts):
                shards[(0, r)][name] = part
        back = megatron_to_hf(shards, ModelShape.from_hf_config(hf_config), Parallelism(tp_size=args.tp))
        result["round_trip_exact"] = set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
    finally:
        mg_model.close_parallel()
    result["seconds"] = round(time.monotonic() - started, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    ok = result["logits_ok"] and result["grads_finite"] and result["round_trip_exact"]
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
