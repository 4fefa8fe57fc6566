"""procs.stop_deadline and force_exit_after: a stop signal ends the process within the deadline, whatever its
clean-up does; exit_after_cleanup ends it at once after its own clean-up."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ckpt_common.procs import FORCED_EXIT_MARKER, force_exit_after, stop_deadline

REPO = __import__("pathlib").Path(__file__).resolve().parents[3]

PRELUDE = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, even if the runner ignores SIGINT
sys.path.insert(0, {repo!r})
from ckpt_common.procs import exit_on_signals, stop_deadline
exit_on_signals()  # SIGTERM -> SystemExit, as the entry points do
stop_deadline({deadline_s})
print("ready", flush=True)
"""

SCRIPTS = {
    # a finally block that never ends (a close() waiting on a dead peer)
    "python_hang": """
def hang_in_cleanup():
    while True:
        time.sleep(0.05)
try:
    time.sleep(60)
finally:
    hang_in_cleanup()
""",
    # the main thread inside one C call that never returns to the interpreter, so Python-level
    # signal handlers never run (a mutex locked twice stands in for a stuck collective)
    "stuck_in_c": """
import ctypes
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER, a non-recursive mutex
libc.pthread_mutex_lock(mutex)
libc.pthread_mutex_lock(mutex)
""",
    # a forked child that gets SIGTERM: the parent's watchdog must not see that signal
    "forked_child_stopped": """
import multiprocessing, signal
def child():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(30)
p = multiprocessing.get_context("fork").Process(target=child)
p.start()
time.sleep(0.3)
p.terminate()
p.join(10)
time.sleep(2.0)  # twice the deadline
print("survived", flush=True)
""",
    # after its clean-up, the entry point ends with exit_after_cleanup while a thread a library started
    # is still running: finalization (which would join it, then run atexit) is skipped
    "exit_after_cleanup": """
import atexit, logging, threading
from ckpt_common.procs import exit_after_cleanup
logging.basicConfig(level=logging.INFO, format="%(message)s")
atexit.register(lambda: print("finalized", flush=True))
threading.Thread(target=time.sleep, args=(600,), name="library-thread").start()  # not a daemon
try:
    time.sleep(60)
except KeyboardInterrupt:
    code = 130
logging.getLogger("entry").info("cleaned up")
print("summary")  # buffered: stdout is a pipe
exit_after_cleanup(code)
""",
    # a clean-up that finishes: the watchdog must not interfere
    "clean": """
try:
    time.sleep(60)
finally:
    print("cleaned", flush=True)
""",
}


def _start(script: str, deadline_s: float) -> subprocess.Popen:
    code = PRELUDE.format(repo=str(REPO), deadline_s=deadline_s) + textwrap.dedent(SCRIPTS[script])
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    time.sleep(0.3)  # into the try block / the C call
    return proc


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, float, str, str]:
    start = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode, time.monotonic() - start, out, err


@pytest.mark.parametrize(
    ("script", "sig"),
    [("python_hang", signal.SIGINT), ("stuck_in_c", signal.SIGINT), ("python_hang", signal.SIGTERM)],
)
def test_a_hanging_stop_is_forced_after_the_deadline_with_the_stacks(script, sig):
    deadline_s = 1.0
    proc = _start(script, deadline_s)
    rc, stop_s, _, err = _stop(proc, sig)
    assert rc == 128 + sig, err
    assert FORCED_EXIT_MARKER in err, err
    assert deadline_s <= stop_s < deadline_s + 10, stop_s
    if script == "python_hang":
        assert "hang_in_cleanup" in err, err  # the stack shows where the clean-up hung


def test_a_clean_stop_is_left_alone():
    proc = _start("clean", deadline_s=30.0)
    proc.send_signal(signal.SIGUSR1)  # stacks on demand; the process goes on
    time.sleep(0.5)
    assert proc.poll() is None
    rc, stop_s, out, err = _stop(proc, signal.SIGINT)
    assert "cleaned" in out
    assert FORCED_EXIT_MARKER not in err
    assert "most recent call first" in err, err  # the SIGUSR1 dump
    assert rc == -signal.SIGINT, err  # the uncaught KeyboardInterrupt, as without the watchdog
    assert stop_s < 10


