"""A watchdog process that cleans up the job's child processes when the job dies, even by SIGKILL.

::

    job (pid P) ──spawn──▶ reaper (python -m orchestrator.reaper P), stdin = a pipe only P writes to
        every poll_s: reaper records P's descendants (vLLM EngineCore, workers, ...)
        and the named shared memory they map (/dev/shm/psm_*: vLLM's message queues)
    P exits or is killed ──▶ the pipe reaches EOF ──▶ reaper: SIGTERM the recorded processes,
                                                      SIGKILL what is left after grace_s,
                                                      remove the recorded segments still there, exit

vLLM's engine processes outlive a killed front end (and its CPU workers spin at 100%), and processes
killed with SIGKILL leave their segments in /dev/shm until the machine restarts, so the job starts
one reaper at start-up; a clean exit closes the pipe the same way (its segments are gone by then).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import subprocess
import sys
from collections.abc import Sequence

from checkpoint_engine.procs import descendants, end_processes, shm_segments, unlink_segments

logger = logging.getLogger(__name__)


def start_reaper(poll_s: float = 1.0, grace_s: float = 2.0, record_path: str | None = None) -> subprocess.Popen:
    """Spawn the reaper for this process; keep the returned Popen alive (its stdin is the lifeline)."""
    extra = [] if record_path is None else ["--record-path", record_path]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.reaper",
            str(os.getpid()),
            "--poll-s",
            str(poll_s),
            "--grace-s",
            str(grace_s),
            *extra,
        ],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )


def stop_reaper(reaper: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Close the lifeline (the reaper then cleans up what is left) and wait for it."""
    if reaper.stdin is not None:
        reaper.stdin.close()
    try:
        reaper.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()


def _write_record(path: str, pids: Sequence[int], segments: set[str]) -> None:
    """Line 1: the recorded pids; line 2: the recorded segments' paths (both space-separated)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(" ".join(str(p) for p in sorted(pids)) + "\n" + " ".join(sorted(segments)) + "\n")
    os.replace(tmp, path)


def watch(
    parent_pid: int, poll_s: float, grace_s: float, record_path: str | None = None
) -> tuple[list[str], list[str]]:
    """Record the parent's descendants and the segments they map until stdin closes; then end them
    and remove those segments. Returns the ended processes' names and the removed segments."""
    recorded: dict[int, float] = {}
    segments: set[str] = set()
    me = os.getpid()
    while True:
        before = (len(recorded), len(segments))
        now = {p: t for p, t in descendants(parent_pid).items() if p != me}
        recorded.update(now)
        segments |= shm_segments(now)  # the tree of now: a long job records many short-lived processes
        changed = (len(recorded), len(segments)) != before
        if record_path is not None and (changed or not os.path.exists(record_path)):
            _write_record(record_path, list(recorded), segments)
        ready, _, _ = select.select([sys.stdin], [], [], poll_s)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF: the parent is gone (or closed the pipe on a clean exit)
    ended = end_processes(recorded, grace_s)
    return ended, unlink_segments(segments)  # only those still there: a clean stop removed its own


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="End a process's descendants once it dies.")
    parser.add_argument("parent_pid", type=int)
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--grace-s", type=float, default=2.0)
    parser.add_argument("--record-path", default=None, help="write the recorded pids and segments here (for tests)")
    args = parser.parse_args(argv)
    ended, removed = watch(args.parent_pid, args.poll_s, args.grace_s, args.record_path)
    if ended:
        print(
            f"orchestrator.reaper: ended {len(ended)} leftover process(es) of pid {args.parent_pid}: "
            f"{', '.join(ended)}",
            file=sys.stderr,
        )
    if removed:
        print(
            f"orchestrator.reaper: removed {len(removed)} shared-memory segment(s) they left: {', '.join(removed)}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
