"""long2short training on HF model dirs: SFT on shortest-rejection records (``sft-on``) and DPO
against a frozen copy (``dpo``), both with ``trainer.hf.HFTrainer`` (CPU, float32)."""

from __future__ import annotations

import dataclasses
import pathlib
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt_common.cli_config import meta
from ckpt_common.validate import check_int, check_number
from orchestrator.long2short.merge import write_info
from trainer import dpo


@dataclasses.dataclass(frozen=True)
class _TrainingConfig:
    """What both training commands set: AdamW's lr, epochs, the seed and torch threads."""

    lr: float = 1e-4
    num_epochs: int = 2
    seed: int = 0
    num_threads: int | None = dataclasses.field(
        default=None, metadata=meta("torch threads (None: the affinity mask's CPUs)")
    )

    def __post_init__(self) -> None:
        check_number("lr", self.lr)
        check_int("num_epochs", self.num_epochs)
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads)


@dataclasses.dataclass(frozen=True)
class TrainConfig(_TrainingConfig):
    batch_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True)
class DpoConfig(_TrainingConfig):
    beta: float = 0.1
    length_ratio: float = dataclasses.field(
        default=1.5, metadata=meta("a correct sample this many times longer than the shortest is rejected")
    )
    pairs_per_step: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("beta", self.beta)
        if not self.length_ratio >= 1:
            raise ValueError(f"length_ratio={self.length_ratio!r} must be >= 1")
        check_int("pairs_per_step", self.pairs_per_step)


def _trainer(model_dir: str | pathlib.Path, config: TrainConfig):
    from trainer.base import TrainerConfig
    from trainer.hf import HFTrainer

    return HFTrainer(model_dir, TrainerConfig(lr=config.lr, num_threads=config.num_threads, seed=config.seed))


def sft_examples(tokenizer, records: Sequence[Mapping[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with bos, response ids) per record: ``prompt_ids`` as sampled when present (a problem
    file task's records: its template or chat template applied), else the ``prompt`` text tokenized;
    ``response_ids`` as sampled when present, else the ``response`` text tokenized plus eos."""
    out = []
    for record in records:
        if record.get("prompt_ids"):
            prompt = [int(t) for t in record["prompt_ids"]]
        else:
            prompt = list(tokenizer(record["prompt"])["input_ids"])
        if record.get("response_ids"):
            response = [int(t) for t in record["response_ids"]]
        else:
            response = list(tokenizer(record["response"], add_special_tokens=False)["input_ids"])
            response.append(tokenizer.eos_token_id)
        out.append((prompt, response))
    return out


def sft_on(
    model_dir: str | pathlib.Path,
    records: Sequence[Mapping[str, Any]],
    out_dir: str | pathlib.Path,
    config: TrainConfig = TrainConfig(),
) -> dict[str, Any]:
    """Fine-tune ``model_dir`` on (prompt, response) records (mean token NLL of the responses, AdamW at a
    constant lr, shuffled minibatches) and save the result to ``out_dir``; returns training stats."""
    from transformers import AutoTokenizer

    if not records:
        raise ValueError("no SFT records (no problem had a correct sample?)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = sft_examples(tokenizer, records)
    trainer = _trainer(model_dir, config)
    rng = random.Random(config.seed)
    losses = []
    for _ in range(config.num_epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order), config.batch_size):
            batch = [examples[i] for i in order[start : start + config.batch_size]]
            logprobs = trainer.sequence_logprobs([p for p, _ in batch], [r for _, r in batch])
            loss = -logprobs.sum() / sum(len(r) for _, r in batch)
            trainer.step(loss)
            losses.append(float(loss.detach()))
    out = trainer.save(out_dir)
    stats = {
        "method": "shortest_rejection_sft",
        "base_model": str(model_dir),
        "model_dir": str(out),
        "num_examples": len(examples),
        "mean_target_tokens": sum(len(r) for _, r in examples) / len(examples),
        "num_steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "config": dataclasses.asdict(config),
    }
    write_info(pathlib.Path(out), stats)
    return stats


def dpo_token_pairs(
    tokenizer,
    problems: Sequence[Any],
    groups: Sequence[Sequence[dpo.Sample]],
    length_ratio: float = 1.5,
    encode_problem: Callable[[Any, Any], Sequence[int]] | None = None,
) -> tuple[list[dpo.TokenPair], dict[str, int]]:
    """``dpo.build_dpo_pairs`` per problem, in token ids (the responses' ids as sampled); and the count of
    pairs per reason ("wrong", "long"). Prompt ids: ``encode_problem(problem, tokenizer)`` (a task's
    ``encode``), else the demo's ``tokenizer(problem.prompt)``."""
    pairs, reasons = [], {"wrong": 0, "long": 0}
    for problem, group in zip(problems, groups):
        if encode_problem is not None:
            prompt = tuple(encode_problem(problem, tokenizer))
        else:
            prompt = tuple(tokenizer(problem.prompt)["input_ids"])
        for pair in dpo.build_dpo_pairs(group, length_ratio=length_ratio):
            pairs.append(dpo.TokenPair(prompt, pair.chosen.token_ids, pair.rejected.token_ids))
            reasons[pair.reason] += 1
    return pairs, reasons


def pair_margin(trainer: Any, reference: Any, pairs: Sequence[dpo.TokenPair]) -> float:
    """Mean DPO margin ``(pi_w - ref_w) - (pi_l - ref_l)`` over ``pairs`` (0 before any step)."""
    import torch

    with torch.no_grad():
        w, l = dpo._pair_logprobs(trainer, pairs)
        rw, rl = dpo._pair_logprobs(reference, pairs)
    return float(((w - rw) - (l - rl)).mean())


def run_dpo(
    model_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    problems: Sequence[Any],
    groups: Sequence[Sequence[dpo.Sample]],
    config: DpoConfig = DpoConfig(),
    encode_problem: Callable[[Any, Any], Sequence[int]] | None = None,
) -> dict[str, Any]:
    """DPO of ``model_dir`` on the pairs of ``groups`` (samples of ``problems``) against a frozen copy of
    itself; saves the result to ``out_dir`` and returns stats (loss, the pairs' margin before and after).
    ``encode_problem(problem, tokenizer)``: a task's prompt ids (default: the demo's prompt text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs, reasons = dpo_token_pairs(tokenizer, problems, groups, config.length_ratio, encode_problem)
    if not pairs:
        raise ValueError("no DPO pairs: no problem had a correct sample next to a wrong or a long one")
    train = TrainConfig(lr=config.lr, seed=config.seed, num_threads=config.num_threads)
    trainer, reference = _trainer(model_dir, train), _trainer(model_dir, train)
    reference.model.eval()
    margin_before = pair_margin(trainer, reference, pairs)
    stats = dpo.dpo_train(
        trainer,
        reference,
        pairs,
        beta=config.beta,
        lr=config.lr,
        num_epochs=config.num_epochs,
        pairs_per_step=config.pairs_per_step,
        rng=random.Random(config.seed),
    )
    margin_after = pair_margin(trainer, reference, pairs)
    out = trainer.save(out_dir)
    result = {
        "method": "dpo",
        "base_model": str(model_dir),
        "model_dir": str(out),
        **stats,
        "pairs_by_reason": reasons,
        "mean_chosen_tokens": sum(len(p.chosen_ids) for p in pairs) / len(pairs),
        "mean_rejected_tokens": sum(len(p.rejected_ids) for p in pairs) / len(pairs),
        "margin_before": margin_before,
        "margin_after": margin_after,
        "config": dataclasses.asdict(config),
    }
    write_info(pathlib.Path(out), result)
    return result
