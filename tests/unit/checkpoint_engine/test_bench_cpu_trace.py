"""benchmarks/cpu_trace.py: the cores each process under a root used during a window, labelled by
its daemon rank (its own or an ancestor's LOCAL_RANK) and role."""

import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import pytest

pytest.importorskip("psutil")

_PATH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "cpu_trace.py"


def _module():
    spec = importlib.util.spec_from_file_location("cpu_trace", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUSY_CHILD = """
import subprocess, sys, time
# a child without LOCAL_RANK (as an engine started by a daemon rank): labelled with its parent's rank;
# it creates the marker file (argv[1]) when its busy loop starts, and spins for 4 s
busy = "import sys, time\\nopen(sys.argv[1], 'w').close()\\nt = time.time()\\nwhile time.time() - t < 4.0: pass"
child = subprocess.Popen([sys.executable, "-c", busy, sys.argv[1]], env={"PATH": ""})
sys.exit(child.wait())
"""


def test_a_busy_grandchild_is_counted_under_its_ancestors_rank_and_an_idle_window_is_not(tmp_path):
    cpu_trace = _module()
    marker = tmp_path / "busy"
    parent = subprocess.Popen(
        [sys.executable, "-c", BUSY_CHILD, str(marker)], env=dict(os.environ, LOCAL_RANK="3"), stdout=subprocess.DEVNULL
    )
    trace = cpu_trace.CpuTrace(os.getpid(), names={os.getpid(): "test"}, interval_s=0.05, refresh_every=2).start()
    try:
        deadline = time.monotonic() + 60  # process starts are slow on a loaded machine
        while not marker.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the busy grandchild did not start"
            time.sleep(0.05)  # polling the marker, bounded by the deadline
        time.sleep(0.4)  # a refresh (every 0.1 s) has found the grandchild
        t0 = time.time()
        time.sleep(1.0)
        t1 = time.time()
        assert parent.wait(10) == 0
        time.sleep(0.3)
        t2 = time.time()
        time.sleep(0.5)
        t3 = time.time()
    finally:
        trace.stop()
        parent.kill()
    busy = trace.window(t0, t1)
    assert 0.9 <= busy["span_s"] <= 1.2
    # both the idle parent and the busy child are "r3:-c"; the child spins on one core (more than a
    # quarter of it even beside a busy neighbour), the parent waits
    assert busy["cores"]["r3:-c"] > 0.25
    assert busy["machine_busy_cores"] >= busy["cores"]["r3:-c"] - 0.1
    idle = trace.window(t2, t3)
    assert idle["cores"].get("r3:-c", 0.0) == 0.0  # exited: no sample of them spans the window
    merged = cpu_trace.CpuTrace.merge([busy, idle])
    assert merged["windows"] == 2 and merged["span_s"] == pytest.approx(busy["span_s"] + idle["span_s"], abs=0.01)
    share = busy["span_s"] / merged["span_s"]
    assert merged["cores"]["r3:-c"] == pytest.approx(busy["cores"]["r3:-c"] * share, abs=0.02)
    assert "test" not in merged["cores"] or merged["cores"]["test"] < 0.5
    assert cpu_trace.CpuTrace.merge([]) == {}


def test_a_process_that_exited_keeps_the_label_it_had_alive():
    # an exited child not yet reaped (a zombie) has no command line nor environment: relabelled, its
    # CPU time would move to "pid N" in a window that ends after it exited
    import psutil

    cpu_trace = _module()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=dict(os.environ, LOCAL_RANK="5"),
    )
    try:
        trace = cpu_trace.CpuTrace(os.getpid(), names={os.getpid(): "test"})
        deadline = time.monotonic() + 60
        while trace._labels.get(child.pid) != "r5:-c":  # exec'ed: its own command line, not ours
            assert time.monotonic() < deadline, trace._labels
            trace._refresh()
            time.sleep(0.05)
        child.stdin.close()
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        assert cpu_trace.label_of(psutil.Process(child.pid), {}) is None
        trace._refresh()
        assert child.pid in trace._procs and trace._labels[child.pid] == "r5:-c"
    finally:
        child.kill()
        assert child.wait(10) == 0
