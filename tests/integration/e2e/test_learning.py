"""learning.mean_solution_probability: the batched, right-padded computation equals a plain
per-problem one, on problems of different lengths (a random tiny model; no vLLM, seconds);
learning.greedy_drop_z on a table of paired outcomes."""

from __future__ import annotations

import math

import pytest
import torch

from demo import task
from demo.tiny_model import TinyModelConfig, make_tiny_model
from tests.integration.e2e.learning import greedy_drop_z, mean_solution_probability


def test_batched_probability_equals_one_problem_at_a_time(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.sft import encode_examples

    model_dir = make_tiny_model(tmp_path / "m", TinyModelConfig.tiny(num_layers=2), seed=3)
    problems = [p for level in (1, 2, 3, 4) for p in task.heldout_problems(0, 3, [level], allow_fewer=True)]
    assert len({len(task.solution_text(p)) for p in problems}) > 1  # padding is exercised
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt, response in zip(*encode_examples(tokenizer, problems), strict=True):
            logits = model(torch.tensor([prompt + response])).logits[0]
            logp = torch.log_softmax(logits.float(), -1)
            expected.append(sum(logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)))
    reference = sum(math.exp(x) for x in expected) / len(expected)
    got = mean_solution_probability(model_dir, problems)
    assert 0 < got < 1
    assert math.isclose(got, reference, rel_tol=1e-4), (got, reference)


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ("1100", "1100", (0, 0, 0.0)),  # nothing changed
        ("1100", "0011", (2, 2, 0.0)),  # as many lost as gained
        ("11111111100", "00000000011", (9, 2, 7 / math.sqrt(11))),  # many lost: z 2.11
        ("1" * 16 + "0", "0" * 16 + "1", (16, 1, 15 / math.sqrt(17))),  # a collapse: z 3.64
        ("0000", "1110", (0, 3, -math.sqrt(3))),  # only gains: negative z
    ],
)
def test_greedy_drop_z_counts_the_changed_problems(before, after, expected):
    lost, gained, z = greedy_drop_z([c == "1" for c in before], [c == "1" for c in after])
    assert (lost, gained) == expected[:2]
    assert math.isclose(z, expected[2], abs_tol=1e-12)


def test_greedy_drop_z_refuses_unpaired_results():
    with pytest.raises(ValueError, match="3 results before, 2 after"):
        greedy_drop_z([True] * 3, [True] * 2)
