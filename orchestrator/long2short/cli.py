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

Problems: the demo's arithmetic by default (``--num-problems``, ``--levels``, ``--seed``); or any task's,
named as in the RL job: ``--config JOB.json`` and/or its ``--set`` overrides of ``data.train_path`` and
``data.heldout_path`` (or ``data.heldout_fraction``): JSONL problem files (``orchestrator.tasks.file_task``). Then
shortest-rejection and dpo sample every training problem and evaluate every held-out one; prompts are
the task's (``task.encode(problem, tokenizer)``: its template or the model's chat template), a
response is correct when the task's reward reaches ``reward.correct_threshold``, and records carry
the problem's stable id (and the ``prompt_ids`` sampled from, which ``sft-on`` trains on). A bad
file is an error naming ``file:line`` (exit 2) before any engine starts.

Every command works on HF model directories and writes one (``merge``, ``sft-on``, ``dpo``) or data.
This module is the command line; the work is in ``long2short_merge`` (merge, the INFO_FILE each
command writes), ``long2short_sample`` (sampling, shortest rejection), ``long2short_train`` (SFT on
the records, DPO) and ``long2short_eval`` (token efficiency).
Sampling goes through the rollout engine interface (``orchestrator.engine_pool.base.RolloutEngine``), as in
``orchestrator.curation``: the CLI starts the in-process vLLM engine on dummy weights and pushes the
model's weights through the checkpoint engine (``evaluate`` pushes each model in turn into one
engine, so the models must share an architecture); tests drive the same functions with scripted
engines. Training runs on ``trainer.hf.HFTrainer`` (CPU, float32). The last printed line of
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
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ckpt_common.cli_config import ConfigArgs, add_config_args
from ckpt_common.logs import add_log_level_flag
from demo import task
from orchestrator.long2short.eval import evaluate_models, parse_model_spec, write_evaluation
from orchestrator.long2short.merge import DEFAULT_ALPHA, merge_model_dirs
from orchestrator.long2short.sample import (
    ProblemSetConfig,
    SamplingConfig,
    demo_problem_fields,
    group_stats,
    sample_groups,
    shortest_rejection_records,
)
from orchestrator.long2short.train import DpoConfig, TrainConfig, run_dpo, sft_on
from orchestrator.tasks.factory import add_task_args, file_task_from_sections, job_sections
from trainer import dpo

logger = logging.getLogger(__name__)


# -- the command ----------------------------------------------------------------------------------


# Each subcommand's generated flags: name -> (its parser, the configs built from its arguments).
Commands = dict[str, tuple[argparse.ArgumentParser, dict[str, ConfigArgs]]]


def _add_engine(p: argparse.ArgumentParser, specs: dict[str, ConfigArgs]) -> None:
    """Flags of the commands that run vLLM: its context length and eager mode (EngineConfig), the log level."""
    from orchestrator.config import EngineConfig  # light: dataclasses only

    specs["engine"] = add_config_args(p, EngineConfig, only=("max_model_len", "enforce_eager"))
    add_log_level_flag(p)


def _add_sampling(p: argparse.ArgumentParser, specs: dict[str, ConfigArgs]) -> None:
    _add_engine(p, specs)
    p.add_argument("--model", required=True, help="HF model directory to sample from (and to train, for dpo)")
    specs["sampling"] = add_config_args(p, SamplingConfig)
    specs["problems"] = add_config_args(p.add_argument_group("problems (training split)"), ProblemSetConfig)
    _add_task(p)
    p.add_argument(
        "--endpoint", default=None, help="a running vLLM server that already serves --model (default: in-process)"
    )


def _add_task(p: argparse.ArgumentParser) -> None:
    """The task's flags, the RL job's: a job config and its overrides (problem files: data.train_path, ...)."""
    add_task_args(
        p,
        "any task, as the RL job names it: with data.train_path set, its problems replace the demo's "
        "(--num-problems, --levels and the problem --seed are then unused)",
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
    _add_task(p)
    commands["evaluate"] = (p, specs)
    return parser, commands


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return _parser()[0].parse_args(argv)


class _Engine:
    """The CLI's engine: vLLM (in-process on dummy weights, or a server) and a weight pusher."""

    def __init__(self, model_dir: str, endpoint: str | None, config: Any) -> None:
        """``config``: the ``orchestrator.config.EngineConfig`` of the in-process engine."""
        from orchestrator.config import SyncConfig
        from orchestrator.engine_pool.factory import make_engine
        from orchestrator.engine_pool.weight_sync import WeightSync

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
        from ckpt_common.hf_dir import read_tensors

        self.sync.push(read_tensors(model_dir), version=self.version)
        self.version += 1

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.engine.close()


def _setup(args: argparse.Namespace) -> None:
    from ckpt_common.logs import setup_logging

    setup_logging(args.log_level)
    logging.getLogger("checkpoint_engine").setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if args.log_level == "INFO" else args.log_level)


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _codec(tokenizer):
    return (
        lambda text: list(tokenizer(text)["input_ids"]),
        lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
    )


