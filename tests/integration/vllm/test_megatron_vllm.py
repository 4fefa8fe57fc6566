"""A weight sync from the Megatron trainer into a real vLLM (CPU) engine; one vLLM start.

A child process (vLLM's LLM must be created under ``__main__``) runs, in order:
  1. LLM(tiny model dir, load_format="dummy") with the repo's worker extension: random weights;
  2. MegatronTrainer (TP=1, in process) from the same HF dir, one training step (weights now differ
     from the directory's and from vLLM's dummy ones);
  3. orchestrator.weight_sync.WeightSync (in-process ParameterServer, as the RL loop does) pushes
     ``trainer.named_tensors()`` (megatron_to_hf) into vLLM;
  4. greedy tokens from vLLM, from Megatron itself (full forward per token), and from transformers
     loaded with the trainer's saved HF directory.
The parent asserts the three agree token for token on every prompt, and that the tokens changed
after the sync (vLLM served dummy weights before it).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[1, 20, 21, 11, 22, 23, 14], [1, 40, 41, 42, 43], [1, 70], [1, 50, 60, 70, 80, 90, 100]]
MAX_TOKENS = 16

pytestmark = pytest.mark.vllm


def _greedy(logits_fn, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(logits_fn(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _child(model_dir: str, out_json: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from orchestrator.config import SyncConfig
    from orchestrator.weight_sync import WeightSync
    from testing.vllm_servers import cpu_llm
    from trainer.torch_trainer import TrainerConfig, make_trainer
    from vllm_ext.req import llm_req_func

    llm = cpu_llm(model_dir)  # dummy weights
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    before = generate()
    trainer = make_trainer("megatron", model_dir, TrainerConfig(lr=1e-2, autocast_dtype="float32", num_threads=1))
    rng = random.Random(0)
    prompts = [tuple(p) for p in PROMPTS]
    responses = [tuple(rng.randrange(3, 128) for _ in range(8)) for _ in PROMPTS]
    trainer.step(-trainer.sequence_logprobs(prompts, responses).mean())
    sync = WeightSync(SyncConfig(timeout_s=120.0), llm_req_func(llm, timeout_s=120.0))
    try:
        result = sync.push(trainer.named_tensors(), version=1)
        after = generate()
    finally:
        sync.close()
    megatron = [_greedy(trainer._logits, p, MAX_TOKENS) for p in PROMPTS]
    saved = trainer.save(Path(out_json).parent / "trained")
    hf_model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    hf = [_greedy(lambda ids: hf_model(input_ids=ids).logits, p, MAX_TOKENS) for p in PROMPTS]
    trainer.close()
    Path(out_json).write_text(
        json.dumps(
            {
                "before": before,
                "after": after,
                "megatron": megatron,
                "hf": hf,
                "sync_total_s": result.total_s,
                "sync_bytes": result.total_bytes,
            }
        )
    )


def test_vllm_greedy_after_megatron_sync_equals_megatron_and_hf(tmp_path):
    pytest.importorskip("megatron.core")
    pytest.importorskip("vllm")
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from tests.integration.dist.harness import run_python

    # A larger init std than the default gives clear logit margins, so greedy ties cannot flip.
    model_dir = make_tiny_model(tmp_path / "model", TinyModelConfig.tiny(init_std=0.1), seed=21)
    out = tmp_path / "out.json"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "GLOG_minloglevel": "2"}
    run_python(__file__, str(model_dir), str(out), timeout_s=600, **env)
    got = json.loads(out.read_text())
    print(f"sync {got['sync_bytes'] / 2**20:.1f} MiB in {got['sync_total_s']:.3f} s")
    assert got["after"] == got["megatron"] == got["hf"], got
    assert got["before"] != got["after"]  # vLLM started on dummy weights: the sync changed what it serves
    assert all(len(t) == MAX_TOKENS for t in got["after"])


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    _child(sys.argv[1], sys.argv[2])
