"""vLLM (CPU) starts on the tiny model directory and matches transformers' greedy output.

The test runs this file as a script in a child process (vLLM must be created under
``if __name__ == "__main__"``); the child writes its results as JSON.
"""

import json
import pathlib
import sys
import time

import pytest

PROMPTS = ["12+34=", "Hello world\n", "a"]
MAX_TOKENS = 24


def _run_vllm(model_dir: str, out_json: str) -> None:
    from vllm import LLM, SamplingParams

    start = time.monotonic()
    # eager, as the suite's engines run (testing.vllm_servers.CPU_ENGINE_ARGS)
    llm = LLM(model=model_dir, load_format="auto", dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
    start_s = time.monotonic() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    results = llm.generate(PROMPTS, params)
    out = {"start_s": start_s, "outputs": []}
    for result in results:
        completion = result.outputs[0]
        logprobs = [step[tid].logprob for step, tid in zip(completion.logprobs, completion.token_ids)]
        out["outputs"].append(
            {
                "prompt_token_ids": list(result.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "logprobs": logprobs,
                "text": completion.text,
            }
        )
    pathlib.Path(out_json).write_text(json.dumps(out))


def _hf_greedy(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
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


@pytest.mark.vllm
def test_vllm_matches_transformers_greedy(tmp_path):
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from tests.integration.dist.harness import run_python

    # A larger init std than the default gives clear logit margins, so greedy ties cannot flip.
    model_dir = make_tiny_model(tmp_path / "model", TinyModelConfig.tiny(init_std=0.1), seed=7)
    out_json = tmp_path / "vllm.json"
    run_python(__file__, str(model_dir), str(out_json), timeout_s=600, VLLM_CPU_KVCACHE_SPACE="1")
    got = json.loads(out_json.read_text())
    expected = _hf_greedy(model_dir)
    for vllm_out, hf_out in zip(got["outputs"], expected, strict=True):
        assert vllm_out["prompt_token_ids"] == hf_out["prompt_token_ids"]
        assert vllm_out["token_ids"] == hf_out["token_ids"]
        assert vllm_out["text"] == hf_out["text"]
        assert vllm_out["logprobs"] == pytest.approx(hf_out["logprobs"], abs=1e-3)
    assert len({tuple(o["token_ids"]) for o in got["outputs"]}) == len(PROMPTS)
    print(f"vLLM start {got['start_s']:.1f} s")


if __name__ == "__main__":
    _run_vllm(sys.argv[1], sys.argv[2])
