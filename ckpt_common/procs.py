"""Child processes end with their parent.

Four mechanisms, and one ending:
- ``exit_on_signals()`` (entry points only): SIGTERM (and SIGINT) raise ``SystemExit`` in the main
  thread, so ``finally`` blocks that stop servers run, as they do for Ctrl-C.
- ``stop_deadline()`` (entry points only): once such a signal arrived, the process ends within a
  deadline even if that clean-up hangs (a peer that died mid-call, a thread the interpreter joins
  at exit); it first writes every thread's stack to stderr, so the hang can be found.
  ``force_exit_after()`` arms the same deadline from a signal handler that already ran (an asyncio
  loop's, which owns the wakeup fd ``stop_deadline`` would read).
- ``die_with_parent`` (``preexec_fn`` of ``subprocess.Popen``): the kernel sends the child SIGTERM
  when the thread that started it dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``). Start such
  children from the main thread (or one that lives as long as they should).
- ``signal_when_orphaned()`` (entry points whose parent they do not start: torchrun's ranks, in a
  session of their own): a thread sends the process SIGTERM once its parent is gone, so a SIGKILLed
  torchrun does not leave its ranks, and the engines they manage, running unowned.

    parent ──SIGTERM/SIGINT──▶ SystemExit ──▶ finally: child.terminate()
    parent ──SIGKILL──▶ kernel ──SIGTERM──▶ child (its own handler stops its children)
    signal ──wakeup fd──▶ watchdog thread ──deadline_s later, still alive──▶ stacks, os._exit(128 + signum)
    signal ──asyncio handler──▶ force_exit_after(deadline_s, signum) ──same ending──
    parent gone (reparented) ──orphan watch──▶ SIGTERM to itself ──the same stop as above──

- ``exit_after_cleanup()`` (entry points, once their own clean-up after a stop signal has run): ends
  the process without the interpreter's finalization, which what the signal cut short (a C
  extension's import, a thread of native code mid-call) can crash or hang.
- ``record_stop_signals()`` (entry points that end every stop the same way, the RL job): like
  ``exit_on_signals`` (SIGINT stays ``KeyboardInterrupt``), and the first signal is recorded, so
  whatever error the stop sets off (a child in the terminal's process group died of the same
  Ctrl-C, a peer hung up) is known to be the stop: ``stop_exit_code()``. ``quiet_after_stop()``
  keeps the process's logging and warnings silent from then on (the errors the stop causes are not
  news). A process or thread that must not get a terminal's Ctrl-C runs ``block_sigint()``.

A killed process cannot remove the POSIX shared memory it made (vLLM's message queues: `/dev/shm/psm_*`;
its workers' named semaphores: `/dev/shm/sem.mp-*`, `sem.loky-*` once joblib is imported). Whoever
stops a vLLM process tree notes the segments it maps (``shm_segments``, ``group_shm_segments``) once
it is up, right before the signal (``signal_noting_segments``) and while it stops (``wait_noting_segments``; both:
``terminate_noting_segments``), and removes what is left after the stop (``unlink_segments``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import NoReturn

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: ask the kernel for SIGTERM once the parent thread dies (no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Turn each of ``signals`` into ``SystemExit(128 + signum)`` in the main thread."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in signals:
        signal.signal(sig, handler)


_stop_signum: int | None = None  # the first signal record_stop_signals' handler got


def record_stop_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Main thread: the first of ``signals`` is recorded (``stop_signal()``) and unwinds the main thread,
    SIGINT as ``KeyboardInterrupt``, any other as ``SystemExit(128 + signum)``; a later one is only
    noted in the log (the clean-up the first one started goes on; ``stop_deadline`` bounds it).

    A SIGINT the process inherited as ignored (started in the background by a shell without job
    control, or under ``nohup``) stays ignored: a terminal's Ctrl-C is not meant for it."""

    def handler(signum, _frame):
        if _stop_signum is not None:
            logger.debug("%s again: the stop is already under way", signal.Signals(signum).name)
            return
        _record_stop(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    for sig in signals:
        if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        signal.signal(sig, handler)


def stop_signal() -> int | None:
    """The stop signal ``record_stop_signals``' handler received first, else None."""
    return _stop_signum


def stop_exit_code(exc: BaseException | None = None) -> int | None:
    """The exit code of a stop: ``128 + signum`` once a stop signal was recorded, whatever ``exc`` is
    (the stop is what set off any error that follows it); else the stop that ``exc`` comes from, if
    any: ``KeyboardInterrupt`` (130) or ``SystemExit(128 + n)`` for SIGINT/SIGTERM, anywhere in its
    chain of causes and contexts (a Ctrl-C inside a C extension's import surfaces as ``ImportError``
    with the interrupt as its cause); else None."""
    if _stop_signum is not None:
        return 128 + _stop_signum
    seen: set[int] = set()
    pending = [exc] if exc is not None else []
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return 128 + signal.SIGINT
        if isinstance(e, SystemExit) and e.code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            return e.code
        pending += [e.__context__, e.__cause__]
    return None


_quiet_on_stop = False


def _record_stop(signum: int) -> None:
    global _stop_signum
    _stop_signum = signum
    if _quiet_on_stop:
        # every logger and handler of the process, those a library sets up (again) later included:
        # vLLM's, to stdout; and Python's warnings (multiprocessing's resource tracker's)
        logging.disable(logging.CRITICAL)
        warnings.simplefilter("ignore")


def quiet_after_stop() -> None:
    """From the first stop signal ``record_stop_signals`` records on, this process logs nothing and
    shows no warnings: what a stop sets off (a request cut short, a torn weight update, an engine
    that died of the same Ctrl-C) is the stop's, not news, and the entry point says it in one line."""
    global _quiet_on_stop
    _quiet_on_stop = True


def block_sigint() -> None:
    """Block SIGINT in the calling thread, and so in the threads it starts and the processes it forks
    from now on (a handler installed later does not unblock it). Not in those it starts by fork and
    exec through Python (``subprocess``, multiprocessing's "spawn"): CPython clears their mask, so
    such a child calls this itself, first (orchestrator/spawned.py).

    For processes that must not get a terminal's Ctrl-C, sent to the whole foreground process group,
    but be stopped by their parent, in order (vLLM's engine core, which takes SIGINT for its own
    shutdown). In a parent, the main thread, which runs Python's signal handlers, still gets the
    signal. No-op where ``pthread_sigmask`` does not exist."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def signal_when_orphaned(sig: int = signal.SIGTERM, poll_s: float = 1.0) -> threading.Thread:
    """Send this process `sig` once its parent has gone (it was reparented: `os.getppid()` changed).

    For processes started by a supervisor that neither signals them when it dies nor sets
    PR_SET_PDEATHSIG (torchrun starts its ranks in sessions of their own). A poll, not
    PR_SET_PDEATHSIG set here: that fires when the parent's *thread* that forked us ends, which
    need not be the parent's end. The parent at the call is the one watched (pid 1 as well: then
    nothing ever changes)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.error("parent process %d is gone: stopping (signal %d)", parent, sig)
        os.kill(os.getpid(), sig)

    t = threading.Thread(target=watch, daemon=True, name="orphan-watch")
    t.start()
    return t