def test_exit_after_cleanup_ends_the_process_with_its_code_and_its_output_without_finalizing():
    proc = _start("exit_after_cleanup", deadline_s=30.0)
    rc, stop_s, out, err = _stop(proc, signal.SIGINT)
    assert rc == 130, err
    assert out.split() == ["summary"], out  # flushed; the atexit handler did not run
    assert "cleaned up" in err
    assert FORCED_EXIT_MARKER not in err
    assert stop_s < 10  # not waiting for the thread


def test_a_signal_to_a_forked_child_does_not_trip_the_parent():
    proc = _start("forked_child_stopped", deadline_s=1.0)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "survived" in out, err
    assert FORCED_EXIT_MARKER not in err


def test_deadline_must_be_positive():
    with pytest.raises(ValueError, match="deadline_s"):
        stop_deadline(0)
    with pytest.raises(ValueError, match="deadline_s"):
        force_exit_after(-1.0, signal.SIGTERM)


ASYNCIO_HANG = """
import asyncio, signal, sys, time
sys.path.insert(0, {repo!r})
from ckpt_common.procs import force_exit_after

async def main():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def on_signal(signum):
        force_exit_after({deadline_s}, signum)
        stop.set()
    loop.add_signal_handler(signal.SIGTERM, on_signal, signal.SIGTERM)
    print("ready", flush=True)
    await stop.wait()
    time.sleep(60)  # a shutdown that blocks the loop (an engine that never stops)

asyncio.run(main())
"""


