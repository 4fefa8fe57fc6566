"""vLLM (CPU) on the tiny model, then a weight sync from the Megatron trainer into it; one vLLM start.

A child process (vLLM's LLM must be created under ``__main__``) runs, in order:
  1. LLM(tiny model dir, load_format="auto") with the repo's worker extension, its engine core and
     worker forked (testing.vllm_servers.cpu_llm); greedy text completions with logprobs, which the
     parent compares with transformers' on the same directory (vLLM reads the tiny model's format
     exactly: tokens, text and logprobs within 1e-3);
  2. MegatronTrainer (TP=1, in process) from the same HF dir, one training step (weights now differ
     from the directory's and from what vLLM serves);
  3. orchestrator.engine_pool.weight_sync.WeightSync (in-process ParameterServer, as the RL loop does) pushes
     ``trainer.named_tensors()`` (megatron_to_hf) into vLLM;
  4. greedy tokens from vLLM and from Megatron itself (full forward per token);
  5. a second training step, then vLLM's own trainer API with the checkpoint_engine backend
     (`trainer_init` + `send_weights`, `NamedTensorsSource(trainer.named_tensors)` over an in-process
     client): the ParameterServer adopts the Megatron trainer's shared HF buffer without a copy;
  6. greedy tokens from vLLM, from Megatron, and from transformers loaded with the trainer's saved
     HF directory.
The parent asserts that vLLM and Megatron agree token for token after step 3, that the three agree
after step 5, and that the tokens changed at each sync. (The start on dummy weights that a push
fills is the launcher engines' case: test_vllm_engines.py.)
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[1, 20, 21, 11, 22, 23, 14], [1, 40, 41, 42, 43], [1, 70], [1, 50, 60, 70, 80, 90, 100]]
MAX_TOKENS = 16
TEXT_PROMPTS = ["12+34=", "Hello world\n", "a"]  # step 1: vLLM against transformers on the directory
TEXT_MAX_TOKENS = 24

pytestmark = pytest.mark.vllm


def _greedy(logits_fn, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(logits_fn(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _text_completions(llm) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TEXT_MAX_TOKENS, ignore_eos=True, logprobs=0)
    out = []
    for result in llm.generate(TEXT_PROMPTS, params, use_tqdm=False):
        completion = result.outputs[0]
        logprobs = [step[tid].logprob for step, tid in zip(completion.logprobs, completion.token_ids)]
        out.append(
            {
                "prompt_token_ids": list(result.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "logprobs": logprobs,
                "text": completion.text,
            }
        )
    return out


def _hf_text_completions(model_dir) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in TEXT_PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=TEXT_MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new_ids = gen.sequences[0, ids.shape[1] :].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, new_ids)]
        outputs.append(
            {
                "prompt_token_ids": ids[0].tolist(),
                "token_ids": new_ids,
                "logprobs": logprobs,
                "text": tokenizer.decode(new_ids, skip_special_tokens=True),
            }
        )
    return outputs


def _child(model_dir: str, out_json: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from orchestrator.config import SyncConfig
    from orchestrator.engine_pool.weight_sync import WeightSync
    from testing.vllm_servers import LLMSyncClient, cpu_llm
    from trainer.base import TrainerConfig
    from trainer.factory import make_trainer
    from vllm_ext.extension_req import llm_req_func
    from vllm_ext.weight_transfer.trainer import CheckpointEngineTrainerInitInfo, NamedTensorsSource

    start = time.monotonic()
    llm = cpu_llm(model_dir, load_format="auto", weight_transfer_config={"backend": "checkpoint_engine"})
    start_s = time.monotonic() - start
    text = _text_completions(llm)
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
    megatron_first = [_greedy(trainer._logits, p, MAX_TOKENS) for p in PROMPTS]

    # 5. vLLM's trainer API: the Megatron trainer's shared HF buffer, adopted by the PS
    trainer.step(-trainer.sequence_logprobs(prompts, responses).mean())
    info = CheckpointEngineTrainerInitInfo(rank=0, transport="cpu", source_layout="distinct")
    source = NamedTensorsSource(trainer.named_tensors)
    api = WeightTransferTrainerFactory.trainer_init(info, client=LLMSyncClient(llm), source=source)
    try:
        api.send_weights()
        adopted = api.ps._checkpoints[api._registered].adopted
        after_api = generate()
    finally:
        api.shutdown()
    megatron = [_greedy(trainer._logits, p, MAX_TOKENS) for p in PROMPTS]
    saved = trainer.save(Path(out_json).parent / "trained")
    hf_model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    hf = [_greedy(lambda ids: hf_model(input_ids=ids).logits, p, MAX_TOKENS) for p in PROMPTS]
    trainer.close()
    Path(out_json).write_text(
        json.dumps(
            {
                "start_s": start_s,
                "text": text,
                "before": before,
                "after": after,
                "megatron_first": megatron_first,
                "after_api": after_api,
                "adopted": adopted,
                "megatron": megatron,
                "hf": hf,
                "sync_total_s": result.total_s,
                "sync_bytes": result.total_bytes,
            }
        )
    )


def test_vllm_matches_transformers_then_greedy_after_megatron_sync_equals_megatron_and_hf(tmp_path):
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
    print(f"vLLM start {got['start_s']:.1f} s; sync {got['sync_bytes'] / 2**20:.1f} MiB in {got['sync_total_s']:.3f} s")
    # 1. vLLM on the directory answers as transformers does (was test_tiny_model_vllm.py)
    for vllm_out, hf_out in zip(got["text"], _hf_text_completions(model_dir), strict=True):
        assert vllm_out["prompt_token_ids"] == hf_out["prompt_token_ids"]
        assert vllm_out["token_ids"] == hf_out["token_ids"]
        assert vllm_out["text"] == hf_out["text"]
        assert vllm_out["logprobs"] == pytest.approx(hf_out["logprobs"], abs=1e-3)
    assert len({tuple(o["token_ids"]) for o in got["text"]}) == len(TEXT_PROMPTS)
    # 2-4. the Megatron sync (the RL job's WeightSync)
    assert got["after"] == got["megatron_first"], got
    assert got["before"] != got["after"]  # the trained weights differ from the directory's: the sync changed them
    assert all(len(t) == MAX_TOKENS for t in got["after"])
    # 5-6. vLLM's trainer API over the Megatron trainer's shared buffer, adopted without a copy
    assert got["adopted"] is True
    assert got["after_api"] == got["megatron"] == got["hf"], got
    assert got["after_api"] != got["after"]  # the second step's weights reached vLLM


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    _child(sys.argv[1], sys.argv[2])