FORCED_EXIT_MARKER = "forcing the exit"


def _detach_wakeup_fd() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the main one: nothing was inherited there
        pass


# An entry point's default for `stop_deadline`: under torchrun's and Kubernetes' 30 s between SIGTERM
# and SIGKILL, so a process that hangs in clean-up still ends by itself and says where it hung.
DEFAULT_STOP_TIMEOUT_S = 20.0


def stop_deadline(deadline_s: float, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """After the first of ``signals``, end the process within ``deadline_s`` even if clean-up hangs.

    Call from the main thread, after the Python handlers for ``signals`` are installed (the default
    SIGINT handler counts). The interpreter's C-level handler writes each signal number to a wakeup
    fd; a daemon thread reads it, so it wakes even while the main thread is stuck inside a C call and
    cannot run Python handlers. The normal path (``KeyboardInterrupt``/``SystemExit`` unwinding
    through ``finally``) keeps the whole deadline; the watchdog only acts if the process outlives it.
    Also registers SIGUSR1 to dump every thread's stack to stderr on demand.
    """
    if deadline_s <= 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler must never block
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # A forked child (multiprocessing's "fork", as vLLM and torch use it) inherits the wakeup fd but not
    # the watchdog: a signal to the child would reach this process's watchdog. Detach it there.
    os.register_at_fork(after_in_child=_detach_wakeup_fd)
    watched = {int(s) for s in signals}

    def watch() -> None:
        while True:
            data = os.read(read_fd, 64)
            hit = [b for b in data if b in watched]
            if hit:
                break
        _exit_after(deadline_s, hit[0])

    threading.Thread(target=watch, name="stop-deadline", daemon=True).start()


def force_exit_after(deadline_s: float, signum: int) -> None:
    """Arm the stop deadline now, from a handler that ``signum`` already ran (an asyncio loop's signal
    handler: the loop owns the wakeup fd, so ``stop_deadline`` cannot watch it). Same ending: if the
    process is still alive ``deadline_s`` later, every thread's stack goes to stderr and it exits
    ``128 + signum``."""
    if deadline_s <= 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    threading.Thread(target=_exit_after, args=(deadline_s, int(signum)), name="stop-deadline", daemon=True).start()


def _exit_after(deadline_s: float, signum: int) -> None:
    time.sleep(deadline_s)
    name = signal.Signals(signum).name
    # os.write, not sys.stderr/logging: the stuck main thread may hold their locks.
    os.write(
        2,
        f"\n{name} received {deadline_s:.0f} s ago and clean-up still runs: {FORCED_EXIT_MARKER}; "
        "stacks of every thread:\n".encode(),
    )
    faulthandler.dump_traceback(file=2, all_threads=True)
    os._exit(128 + signum)


def exit_after_cleanup(code: int) -> NoReturn:
    """End the process now with ``code``: flush logging and stdio, then ``os._exit``.

    For an entry point stopped by a signal, after its own clean-up ran (engines closed, children
    ended). The interpreter's finalization would come next, and what the signal interrupted can break
    it: a C extension whose initialization it cut short (matplotlib's ft2font, imported at the RL job's
    first plot) aborts it ("PyThreadState_Get: ... the GIL is released", SIGABRT), and so can a
    thread of native code left mid-call; a non-daemon thread left running blocks it. Skipped with
    finalization: ``atexit`` handlers and the joining of threads, which is the point.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can reach it
            pass
    os._exit(code)


def descendants(pid: int) -> dict[int, float]:
    """A process's descendants now, as {pid: create_time} (the time tells a reused pid apart)."""
    import psutil

    try:
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


def _gone(proc) -> bool:
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, waiting for a parent that may never reap it
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list, timeout_s: float, poll_s: float = 0.05) -> list:
    """Wait until every process has exited (zombies count as exited); the ones still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = [p for p in procs if not _gone(p)]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(poll_s)


def live_pids(recorded: dict[int, float]) -> list[int]:
    """The recorded processes (``descendants()``) that still run as themselves: not exited, not a
    zombie, not a reused pid."""
    import psutil

    alive = []
    for pid, created in recorded.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and not _gone(proc):
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def end_processes(recorded: dict[int, float], grace_s: float) -> list[str]:
    """SIGTERM the recorded processes (``descendants()``) still alive, SIGKILL what is left after
    ``grace_s``; the names of those that were alive."""
    import psutil

    alive, names = [], []
    for pid, created in recorded.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() != created or _gone(proc):  # reused pid, or already dead
                continue
            names.append(f"{proc.name()}[{pid}]")
            proc.terminate()
            alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    for proc in _wait_gone(alive, grace_s):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(alive, grace_s)
    return names


SHM_DIR = "/dev/shm"
# Python's multiprocessing names them so: shared_memory.SharedMemory (vLLM's message queues) and the
# named semaphores of its locks under the spawn start method (vLLM's workers). A process that has
# imported joblib gets its semaphores named by joblib's loky instead (it renames multiprocessing's).
# vLLM's CPU backend names the shared-memory buffers of its tensor-parallel communicator
# "vllm_dist_<id>-tp:<group>-cpushm_<rank>" (4 MiB each, one per worker).
SHM_PREFIXES = ("psm_", "sem.mp-", "sem.loky-", "vllm_dist_")


def group_pids(pgid: int) -> list[int]:
    """The processes of group `pgid` still running (zombies left out)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) != pgid:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry))
            except (OSError, IndexError):
                continue  # ended meanwhile
    return pids