@dataclasses.dataclass(frozen=True)
class Problems:
    """A command's problems and how to ask and judge them: the demo's (``source`` None) or a task's."""

    problems: Sequence[Any]
    source: Any = None  # orchestrator.tasks.base.Task, or None: the demo's arithmetic (demo.task)
    is_correct: Callable[[Any, str], bool] = task.is_correct

    def encode_problem(self, tokenizer: Any) -> Callable[[Any], list[int]] | None:
        """problem -> prompt ids (None: the demo's prompt text, encoded by the caller)."""
        if self.source is None:
            return None
        return lambda p: self.source.encode(p, tokenizer)

    def level_of(self, problem: Any) -> int:
        return problem.level if self.source is None else self.source.level_of(problem)

    def fields(self, tokenizer: Any) -> Callable[[Any], dict[str, Any]]:
        """A shortest-rejection record's problem fields: the demo's, or a task's (id, the rendered prompt
        and its ids, the answer (None for code), the level)."""
        if self.source is None:
            return demo_problem_fields
        t = self.source

        def fields(p: Any) -> dict[str, Any]:
            reference = t.reference(p)
            return {
                "id": p.id,
                "prompt": t.prompt_text(p, tokenizer),
                "prompt_ids": t.encode(p, tokenizer),
                "answer": reference if isinstance(reference, str) else None,
                "level": t.level_of(p),
            }

        return fields


def _task_problems(args: argparse.Namespace, problem_set: ProblemSetConfig, split: str) -> Problems:
    """The ``split`` ("train" or "heldout") problems: the job config's task when it names problem files
    (ProblemFileError, a ValueError naming file:line, for a bad one), else the demo's draw."""
    if args.config is not None or args.overrides:
        data, reward = job_sections(args.config, args.overrides)
        if data.train_path is None:
            raise ValueError(
                "--config/--set name no problem files (data.train_path): the demo's problems come from "
                "--num-problems, --levels and --seed"
            )
        chosen = file_task_from_sections(data, reward)
        problems = chosen.train_problems() if split == "train" else chosen.heldout_problems()
        if not problems:
            raise ValueError(f"the task has no {split} problems")
        return Problems(list(problems), chosen, chosen.make_is_correct(reward))
    if split == "train":
        return Problems(task.training_problems(problem_set.seed, problem_set.num_problems, problem_set.levels))
    return Problems(
        task.heldout_problems(problem_set.seed, problem_set.num_problems, problem_set.levels, allow_fewer=True)
    )


def _sample(args: argparse.Namespace, configs: dict[str, Any]) -> tuple[Problems, Any, list[list[dpo.Sample]]]:
    """(the problems, the model's tokenizer, the sampled groups)."""
    chosen = _task_problems(args, configs["problems"], "train")
    tokenizer = _tokenizer(args.model)
    encode, decode = _codec(tokenizer)
    engine = _Engine(args.model, args.endpoint, configs["engine"])
    try:
        if not args.endpoint:
            engine.load(args.model)  # vLLM started on dummy weights
        groups = sample_groups(
            engine.engine,
            chosen.problems,
            encode,
            decode,
            configs["sampling"],
            chosen.is_correct,
            encode_problem=chosen.encode_problem(tokenizer),
        )
    finally:
        engine.close()
    return chosen, tokenizer, groups


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
        chosen, tokenizer, groups = _sample(args, configs)
        records = shortest_rejection_records(chosen.problems, groups, chosen.fields(tokenizer))
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        kept = [r["num_tokens"] for r in records]
        return {
            "data": str(out),
            **group_stats(groups),
            "num_records": len(records),
            "mean_kept_tokens": sum(kept) / len(kept) if kept else None,
        }
    if args.command == "dpo":
        chosen, _, groups = _sample(args, configs)
        encode_problem = None if chosen.source is None else chosen.source.encode
        result = run_dpo(args.model, args.out, chosen.problems, groups, configs["dpo"], encode_problem)
        return {**result, "samples": group_stats(groups)}
    # evaluate
    models = [parse_model_spec(spec) for spec in args.models]
    chosen = _task_problems(args, configs["problems"], "heldout")
    tokenizer = _tokenizer(models[0][1])
    encode, decode = _codec(tokenizer)
    engine = _Engine(models[0][1], None, configs["engine"])
    try:
        summary = evaluate_models(
            models,
            engine.engine,
            engine.load,
            chosen.problems,
            encode,
            decode,
            configs["sampling"].max_response_tokens,
            timeout_s=configs["sampling"].timeout_s,
            encode_problem=chosen.encode_problem(tokenizer),
            is_correct=chosen.is_correct,
            level_of=chosen.level_of,
        )
    finally:
        engine.close()
    return write_evaluation(summary, args.out_dir)


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
