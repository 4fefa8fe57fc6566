"""long2short sampling: n responses per problem through the rollout engine, and k1.5's shortest
rejection sampling over them (the shortest correct response per problem, as SFT records).

Problems are any task's (``orchestrator.tasks.base.Task``); by default the demo's (``demo.task.Problem``:
the prompt text is encoded, ``demo.task.is_correct`` judges). The CLI passes a problem file task's
``encode_problem`` (``task.encode(problem, tokenizer)``: its template or chat template), its reward
against ``reward.correct_threshold`` as ``is_correct``, and ``problem_fields`` (the record's
id/prompt/answer fields)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ckpt_common.cli_config import meta
from ckpt_common.validate import check_int, check_number
from demo import task
from trainer import dpo


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
    problems: Sequence[Any],
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    config: SamplingConfig = SamplingConfig(),
    is_correct: Callable[[Any, str], bool] = task.is_correct,
    encode_problem: Callable[[Any], Sequence[int]] | None = None,
) -> list[list[dpo.Sample]]:
    """``config.num_samples`` responses per problem: one group of ``dpo.Sample(Response, correct, num_tokens)``
    per problem, in order (num_tokens: the generated token count, eos included). A problem's prompt ids:
    ``encode_problem(problem)``, else ``encode(problem.prompt)`` (the demo's)."""
    from orchestrator.engine_pool.base import GenRequest, SamplingSettings

    if encode_problem is None:
        encode_problem = lambda p: encode(p.prompt)
    n = config.num_samples
    requests = [
        GenRequest(f"l2s-{i}.{c}", tuple(encode_problem(p)), config.max_response_tokens)
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


def demo_problem_fields(problem: task.Problem) -> dict[str, Any]:
    """A demo problem's fields in a shortest-rejection record."""
    return {"id": problem.id, "prompt": problem.prompt, "answer": problem.answer, "level": problem.level}


def shortest_rejection_records(
    problems: Sequence[Any],
    groups: Sequence[Sequence[dpo.Sample]],
    problem_fields: Callable[[Any], dict[str, Any]] = demo_problem_fields,
) -> list[dict]:
    """SFT records (one per problem with a correct sample): ``problem_fields(problem)`` (id, prompt, ...)
    and the shortest correct response of its group."""
    records = []
    for problem, group in zip(problems, groups):
        index = dpo.shortest_correct_index(group)
        if index is None:
            continue
        best = group[index]
        records.append(
            {
                **problem_fields(problem),
                "response": best.response.text,
                "response_ids": list(best.response.token_ids),
                "num_tokens": best.num_tokens,
                "num_correct": sum(s.correct for s in group),
                "num_samples": len(group),
                "mean_correct_tokens": sum(s.num_tokens for s in group if s.correct) / sum(s.correct for s in group),
            }
        )
    return records


def group_stats(groups: Sequence[Sequence[dpo.Sample]]) -> dict[str, Any]:
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
