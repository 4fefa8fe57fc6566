"""Prompt-set curation (k1.5 sections 2.2/2.3): format filters, the easy-to-hack filter, difficulty
from the model's own pass rate.

    python -m orchestrator.curation --problems IN.jsonl --out OUT.jsonl --model DIR
    python -m orchestrator.curation --problems IN.jsonl --out OUT.jsonl --model DIR \
        [--config JOB.json] [--set data.chat_template=true --set data.answer_markers='["Answer:"]' ...]

::

    IN.jsonl (one problem per line: prompt, answer [, id, level, ...])
        │ format filters: unparsable line, empty prompt, prompt over max_prompt_tokens,
        │                 answer the verifier can never accept ("uncheckable_answer")
        ▼
    engine.generate  ── num_samples (10) per prompt at a high temperature, with chain of thought
        │                 ──▶ pass_rate = correct / num_samples, difficulty = 1 - pass_rate
        └──────────── num_hack_tries (8) per prompt asked to answer directly (prompt + the task's
                         answer marker, direct_answer_suffix "#### ": no chain of thought)
                         ──▶ any correct: dropped as "easy_to_hack"
        ▼
    OUT.jsonl: every input line, with pass_rate, difficulty, num_correct, num_direct_correct,
               kept (bool) and reason ("kept" | the first filter that dropped it)
    --problems-out FILE: the kept problems as a problem file (id, prompt, answer, difficulty =
               1 - pass rate; orchestrator.tasks.problems): the RL job's data.train_path

That is the demo's curation (``curate``): lines of prompt text and an answer, ``demo.task.is_correct``.
With ``--config`` and/or ``--set`` (the RL job's, ``orchestrator.tasks.factory``) it curates for any
task (``curate_task``): IN is a problem set (``orchestrator.tasks.problems``: ids, ``messages``,
code ``tests``; this project's JSONL or any table ``ckpt_common.tables`` reads, its columns mapped by
``data.fields``, its split ``data.train_split``) read whole by a ``FileTask`` with the config's data
section (``data.prompt_template``, ``data.chat_template``, ``data.answer_markers``; its file paths are
unused) and reward section. ``--problems-out`` is written in this project's JSONL format whatever the
input's (the answers as the mapping extracted them: what the RL job reads with the default mapping). A bad
line is then an error naming ``file:line`` (exit 2) before any engine starts; prompts are the task's
(``task.encode``: its template or the model's chat template); a response is correct when the task's
reward reaches ``reward.correct_threshold``; the easy-to-hack probe appends the task's
``direct_answer_prefix`` (the first of ``data.answer_markers`` and a space, e.g. ``"#### "``; nothing
when the list is empty) and reads the response after it. Code problems are not probed (a program
is checked by its tests, not guessed: ``num_hack_tries`` 0 in their records) and have no
uncheckable-answer filter. OUT.jsonl's lines are then the problems' records (``Problem.to_record``:
every problem has its id) with the same result fields, and ``--problems-out`` keeps messages and tests.

It codes against the rollout engine interface (``orchestrator.engine_pool.base.RolloutEngine``), so tests
run it on scripted engines; the CLI builds the same vLLM engine the RL loop uses and syncs the
model's weights into it through the checkpoint engine (the engine starts with dummy weights).
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

from ckpt_common.cli_config import ConfigArgs, add_config_args, meta
from ckpt_common.logs import add_log_level_flag
from demo import task
from orchestrator.tasks.factory import add_task_args

logger = logging.getLogger(__name__)

DROP_REASONS = ("bad_record", "empty_prompt", "overlong_prompt", "uncheckable_answer", "easy_to_hack", "too_easy")


@dataclasses.dataclass(frozen=True)
class CurationConfig:
    num_samples: int = dataclasses.field(
        default=10, metadata=meta("pass-rate samples per prompt (with chain of thought)")
    )
    temperature: float = dataclasses.field(
        default=1.0, metadata=meta('the "high temperature" of the pass-rate samples')
    )
    num_hack_tries: int = dataclasses.field(
        default=8, metadata=meta("direct-answer tries per prompt (N of the easy-to-hack filter)")
    )
    hack_temperature: float = 1.0
    max_prompt_tokens: int = 128
    max_response_tokens: int = 96
    max_direct_answer_tokens: int = 8
    max_pass_rate: float = dataclasses.field(
        default=1.0, metadata=meta('drop prompts solved more often than this ("too_easy"); 1.0 keeps all')
    )
    direct_answer_suffix: str = dataclasses.field(
        default="#### ",
        metadata=meta(
            "the task's answer marker (the demo's and data.answer_markers' default): appended to the prompt to ask "
            "for the answer without a chain of thought, and put before that answer when it is checked"
        ),
    )
    request_chunk_problems: int = dataclasses.field(default=256, metadata=meta("problems per engine.generate call"))
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        for name in (
            "num_samples",
            "max_prompt_tokens",
            "max_response_tokens",
            "max_direct_answer_tokens",
            "request_chunk_problems",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"curation {name}={value!r} must be an int >= 1")
        if isinstance(self.num_hack_tries, bool) or not isinstance(self.num_hack_tries, int) or self.num_hack_tries < 0:
            raise ValueError(f"curation num_hack_tries={self.num_hack_tries!r} must be an int >= 0")
        for name in ("temperature", "hack_temperature", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"curation {name}={getattr(self, name)!r} must be > 0")
        if not 0 <= self.max_pass_rate <= 1:
            raise ValueError(f"curation max_pass_rate={self.max_pass_rate!r} must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class CurationProblem:
    """What curation needs of a problem; ``record`` is the input line, written back with the results."""

    id: str
    prompt: str
    answer: str
    record: dict


def parse_record(line: str, index: int) -> tuple[CurationProblem | None, str | None]:
    """(problem, None), or (None, why the line is not a problem)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e}"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    if not isinstance(record.get("prompt"), str) or "answer" not in record:
        return None, "needs a string 'prompt' and an 'answer'"
    answer = record["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        return None, f"answer {answer!r} is not a string or an integer"
    return CurationProblem(str(record.get("id", index)), record["prompt"], str(answer), record), None


def format_reason(
    problem: CurationProblem,
    encode: Callable[[Any], Sequence[int]],
    config: CurationConfig,
    is_correct: Callable[[Any, str], bool],
) -> str | None:
    """The format filter that drops ``problem``, or None."""
    if not problem.prompt.strip():
        return "empty_prompt"
    if len(encode(problem)) > config.max_prompt_tokens:
        return "overlong_prompt"
    # the reference answer written the way a response writes it must pass the verifier
    if not problem.answer.strip() or not is_correct(problem, config.direct_answer_suffix + problem.answer):
        return "uncheckable_answer"
    return None


@dataclasses.dataclass(frozen=True)
class _Probe:
    """A problem past the format filters: its results go to ``out[index]``, over ``record``."""

    index: int
    problem: Any  # what is_correct is given
    record: dict
    prompt_ids: Sequence[int]
    direct_ids: Sequence[int] | None  # the easy-to-hack probe's prompt; None: not probed (code)


def _counts(
    engine,
    id_lists: Sequence[Sequence[int] | None],
    problems: Sequence[Any],
    decode,
    is_correct,
    copies,
    max_tokens,
    temperature,
    prefix,
    timeout_s,
    response_prefix: str = "",
) -> list[int]:
    """Correct responses out of ``copies`` per prompt (a None prompt: not asked, 0)."""
    from orchestrator.engine_pool.base import GenRequest, SamplingSettings

    asked = [i for i, ids in enumerate(id_lists) if ids is not None]
    if copies == 0 or not asked:
        return [0] * len(problems)
    requests = [GenRequest(f"{prefix}{i}.{c}", tuple(id_lists[i]), max_tokens) for i in asked for c in range(copies)]
    results = {
        r.request_id: r
        for r in engine.generate(requests, SamplingSettings(temperature=temperature), timeout_s=timeout_s)
    }
    return [
        sum(bool(is_correct(p, response_prefix + decode(results[f"{prefix}{i}.{c}"].token_ids))) for c in range(copies))
        if id_lists[i] is not None
        else 0
        for i, p in enumerate(problems)
    ]


def _run_probes(
    out: list[dict | None],
    probes: Sequence[_Probe],
    engine: Any,
    decode: Callable[[Sequence[int]], str],
    is_correct: Callable[[Any, str], bool],
    config: CurationConfig,
    response_prefix: str,
) -> list[dict]:
    """The pass-rate samples and the easy-to-hack tries of ``probes``, chunk by chunk, into ``out``."""
    step = config.request_chunk_problems
    for start in range(0, len(probes), step):
        chunk = probes[start : start + step]
        problems = [p.problem for p in chunk]
        solved = _counts(
            engine,
            [p.prompt_ids for p in chunk],
            problems,
            decode,
            is_correct,
            config.num_samples,
            config.max_response_tokens,
            config.temperature,
            "s",
            config.timeout_s,
        )
        # asked to answer directly: the prompt followed by the answer line's prefix; the check reads the
        # answer as a response would write it
        guessed = _counts(
            engine,
            [p.direct_ids for p in chunk],
            problems,
            decode,
            is_correct,
            config.num_hack_tries,
            config.max_direct_answer_tokens,
            config.hack_temperature,
            "d",
            config.timeout_s,
            response_prefix=response_prefix,
        )
        for probe, num_correct, num_guessed in zip(chunk, solved, guessed):
            pass_rate = num_correct / config.num_samples
            reason = "easy_to_hack" if num_guessed > 0 else "too_easy" if pass_rate > config.max_pass_rate else "kept"
            out[probe.index] = {
                **probe.record,
                "pass_rate": pass_rate,
                "difficulty": 1.0 - pass_rate,
                "num_correct": num_correct,
                "num_samples": config.num_samples,
                "num_direct_correct": num_guessed,
                "num_hack_tries": config.num_hack_tries if probe.direct_ids is not None else 0,
                "kept": reason == "kept",
                "reason": reason,
            }
    return [r for r in out if r is not None]


def curate(
    records: Sequence[str],
    engine: Any,
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    config: CurationConfig = CurationConfig(),
    is_correct: Callable[[Any, str], bool] = task.is_correct,
) -> list[dict]:
    """One output record per input line (see the module docstring). ``encode`` maps prompt text to ids."""
    out: list[dict | None] = [None] * len(records)
    probes: list[_Probe] = []
    for index, line in enumerate(records):
        problem, error = parse_record(line, index)
        if problem is None:
            out[index] = {"line": index + 1, "error": error, "kept": False, "reason": "bad_record"}
            continue
        reason = format_reason(problem, lambda p: encode(p.prompt), config, is_correct)
        if reason is not None:
            out[index] = {**problem.record, "pass_rate": None, "difficulty": None, "kept": False, "reason": reason}
        else:
            direct = encode(problem.prompt + config.direct_answer_suffix)
            probes.append(_Probe(index, problem, problem.record, encode(problem.prompt), direct))
    return _run_probes(out, probes, engine, decode, is_correct, config, config.direct_answer_suffix)


def curate_task(
    source: Any,
    engine: Any,
    tokenizer: Any,
    decode: Callable[[Sequence[int]], str],
    is_correct: Callable[[Any, str], bool],
    config: CurationConfig = CurationConfig(),
) -> list[dict]:
    """``curate`` for a task's problems (``source.train_problems()``, in order; an
    ``orchestrator.tasks.base.Task``, e.g. ``FileTask.of_file``): one output record per problem, its
    ``to_record()`` with the results. Prompts: ``source.encode(problem, tokenizer)``; the easy-to-hack
    probe: ``source.encode_direct_answer`` (the prompt and ``source.direct_answer_prefix``), its response
    read after that prefix; ``is_correct``: the task's (``source.make_is_correct(reward)``). A math
    problem's reference answer, written after the prefix, must pass ``is_correct`` ("uncheckable_answer");
    a code problem (a reference that is not a string: tests) has neither that filter nor the probe."""
    problems = list(source.train_problems())
    prefix = source.direct_answer_prefix
    out: list[dict | None] = [None] * len(problems)
    probes: list[_Probe] = []
    for index, problem in enumerate(problems):
        record = problem.to_record()
        reference = source.reference(problem)
        prompt_ids = source.encode(problem, tokenizer)
        if len(prompt_ids) > config.max_prompt_tokens:
            reason = "overlong_prompt"
        elif isinstance(reference, str) and (not reference.strip() or not is_correct(problem, prefix + reference)):
            reason = "uncheckable_answer"
        else:
            direct = source.encode_direct_answer(problem, tokenizer) if isinstance(reference, str) else None
            probes.append(_Probe(index, problem, record, prompt_ids, direct))
            continue
        out[index] = {**record, "pass_rate": None, "difficulty": None, "kept": False, "reason": reason}
    return _run_probes(out, probes, engine, decode, is_correct, config, prefix)


def kept_problems(results: Sequence[dict]) -> list:
    """The kept problems as a problem file's records (``orchestrator.tasks.problems``, a valid
    ``data.train_path``): id (the input's, else the stable id of the prompt or messages), prompt or
    messages, answer or tests, pass_rate (the prioritized sampler's starting success rate) and
    difficulty = 1 - pass rate. A problem whose prompt (messages) or id came before is left out (logged)."""
    from orchestrator.tasks.problems import CodeTest, Problem, stable_id

    out, ids, contents, skipped = [], set(), set(), 0
    for r in results:
        if not r.get("kept"):
            continue
        messages = tuple(dict(m) for m in r["messages"]) if r.get("messages") is not None else None
        problem = Problem(
            id=str(r["id"]) if r.get("id") is not None else stable_id(r.get("prompt"), messages),
            prompt=r.get("prompt"),
            messages=messages,
            answer=str(r["answer"]) if r.get("answer") is not None else None,
            tests=tuple(CodeTest(t["input"], t["output"]) for t in r["tests"]) if r.get("tests") is not None else None,
            difficulty=1.0 - r["pass_rate"],
            pass_rate=r["pass_rate"],
        )
        if problem.id in ids or problem.content_key() in contents:
            skipped += 1
            continue
        ids.add(problem.id)
        contents.add(problem.content_key())
        out.append(problem)
    if skipped:
        logger.warning("%d kept problems repeat an earlier id or prompt: left out of the problem file", skipped)
    return out


def summarize(results: Sequence[dict]) -> dict:
    reasons = {}
    for r in results:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    rates = [r["pass_rate"] for r in results if r.get("pass_rate") is not None]
    return {
        "num_problems": len(results),
        "num_kept": reasons.get("kept", 0),
        "reasons": reasons,
        "mean_pass_rate": sum(rates) / len(rates) if rates else None,
    }


# -- the command ----------------------------------------------------------------------------------


def _parser() -> tuple[argparse.ArgumentParser, ConfigArgs, ConfigArgs]:
    """The command line: CurationConfig's fields and the engine's context length as generated flags
    (defaults from the dataclasses), plus the paths, the endpoint and the log level."""
    from orchestrator.config import EngineConfig  # light: dataclasses only

    p = argparse.ArgumentParser(
        prog="python -m orchestrator.curation",
        description="Curate a JSONL problem set with a model: format filters, the easy-to-hack "
        "filter, pass rate (difficulty). The last printed line is a JSON summary.",
    )
    p.add_argument(
        "--problems",
        required=True,
        help="input JSONL, one problem per line (prompt, answer, ...); with --config/--set: a problem set "
        "(JSONL, parquet, CSV, JSON, Arrow or a save_to_disk folder; data.fields maps its columns, "
        "data.train_split names its split)",
    )
    p.add_argument("--out", required=True, help="output JSONL: every problem with pass_rate, kept and reason")
    p.add_argument(
        "--problems-out",
        default=None,
        metavar="FILE",
        help="also write the kept problems as a problem file (difficulty = 1 - pass rate): a data.train_path",
    )
    p.add_argument("--model", required=True, help="HF model directory (e.g. the SFT model)")
    config = add_config_args(p.add_argument_group("curation"), CurationConfig)
    add_task_args(
        p,
        "any task, as the RL job names it: with --config and/or --set, --problems is a problem file read with "
        "the config's data section (data.prompt_template, data.chat_template, data.answer_markers; its paths "
        "are unused) and scored by the task's reward against reward.correct_threshold; the easy-to-hack probe "
        "appends the task's answer marker (the first of data.answer_markers) instead of --direct-answer-suffix",
        example="data.chat_template=true",
    )
    p.add_argument(
        "--endpoint",
        default=None,
        help="a running vLLM server that already serves the model (default: an in-process vLLM)",
    )
    engine = add_config_args(p, EngineConfig, only=("max_model_len", "enforce_eager"))
    add_log_level_flag(p)
    return p, config, engine


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return _parser()[0].parse_args(argv)


def _engine(args: argparse.Namespace, engine_config):
    from orchestrator.config import SyncConfig
    from orchestrator.engine_pool.factory import make_engine

    if args.endpoint:
        return make_engine(
            dataclasses.replace(engine_config, type="vllm_http", endpoint=args.endpoint), args.model
        ), None
    from ckpt_common.hf_dir import read_tensors
    from orchestrator.engine_pool.weight_sync import WeightSync

    engine = make_engine(engine_config, args.model)
    sync = None
    try:
        sync = WeightSync(SyncConfig(), engine.weight_req_func(300.0))
        sync.push(read_tensors(args.model), version=0)  # vLLM started on dummy weights
    except BaseException:
        if sync is not None:
            sync.close()
        engine.close()
        raise
    return engine, sync


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _task(args: argparse.Namespace, config: CurationConfig):
    """(the file task of --problems, its is_correct) from --config/--set; ValueError (a bad file: naming
    ``file:line``) before any engine starts."""
    from orchestrator.tasks.factory import file_task_from_sections, job_sections

    if config.direct_answer_suffix != CurationConfig().direct_answer_suffix:
        raise ValueError(
            "--direct-answer-suffix is the demo's: with --config/--set the easy-to-hack probe asks for the task's "
            "answer marker (the first of data.answer_markers): set that instead"
        )
    if not pathlib.Path(args.problems).exists():
        raise ValueError(f"--problems {args.problems}: no such file or folder")
    data, reward = job_sections(args.config, args.overrides, args.problems)
    source = file_task_from_sections(data, reward, args.problems)
    return source, source.make_is_correct(reward)


def main(argv: Sequence[str] | None = None) -> int:
    parser, config_args, engine_args = _parser()
    args = parser.parse_args(argv)
    config = config_args.build(args, parser)  # a bad value: exit 2 naming the flag
    engine_config = engine_args.build(args, parser)
    source = is_correct = lines = None
    try:
        if args.config is not None or args.overrides:
            source, is_correct = _task(args, config)
        else:
            lines = [line for line in pathlib.Path(args.problems).read_text().splitlines() if line.strip()]
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ckpt_common.logs import setup_logging

    setup_logging(args.log_level)
    logging.getLogger("checkpoint_engine").setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if args.log_level == "INFO" else args.log_level)
    tokenizer = _tokenizer(args.model)
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
    engine, sync = _engine(args, engine_config)
    try:
        if source is not None:
            results = curate_task(source, engine, tokenizer, decode, is_correct, config)
        else:
            results = curate(lines, engine, lambda text: list(tokenizer(text)["input_ids"]), decode, config)
    finally:
        if sync is not None:
            sync.close()
        engine.close()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in results))
    if args.problems_out:
        from orchestrator.tasks.problems import write_problems

        kept = kept_problems(results)
        if kept:
            pathlib.Path(args.problems_out).parent.mkdir(parents=True, exist_ok=True)
            write_problems(args.problems_out, kept)
        else:
            logger.warning("no problem was kept: %s not written", args.problems_out)
    print(json.dumps(summarize(results), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
