"""SFT warm-up of your own model on a JSONL file (``sft.data_path``, with the job's ``init_model_dir``).

::

    sft.data_path ──read_sft_examples (every line checked first)──▶ SFTExample(prompt | messages, response)
        │
        ▼  key = hash(recipe, file sha256, init model dir identity, lr/steps/batch/warmup/... fields)
    <cache_dir>/sft-file-<key>/ complete? ──yes──▶ its model/ at once
        │ no (one trainer per key: a file lock; the others wait, then reuse it)
        ▼
    HFTrainer(init_model_dir, float32, AdamW) ◀── batches of encode_example(...): prompt ids + response
        │      ids (+ eos); loss = -mean log p over the response tokens only; warmup + cosine lr
        ▼
    trainer.save() ──▶ model/ (weights in the source's dtypes, config and tokenizer copied: vLLM-servable),
                       metrics.jsonl, sft_done.json ──atomic rename into place──▶ the job's RL starts from it

Records, one JSON object a line (blank lines skipped)::

    {"prompt": str, "response": str}
    {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}

A ``prompt`` is rendered as the RL job renders a problem's prompt (``PromptStyle``: the job's
``data.prompt_template`` with ``{prompt}`` filled in, then, with ``data.chat_template=true``, as one
user turn through the model's chat template; by default as written, with the tokenizer's own special
tokens, a BOS for instance), so the warm-up sees the inputs RL sends; ``messages`` end with the
assistant's turn, which is the response: the turns before it are rendered by the model's chat
template (``apply_chat_template(..., add_generation_prompt=True)``). The response gets the
tokenizer's eos appended; only response tokens carry loss. Errors name ``path:line``, the field and
what was expected, like problem files (by the record checks both share, ``ckpt_common.records``:
``ProblemFileError``), and every line is checked before anything trains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ckpt_common.prompt_style import PromptStyle
from ckpt_common.records import (
    Collector,
    ColumnNames,
    Issue,
    ProblemFileError,
    got,
    is_text,
    json_object_lines,
    parse_messages,
)
from ckpt_common.tables import MISSING, TableError, column_value, read_table, table_name
from trainer.sft import SFTConfig, cached_training, lr_at

logger = logging.getLogger(__name__)

# Bump when the recipe below changes: old cache entries become stale.
SFT_FILE_RECIPE_VERSION = 2  # 2: prompt records rendered in the job's prompt style
RECORD_FIELDS: tuple[str, ...] = ("prompt", "response", "messages")
# The SFTConfig fields this recipe uses (the rest are the demo's: levels, model shape, evaluation).
KEY_FIELDS: tuple[str, ...] = (
    "lr",
    "num_steps",
    "batch_size",
    "warmup_steps",
    "min_lr_ratio",
    "weight_decay",
    "grad_clip",
    "seed",
    "num_threads",
)
_HASHED_WHOLE_BYTES = 1 << 20  # model dir files up to this size are hashed whole; larger: name, size, mtime
_READ_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One record: ``prompt`` (plain text) or ``messages`` (the conversation before the response), and
    the ``response`` the model learns; ``line`` is where it was read (1-based)."""

    response: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    line: int | None = None


@dataclasses.dataclass(frozen=True)
class EncodedExample:
    """Token ids of one example: the prompt's (no loss) and the response's (eos included, the loss)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    @property
    def input_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.response_ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 on the response tokens, 0 on the prompt's, aligned with ``input_ids``."""
        return [0] * len(self.prompt_ids) + [1] * len(self.response_ids)


# -- reading and checking --------------------------------------------------------------------------


def _parse_record(record: dict[str, Any], line: int, errors: Collector) -> SFTExample | None:
    before = errors.count
    unknown = [key for key in record if key not in RECORD_FIELDS]
    if unknown:
        errors.add(line, unknown[0], f"unknown field(s) {unknown}; allowed: {list(RECORD_FIELDS)}")
    if "messages" in record:
        if "prompt" in record or "response" in record:
            both = "prompt" if "prompt" in record else "response"
            errors.add(line, both, 'expected either "prompt" and "response", or "messages", got both')
            return None
        messages = parse_messages(record["messages"], line, errors, last_role="assistant")
        if messages is not None and len(messages) < 2:
            errors.add(line, "messages", "expected the conversation before the final assistant message, got only it")
        if errors.count > before or messages is None:
            return None
        return SFTExample(messages[-1]["content"], messages=messages[:-1], line=line)
    if "prompt" not in record and "response" not in record:
        errors.add(
            line,
            "prompt",
            'missing: expected "prompt" and "response" (strings), or "messages" (a list ending with the assistant)',
        )
        return None
    for name in ("prompt", "response"):
        if name not in record:
            errors.add(line, name, "missing, expected a non-empty string")
        elif not is_text(record[name]):
            errors.add(line, name, f"expected a non-empty string, {got(record[name])}")
    if errors.count > before:
        return None
    return SFTExample(record["response"], prompt=record["prompt"], line=line)


