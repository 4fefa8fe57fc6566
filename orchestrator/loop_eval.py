"""The RL job's evaluation and summary: held-out evaluation records, the SFT match check, summary.json.

::

    heldout_eval: Evaluator.greedy(held-out) (+ .sampled on an even subset) ──▶ heldout_* fields
    sft_match: vLLM's greedy accuracy of the SFT model vs transformers' (the SFT summary), on the
        SFT evaluation's problems ──▶ sft_match_* progress (a gap means a wrong weight sync)
    last_eval: an iteration without evaluation repeats the last evaluated record's heldout_* fields
    job_summary: before/after accuracy, timings, SFT match, autocast, engines ──▶ summary.json
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orchestrator.config import JobConfig
from orchestrator.tasks.factory import task_kind

logger = logging.getLogger(__name__)

HELDOUT_KEYS = (
    "heldout_accuracy",
    "heldout_accuracy_by_level",
    "heldout_response_tokens",
    "heldout_pass_at_1",
    "heldout_pass_at_k",
)


def heldout_eval(
    engine: Any,
    heldout: Sequence[Any],
    encode: Callable[[Any], list[int]],
    decode: Callable[[Sequence[int]], str],
    is_correct: Callable[[Any, str], bool],
    c: JobConfig,
    sampled: bool,
    level_of: Callable[[Any], int] = lambda p: p.level,
) -> tuple[dict[str, Any], Any]:
    """The held-out fields of a metrics record (sampled pass@k too when ``sampled``), and the greedy result;
    ``level_of``: the task's bucket of a problem in ``heldout_accuracy_by_level``."""
    from orchestrator.engine_pool.base import SamplingSettings
    from orchestrator.evaluate import Evaluator

    start = time.monotonic()
    evaluator = Evaluator(
        engine, encode, decode, is_correct, c.rollout.max_response_tokens, timeout_s=c.rollout.request_timeout_s
    )
    greedy = evaluator.greedy(heldout, level_of)
    out: dict[str, Any] = {
        "heldout_accuracy": greedy.accuracy,
        "heldout_accuracy_by_level": greedy.accuracy_by_level,
        "heldout_response_tokens": greedy.mean_response_tokens,
        "heldout_pass_at_1": None,
        "heldout_pass_at_k": None,
    }
    if sampled and c.eval.num_sampled_problems:
        subset = heldout[:: max(1, len(heldout) // c.eval.num_sampled_problems)]
        subset = subset[: c.eval.num_sampled_problems]
        sampling = SamplingSettings(temperature=c.rl.temperature, top_p=c.rl.top_p)
        result = evaluator.sampled(subset, c.eval.num_samples_per_problem, sampling)
        out.update(heldout_pass_at_1=result.pass_at_1, heldout_pass_at_k=result.pass_at_k)
    out["eval_s"] = time.monotonic() - start
    return out, greedy


def sft_match(
    heldout: Sequence[Any],
    greedy: Any,
    sft_summary: Mapping[str, Any],
    c: JobConfig,
    before: Mapping[str, Any],
    level_of: Callable[[Any], int] = lambda p: p.level,
    *,
    comparable: bool = True,
) -> dict[str, Any]:
    """vLLM's greedy accuracy of the SFT model against transformers' (logged; a warning past the tolerance).
    ``comparable``: whether the task's held-out set is the SFT evaluation's (the demo's); else unchecked."""
    from orchestrator.evaluate import accuracy_by_level, compare_with_reference

    reference = sft_summary.get("heldout_accuracy_by_level", {})
    sft_config = sft_summary.get("config", {})
    # The SFT evaluation used the first n problems per level of the same held-out draw.
    n = sft_config.get("num_eval_problems_per_level")
    same_set = comparable and (
        c.data.heldout_seed == sft_config.get("heldout_seed") and n is not None and c.data.num_heldout_per_level >= n
    )
    measured = accuracy_by_level(heldout, greedy.correct, level_of, n)
    ok, gap = compare_with_reference(measured, reference, c.eval.sft_match_tolerance) if same_set else (True, 0.0)
    if not comparable:  # the task's held-out set is not the SFT evaluation's (problem files)
        logger.info(
            "before RL: held-out greedy accuracy %.1f%% by level %s (vLLM)",
            100 * before["heldout_accuracy"],
            before["heldout_accuracy_by_level"],
        )
    else:
        logger.info(
            "before RL: held-out greedy accuracy %.1f%% by level %s (vLLM); on the SFT evaluation's "
            "problems %s (vLLM) vs %s (transformers)",
            100 * before["heldout_accuracy"],
            before["heldout_accuracy_by_level"],
            measured,
            reference,
        )
    if not ok:
        logger.warning(
            "vLLM's greedy accuracy differs from transformers' by %.1f points on a level: check the weight sync",
            100 * gap,
        )
    return {
        "sft_reference_by_level": reference,
        "sft_vllm_by_level": measured,
        "sft_match_gap": gap,
        "sft_match_ok": ok,
        "sft_match_checked": same_set,
    }


def last_eval(records: Sequence[Mapping[str, Any]], before: Mapping[str, Any]) -> dict[str, Any]:
    """The held-out fields of the last evaluated record (of the evaluation before RL when none)."""
    last = next((r for r in reversed(records) if r.get("evaluated")), None)
    source = last if last is not None else before
    return {k: source.get(k) for k in HELDOUT_KEYS}


def job_summary(
    progress: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    c: JobConfig,
    sft_model_dir: pathlib.Path,
    sft_summary: Mapping[str, Any],
    trainer: Any,
    engines: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """summary.json's content (``engines``: the pool's metrics when the engine is a pool)."""
    before = progress["before"]["heldout_accuracy"]
    after = records[-1]["heldout_accuracy"] if records else before
    total = progress.get("iteration_total_s", 0.0)
    share = progress.get("sync_total_s", 0.0) / total if total > 0 else 0.0
    summary = {
        "task": task_kind(c),  # "demo" or "file" (data.train_path)
        "heldout_accuracy_before": before,
        "heldout_accuracy_after": after,
        "heldout_gain_points": 100 * (after - before),
        "heldout_accuracy_by_level_before": progress["before"]["heldout_accuracy_by_level"],
        "heldout_accuracy_by_level_after": records[-1]["heldout_accuracy_by_level"] if records else None,
        "num_iterations": len(records),
        "rl_minutes": progress.get("rl_elapsed_s", 0.0) / 60,
        "weight_sync_share": share,
        "mean_weight_sync_s": sum(r["weight_sync_s"] for r in records) / len(records) if records else None,
        "sft_match_ok": progress.get("sft_match_ok"),
        "sft_match_gap": progress.get("sft_match_gap"),
        "sft_match_checked": progress.get("sft_match_checked"),
        "sft_vllm_by_level": progress.get("sft_vllm_by_level"),
        "sft_transformers_by_level": progress.get("sft_reference_by_level"),
        "sft_model_dir": str(sft_model_dir),
        "autocast": trainer.dtype_choice.to_dict(),
        "sft_autocast": sft_summary.get("autocast"),
        "trainer_num_threads": trainer.num_threads,
        "trainer": c.trainer.type,
        "trainer_tp_size": c.trainer.tp_size,
    }
    if engines is not None:
        summary["engines"] = engines
    for key in ("switch_to_train_s", "switch_to_inference_s"):  # colocated mode's switches
        values = [r[key] for r in records if key in r]
        if values:
            summary[f"mean_{key}"] = sum(values) / len(values)
    return summary
