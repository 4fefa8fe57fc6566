"""long2short ``evaluate``: greedy held-out accuracy and mean response tokens of several models, pushed
in turn into one engine, as summary.json and a token-efficiency plot."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from demo import task

logger = logging.getLogger(__name__)


def evaluate_models(
    models: Sequence[tuple[str, str]],
    engine: Any,
    load_weights: Callable[[str], None],
    problems: Sequence[Any],
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    max_response_tokens: int = 128,
    timeout_s: float = 900.0,
    *,
    encode_problem: Callable[[Any], Sequence[int]] | None = None,
    is_correct: Callable[[Any, str], bool] = task.is_correct,
    level_of: Callable[[Any], int] = lambda p: p.level,
) -> dict[str, Any]:
    """Greedy held-out accuracy and mean response tokens of each (label, model dir): ``load_weights(dir)``
    puts a model into ``engine``, then ``orchestrator.evaluate.Evaluator.greedy`` runs on it. Problems
    are the demo's by default (``encode(problem.prompt)``, ``demo.task.is_correct``, ``problem.level``);
    a task's problems come with its ``encode_problem``, ``is_correct`` and ``level_of``."""
    from orchestrator.evaluate import Evaluator

    if not models:
        raise ValueError("no models to evaluate")
    labels = [label for label, _ in models]
    if len(set(labels)) != len(labels):
        raise ValueError(f"model labels must be distinct, got {labels}")
    if encode_problem is None:
        encode_problem = lambda p: encode(p.prompt)
    evaluator = Evaluator(
        engine, lambda p: list(encode_problem(p)), decode, is_correct, max_response_tokens, timeout_s=timeout_s
    )
    rows = []
    for label, model_dir in models:
        load_weights(model_dir)
        result = evaluator.greedy(problems, level_of)
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


def write_evaluation(summary: dict[str, Any], out_dir: str | pathlib.Path) -> dict[str, Any]:
    """summary.json and token_efficiency.png into ``out_dir``; returns the summary with their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {**summary, "plot": str(plot_token_efficiency(summary, out / "token_efficiency.png"))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