def test_an_asyncio_server_stuck_in_its_shutdown_exits_at_the_deadline():
    """The daemon's shape: the loop owns the wakeup fd; its signal handler arms the deadline."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ASYNCIO_HANG.format(repo=str(REPO), deadline_s=1.0)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        stop_s = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert FORCED_EXIT_MARKER in err and "SIGTERM" in err, err
    assert 1.0 <= stop_s < 10, stop_s


def _loky_make_name() -> str:
    """The semaphore names that joblib's loky gives multiprocessing's locks once imported."""
    import os
    from multiprocessing import synchronize

    return f"/loky-{os.getpid()}-{next(synchronize.SemLock._rand)}"


@pytest.mark.parametrize("naming", ["multiprocessing", "loky"])
def test_shm_segments_finds_shared_memory_and_named_semaphores_mapped_by_a_process(monkeypatch, naming):
    """What vLLM's processes leave when SIGKILLed: a `multiprocessing.shared_memory` segment (its
    message queues) and the named semaphore of a lock made under the spawn start method (its workers),
    named `mp-...` by multiprocessing or `loky-...` in a process that has imported joblib (the GPU
    machine's pytest process does)."""
    import multiprocessing
    import os
    from multiprocessing import resource_tracker, shared_memory, synchronize

    from ckpt_common.procs import shm_segments, unlink_segments

    if naming == "loky":
        monkeypatch.setattr(synchronize.SemLock, "_make_name", staticmethod(_loky_make_name))
    before = shm_segments([os.getpid()])
    seg = shared_memory.SharedMemory(create=True, size=4096)
    lock = multiprocessing.get_context("spawn").Lock()
    try:
        found = shm_segments([os.getpid()]) - before
        assert f"/dev/shm/{seg.name.lstrip('/')}" in found
        sems = [path for path in found if path.startswith("/dev/shm/sem.")]
        assert sems == [f"/dev/shm/sem.{lock._semlock.name.lstrip('/')}"] and len(found) == 2, found
        if naming == "loky":
            assert sems[0].startswith(f"/dev/shm/sem.loky-{os.getpid()}-"), sems
        psm = found - set(sems)
        assert shm_segments([os.getpid()], prefixes=("psm_",)) - before == psm
        assert unlink_segments(psm) == sorted(psm) and not any(os.path.exists(p) for p in psm)
        resource_tracker.unregister(seg._name, "shared_memory")  # removed above, not by its owner
        assert unlink_segments(psm) == []  # gone already: nothing to remove, no error
    finally:
        seg.close()
        del lock  # its finalizer removes the semaphore


# a segment made and left to the test to remove (its maker ends without removing it)
_MAKE_SEGMENT = (
    "import os, signal, sys, time\n"
    "from multiprocessing import resource_tracker, shared_memory\n"
    "seg = shared_memory.SharedMemory(create=True, size=4096)\n"
    "resource_tracker.unregister(seg._name, 'shared_memory')\n"
    "open(sys.argv[1], 'w').write(seg.name)\n"
)
# makes the segment only after a while (as vLLM's engine core does during its start), then ends
LATE_LEAK = "import time; time.sleep(0.5)\n" + _MAKE_SEGMENT + "time.sleep(0.5)\nos._exit(0)\n"
# makes it at once; on SIGTERM ends at once (as a launcher whose tree goes down with it)
QUICK_LEAK = _MAKE_SEGMENT + "signal.signal(signal.SIGTERM, lambda *_: os._exit(0))\ntime.sleep(60)\n"


@contextlib.contextmanager
def _leaking_child(tmp_path, script: str):
    """`script` in a session of its own, given the file to write its segment's name to; killed if
    still running at the end, and its segment removed."""
    from pathlib import Path

    name_file = tmp_path / "seg"
    child = subprocess.Popen([sys.executable, "-c", script, str(name_file)], start_new_session=True)
    try:
        yield child, name_file
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(30)
        if name_file.exists() and name_file.read_text():
            Path("/dev/shm", name_file.read_text()).unlink(missing_ok=True)


def test_wait_noting_segments_notes_a_segment_made_after_the_wait_began(tmp_path):
    import os
    from pathlib import Path

    from ckpt_common.procs import group_pids, shm_segments, unlink_segments, wait_noting_segments

    with _leaking_child(tmp_path, LATE_LEAK) as (child, name_file):

        def running() -> list[int]:
            child.poll()
            return group_pids(child.pid)

        assert running() == [child.pid] and shm_segments(running()) == set()  # nothing yet
        ended, noted = wait_noting_segments(running, timeout_s=30)
        assert ended and child.returncode == 0 and running() == []
        seg = str(Path("/dev/shm") / name_file.read_text())
        assert noted == {seg} and os.path.exists(seg)  # left behind by its maker
        assert unlink_segments(noted) == [seg]
        # `done` ends the wait; a deadline that passes ends it too and says so
        t0 = time.monotonic()
        assert wait_noting_segments(lambda: [os.getpid()], timeout_s=5, done=lambda: True) == (True, set())
        assert wait_noting_segments(lambda: [os.getpid()], timeout_s=0.2)[0] is False
        assert time.monotonic() - t0 < 3


def test_signal_noting_segments_notes_before_the_signal_a_process_that_ends_at_once(tmp_path):
    import os
    from pathlib import Path

    from ckpt_common.procs import group_pids, signal_noting_segments, unlink_segments

    with _leaking_child(tmp_path, QUICK_LEAK) as (child, name_file):
        deadline = time.monotonic() + 30
        while not (name_file.exists() and name_file.read_text()):
            assert child.poll() is None and time.monotonic() < deadline, "the child did not make its segment"
            time.sleep(0.05)
        seg = str(Path("/dev/shm") / name_file.read_text())
        noted = signal_noting_segments(child, lambda: group_pids(child.pid))
        assert child.wait(timeout=30) == 0  # ended by the signal, its segment left behind
        assert noted == {seg} and os.path.exists(seg)
        assert signal_noting_segments(child, lambda: group_pids(child.pid)) == set()  # ended: no signal, no error
        assert unlink_segments(noted) == [seg]
