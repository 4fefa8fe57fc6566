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
from collections.abc import Callable, Sequence
from typing import TypeVar

from ckpt_common.logs import add_log_level_flag
from ckpt_common.procs import DEFAULT_STOP_TIMEOUT_S
from orchestrator.tasks.factory import add_job_config_args, check_data_files


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator",
        description="Kimi-k1.5-style RL on the arithmetic demo task (SFT warm-up, cached) or on your own "
        "JSONL problem files (--set data.train_path=... --set data.heldout_path=...), with vLLM rollouts and "
        "checkpoint-engine weight sync after every iteration. Re-running with the same --output-dir resumes.",
    )
    add_job_config_args(parser, example="rl.num_iterations=40")
    parser.add_argument("--output-dir", help="where metrics, plot, summary and state go (required to run)")
    parser.add_argument(
        "--write-engine-model",
        metavar="DIR",
        help="write the engines' model folder for this config (config, generation config, tokenizer; no "
        "weights: the checkpoint engine brings them) into DIR and exit: an inference host's --model "
        "without a shared volume (sync.source=memory)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_log_level_flag(parser)
    parser.add_argument(
        "--stop-timeout-s",
        type=float,
        default=DEFAULT_STOP_TIMEOUT_S,
        help="after Ctrl-C or SIGTERM the job ends within this many seconds, even if closing the "
        "engines hangs (it then prints every thread's stack); the saved state is kept either way",
    )
    args = parser.parse_args(argv)
    if args.output_dir is None and args.write_engine_model is None and not args.print_config:
        parser.error("--output-dir is required")
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


T = TypeVar("T")
logger = logging.getLogger("orchestrator")


_CONSOLE_SCRIPT = False  # set by console_main: __main__ is the ckpt-rl wrapper, not this module


def spawn_children_through_here() -> None:
    """Make the processes this one spawns (multiprocessing's "spawn": vLLM's engine core and workers)
    run ``orchestrator.spawned`` first, which blocks SIGINT there: a terminal's Ctrl-C is the job's
    to handle, not vLLM's engine core's. A spawned child runs the module its parent's main module was
    run as (``python -m``), as ``__mp_main__``; a package's ``__main__`` it skips, so this names
    another. For a main module run with ``-m`` that defines nothing a child needs (the job's)."""
    import importlib.util

    main = sys.modules.get("__main__")
    if main is not None and (getattr(main, "__spec__", None) is not None or _CONSOLE_SCRIPT):
        main.__spec__ = importlib.util.find_spec("orchestrator.spawned")


def install_stop_handling(stop_timeout_s: float, log_level: str = "INFO") -> None:
    """Ctrl-C and SIGTERM stop the job, every time the same way (``run_stoppable``).

    The first signal is recorded and unwinds the main thread (``KeyboardInterrupt``, or
    ``SystemExit(143)``), so the ``finally`` blocks close the engine and the trainer; the deadline ends
    a clean-up that hangs; from the signal on, the console's log handler is quiet (unless ``DEBUG``):
    what the stop sets off (a request cut short, a torn weight update) is no news."""
    from ckpt_common.procs import quiet_after_stop, record_stop_signals, stop_deadline

    record_stop_signals((signal.SIGINT, signal.SIGTERM))
    stop_deadline(stop_timeout_s)
    if log_level != "DEBUG":
        quiet_after_stop()


def stop_line(output_dir: str | os.PathLike[str], code: int) -> str:
    """The one line a stop prints: the signal, the phase it stopped, where the state is, how to resume."""
    from orchestrator import phases

    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"exit {code}"
    return (
        f"interrupted ({name}) during {phases.describe()}: the state of the last finished iteration is in "
        f"{os.path.join(output_dir, 'state')}; run the same command to resume"
    )


def run_stoppable(body: Callable[[], T], output_dir: str | os.PathLike[str]) -> T:
    """``body()``'s result, or, when a stop signal ends it (``install_stop_handling``), the end of the process.

    Once a signal was recorded, whatever ``body`` raises is the stop, however the error chain reads
    (vLLM's engine core, in the terminal's process group, may have died of the same Ctrl-C and failed
    the weight update in flight): one line on stderr, exit 128 + signum (130 for Ctrl-C, 143 for
    SIGTERM); the error goes to the log at DEBUG only. An error without a stop is raised as is."""
    from ckpt_common.procs import exit_after_cleanup, stop_exit_code

    try:
        return body()
    except BaseException as e:
        code = stop_exit_code(e)
        if code is None:
            raise
        logger.debug("stopped by a signal; what the stop raised:", exc_info=e)
        print(stop_line(output_dir, code), file=sys.stderr)
        # The engine is closed and its processes ended. The interpreter's finalization is skipped: a C
        # extension whose import the signal cut short (matplotlib's, at the first plot) or a thread
        # left mid-call can abort it.
        exit_after_cleanup(code)


def _run(config, output_dir: str, progress_bar: bool) -> dict:
    from ckpt_common.procs import stop_signal
    from orchestrator.loop import run_job
    from orchestrator.reaper import start_reaper, stop_reaper

    reaper = start_reaper()  # the reaper covers SIGKILL
    try:
        return run_job(config, output_dir, progress_bar=progress_bar)
    finally:
        start = time.monotonic()
        stop_reaper(reaper, quiet=stop_signal() is not None)
        logger.info("reaper done in %.2f s", time.monotonic() - start)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from ckpt_common.dictconfig import to_dict
    from orchestrator.config import load_config

    try:
        config = load_config(args.config, args.overrides)
        check_data_files(config)  # problem files (data.train_path): every line, before anything starts
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(config), indent=2))
        return 0
    if args.write_engine_model is not None:
        from orchestrator.engine_pool.daemon import write_engine_model

        try:
            out = write_engine_model(config, args.write_engine_model)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote the engines' model folder (no weights) to {out}")
        return 0
    from ckpt_common.logs import setup_logging

    setup_logging(args.log_level)
    if args.log_level == "INFO":  # one line per update from the checkpoint engine drowns the progress bar
        logging.getLogger("checkpoint_engine").setLevel(logging.WARNING)
    _environment(config.engine.kv_cache_gib, args.log_level)
    install_stop_handling(args.stop_timeout_s, args.log_level)
    from orchestrator import phases

    phases.configure_test_hooks(os.environ)  # off unless a test set its variables
    spawn_children_through_here()
    summary = run_stoppable(lambda: _run(config, args.output_dir, not args.no_progress), args.output_dir)
    print(summary.pop("summary_line"))
    tensorboard = os.path.join(args.output_dir, "tensorboard")  # the metrics again, as TensorBoard event files
    print(
        f"metrics: {os.path.join(args.output_dir, 'metrics.jsonl')}  plot: "
        f"{os.path.join(args.output_dir, 'metrics.png')}"
        + (f"  tensorboard --logdir {tensorboard}" if config.metrics.tensorboard else "")
    )
    print(json.dumps(summary, sort_keys=True))
    return 0


def console_main() -> int:
    """The ``ckpt-rl`` console script: ``main()``, with the script's wrapper as ``__main__`` (which a
    spawned child would run by path) treated as a ``-m`` module is (``spawn_children_through_here``)."""
    global _CONSOLE_SCRIPT
    _CONSOLE_SCRIPT = True
    return main()


if __name__ == "__main__":
    sys.exit(main())
