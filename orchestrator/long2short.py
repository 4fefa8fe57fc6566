"""k1.5 long2short (report section 2.4): make a long-CoT model answer with fewer tokens.

::

    python -m trainer.sft --solution-style long ──▶ LONG (verbose CoT: per-column re-checks, a re-add)
    python -m trainer.sft                       ──▶ SHORT
        │
        ├─ merge --long LONG --short SHORT --alpha a ──▶ a * LONG + (1 - a) * SHORT, tensor by tensor
        │
        ├─ shortest-rejection --model M ── n = 8 samples per problem (rollout engine, T = 1) ──▶
        │      the shortest correct response per problem ──▶ data.jsonl ── sft-on --data ──▶ M'
        │
        ├─ dpo --model M ── n = 8 samples ──▶ dpo.build_dpo_pairs (chosen = shortest correct;
        │      rejected = wrong, or correct and >= 1.5x longer) ──▶ dpo.dpo_train against the frozen M ──▶ M'
        │
        └─ evaluate --models [LABEL=]DIR ... ── greedy on held-out problems ──▶ summary.json
               (accuracy, mean response tokens per model) + token_efficiency.png (one labelled point each)

Every command works on HF model directories and writes one (``merge``, ``sft-on``, ``dpo``) or data.
Sampling goes through the rollout engine interface (``orchestrator.engine.RolloutEngine``), as in
``orchestrator.curation``: the CLI starts the in-process vLLM engine on dummy weights and pushes the
model's weights through the checkpoint engine (``evaluate`` pushes each model in turn into one
engine, so the models must share an architecture); tests drive the same functions with scripted
engines. Training runs on ``trainer.torch_trainer.HFTrainer`` (CPU, float32). The last printed line of
every command is one JSON object.

**long2short RL is a config, not code**: the RL job, started from the long-CoT model, with the length
penalty at full weight from the first iteration and a lower response cap::

    python -m orchestrator --config configs/demo.json --output-dir runs/long2short-rl \\
        --set sft.solution_style=long \\
        --set length_penalty.weight=1.0 --set length_penalty.warmup_iterations=0 \\
        --set rollout.max_response_tokens=96

``sft.solution_style=long`` makes the job's (cached) SFT warm-up the long-CoT model; ``--set
init_model_dir=DIR`` starts from any other model directory instead (a merged one, say). The long format
takes up to 103 tokens (eos included) on the RL levels 2-4 and the short one up to 35; a cap below the
long length truncates (and so zeroes the reward of) the longest long answers. The cap is not tuned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import random
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from checkpoint_engine.cli_config import ConfigArgs, add_config_args, meta
from checkpoint_engine.validate import check_int, check_number
from demo import task
from trainer import dpo

logger = logging.getLogger(__name__)

WEIGHT_FILE_SUFFIXES = (".safetensors",)
WEIGHT_INDEX_FILE = "model.safetensors.index.json"
INFO_FILE = "long2short.json"  # what made a model directory (written next to its weights)
DEFAULT_ALPHA = 0.5  # merge: weight of the long-CoT model


# -- merge ----------------------------------------------------------------------------------------


def merge_state_dicts(long: Mapping[str, Any], short: Mapping[str, Any], alpha: float) -> dict[str, Any]:
    """``alpha * long + (1 - alpha) * short`` per tensor, computed in float32 and cast back (dtype kept).

    Names, shapes and dtypes must match (ValueError naming the first few that do not). Non-float tensors
    must be equal and are copied.
    """
    import torch

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1]")
    only_long, only_short = sorted(set(long) - set(short)), sorted(set(short) - set(long))
    if only_long or only_short:
        raise ValueError(f"tensor names differ: only in long {only_long[:5]}, only in short {only_short[:5]}")
    bad_shape = [n for n in sorted(long) if tuple(long[n].shape) != tuple(short[n].shape)]
    if bad_shape:
        n = bad_shape[0]
        raise ValueError(
            f"tensor shapes differ for {bad_shape[:5]} ({len(bad_shape)} in all), "
            f"e.g. {n}: {tuple(long[n].shape)} vs {tuple(short[n].shape)}"
        )
    bad_dtype = [n for n in sorted(long) if long[n].dtype != short[n].dtype]
    if bad_dtype:
        n = bad_dtype[0]
        raise ValueError(f"tensor dtypes differ for {bad_dtype[:5]}, e.g. {n}: {long[n].dtype} vs {short[n].dtype}")
    out = {}
    for name, a in long.items():
        b = short[name]
        if not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                raise ValueError(f"non-float tensor {name} ({a.dtype}) differs between the models")
            out[name] = a.clone()
            continue
        mixed = alpha * a.detach().to(torch.float32) + (1.0 - alpha) * b.detach().to(torch.float32)
        out[name] = mixed.to(a.dtype)
    return out


def merge_model_dirs(
    long_dir: str | pathlib.Path,
    short_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    alpha: float = DEFAULT_ALPHA,
) -> pathlib.Path:
    """Weight-average two HF model directories into ``out_dir`` (config and tokenizer from ``short_dir``)."""
    from checkpoint_engine.hf_dir import read_tensors, write_safetensors

    merged = merge_state_dicts(read_tensors(long_dir), read_tensors(short_dir), alpha)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in pathlib.Path(short_dir).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_FILE_SUFFIXES) and path.name != WEIGHT_INDEX_FILE:
            shutil.copy2(path, out / path.name)
    write_safetensors(out, merged)
    _write_info(out, {"method": "merge", "long": str(long_dir), "short": str(short_dir), "alpha": alpha})
    return out


def _write_info(model_dir: pathlib.Path, info: dict) -> None:
    (model_dir / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


# -- sampling through the rollout engine ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Response:
    """One generated response: its decoded text and the token ids the engine produced."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    num_samples: int = dataclasses.field(
        default=8, metadata=meta("samples per problem (n of k1.5's shortest rejection sampling)")
    )
    temperature: float = 1.0
    max_response_tokens: int = 128
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("num_samples", "max_response_tokens"):
            check_int(name, getattr(self, name))
        check_number("temperature", self.temperature, allow_zero=True)
        check_number("timeout_s", self.timeout_s)


