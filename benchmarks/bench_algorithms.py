"""The k1.5 update against GRPO and REINFORCE at equal compute: held-out accuracy per iteration.

    python benchmarks/bench_algorithms.py [--seeds 3 --iterations 60]

::

    for seed in 0..seeds-1, for algorithm in k15, grpo, reinforce:
        python -m orchestrator --config configs/demo.json --set rl.algorithm=ALG --set rl.num_iterations=N
                               --set rl.seed=S --set sampling.seed=S --set engine.seed=S  (+ --set ...)
            same SFT model (cached), training pool, held-out set, token budget, steps per iteration;
            only the loss differs (trainer.policy.make_objective)
        ──▶ OUT/ALG-seedS/{metrics.jsonl, summary.json, job.log}
    ──▶ OUT/algorithms.png (held-out greedy accuracy against iteration, one colour per algorithm,
        one line per seed), OUT/results.json

The last printed line is one JSON object: final held-out accuracy per algorithm (median over seeds,
with min and max), and ``k15_minus_best_baseline_points`` (median k15 minus the best baseline's
median, in points; goal > 0). A finished run directory (summary.json with the asked iterations) is
reused, so an interrupted comparison continues where it stopped. The default (1 seed x 3 iterations)
is a smoke run of a few minutes per algorithm on 2 cores; the comparison is ``--seeds 3 --iterations 60``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

logger = logging.getLogger("bench_algorithms")

REPO = pathlib.Path(__file__).resolve().parents[1]
ALGORITHMS = ("k15", "grpo", "reinforce")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "demo.json"))
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated, from " + ", ".join(ALGORITHMS))
    p.add_argument("--seeds", type=int, default=1, help="runs per algorithm, seeds 0..N-1")
    p.add_argument("--iterations", type=int, default=3, help="RL iterations per run")
    p.add_argument("--eval-every", type=int, default=1, help="held-out evaluation every N iterations")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "bench_algorithms"))
    p.add_argument("--sft-cache-dir", default=str(REPO / ".cache" / "sft"))
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (e.g. rl.kl_coef=0.01); repeatable",
    )
    p.add_argument(
        "--sampled-eval",
        action="store_true",
        help="keep the demo's sampled pass@1 evaluation (off by default: greedy accuracy only)",
    )
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of one run")
    args = p.parse_args(argv)
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad or not args.algorithms:
        p.error(f"--algorithms {bad or args.algorithms} must be from {ALGORITHMS}")
    if args.seeds < 1 or args.iterations < 1 or args.eval_every < 1:
        p.error("--seeds, --iterations and --eval-every must be >= 1")
    return args


def job_command(args: argparse.Namespace, algorithm: str, seed: int, out: pathlib.Path) -> list[str]:
    sets = [
        f"sft_cache_dir={args.sft_cache_dir}",
        f"rl.algorithm={algorithm}",
        f"rl.num_iterations={args.iterations}",
        f"rl.seed={seed}",
        f"sampling.seed={seed}",
        f"engine.seed={seed}",
        f"eval.every_iterations={args.eval_every}",
    ]
    if not args.sampled_eval:
        sets.append("eval.num_sampled_problems=0")
    sets += args.overrides
    return [
        sys.executable,
        "-m",
        "orchestrator",
        "--config",
        args.config,
        "--output-dir",
        str(out),
        "--no-progress",
        *[part for s in sets for part in ("--set", s)],
    ]


def run_one(args: argparse.Namespace, algorithm: str, seed: int) -> pathlib.Path:
    out = pathlib.Path(args.out_dir) / f"{algorithm}-seed{seed}"
    summary = out / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("num_iterations") == args.iterations:
        logger.info("%s seed %d: reusing %s", algorithm, seed, out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    with open(out / "job.log", "a") as log:
        proc = subprocess.run(
            job_command(args, algorithm, seed, out),
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=args.timeout_s,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{algorithm} seed {seed} failed (rc {proc.returncode}); see {out / 'job.log'}")
    logger.info("%s seed %d: done in %.0f s", algorithm, seed, time.monotonic() - start)
    return out


def accuracy_curve(run_dir: pathlib.Path) -> list[tuple[int, float]]:
    """(iteration, held-out greedy accuracy): iteration 0 is the model before RL, then each evaluation."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(0, summary["heldout_accuracy_before"])] + [
        (r["iteration"], r["heldout_accuracy"]) for r in records if r.get("evaluated")
    ]


def summarize(finals: Mapping[str, Sequence[float]]) -> dict:
    """Median/min/max final accuracy per algorithm and k15's margin over the best baseline (points)."""
    out: dict = {"final_heldout_accuracy": {}, "final_heldout_accuracy_min": {}, "final_heldout_accuracy_max": {}}
    for algorithm, values in finals.items():
        out["final_heldout_accuracy"][algorithm] = statistics.median(values)
        out["final_heldout_accuracy_min"][algorithm] = min(values)
        out["final_heldout_accuracy_max"][algorithm] = max(values)
    medians = out["final_heldout_accuracy"]
    baselines = [a for a in medians if a != "k15"]
    out["k15_minus_best_baseline_points"] = (
        100 * (medians["k15"] - max(medians[a] for a in baselines)) if "k15" in medians and baselines else None
    )
    out["best_baseline"] = max(baselines, key=lambda a: medians[a]) if baselines else None
    return out


def plot(curves: Mapping[str, Sequence[Sequence[tuple[int, float]]]], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for color, (algorithm, runs) in zip(("tab:blue", "tab:orange", "tab:green"), curves.items()):
        for i, curve in enumerate(runs):
            xs, ys = zip(*curve)
            ax.plot(
                xs,
                [100 * y for y in ys],
                color=color,
                marker="o",
                markersize=3,
                alpha=0.8,
                label=algorithm if i == 0 else None,
            )
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # run as a script from a checkout
    from ckpt_common.logs import setup_logging

    setup_logging("INFO")
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    for seed in range(args.seeds):  # seeds outer: an interrupted run has every algorithm at the early seeds
        for algorithm in args.algorithms:
            curves.setdefault(algorithm, []).append(accuracy_curve(run_one(args, algorithm, seed)))
    finals = {a: [curve[-1][1] for curve in runs] for a, runs in curves.items()}
    result = {
        **summarize(finals),
        "seeds": args.seeds,
        "iterations": args.iterations,
        "before": statistics.median(c[0][1] for runs in curves.values() for c in runs),
        "plot": str(out_dir / "algorithms.png"),
    }
    plot(
        curves,
        out_dir / "algorithms.png",
        f"{', '.join(args.algorithms)}: {args.seeds} seed(s) x {args.iterations} iterations",
    )
    (out_dir / "results.json").write_text(json.dumps({**result, "curves": curves}, indent=2) + "\n")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
