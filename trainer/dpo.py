"""k1.5 long2short (report section 2.4): shortest rejection sampling and DPO toward short answers.

::

    n samples per prompt (response, correct, num_tokens)
        │
        ├──shortest_correct──▶ the shortest correct response, or None   (rejection sampling: SFT data)
        │
        └──build_dpo_pairs──▶ (chosen = shortest correct, rejected) for every rejected response:
                              wrong answers, and correct ones >= length_ratio x the shortest correct
                                   │
    reference (the model before DPO, no_grad) ──sequence log-probs──▶ ref_w, ref_l
    trainer ────────────────────────────────────sequence log-probs──▶ pi_w, pi_l ──▶ dpo_loss(beta) ──▶ step

Ties for the shortest correct response go to the earliest sample; a correct response exactly
``length_ratio`` times the shortest counts as a negative ("1.5x longer or more").
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

# torch (and trainer.loss) load in the functions that use them: the data rules and the CLIs built
# on them (orchestrator.long2short.cli) stay light to import

logger = logging.getLogger(__name__)

R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Sample(Generic[R]):
    """One sampled response to a prompt."""

    response: R
    correct: bool
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class DpoPair(Generic[R]):
    chosen: R
    rejected: R
    reason: str  # "wrong" | "long": why the rejected response is a negative


def _samples(group: Sequence[Any]) -> list[Sample]:
    out = []
    for s in group:
        sample = s if isinstance(s, Sample) else Sample(*s)
        if isinstance(sample.num_tokens, bool) or not isinstance(sample.num_tokens, int) or sample.num_tokens < 0:
            raise ValueError(f"num_tokens={sample.num_tokens!r} must be an int >= 0")
        out.append(sample)
    return out


def shortest_correct_index(group: Sequence[Any]) -> int | None:
    """Index of the shortest correct sample of ``group`` ((response, correct, num_tokens) items), or None."""
    samples = _samples(group)
    correct = [i for i, s in enumerate(samples) if s.correct]
    return min(correct, key=lambda i: samples[i].num_tokens) if correct else None


def shortest_correct(group: Sequence[Any]) -> Any | None:
    """Shortest rejection sampling for one prompt: the shortest correct response, or None."""
    index = shortest_correct_index(group)
    return None if index is None else _samples(group)[index].response


def shortest_rejection_sampling(groups: Sequence[tuple[Any, Sequence[Any]]]) -> list[tuple[Any, Any]]:
    """(prompt, shortest correct response) for every (prompt, samples) group with a correct sample."""
    out = []
    for prompt, group in groups:
        response = shortest_correct(group)
        if response is not None:
            out.append((prompt, response))
    return out


def build_dpo_pairs(group: Sequence[Any], length_ratio: float = 1.5) -> list[DpoPair]:
    """DPO pairs of one prompt's samples: positive = shortest correct; negatives = wrong ones and correct
    ones with ``num_tokens >= length_ratio * shortest``. No correct sample: no pairs."""
    if not length_ratio >= 1:
        raise ValueError(f"length_ratio={length_ratio!r} must be >= 1")
    samples = _samples(group)
    best = shortest_correct_index(samples)
    if best is None:
        return []
    shortest = samples[best].num_tokens
    pairs = []
    for i, s in enumerate(samples):
        if i == best:
            continue
        if not s.correct:
            pairs.append(DpoPair(samples[best].response, s.response, "wrong"))
        elif s.num_tokens >= length_ratio * shortest:
            pairs.append(DpoPair(samples[best].response, s.response, "long"))
    return pairs


# -- the DPO step over a trainer ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenPair:
    """A DPO pair in token ids (the prompt includes any bos token)."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


def _pair_logprobs(model: Any, pairs: Sequence[TokenPair]) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = [p.prompt_ids for p in pairs] * 2
    responses = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    logp = model.sequence_logprobs(prompts, responses)
    return logp[: len(pairs)], logp[len(pairs) :]


def dpo_train(
    trainer: Any,
    reference: Any,
    pairs: Sequence[TokenPair],
    *,
    beta: float = 0.1,
    lr: float = 1e-5,
    num_epochs: int = 1,
    pairs_per_step: int = 16,
    rng: random.Random | None = None,
) -> dict[str, float]:
    """DPO over ``pairs``: reference log-probs once (``reference``: the model before DPO, unchanged),
    then ``num_epochs`` passes of minibatch steps on ``trainer``; returns mean loss, first/last loss."""
    if not pairs:
        raise ValueError("no DPO pairs")
    if pairs_per_step < 1 or num_epochs < 1:
        raise ValueError(f"pairs_per_step={pairs_per_step!r} and num_epochs={num_epochs!r} must be >= 1")
    import torch

    from trainer.loss import dpo_loss

    rng = rng if rng is not None else random.Random(0)
    with torch.no_grad():
        ref_w, ref_l = (t.detach() for t in _pair_logprobs(reference, pairs))
    trainer.reset_optimizer()
    trainer.set_lr(lr)
    losses = []
    for _ in range(num_epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for start in range(0, len(order), pairs_per_step):
            idx = order[start : start + pairs_per_step]
            pi_w, pi_l = _pair_logprobs(trainer, [pairs[i] for i in idx])
            loss = dpo_loss(pi_w, pi_l, ref_w[idx], ref_l[idx], beta)
            trainer.step(loss)
            losses.append(float(loss.detach()))
    return {
        "num_pairs": len(pairs),
        "num_steps": len(losses),
        "loss": sum(losses) / len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
