"""Per-iteration metrics: JSONL lines, the plot a person opens, the closing summary line.

::

    loop ──record (dict)──▶ MetricsLog.append ──▶ DIR/metrics.jsonl   (one line per iteration,
                                                  flushed + fsynced; a resumed run first drops
                                                  lines past its checkpoint)
    DIR/metrics.jsonl ──plot_metrics──▶ DIR/metrics.png  held-out accuracy | reward | length | sync
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_common.fsutil import atomic_write_text

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("iteration", "heldout_accuracy", "mean_reward", "mean_response_tokens", "weight_sync_s")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a run killed while writing) is ignored."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text().splitlines()
    for index, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index != len(lines) - 1:
                raise ValueError(f"{path}: line {index + 1} is not JSON") from None
            logger.warning("%s: ignoring a torn last line", path)
    return records


class MetricsLog:
    """Append-only JSONL of iteration records."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: Mapping[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def truncate_after(self, iteration: int) -> int:
        """Drop records of iterations > ``iteration`` (written after the last checkpoint); return how many."""
        records = self.records()
        keep = [r for r in records if r["iteration"] <= iteration]
        if len(keep) != len(records) or (self.path.exists() and not self.path.read_text().endswith("\n")):
            atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))
        return len(records) - len(keep)


def plot_metrics(
    records: Sequence[Mapping[str, Any]],
    png_path: str | os.PathLike[str],
    before_accuracy: float | None = None,
    before_pass_at_1: float | None = None,
    title: str = "RL on the arithmetic task",
) -> None:
    """Four panels against the iteration: held-out accuracy, reward, response length, sync time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iterations = [r["iteration"] for r in records]
    evaluated = [r for r in records if r.get("evaluated")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0][0]
    xs = ([0] if before_accuracy is not None else []) + [r["iteration"] for r in evaluated]
    ys = ([before_accuracy] if before_accuracy is not None else []) + [r["heldout_accuracy"] for r in evaluated]
    ax.plot([x for x in xs], [100 * y for y in ys], marker="o", label="greedy (vLLM)")
    sampled = ([(0, before_pass_at_1)] if before_pass_at_1 is not None else []) + [
        (r["iteration"], r["heldout_pass_at_1"]) for r in evaluated if r.get("heldout_pass_at_1") is not None
    ]
    if sampled:
        ax.plot(
            [x for x, _ in sampled],
            [100 * y for _, y in sampled],
            marker="x",
            linestyle="--",
            label="pass@1 over k samples",
        )
    ax.set(xlabel="iteration", ylabel="held-out accuracy (%)", title="held-out accuracy")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    panels = [
        (axes[0][1], "mean_reward", "mean reward (train)"),
        (axes[1][0], "mean_response_tokens", "mean response length (tokens)"),
        (axes[1][1], "weight_sync_s", "weight sync time (s)"),
    ]
    for ax, key, label in panels:
        ax.plot(iterations, [math.nan if r[key] is None else r[key] for r in records], marker=".")
        ax.set(xlabel="iteration", ylabel=label, title=label)
        ax.grid(alpha=0.3)
    if records and "train_pass_at_1" in records[0]:
        axes[0][1].plot(
            iterations,
            [math.nan if r["train_pass_at_1"] is None else r["train_pass_at_1"] for r in records],
            marker=".",
            alpha=0.6,
            label="pass@1 of rollouts",
        )
        axes[0][1].legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    tmp = pathlib.Path(png_path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)


def summary_line(before: float, after: float, rl_minutes: float, sync_share: float) -> str:
    """E.g. 'held-out accuracy 31.0% -> 58.5% (+27.5 points) in 14.2 min; weight sync 0.4% of iteration time'."""
    return (
        f"held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f} points) "
        f"in {rl_minutes:.1f} min; weight sync {100 * sync_share:.1f}% of iteration time"
    )