def group_shm_segments(pgid: int, prefixes: tuple[str, ...] = SHM_PREFIXES) -> set[str]:
    """The POSIX shared-memory segments (`SHM_DIR/<prefix>*`) that the processes of group `pgid` have
    mapped now."""
    return shm_segments(group_pids(pgid), prefixes)


def shm_segments(pids: Iterable[int], prefixes: tuple[str, ...] = SHM_PREFIXES) -> set[str]:
    """The files `SHM_DIR/<prefix>*` that the processes `pids` have mapped now (a process that ended
    meanwhile, or is not ours to read, adds nothing).

    Matched by inode, not by the path in /proc/PID/maps: glibc's sem_open maps a temporary file and
    then links it under the semaphore's name, so the mapping shows the temporary name, "(deleted)".
    """
    inodes: set[int] = set()
    head = f"{SHM_DIR}/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()  # thousands of lines for a vLLM process: one search, then its few lines
        except OSError:
            continue
        if head not in maps:
            continue
        for line in maps.splitlines():
            if head in line:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(head):
                    inodes.add(int(parts[4]))
    if not inodes:
        return set()
    found: set[str] = set()
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            try:
                if entry.name.startswith(prefixes) and entry.inode() in inodes and entry.is_file(follow_symlinks=False):
                    found.add(entry.path)
            except OSError:
                continue  # removed meanwhile
    return found


