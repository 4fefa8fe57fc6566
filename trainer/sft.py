"""SFT warm-up: teach the tiny random model the arithmetic task's chain-of-thought format.

::

    SFTConfig ──hash──▶ <out_dir>/sft-<hash>/ exists and complete? ──yes──▶ return it at once
        │ no
        ▼
    make_tiny_model(random) ──▶ HFTrainer ◀── batches of (prompt, solution + eos) from the
        │                         │            training split (task.iter_training_problems)
        │          loss = -mean token log p (response tokens only), AdamW, warmup + cosine
        ▼                         ▼
    metrics.jsonl, loss.png   trainer.save() ──▶ greedy eval on held-out levels ──▶ eval.json
                                                          └──▶ atomic rename into place

The default config stops at partial competence: near-perfect on the SFT levels, partly right
on the harder RL levels, so RL has headroom to show.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import pathlib
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ckpt_common.cli_config import add_config_args, meta
from ckpt_common.validate import check_int
from demo import task
from trainer.cpu import AUTOCAST_DTYPES, num_threads_for, resolve_autocast_dtype

logger = logging.getLogger(__name__)

# Bump when the training recipe or the task's text format changes: old caches become stale.
SFT_RECIPE_VERSION = 1
DONE_FILE = "sft_done.json"
# Evaluation settings do not change the trained weights, so they stay out of the key (a cache
# hit's summary reports the evaluation of the run that trained it). The thread count and the
# autocast dtype do: they change float reduction order, and training amplifies that.
_NOT_IN_CACHE_KEY = ("eval_every_steps", "eval_levels", "num_eval_problems_per_level", "heldout_seed")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """What to train and how to evaluate it; see ``cache_key`` for what identifies a result."""

    levels: tuple[int, ...] = dataclasses.field(default=task.SFT_LEVELS, metadata=meta("difficulty levels trained on"))
    level_weights: tuple[float, ...] | None = dataclasses.field(
        default=None, metadata=meta("one weight per level (None: uniform)")
    )
    num_steps: int = 600
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 30
    min_lr_ratio: float = dataclasses.field(default=0.1, metadata=meta("cosine decay floor, a fraction of lr"))
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    init_seed: int = dataclasses.field(default=0, metadata=meta("seed of the random initial model"))
    # One thread by default: the thread count changes float reduction order, and SFT amplifies it
    # (two threads trained a different, weaker demo model than one), so one thread makes the cached
    # model the same on every machine whatever its core count.
    num_threads: int | None = dataclasses.field(
        default=1, metadata=meta("torch threads; None: every CPU of the affinity mask (part of the cache key)")
    )
    num_layers: int = 4
    hidden_size: int = 256
    eval_levels: tuple[int, ...] = dataclasses.field(
        default=tuple(sorted(task.LEVELS)), metadata=meta("held-out levels evaluated")
    )
    num_eval_problems_per_level: int = 64
    heldout_seed: int = 0
    eval_every_steps: int = dataclasses.field(
        default=0, metadata=meta("evaluate on 16 problems per level this often (0: only at the end)")
    )
    # resolved before the cache key is taken, so the key names the dtype that trained the weights
    autocast_dtype: str = dataclasses.field(
        default="auto",
        metadata=meta("auto: bfloat16 only where the CPU runs it natively (trainer.cpu)", choices=AUTOCAST_DTYPES),
    )
    # kept out of the cache key when "short", so the short model's key is what it was before the field existed
    solution_style: str = dataclasses.field(
        default="short",
        metadata=meta(
            "chain-of-thought format of the targets: short (task.solution_text), or long (verbose re-checks, "
            "task.long_solution_text: the long-CoT model of long2short)",
            choices=task.SOLUTION_STYLES,
        ),
    )
    # trainer.sft_file's: fine-tune your own model (the job's init_model_dir) on this JSONL file instead of
    # training the demo's; kept out of this key when None (the demo's keys predate it), and out of this CLI
    data_path: str | None = None
    # which columns of data_path hold "prompt", "response" and "messages" (absent keys: those names), and
    # its split where it has several (trainer.sft_file); both kept out of this key when None, as data_path
    data_fields: Mapping[str, str] | None = None
    data_split: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "num_threads", "num_layers", "hidden_size"):
            if not (name == "num_threads" and getattr(self, name) is None):
                check_int(name, getattr(self, name))
        for name in ("warmup_steps", "num_eval_problems_per_level", "eval_every_steps"):
            check_int(name, getattr(self, name), 0)
        if not self.levels or any(level not in task.LEVELS for level in self.levels):
            raise ValueError(f"levels={self.levels!r} must be a non-empty subset of {sorted(task.LEVELS)}")
        if any(level not in task.LEVELS for level in self.eval_levels):
            raise ValueError(f"eval_levels={self.eval_levels!r} must be a subset of {sorted(task.LEVELS)}")
        if self.level_weights is not None and (
            len(self.level_weights) != len(self.levels) or min(self.level_weights) < 0 or sum(self.level_weights) <= 0
        ):
            raise ValueError(
                f"level_weights={self.level_weights!r} must be {len(self.levels)} non-negative numbers, not all 0"
            )
        if self.solution_style not in task.SOLUTION_STYLES:
            raise ValueError(f"solution_style={self.solution_style!r} must be one of {task.SOLUTION_STYLES}")
        if self.autocast_dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast_dtype={self.autocast_dtype!r} must be one of {AUTOCAST_DTYPES}")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if self.data_path is not None and (not isinstance(self.data_path, str) or not self.data_path.strip()):
            raise ValueError(f"data_path={self.data_path!r} must be the path of an SFT file or folder")
        if self.data_fields is not None:
            known = ("prompt", "response", "messages")
            if not isinstance(self.data_fields, Mapping) or any(
                key not in known or not isinstance(value, str) or not value.strip()
                for key, value in self.data_fields.items()
            ):
                raise ValueError(
                    f"data_fields={self.data_fields!r} must map some of {list(known)} to column names (strings)"
                )
        if self.data_split is not None and (not isinstance(self.data_split, str) or not self.data_split.strip()):
            raise ValueError(f"data_split={self.data_split!r} must be a split's name or null")

    def resolved(self) -> SFTConfig:
        """This config with "auto" settings replaced by what this machine uses (part of the cache key)."""
        return dataclasses.replace(
            self,
            autocast_dtype=resolve_autocast_dtype(self.autocast_dtype).chosen,
            num_threads=num_threads_for(self.num_threads),
        )

    def cache_key(self) -> str:
        """Hash of the recipe version and every field that can change the result."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_IN_CACHE_KEY}
        if self.solution_style == "short":
            del fields["solution_style"]  # the key of a short-CoT model predates the field
        for name in ("data_path", "data_fields", "data_split"):
            if getattr(self, name) is None:
                del fields[name]  # the demo's keys predate these fields
        payload = json.dumps({"recipe": SFT_RECIPE_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def lr_at(step: int, config: SFTConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.num_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def encode_examples(
    tokenizer, problems: Sequence[task.Problem], solution_style: str = "short"
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids (with bos) and response ids (solution in ``solution_style`` + eos) for SFT."""
    prompts = tokenizer([p.prompt for p in problems])["input_ids"]
    targets = [task.solution_text_for(p, solution_style) for p in problems]
    responses = tokenizer(targets, add_special_tokens=False)["input_ids"]
    return prompts, [r + [tokenizer.eos_token_id] for r in responses]


def iter_batches(config: SFTConfig) -> Iterator[list[task.Problem]]:
    """Endless training batches; each batch holds one level (similar lengths, little padding)."""
    rng = random.Random(f"sft-levels/{config.seed}")
    streams = {level: task.iter_training_problems(config.seed * 1009 + level, [level]) for level in config.levels}
    while True:
        level = rng.choices(config.levels, weights=config.level_weights)[0]
        yield [next(streams[level]) for _ in range(config.batch_size)]


def greedy_responses(
    model, tokenizer, problems: Sequence[task.Problem], batch_size: int = 64, solution_style: str = "short"
) -> list[str]:
    """Greedy completions (special tokens stripped) with ``transformers`` generate (a budget that fits
    ``solution_style``'s reference solutions)."""
    import torch

    out: list[str] = []
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True)
            budget = max(task.max_solution_chars_for(p, solution_style) for p in chunk) + 1
            with torch.no_grad():
                gen = model.generate(
                    **enc,
                    max_new_tokens=budget,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new_tokens = gen[:, enc["input_ids"].shape[1] :]
            out += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out


def accuracy_by_level(
    model, tokenizer, problems: Sequence[task.Problem], solution_style: str = "short"
) -> dict[int, float]:
    """Greedy accuracy per difficulty level."""
    responses = greedy_responses(model, tokenizer, problems, solution_style=solution_style)
    totals: dict[int, list[int]] = {}
    for problem, response in zip(problems, responses):
        totals.setdefault(problem.level, []).append(int(task.is_correct(problem, response)))
    return {level: sum(v) / len(v) for level, v in sorted(totals.items())}


def evaluate_greedy(
    model_dir: str | pathlib.Path, problems: Sequence[task.Problem], num_threads: int | None = None
) -> float:
    """Fraction of ``problems`` a model directory answers correctly with greedy decoding."""
    model, tokenizer = _load(model_dir, num_threads)
    responses = greedy_responses(model, tokenizer, problems)
    return sum(task.is_correct(p, r) for p, r in zip(problems, responses)) / max(1, len(problems))


def _load(model_dir, num_threads: int | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(num_threads_for(num_threads))
    return (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_dir),
    )


def model_shape(config: SFTConfig):
    """The warm-up model's shape (a demo.tiny_model.TinyModelConfig) for `config`."""
    from demo.tiny_model import TinyModelConfig

    return TinyModelConfig.tiny(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        intermediate_size=4 * config.hidden_size,
        num_attention_heads=config.hidden_size // 64,
        num_key_value_heads=max(1, config.hidden_size // 128),
    )


def write_warmup_model_files(config: SFTConfig, out_dir: str | pathlib.Path) -> pathlib.Path:
    """The engines' model folder for `config`'s model: config, generation config and tokenizer, no
    weights (the checkpoint engine brings them). What an inference host needs without a shared volume."""
    from demo.tiny_model import write_model_files

    return write_model_files(out_dir, model_shape(config))


def _train(config: SFTConfig, work_dir: pathlib.Path) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from demo.tiny_model import make_tiny_model
    from trainer.base import TrainerConfig
    from trainer.hf import HFTrainer

    init_dir = make_tiny_model(work_dir / "init", model_shape(config), seed=config.init_seed)
    trainer = HFTrainer(
        init_dir,
        TrainerConfig(
            lr=config.lr,
            weight_decay=config.weight_decay,
            grad_clip=config.grad_clip,
            num_threads=config.num_threads,
            seed=config.seed,
            autocast_dtype=config.autocast_dtype,
        ),
    )
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    batches = iter_batches(config)
    heldout = [
        p
        for level in config.eval_levels
        for p in task.heldout_problems(
            config.heldout_seed, config.num_eval_problems_per_level, [level], allow_fewer=True
        )
    ]
    start = time.monotonic()
    with (
        open(work_dir / "metrics.jsonl", "w") as metrics,
        tqdm(range(config.num_steps), desc="sft", unit="step", mininterval=2.0) as bar,
    ):
        for step in bar:
            problems = next(batches)
            prompts, responses = encode_examples(tokenizer, problems, config.solution_style)
            trainer.set_lr(lr_at(step, config))
            logprobs = trainer.sequence_logprobs(prompts, responses)
            loss = -logprobs.sum() / sum(len(r) for r in responses)
            stats = trainer.step(loss)
            record = {"step": step, "loss": loss.item(), **stats, "elapsed_s": time.monotonic() - start}
            if config.eval_every_steps and (step + 1) % config.eval_every_steps == 0 and heldout:
                small = _first_per_level(heldout, 16)
                record["heldout_accuracy_by_level"] = accuracy_by_level(
                    trainer.model, tokenizer, small, config.solution_style
                )
                logger.info(
                    "step %d: held-out accuracy (16 per level) %s", step + 1, record["heldout_accuracy_by_level"]
                )
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
    train_s = time.monotonic() - start
    model_dir = trainer.save(work_dir / "model")
    shutil.rmtree(init_dir)
    eval_start = time.monotonic()
    accuracy = accuracy_by_level(trainer.model, tokenizer, heldout, config.solution_style) if heldout else {}
    return {
        "train_s": train_s,
        "eval_s": time.monotonic() - eval_start,
        "heldout_accuracy_by_level": accuracy,
        "model_dir": str(model_dir),
    }


def _first_per_level(problems: Sequence[task.Problem], num_per_level: int) -> list[task.Problem]:
    counts: dict[int, int] = {}
    out = []
    for problem in problems:
        counts[problem.level] = counts.get(problem.level, 0) + 1
        if counts[problem.level] <= num_per_level:
            out.append(problem)
    return out


def _plot_loss(work_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records])
    ax.set(xlabel="step", ylabel="loss (nats/token)", yscale="log", title="SFT loss")
    fig.tight_layout()
    fig.savefig(work_dir / "loss.png")
    plt.close(fig)


@contextlib.contextmanager
def _training_lock(path: pathlib.Path, wait_s: float) -> Iterator[None]:
    """One trainer per cache entry: an exclusive ``flock`` on ``path``, polled until ``wait_s``. The
    kernel drops it when its holder exits, however it exits, so a killed trainer never blocks a later one."""
    with open(path, "a") as f:
        deadline = time.monotonic() + wait_s
        logged = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not logged:
                    logger.info("another process is training this SFT (%s held): waiting up to %.0f s", path, wait_s)
                    logged = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{path} is still held after {wait_s:.0f} s: another process is training this SFT"
                    ) from None
                time.sleep(1.0)  # the other trainer's minutes, polled under the deadline
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_sft(config: SFTConfig, out_dir: str | pathlib.Path, *, wait_s: float = 4 * 3600.0) -> pathlib.Path:
    """Train (or reuse the cached result) and return the model directory.

    Results live in ``<out_dir>/sft-<config hash>/``: ``model/`` (HF dir, vLLM-loadable),
    ``metrics.jsonl``, ``loss.png``, ``sft_done.json`` (config, timings, held-out accuracy).
    Processes asking for the same config at once train it once: the others wait for it (up to
    ``wait_s``, then TimeoutError) and return the cached result.
    """
    if config.data_path is not None:
        raise ValueError(
            f"data_path={config.data_path!r}: the demo's SFT trains its own tiny model on the arithmetic task; "
            "an SFT file fine-tunes your model (trainer.sft_file.run_file_sft, the job's init_model_dir)"
        )
    choice = resolve_autocast_dtype(config.autocast_dtype)
    config = config.resolved()
    final = pathlib.Path(out_dir) / f"sft-{config.cache_key()}"

    def train(work_dir: pathlib.Path) -> dict[str, Any]:
        summary = _train(config, work_dir)
        _plot_loss(work_dir)
        summary["config"] = dataclasses.asdict(config)
        summary["autocast"] = choice.to_dict()
        logger.info(
            "SFT done in %.0f s; held-out accuracy by level %s",
            summary["train_s"],
            summary["heldout_accuracy_by_level"],
        )
        return summary

    return cached_training(final, train, wait_s, tmp_prefix=".sft-tmp-")


def cached_training(
    final: pathlib.Path,
    train: Callable[[pathlib.Path], dict[str, Any]],
    wait_s: float,
    *,
    tmp_prefix: str,
) -> pathlib.Path:
    """``final/model`` of the cache entry ``final`` (complete once ``final/DONE_FILE`` exists); on a miss,
    under the entry's lock (one trainer per entry, the others wait up to ``wait_s``), ``train(work_dir)``
    fills a temporary folder beside ``final`` and returns the summary written to DONE_FILE, and the
    folder is renamed to ``final`` (atomic: a cache entry is complete or absent). Shared by ``run_sft``
    and ``trainer.sft_file.run_file_sft``."""
    if (final / DONE_FILE).exists():
        logger.info("SFT cache hit: %s", final)
        return final / "model"
    final.parent.mkdir(parents=True, exist_ok=True)
    with _training_lock(final.with_name(final.name + ".lock"), wait_s):
        if (final / DONE_FILE).exists():
            logger.info("SFT cache hit once the other trainer finished: %s", final)
            return final / "model"
        work_dir = pathlib.Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=final.parent))
        try:
            summary = train(work_dir)
            summary["model_dir"] = str(final / "model")
            (work_dir / DONE_FILE).write_text(json.dumps(summary, indent=2))
            try:
                work_dir.rename(final)
            except OSError:
                if not (final / DONE_FILE).exists():
                    raise
                logger.info("another process finished the same SFT first; using %s", final)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    return final / "model"


def sft_summary(model_dir: str | pathlib.Path) -> dict[str, Any]:
    """The summary ``run_sft`` wrote next to a model directory it returned."""
    return json.loads((pathlib.Path(model_dir).parent / DONE_FILE).read_text())


DEFAULT_CACHE_DIR = ".cache/sft"  # the SFT cache root (the RL job's `sft_cache_dir` too)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="SFT warm-up of the tiny model on the arithmetic task (cached by config hash)."
    )
    parser.add_argument("--out-dir", default=DEFAULT_CACHE_DIR, help="cache root (default: %(default)s)")
    # every field a flag (but data_path: trainer.sft_file's); defaults and help from SFTConfig
    spec = add_config_args(parser, SFTConfig, exclude=("data_path", "data_fields", "data_split"))
    args = parser.parse_args(argv)
    config = spec.build(args, parser)
    from ckpt_common.logs import setup_logging

    setup_logging("INFO")
    model_dir = run_sft(config, args.out_dir)
    print(json.dumps(sft_summary(model_dir)["heldout_accuracy_by_level"]))
    print(
        json.dumps(
            {
                "model_dir": str(model_dir),
                **{k: v for k, v in sft_summary(model_dir).items() if k in ("train_s", "eval_s")},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
