"""The RL job's entry point: SFT warm-up (cached), then RL with vLLM and the checkpoint engine.

    python -m orchestrator --config configs/demo.json --output-dir runs/demo [--set rl.lr=3e-4 ...]

Writes DIR/metrics.jsonl (one line per iteration), DIR/metrics.png, DIR/summary.json and the
resume state DIR/state/; run the same command again to resume a killed run. The last printed
line is the summary as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator",
        description="Kimi-k1.5-style RL on the arithmetic demo task: SFT warm-up (cached), then RL with "
        "vLLM rollouts and checkpoint-engine weight sync after every iteration. Re-running "
        "with the same --output-dir resumes.",
    )
    parser.add_argument("--config", default=None, help="JSON config file (default: built-in defaults)")
    parser.add_argument("--output-dir", required=True, help="where metrics, plot, summary and state go")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value, e.g. --set rl.num_iterations=40 (value parsed as "
        "JSON, else taken as a string); repeatable",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument(
        "--stop-timeout-s",
        type=float,
        default=20.0,
        help="after Ctrl-C or SIGTERM the job ends within this many seconds, even if closing the "
        "engines hangs (it then prints every thread's stack); the saved state is kept either way",
    )
    args = parser.parse_args(argv)
    if args.stop_timeout_s <= 0:
        parser.error(f"--stop-timeout-s must be > 0, got {args.stop_timeout_s}")
    return args


def _environment(kv_cache_gib: int, log_level: str) -> None:
    """Process-wide settings for vLLM (CPU) and tokenizers; set before either is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if log_level == "INFO" else log_level)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")


def _stop_code(exc: BaseException) -> int | None:
    """The exit code of a stop by signal that ``exc`` comes from, else None.

    Ctrl-C is ``KeyboardInterrupt`` (130) and SIGTERM ``SystemExit(143)`` (``exit_on_signals``), or
    an error that one of them caused: a Ctrl-C inside a C extension's import (matplotlib's, at the
    first plot) surfaces as ``ImportError: initialization failed`` with the interrupt as its cause.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return 128 + signal.SIGINT
        if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
            return exc.code
        exc = exc.__cause__ or exc.__context__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from orchestrator.config import load_config, to_dict

    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(config), indent=2))
        return 0
    from checkpoint_engine.logs import setup_logging

    setup_logging(args.log_level)
    if args.log_level == "INFO":  # one line per update from the checkpoint engine drowns the progress bar
        logging.getLogger("checkpoint_engine").setLevel(logging.WARNING)
    _environment(config.engine.kv_cache_gib, args.log_level)
    from checkpoint_engine.procs import exit_after_cleanup, exit_on_signals, stop_deadline

    # SIGTERM unwinds like Ctrl-C, so the engine is shut down; the reaper covers SIGKILL; the
    # deadline covers a clean-up that hangs.
    exit_on_signals((signal.SIGTERM,))
    stop_deadline(args.stop_timeout_s)
    from orchestrator.loop import run_job
    from orchestrator.reaper import start_reaper, stop_reaper

    reaper = start_reaper()
    stop_code = None
    try:
        summary = run_job(config, args.output_dir, progress_bar=not args.no_progress)
    except BaseException as e:
        stop_code = _stop_code(e)
        if stop_code is None:
            raise
    finally:
        start = time.monotonic()
        stop_reaper(reaper)
        logging.getLogger("orchestrator").info("reaper done in %.2f s", time.monotonic() - start)
    if stop_code is not None:
        print(
            f"interrupted: the state of the last finished iteration is in "
            f"{os.path.join(args.output_dir, 'state')}; run the same command to resume",
            file=sys.stderr,
        )
        # The engine is closed and its processes ended. The interpreter's finalization is skipped: a C
        # extension whose import the signal cut short (matplotlib's, at the first plot) or a thread
        # left mid-call can abort it.
        exit_after_cleanup(stop_code)
    print(summary.pop("summary_line"))
    print(
        f"metrics: {os.path.join(args.output_dir, 'metrics.jsonl')}  plot: "
        f"{os.path.join(args.output_dir, 'metrics.png')}"
    )
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
