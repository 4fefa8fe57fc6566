"""The demo task as files: ``python -m orchestrator.tasks.demo_export --out DIR [--config JOB.json] [--num-train N]
[--seed S]``.

It lives here, not in ``demo/``, because it draws the problems as the RL job does (the job config's
data section, ``orchestrator.data``) and writes them in the orchestrator's problem format: ``demo/``
sits below the orchestrator and imports nothing above it.

Writes the demo's own split in the JSONL problem format (``orchestrator.tasks.problems``), for the
data section of ``--config`` (a job config such as configs/demo.json; default: the built-in one):

- ``DIR/heldout.jsonl``: the RL job's held-out set, ``orchestrator.data.heldout_set(data)``
  (the section's levels, sizes and seed), level by level;
- ``DIR/train.jsonl``: ``N`` (default the section's ``num_train_problems``, 4096 built in) distinct
  training problems drawn as the RL job draws its pool (``orchestrator.data.train_pool``, the
  section's ``train_levels``, ``--seed`` as ``data.train_seed``, default its own); they come from
  the task's training split, and the files are checked disjoint (``check_disjoint``) before writing.
  With ``--config`` and no other option the files are the job's own problems: RL on them
  (``data.train_path``, ``data.heldout_path``) trains and evaluates on what the built-in task does.

Each record: ``id`` = ``demo-<level>-<expression>`` (``demo-3-347+586``: stable, unique, the same for
the same problem in every export); ``prompt`` = the text the model is given (``"347+586\\n"``);
``answer`` = the reference answer as the demo's reward compares it: ``task.is_correct`` takes the number
after the last ``####`` of a response (``#### 933``, leading zeros dropped) and compares it with this
string; ``difficulty`` = ``(level - 1) / (7 - 1)``: level 1 (one-digit sums) is 0.0, level 7
(three 2-digit operands) is 1.0, in the task's order of levels (``demo.task.LEVELS``).

``--help`` is instant: nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.tasks.demo_export",
        description="Write DIR/train.jsonl and DIR/heldout.jsonl (the demo's own split) in the JSONL problem format.",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write into (made if missing)")
    parser.add_argument(
        "--config",
        default=None,
        metavar="JOB.json",
        help="export the data section of this RL job config (default: the built-in config)",
    )
    parser.add_argument(
        "--num-train",
        type=int,
        default=None,
        metavar="N",
        help="training problems to export (default: the config's data.num_train_problems)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="seed of the training draw (default: the config's data.train_seed)",
    )
    return parser


def export(
    out: str | os.PathLike[str],
    num_train: int | None = None,
    seed: int | None = None,
    config_path: str | os.PathLike[str] | None = None,
) -> tuple[str, str]:
    """Write ``out/train.jsonl`` and ``out/heldout.jsonl`` (the data section of the job config at
    ``config_path``, default the built-in one); returns their paths."""
    import dataclasses

    from demo import task
    from orchestrator import data
    from orchestrator.config import load_config
    from orchestrator.tasks import Problem, check_disjoint, write_problems

    defaults = load_config(config_path).data
    if defaults.uses_files:
        raise ValueError(f"{config_path}: its data section names problem files already (data.train_path)")
    config = dataclasses.replace(
        defaults,
        num_train_problems=defaults.num_train_problems if num_train is None else num_train,
        train_seed=defaults.train_seed if seed is None else seed,
    )
    top = max(task.LEVELS)
    low = min(task.LEVELS)

    def to_problem(p: task.Problem) -> Problem:
        return Problem(
            id=f"demo-{p.level}-{p.id}", prompt=p.prompt, answer=p.answer, difficulty=(p.level - low) / (top - low)
        )

    heldout = [to_problem(p) for p in data.heldout_set(config)]
    train = [to_problem(p) for p in data.train_pool(config)]
    os.makedirs(out, exist_ok=True)
    train_path, heldout_path = os.path.join(out, "train.jsonl"), os.path.join(out, "heldout.jsonl")
    check_disjoint(train, heldout, train_path, heldout_path)
    write_problems(train_path, train)
    write_problems(heldout_path, heldout)
    print(f"wrote {train_path} ({len(train)} training problems) and {heldout_path} ({len(heldout)} held-out problems)")
    return train_path, heldout_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_train is not None and args.num_train < 1:
        parser.error(f"--num-train={args.num_train} must be >= 1")
    try:
        export(args.out, args.num_train, args.seed, args.config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