def parse_sft_lines(lines: Iterable[str], path: str | os.PathLike[str] = "<sft>") -> list[SFTExample]:
    """The examples of a JSONL text given as lines (line 1 first); ProblemFileError listing every error
    (up to 20) if any line is not valid. ``path`` only names the source in errors."""
    errors = Collector(os.fspath(path))
    return _examples(json_object_lines(lines, errors), errors, None, strict=True)


def _examples(
    rows: Iterable[tuple[int, dict[str, Any]]], errors: Collector, columns: Mapping[str, str] | None, strict: bool
) -> list[SFTExample]:
    columns = dict(columns or {})
    examples: list[SFTExample] = []
    for line_number, row in rows:
        if strict:
            example = _parse_record(row, line_number, errors)
        else:  # a table's columns, renamed to the record's fields; columns nobody named are left alone
            record = {}
            for name in RECORD_FIELDS:
                value = column_value(row, columns.get(name, name))
                if value is not MISSING:
                    record[name] = value
            example = _parse_record(record, line_number, ColumnNames(errors, columns))
        if example is not None:
            examples.append(example)
    if not examples and not errors.count:
        errors.add(None, None, "no examples: the file is empty (an SFT file needs at least one line)")
    errors.raise_if_any()
    return examples


def read_sft_examples(
    path: str | os.PathLike[str], columns: Mapping[str, str] | None = None, split: str | None = None
) -> list[SFTExample]:
    """Every example of the SFT set at ``path`` (this project's JSONL, or a table ``ckpt_common.tables``
    reads: parquet, CSV, JSON, Arrow, a ``save_to_disk`` folder; ``split`` where it has several), its
    columns named by ``columns`` (``sft.data_fields``: which column is the prompt, the response, the
    messages), or ProblemFileError naming what is wrong (the user's column)."""
    name = table_name(path, split)
    errors = Collector(name)
    try:
        table = read_table(path, errors, split)
    except TableError as e:
        hint = "" if pathlib.Path(path).exists() else ": check sft.data_path"
        raise ProblemFileError([Issue(e.name, None, None, str(e)[len(e.name) + 2 :] + hint)]) from None
    strict = table.kind == "jsonl" and not columns
    return _examples(table.rows, errors, columns, strict)


def data_sha256(path: str | os.PathLike[str]) -> str:
    """The content hash of an SFT source: a file's bytes, or a folder's files (relative names and bytes)."""
    source = pathlib.Path(path)
    if not source.is_dir():
        return file_sha256(source)
    digest = hashlib.sha256()
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(file.relative_to(source).as_posix().encode() + b"\0" + file_sha256(file).encode())
    return digest.hexdigest()


# -- tokens ------------------------------------------------------------------------------------------


def encode_example(example: SFTExample, tokenizer: Any, style: PromptStyle = PromptStyle()) -> EncodedExample:
    """Prompt ids (a ``prompt`` in ``style``: its template filled in, with the tokenizer's special tokens,
    or as one user turn through the chat template; ``messages`` through the chat template, generation
    prompt added) and response ids (+ eos)."""
    messages = example.messages
    if messages is None and style.chat_template:
        messages = style.messages(example.prompt)
    if messages is None:
        prompt_ids = tokenizer(style.text(example.prompt))["input_ids"]
    else:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the specials
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no eos token to end responses")
    response_ids = [*tokenizer(example.response, add_special_tokens=False)["input_ids"], eos]
    return EncodedExample(tuple(prompt_ids), tuple(response_ids))


def check_encodable(
    examples: Sequence[SFTExample],
    tokenizer: Any,
    max_tokens: int | None,
    path: str,
    style: PromptStyle = PromptStyle(),
) -> None:
    """ProblemFileError naming each line whose example the model cannot take: ``messages`` (or a prompt in
    a chat ``style``) without a chat template, or more than ``max_tokens`` tokens (the model's context;
    None: unchecked)."""
    errors = Collector(path)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    for example in examples:
        if example.messages is None and style.chat_template and not has_template:
            errors.add(
                example.line,
                "prompt",
                f"data.chat_template=true renders prompts through the model's chat template, but its tokenizer "
                f"({getattr(tokenizer, 'name_or_path', '?')}) has none: set data.chat_template=false, or add one "
                "to its tokenizer_config.json",
            )
            continue
        if example.messages is not None and not has_template:
            errors.add(
                example.line,
                "messages",
                f"the model's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template to render "
                'them: give "prompt" and "response", or add one to its tokenizer_config.json',
            )
            continue
        if max_tokens is not None:
            length = len(encode_example(example, tokenizer, style).input_ids)
            if length > max_tokens:
                errors.add(example.line, None, f"{length} tokens, longer than the model's context ({max_tokens})")
    errors.raise_if_any()