@dataclasses.dataclass(frozen=True)
class ProblemSetConfig:
    """Which problems a command samples (the training split) or evaluates (the held-out split)."""

    num_problems: int = 256
    levels: tuple[int, ...] = task.RL_LEVELS
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("num_problems", self.num_problems)
        if not self.levels or any(level not in task.LEVELS for level in self.levels):
            raise ValueError(f"levels={self.levels!r} must be a non-empty subset of {sorted(task.LEVELS)}")


def sample_groups(
    engine: Any,
    problems: Sequence[task.Problem],
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    config: SamplingConfig = SamplingConfig(),
    is_correct: Callable[[Any, str], bool] = task.is_correct,
) -> list[list[dpo.Sample]]:
    """``config.num_samples`` responses per problem: one group of ``dpo.Sample(Response, correct, num_tokens)``
    per problem, in order (num_tokens: the generated token count, eos included)."""
    from orchestrator.engine import GenRequest, SamplingSettings

    n = config.num_samples
    requests = [
        GenRequest(f"l2s-{i}.{c}", tuple(encode(p.prompt)), config.max_response_tokens)
        for i, p in enumerate(problems)
        for c in range(n)
    ]
    results = {
        r.request_id: r
        for r in engine.generate(requests, SamplingSettings(temperature=config.temperature), timeout_s=config.timeout_s)
    }
    groups = []
    for i, problem in enumerate(problems):
        group = []
        for c in range(n):
            result = results[f"l2s-{i}.{c}"]
            text = decode(result.token_ids)
            response = Response(text, tuple(result.token_ids), result.finish_reason)
            group.append(dpo.Sample(response, bool(is_correct(problem, text)), len(result.token_ids)))
        groups.append(group)
    return groups


