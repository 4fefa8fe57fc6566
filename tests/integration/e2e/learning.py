"""A held-out learning signal for short RL runs that sampling and greedy ties do not blur.

Greedy accuracy on a few hundred held-out problems moves in steps of one problem and, a few
iterations into RL, swings by several points from one policy to the next, so a short run's gain
can be zero while the policy did improve. The probability that the model writes the reference
solution (the SFT target: column lines, answer, eos) after the prompt, averaged over the held-out
problems, is exact for a given model: the chance that one temperature-1 sample reproduces the
correct chain of thought, a lower bound of the model's sampled accuracy on the task.

Greedy accuracy still guards against a policy that got worse, but as a paired test: the problems a
run newly fails against those it newly solves (`greedy_drop_z`), not a fixed number of points. On
128 held-out problems five more lost than gained (-3.9 points, x1.18 P(solution)) happened in a CI
run of an improving policy; a real collapse loses many and gains few.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence

import torch


def _load(model_dir: str | pathlib.Path):
    """(float32 HF model in eval mode, its tokenizer) from `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(pathlib.Path(model_dir).resolve())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def mean_solution_probability(model_dir: str | pathlib.Path, problems: Sequence) -> float:
    """Mean over `problems` of P(reference solution + eos | prompt) under the HF model in `model_dir`."""
    from trainer.sft import encode_examples

    model, tokenizer = _load(model_dir)
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


def greedy_correct(model_dir: str | pathlib.Path, problems: Sequence) -> list[bool]:
    """Whether the HF model in `model_dir` answers each problem correctly with greedy decoding."""
    from demo import task
    from trainer.sft import greedy_responses

    model, tokenizer = _load(model_dir)
    responses = greedy_responses(model, tokenizer, problems)
    return [task.is_correct(p, r) for p, r in zip(problems, responses, strict=True)]


def greedy_drop_z(before: Sequence[bool], after: Sequence[bool]) -> tuple[int, int, float]:
    """(lost, gained, z): problems solved before but not after, the reverse, and the sign test's
    z = (lost - gained) / sqrt(lost + gained) over those discordant pairs (0 when there are none).
    Under "the policy is no worse" z stays below 3 in all but about 1 run in 700."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} results before, {len(after)} after")
    lost = sum(b and not a for b, a in zip(before, after))
    gained = sum(a and not b for b, a in zip(before, after))
    return lost, gained, (lost - gained) / math.sqrt(lost + gained) if lost + gained else 0.0


def run_heldout(run_dir: str | pathlib.Path) -> list:
    """The demo's held-out problems of the RL run in `run_dir`, rebuilt from its config.json's data section
    (a run on the demo's exported files keeps the section's demo fields: the same draw as the file)."""
    from ckpt_common.dictconfig import from_dict
    from orchestrator.config import DataConfig
    from orchestrator.data import heldout_set

    saved = json.loads((pathlib.Path(run_dir) / "config.json").read_text())["data"]
    return list(heldout_set(from_dict(DataConfig, saved, "data")))  # nested sections (data.fields) rebuilt


def _heldout_and_last_model(run_dir: pathlib.Path) -> tuple[list, pathlib.Path]:
    heldout = run_heldout(run_dir)
    saved = sorted((run_dir / "state").glob("*/model"))
    assert saved, f"no saved model under {run_dir / 'state'}"
    return heldout, saved[-1]


def run_greedy_drop(run_dir: str | pathlib.Path, start_model_dir: str | pathlib.Path) -> tuple[int, int, float]:
    """`greedy_drop_z` of the RL run in `run_dir`'s last saved model against the model it started from,
    on the run's held-out problems."""
    heldout, last = _heldout_and_last_model(pathlib.Path(run_dir))
    return greedy_drop_z(greedy_correct(start_model_dir, heldout), greedy_correct(last, heldout))


def run_solution_probabilities(run_dir: str | pathlib.Path, start_model_dir: str | pathlib.Path) -> tuple[float, float]:
    """(before, after): `mean_solution_probability` of the model the RL run in `run_dir` started from and
    of its last saved model, on the run's held-out problems (rebuilt from its config.json)."""
    heldout, last = _heldout_and_last_model(pathlib.Path(run_dir))
    return mean_solution_probability(start_model_dir, heldout), mean_solution_probability(last, heldout)
