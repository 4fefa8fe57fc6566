"""A held-out learning signal for short RL runs that sampling and greedy ties do not blur.

Greedy accuracy on a few hundred held-out problems moves in steps of one problem and, a few
iterations into RL, swings by several points from one policy to the next, so a short run's gain
can be zero while the policy did improve. The probability that the model writes the reference
solution (the SFT target: column lines, answer, eos) after the prompt, averaged over the held-out
problems, is exact for a given model: the chance that one temperature-1 sample reproduces the
correct chain of thought, a lower bound of the model's sampled accuracy on the task.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence

import torch


def mean_solution_probability(model_dir: str | pathlib.Path, problems: Sequence) -> float:
    """Mean over `problems` of P(reference solution + eos | prompt) under the HF model in `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.sft import encode_examples

    model_dir = pathlib.Path(model_dir).resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts, responses = encode_examples(tokenizer, problems)
    seqs = [prompt + response for prompt, response in zip(prompts, responses, strict=True)]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):  # right padding: positions and causal attention stay as unpadded
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits.float(), -1)
    total = 0.0
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        # logits at position t predict token t + 1: the response's tokens from the prompt's last position on
        rows = logp[i, len(prompt) - 1 : len(prompt) - 1 + len(response)]
        total += math.exp(rows.gather(1, torch.tensor(response)[:, None]).sum().item())
    return total / len(problems)


def run_solution_probabilities(run_dir: str | pathlib.Path, start_model_dir: str | pathlib.Path) -> tuple[float, float]:
    """(before, after): `mean_solution_probability` of the model the RL run in `run_dir` started from and
    of its last saved model, on the run's held-out problems (rebuilt from its config.json)."""
    from orchestrator.config import DataConfig
    from orchestrator.data import heldout_set

    run_dir = pathlib.Path(run_dir)
    heldout = heldout_set(DataConfig(**json.loads((run_dir / "config.json").read_text())["data"]))
    saved = sorted((run_dir / "state").glob("*/model"))
    assert saved, f"no saved model under {run_dir / 'state'}"
    return mean_solution_probability(start_model_dir, heldout), mean_solution_probability(saved[-1], heldout)