def shortest_rejection_records(problems: Sequence[task.Problem], groups: Sequence[Sequence[dpo.Sample]]) -> list[dict]:
    """SFT records (one per problem with a correct sample): the shortest correct response of its group."""
    records = []
    for problem, group in zip(problems, groups):
        index = dpo.shortest_correct_index(group)
        if index is None:
            continue
        best = group[index]
        records.append(
            {
                "id": problem.id,
                "prompt": problem.prompt,
                "answer": problem.answer,
                "level": problem.level,
                "response": best.response.text,
                "response_ids": list(best.response.token_ids),
                "num_tokens": best.num_tokens,
                "num_correct": sum(s.correct for s in group),
                "num_samples": len(group),
                "mean_correct_tokens": sum(s.num_tokens for s in group if s.correct) / sum(s.correct for s in group),
            }
        )
    return records


def _group_stats(groups: Sequence[Sequence[dpo.Sample]]) -> dict[str, Any]:
    samples = [s for g in groups for s in g]
    correct = [s for s in samples if s.correct]
    return {
        "num_problems": len(groups),
        "num_samples": len(samples),
        "sample_accuracy": len(correct) / max(1, len(samples)),
        "mean_sample_tokens": sum(s.num_tokens for s in samples) / max(1, len(samples)),
        "mean_correct_tokens": sum(s.num_tokens for s in correct) / len(correct) if correct else None,
        "num_problems_with_correct": sum(any(s.correct for s in g) for g in groups),
    }


# -- SFT on shortest-rejection data ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    lr: float = 1e-4
    num_epochs: int = 2
    batch_size: int = 16
    seed: int = 0
    num_threads: int | None = dataclasses.field(
        default=None, metadata=meta("torch threads (None: the affinity mask's CPUs)")
    )

    def __post_init__(self) -> None:
        check_number("lr", self.lr)
        for name in ("num_epochs", "batch_size"):
            check_int(name, getattr(self, name))
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads)


def _trainer(model_dir: str | pathlib.Path, config: TrainConfig):
    from trainer.torch_trainer import HFTrainer, TrainerConfig

    return HFTrainer(model_dir, TrainerConfig(lr=config.lr, num_threads=config.num_threads, seed=config.seed))


