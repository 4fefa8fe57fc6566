"""The reaper ends a job's child processes when the job is SIGKILLed (vLLM's would spin on)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil

from tests.leaky_shm import LEAKY_ENGINE

REPO = pathlib.Path(__file__).resolve().parents[3]
# the job: starts its reaper, then the child given as argv[2:] (default: one that ignores SIGTERM)
PARENT = """
import subprocess, sys, time
from orchestrator.reaper import start_reaper
reaper = start_reaper(poll_s=0.2, grace_s=2.0, record_path=sys.argv[1])
IGNORE_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", *(sys.argv[2:] or [IGNORE_SIGTERM])])
print(child.pid, reaper.pid, flush=True)
sys.stdin.read()  # until the test kills us
"""


def _wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling a condition under a deadline


def test_children_of_a_sigkilled_job_are_ended(tmp_path):
    record = tmp_path / "recorded"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(record)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child_pid, reaper_pid = (int(x) for x in parent.stdout.readline().split())
    _wait_for(lambda: record.exists() and str(child_pid) in record.read_text().split(), 30, "the reaper's record")
    os.kill(parent.pid, signal.SIGKILL)
    assert parent.wait(timeout=30) == -signal.SIGKILL
    child = psutil.Process(child_pid)
    # the child ignores SIGTERM: the reaper must escalate to SIGKILL after its grace period
    _wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 30, "the child to end")
    reaper = psutil.Process(reaper_pid)
    _wait_for(lambda: not reaper.is_running() or reaper.status() == psutil.STATUS_ZOMBIE, 30, "the reaper to exit")


def test_clean_exit_leaves_nothing_behind(tmp_path):
    code = (
        "import sys; from orchestrator.reaper import start_reaper, stop_reaper; "
        "r = start_reaper(poll_s=0.2); stop_reaper(r); sys.exit(r.returncode)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
    assert out.returncode == 0


def test_shared_memory_of_a_sigkilled_job_is_removed(tmp_path):
    """The job's child maps a named segment and dies with the job without removing it (as vLLM's
    processes do when SIGKILLed): the reaper noted it and removes it once it ended the child."""
    record, name_file = tmp_path / "recorded", tmp_path / "seg"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(record), LEAKY_ENGINE, str(name_file)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child_pid, reaper_pid = (int(x) for x in parent.stdout.readline().split())
        _wait_for(lambda: name_file.exists() and name_file.read_text(), 30, "the child's segment")
        seg = pathlib.Path("/dev/shm") / name_file.read_text()
        _wait_for(lambda: record.exists() and str(seg) in record.read_text().split(), 30, "the reaper's record")
        os.kill(parent.pid, signal.SIGKILL)
        assert parent.wait(timeout=30) == -signal.SIGKILL
        reaper = psutil.Process(reaper_pid)
        _wait_for(lambda: not reaper.is_running() or reaper.status() == psutil.STATUS_ZOMBIE, 30, "the reaper to exit")
        assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
        assert not seg.exists()
    finally:
        if parent.poll() is None:
            parent.kill()
        if name_file.exists() and name_file.read_text():
            pathlib.Path("/dev/shm", name_file.read_text()).unlink(missing_ok=True)