def iter_batches(num_examples: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of example indices: seeded shuffled passes over the file, one after another."""
    rng = random.Random(f"sft-file/{seed}")
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(num_examples))
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


# -- the cache key -----------------------------------------------------------------------------------


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_dir_identity(model_dir: str | os.PathLike[str]) -> str:
    """A hash of a model directory's files: small ones (config, tokenizer, chat template) by content,
    large ones (weights) by name, size and modification time, so a model changed in place is new."""
    digest = hashlib.sha256()
    for path in sorted(p for p in pathlib.Path(model_dir).iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(path.name.encode() + b"\0")
        if stat.st_size <= _HASHED_WHOLE_BYTES:
            digest.update(path.read_bytes())
        else:
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
        digest.update(b"\0")
    return digest.hexdigest()


def cache_key(config: SFTConfig, data_sha256: str, model_identity: str, style: PromptStyle = PromptStyle()) -> str:
    """Hash of the recipe, the data file's content, the initial model, the prompt style and ``KEY_FIELDS``
    of ``config`` (its thread count resolved: it changes float reduction order)."""
    fields = {name: getattr(config, name) for name in KEY_FIELDS}
    payload = {
        "recipe": SFT_FILE_RECIPE_VERSION,
        "data": data_sha256,
        "model": model_identity,
        "prompt_style": dataclasses.asdict(style),
        **fields,
    }
    if config.data_fields or config.data_split:  # keys of a plain JSONL file predate these
        payload |= {"data_fields": dict(config.data_fields or {}), "data_split": config.data_split}
    if style.system_prompt is None:
        del payload["prompt_style"]["system_prompt"]  # keys without a system turn predate it
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# -- training ----------------------------------------------------------------------------------------


def run_file_sft(
    config: SFTConfig,
    init_model_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    *,
    style: PromptStyle = PromptStyle(),
    wait_s: float = 4 * 3600.0,
) -> pathlib.Path:
    """Fine-tune ``init_model_dir`` on ``config.data_path`` (or reuse the cached result); the model dir.
    ``style``: how the job renders its problems' prompts, which ``prompt`` records follow.

    Results live in ``<cache_dir>/sft-file-<key>/``: ``model/`` (HF dir), ``metrics.jsonl`` (loss per
    step), ``sft_done.json`` (the key's inputs, timings, first and last loss). Processes asking for the
    same key at once train it once (the others wait up to ``wait_s``, then TimeoutError).
    """
    from trainer.cpu import num_threads_for

    if config.data_path is None:
        raise ValueError("run_file_sft needs sft.data_path (a JSONL SFT file)")
    data_path = os.fspath(config.data_path)
    examples = read_sft_examples(data_path, config.data_fields, config.data_split)  # all checked first
    config = dataclasses.replace(config, num_threads=num_threads_for(config.num_threads))
    key = cache_key(config, data_sha256(data_path), model_dir_identity(init_model_dir), style)
    final = pathlib.Path(cache_dir) / f"sft-file-{key}"

    def train(work_dir: pathlib.Path) -> dict[str, Any]:
        return {**_train(config, examples, pathlib.Path(init_model_dir), data_path, work_dir, style), "key": key}

    return cached_training(final, train, wait_s, tmp_prefix=".sft-file-tmp-")


def _train(
    config: SFTConfig,
    examples: Sequence[SFTExample],
    init_dir: pathlib.Path,
    data_path: str,
    work_dir: pathlib.Path,
    style: PromptStyle,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from trainer.base import TrainerConfig
    from trainer.hf import HFTrainer

    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    trainer = HFTrainer(
        init_dir,
        TrainerConfig(
            lr=config.lr,
            weight_decay=config.weight_decay,
            grad_clip=config.grad_clip,
            num_threads=config.num_threads,
            seed=config.seed,
            autocast_dtype="float32",
        ),
    )
    max_tokens = getattr(trainer.model.config, "max_position_embeddings", None)
    check_encodable(examples, tokenizer, max_tokens, data_path, style)
    encoded = [encode_example(example, tokenizer, style) for example in examples]
    batches = iter_batches(len(encoded), config.batch_size, config.seed)
    logger.info(
        "SFT of %s on %d examples of %s: %d steps of %d",
        init_dir,
        len(encoded),
        data_path,
        config.num_steps,
        config.batch_size,
    )
    losses: list[float] = []
    start = time.monotonic()
    with open(work_dir / "metrics.jsonl", "w") as metrics:
        for step in range(config.num_steps):
            batch = [encoded[i] for i in next(batches)]
            trainer.set_lr(lr_at(step, config))
            logprobs = trainer.sequence_logprobs([e.prompt_ids for e in batch], [e.response_ids for e in batch])
            loss = -logprobs.sum() / sum(len(e.response_ids) for e in batch)
            stats = trainer.step(loss)
            losses.append(loss.item())
            record = {"step": step, "loss": losses[-1], **stats, "elapsed_s": time.monotonic() - start}
            metrics.write(json.dumps(record) + "\n")
    train_s = time.monotonic() - start
    trainer.save(work_dir / "model")
    logger.info("SFT done in %.0f s: loss %.4f -> %.4f", train_s, losses[0], losses[-1])
    return {
        "data_path": data_path,
        "num_examples": len(encoded),
        "init_model_dir": str(init_dir),
        "config": {name: getattr(config, name) for name in KEY_FIELDS},
        "prompt_style": dataclasses.asdict(style),
        "recipe": SFT_FILE_RECIPE_VERSION,
        "train_s": train_s,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