def sft_examples(tokenizer, records: Sequence[Mapping[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with bos, response ids) per record: ``response_ids`` as sampled when present, else the
    ``response`` text tokenized plus eos."""
    out = []
    for record in records:
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
    _write_info(pathlib.Path(out), stats)
    return stats


# -- DPO ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DpoConfig:
    beta: float = 0.1
    length_ratio: float = dataclasses.field(
        default=1.5, metadata=meta("a correct sample this many times longer than the shortest is rejected")
    )
    lr: float = 1e-4
    num_epochs: int = 2
    pairs_per_step: int = 16
    seed: int = 0
    num_threads: int | None = dataclasses.field(
        default=None, metadata=meta("torch threads (None: the affinity mask's CPUs)")
    )

    def __post_init__(self) -> None:
        check_number("beta", self.beta)
        check_number("lr", self.lr)
        if not self.length_ratio >= 1:
            raise ValueError(f"length_ratio={self.length_ratio!r} must be >= 1")
        for name in ("num_epochs", "pairs_per_step"):
            check_int(name, getattr(self, name))
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads)


def dpo_token_pairs(
    tokenizer, problems: Sequence[task.Problem], groups: Sequence[Sequence[dpo.Sample]], length_ratio: float = 1.5
) -> tuple[list[dpo.TokenPair], dict[str, int]]:
    """``dpo.build_dpo_pairs`` per problem, in token ids (the responses' ids as sampled); and the count of
    pairs per reason ("wrong", "long")."""
    pairs, reasons = [], {"wrong": 0, "long": 0}
    for problem, group in zip(problems, groups):
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
    problems: Sequence[task.Problem],
    groups: Sequence[Sequence[dpo.Sample]],
    config: DpoConfig = DpoConfig(),
) -> dict[str, Any]:
    """DPO of ``model_dir`` on the pairs of ``groups`` (samples of ``problems``) against a frozen copy of
    itself; saves the result to ``out_dir`` and returns stats (loss, the pairs' margin before and after)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs, reasons = dpo_token_pairs(tokenizer, problems, groups, config.length_ratio)
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
    _write_info(pathlib.Path(out), result)
    return result


# -- token efficiency -----------------------------------------------------------------------------


def evaluate_models(
    models: Sequence[tuple[str, str]],
    engine: Any,
    load_weights: Callable[[str], None],
    problems: Sequence[task.Problem],
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    max_response_tokens: int = 128,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Greedy held-out accuracy and mean response tokens of each (label, model dir): ``load_weights(dir)``
    puts a model into ``engine``, then ``orchestrator.evaluate.greedy_eval`` runs on it."""
    from orchestrator.evaluate import greedy_eval

    if not models:
        raise ValueError("no models to evaluate")
    labels = [label for label, _ in models]
    if len(set(labels)) != len(labels):
        raise ValueError(f"model labels must be distinct, got {labels}")
    rows = []
    for label, model_dir in models:
        load_weights(model_dir)
        result = greedy_eval(
            engine,
            problems,
            lambda p: list(encode(p.prompt)),
            decode,
            task.is_correct,
            max_response_tokens,
            timeout_s=timeout_s,
        )
        rows.append(
            {
                "label": label,
                "model_dir": str(model_dir),
                "accuracy": result.accuracy,
                "accuracy_by_level": {str(k): v for k, v in result.accuracy_by_level.items()},
                "mean_response_tokens": result.mean_response_tokens,
                "num_problems": result.num_problems,
            }
        )
        logger.info("%s: accuracy %.3f, mean response tokens %.1f", label, result.accuracy, result.mean_response_tokens)
    return {"models": rows, "num_problems": len(problems), "max_response_tokens": max_response_tokens}


def plot_token_efficiency(summary: Mapping[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Accuracy (%) against mean response tokens, one labelled point per model, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for row in summary["models"]:
        x, y = row["mean_response_tokens"], 100.0 * row["accuracy"]
        ax.scatter([x], [y], s=40)
        ax.annotate(row["label"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.set(
        xlabel="mean response tokens (greedy, held-out)",
        ylabel="held-out accuracy (%)",
        title=f"Token efficiency ({summary.get('num_problems', '?')} held-out problems)",
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def parse_model_spec(spec: str) -> tuple[str, str]:
    """ "LABEL=DIR" -> (LABEL, DIR); "DIR" -> (a label from the path: its name, or its parent's when the
    name is "model", as in the SFT cache's sft-<hash>/model), DIR)."""
    if "=" in spec:
        label, _, path = spec.partition("=")
        if not label or not path:
            raise ValueError(f"model {spec!r} must be LABEL=DIR or DIR")
        return label, path
    path = pathlib.Path(spec.rstrip("/"))
    return (path.parent.name if path.name == "model" and path.parent.name else path.name), spec


# -- the command ----------------------------------------------------------------------------------


# Each subcommand's generated flags: name -> (its parser, the configs built from its arguments).
Commands = dict[str, tuple[argparse.ArgumentParser, dict[str, ConfigArgs]]]


def _add_engine(p: argparse.ArgumentParser, specs: dict[str, ConfigArgs]) -> None:
    """Flags of the commands that run vLLM: its context length (EngineConfig) and the log level."""
    from orchestrator.config import EngineConfig  # light: dataclasses only

    specs["engine"] = add_config_args(p, EngineConfig, only=("max_model_len",))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _add_sampling(p: argparse.ArgumentParser, specs: dict[str, ConfigArgs]) -> None:
    _add_engine(p, specs)
    p.add_argument("--model", required=True, help="HF model directory to sample from (and to train, for dpo)")
    specs["sampling"] = add_config_args(p, SamplingConfig)
    specs["problems"] = add_config_args(p.add_argument_group("problems (training split)"), ProblemSetConfig)
    p.add_argument(
        "--endpoint", default=None, help="a running vLLM server that already serves --model (default: in-process)"
    )


def _unused_num_threads(p: argparse.ArgumentParser) -> None:
    """--num-threads, accepted by every command; sampling and evaluation run inside vLLM and ignore it."""
    p.add_argument("--num-threads", type=int, default=None, help="torch threads of training commands (unused here)")


def _parser() -> tuple[argparse.ArgumentParser, Commands]:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.long2short",
        description="k1.5 long2short over HF model directories: merge, shortest rejection sampling (+ sft-on), "
        "DPO, token-efficiency evaluation. long2short RL is a config of the RL job (see the module docstring).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands: Commands = {}

    p = sub.add_parser("merge", help="weight-average a long-CoT and a short-CoT model")
    p.add_argument("--long", required=True, help="long-CoT model dir")
    p.add_argument("--short", required=True, help="short-CoT model dir (config and tokenizer are copied from it)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="weight of the long model (default: %(default)s)")
    p.add_argument("--out", required=True, help="new model dir")
    commands["merge"] = (p, {})

    p = sub.add_parser("shortest-rejection", help="n samples per problem; keep the shortest correct as SFT data")
    specs: dict[str, ConfigArgs] = {}
    _unused_num_threads(p)
    _add_sampling(p, specs)
    p.add_argument("--out", required=True, help="SFT data (JSONL: prompt, response, response_ids, num_tokens, ...)")
    commands["shortest-rejection"] = (p, specs)

    p = sub.add_parser("sft-on", help="fine-tune a model on shortest-rejection data")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSONL from shortest-rejection")
    p.add_argument("--out", required=True, help="new model dir")
    commands["sft-on"] = (p, {"train": add_config_args(p, TrainConfig)})

    p = sub.add_parser("dpo", help="DPO toward the shortest correct sample, against the frozen model")
    specs = {}
    _add_sampling(p, specs)  # its --seed seeds both the problems and DPO
    p.add_argument("--out", required=True, help="new model dir")
    specs["dpo"] = add_config_args(p.add_argument_group("dpo"), DpoConfig, exclude=("seed",))
    commands["dpo"] = (p, specs)

    p = sub.add_parser("evaluate", help="held-out accuracy vs mean response tokens of several models")
    specs = {}
    _unused_num_threads(p)
    _add_engine(p, specs)
    specs["sampling"] = add_config_args(p, SamplingConfig, only=("max_response_tokens",))
    p.add_argument("--models", nargs="+", required=True, help="[LABEL=]DIR ... (one architecture)")
    p.add_argument("--out-dir", required=True, help="writes summary.json and token_efficiency.png")
    specs["problems"] = add_config_args(
        p.add_argument_group("problems (held-out split)"),
        ProblemSetConfig,
        rename={"seed": "heldout-seed"},
        defaults={"num_problems": 192},
    )
    commands["evaluate"] = (p, specs)
    return parser, commands


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return _parser()[0].parse_args(argv)


class _Engine:
    """The CLI's engine: vLLM (in-process on dummy weights, or a server) and a weight pusher."""

    def __init__(self, model_dir: str, endpoint: str | None, config: Any) -> None:
        """``config``: the ``orchestrator.config.EngineConfig`` of the in-process engine."""
        from orchestrator.config import SyncConfig
        from orchestrator.engine import make_engine
        from orchestrator.weight_sync import WeightSync

        self.sync = None
        self.version = 0
        if endpoint:
            config = dataclasses.replace(config, type="vllm_http", endpoint=endpoint)
        self.engine = make_engine(config, model_dir)
        try:
            self.sync = WeightSync(SyncConfig(), self.engine.weight_req_func(300.0))
        except BaseException:
            self.engine.close()
            raise

    def load(self, model_dir: str) -> None:
        from checkpoint_engine.hf_dir import read_tensors

        self.sync.push(read_tensors(model_dir), version=self.version)
        self.version += 1

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.engine.close()


def _setup(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("checkpoint_engine").setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if args.log_level == "INFO" else args.log_level)


def _codec(model_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return (
        lambda text: list(tokenizer(text)["input_ids"]),
        lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
    )


def _sample(args: argparse.Namespace, configs: dict[str, Any]) -> tuple[list[task.Problem], list[list[dpo.Sample]]]:
    problem_set: ProblemSetConfig = configs["problems"]
    problems = task.training_problems(problem_set.seed, problem_set.num_problems, problem_set.levels)
    encode, decode = _codec(args.model)
    engine = _Engine(args.model, args.endpoint, configs["engine"])
    try:
        if not args.endpoint:
            engine.load(args.model)  # vLLM started on dummy weights
        groups = sample_groups(engine.engine, problems, encode, decode, configs["sampling"])
    finally:
        engine.close()
    return problems, groups


def _configs(args: argparse.Namespace, commands: Commands) -> dict[str, Any]:
    """The command's configs built from its flags (a bad value: exit 2 naming the flag)."""
    parser, specs = commands[args.command]
    configs = {key: spec.build(args, parser) for key, spec in specs.items() if key != "dpo"}
    if "dpo" in specs:  # the command's one --seed seeds the problems and DPO
        configs["dpo"] = specs["dpo"].build(args, parser, seed=configs["problems"].seed)
    return configs


def _run(args: argparse.Namespace, configs: dict[str, Any]) -> dict[str, Any]:
    if args.command == "merge":
        out = merge_model_dirs(args.long, args.short, args.out, args.alpha)
        return {"model_dir": str(out), "alpha": args.alpha}
    if args.command == "sft-on":
        records = [json.loads(line) for line in pathlib.Path(args.data).read_text().splitlines() if line.strip()]
        return sft_on(args.model, records, args.out, configs["train"])
    _setup(args)
    if args.command == "shortest-rejection":
        problems, groups = _sample(args, configs)
        records = shortest_rejection_records(problems, groups)
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        kept = [r["num_tokens"] for r in records]
        return {
            "data": str(out),
            **_group_stats(groups),
            "num_records": len(records),
            "mean_kept_tokens": sum(kept) / len(kept) if kept else None,
        }
    if args.command == "dpo":
        problems, groups = _sample(args, configs)
        result = run_dpo(args.model, args.out, problems, groups, configs["dpo"])
        return {**result, "samples": _group_stats(groups)}
    # evaluate
    models = [parse_model_spec(spec) for spec in args.models]
    problem_set: ProblemSetConfig = configs["problems"]
    problems = task.heldout_problems(problem_set.seed, problem_set.num_problems, problem_set.levels, allow_fewer=True)
    encode, decode = _codec(models[0][1])
    engine = _Engine(models[0][1], None, configs["engine"])
    try:
        summary = evaluate_models(
            models,
            engine.engine,
            engine.load,
            problems,
            encode,
            decode,
            configs["sampling"].max_response_tokens,
            timeout_s=configs["sampling"].timeout_s,
        )
    finally:
        engine.close()
    return write_evaluation(summary, args.out_dir)


def write_evaluation(summary: dict[str, Any], out_dir: str | pathlib.Path) -> dict[str, Any]:
    """summary.json and token_efficiency.png into ``out_dir``; returns the summary with their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {**summary, "plot": str(plot_token_efficiency(summary, out / "token_efficiency.png"))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = _parser()
    args = parser.parse_args(argv)
    configs = _configs(args, commands)
    try:
        result = _run(args, configs)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