def wait_noting_segments(
    alive: Callable[[], list[int]],
    timeout_s: float,
    done: Callable[[], bool] | None = None,
    poll_s: float = 0.05,
) -> tuple[bool, set[str]]:
    """Wait up to `timeout_s` until `done()` (default: until `alive()`, the pids still running, is
    empty), noting every `poll_s` the segments those processes map: one stopped during its start may
    make a segment after the stop began and die without removing it. Returns (done, segments noted)."""
    noted: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        pids = alive()
        if done() if done is not None else not pids:
            return True, noted
        noted |= shm_segments(pids)
        if time.monotonic() >= deadline:
            return False, noted
        time.sleep(poll_s)  # polling the processes' end, bounded by the deadline


def signal_noting_segments(proc, running: Callable[[], list[int]], sig: int = signal.SIGTERM) -> set[str]:
    """Note the segments that `running()` (`proc`'s processes) map, then send `sig` to `proc` (a
    ``subprocess.Popen``) if it still runs: noted after the signal, a tree that ends at once would be
    gone with its segments unnoted. Returns the segments noted."""
    noted = shm_segments(running())
    if proc.poll() is None:
        proc.send_signal(sig)
    return noted


def terminate_noting_segments(
    proc, running: Callable[[], list[int]], grace_s: float, done: Callable[[], bool] | None = None
) -> tuple[bool, set[str]]:
    """SIGTERM `proc` (a ``subprocess.Popen``) and wait up to `grace_s` until `done()` (default: until
    it exited), noting the segments that `running()` (its processes) map before and meanwhile.
    Returns (done, noted)."""
    done = done or (lambda: proc.poll() is not None)
    if proc.poll() is not None and done():
        return True, shm_segments(running())
    noted = signal_noting_segments(proc, running)
    finished, more = wait_noting_segments(running, grace_s, done=done)
    return finished, noted | more


def unlink_segments(paths: set[str]) -> list[str]:
    """Remove the named segments that still exist (what a killed process group could not remove);
    the memory goes once the last mapping of it is gone. Returns those removed."""
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass  # removed by its owner, as on a clean stop
        except OSError as e:
            logger.warning("could not remove shared memory %s: %s", path, e)
    return removed
