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
A job that stops on a signal writes ``QUIET`` into the pipe first: its stop prints one line, and
the reaper does not add its own.

multiprocessing's resource tracker (started by the first spawned child) gets SIGKILL once the others
are gone, without a grace period: it ignores SIGTERM (the grace period would be lost on every exit),
and left to end by itself it warns about the segments vLLM leaked, which the reaper removes anyway.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import subprocess
import sys
from collections.abc import Sequence

from ckpt_common.procs import descendants, end_processes, shm_segments, unlink_segments

logger = logging.getLogger(__name__)

QUIET = b"QUIET\n"  # from the job, before it closes the pipe: print nothing


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


def stop_reaper(reaper: subprocess.Popen, timeout_s: float = 30.0, *, quiet: bool = False) -> None:
    """Close the lifeline (the reaper then cleans up what is left) and wait for it. ``quiet``: it
    prints nothing (the job is stopping on a signal, and says so in one line)."""
    if reaper.stdin is not None:
        try:
            if quiet:
                reaper.stdin.write(QUIET)
                reaper.stdin.flush()
        except OSError:  # the reaper is gone: nothing to tell
            pass
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
) -> tuple[list[str], list[str], bool]:
    """Record the parent's descendants and the segments they map until stdin closes; then end them
    and remove those segments. Returns the ended processes' names and the removed segments, and
    whether the parent asked for quiet (``QUIET``)."""
    recorded: dict[int, float] = {}
    segments: set[str] = set()
    me = os.getpid()
    quiet = False
    while True:
        before = (len(recorded), len(segments))
        now = {p: t for p, t in descendants(parent_pid).items() if p != me}
        recorded.update(now)
        segments |= shm_segments(now)  # the tree of now: a long job records many short-lived processes
        changed = (len(recorded), len(segments)) != before
        if record_path is not None and (changed or not os.path.exists(record_path)):
            _write_record(record_path, list(recorded), segments)
        ready, _, _ = select.select([sys.stdin], [], [], poll_s)
        if ready:
            data = os.read(sys.stdin.fileno(), 4096)
            if not data:
                break  # EOF: the parent is gone (or closed the pipe on a clean exit)
            quiet = quiet or QUIET in data
    trackers = {p: t for p, t in recorded.items() if _resource_tracker(p)}
    # the tracker last: the others unregister their segments with it as they stop (one it no longer
    # runs is started again by the first of them, with a warning and a traceback about what it lacks)
    ended = end_processes({p: t for p, t in recorded.items() if p not in trackers}, grace_s)
    ended += end_processes(trackers, 0.0)
    return ended, unlink_segments(segments), quiet  # only those still there: a clean stop removed its own


def _resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker (its command line names its module)."""
    import psutil

    try:
        return any("multiprocessing.resource_tracker" in arg for arg in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="End a process's descendants once it dies.")
    parser.add_argument("parent_pid", type=int)
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--grace-s", type=float, default=2.0)
    parser.add_argument("--record-path", default=None, help="write the recorded pids and segments here (for tests)")
    args = parser.parse_args(argv)
    ended, removed, quiet = watch(args.parent_pid, args.poll_s, args.grace_s, args.record_path)
    if quiet:
        return 0
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
