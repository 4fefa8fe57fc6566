"""How the RL job stops on Ctrl-C or SIGTERM: every time one line, exit 130 (143), resumable.

Once a stop signal is recorded, whatever error follows is the stop (an engine in the terminal's process
group that died of the same Ctrl-C fails the weight update in flight: UpdateFailed from EngineDeadError);
the console is quiet from the signal on; the job's spawned children (vLLM's engine core and workers)
run with SIGINT blocked, so the job stops them itself. The subprocess tests run a small job on the
same machinery (orchestrator.__main__, orchestrator.phases), no vLLM, with a spawned stand-in for
vLLM's engine core that, like it, takes SIGINT for its own end.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from checkpoint_engine.errors import UpdateFailed
from ckpt_common import procs
from orchestrator import phases

REPO = pathlib.Path(__file__).resolve().parents[3]


def _raised(exc: BaseException, cause: BaseException | None = None, context: BaseException | None = None):
    """`exc` as it is when raised `from cause`, or while handling `context`."""
    exc.__cause__, exc.__context__ = cause, context
    return exc


@pytest.fixture
def recorded(monkeypatch):
    """Record a stop signal as record_stop_signals' handler does (undone after the test)."""

    def record(signum: int | None) -> None:
        monkeypatch.setattr(procs, "_stop_signum", signum)

    record(None)
    return record


@pytest.mark.parametrize(
    "exc,code",
    [
        (KeyboardInterrupt(), 130),
        (SystemExit(143), 143),  # SIGTERM through exit_on_signals / record_stop_signals
        (SystemExit(130), 130),
        (_raised(ImportError("initialization failed"), cause=KeyboardInterrupt()), 130),  # Ctrl-C in an import
        (_raised(RuntimeError("x"), context=_raised(OSError(), context=SystemExit(143))), 143),
        # raised `from` another error while handling the interrupt: the context still counts
        (_raised(RuntimeError("x"), cause=ValueError("y"), context=KeyboardInterrupt()), 130),
        (SystemExit(2), None),  # not a stop signal
        (SystemExit(None), None),
        (RuntimeError("a bug"), None),
        (_raised(ValueError("y"), context=RuntimeError("z")), None),
    ],
)
def test_without_a_recorded_signal_only_a_stop_in_the_chain_is_a_stop(recorded, exc, code):
    assert procs.stop_exit_code(exc) == code


ENGINE_DEAD = RuntimeError("EngineDeadError: EngineCore encountered an issue")


@pytest.mark.parametrize(
    "exc",
    [
        # the report: the engine core died of the same Ctrl-C, the update failed, the interrupt nowhere
        UpdateFailed({0: "req_func raised EngineDeadError: EngineCore encountered an issue"}),
        _raised(UpdateFailed({0: "req_func raised EngineDeadError"}), cause=ENGINE_DEAD),
        _raised(RuntimeError("rank 0: weight update aborted: EngineFailure"), cause=ConnectionError()),
        _raised(RuntimeError("the in-process vLLM engine died"), cause=None, context=ENGINE_DEAD),
        TimeoutError("vLLM generation of 64 requests did not finish within 900 s"),
        _raised(OSError("Broken pipe"), context=KeyboardInterrupt()),
        SystemExit(1),
        SystemExit(2),
        KeyboardInterrupt(),
        None,  # nothing raised at all
    ],
)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_after_a_recorded_signal_every_error_chain_is_the_stop(recorded, exc, signum):
    recorded(signum)
    assert procs.stop_exit_code(exc) == 128 + signum


def test_after_a_stop_the_process_logs_nothing_and_warns_nothing(recorded, monkeypatch):
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    lg = logging.getLogger("test_orch_stop.quiet")
    lg.propagate = False
    lg.handlers[:] = [Collect()]
    monkeypatch.setattr(procs, "_quiet_on_stop", False)
    procs.quiet_after_stop()
    lg.warning("before")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            procs._record_stop(signal.SIGINT)  # what the signal handler does
            lg.error("AsyncLLM output_handler failed.")  # a handler set up after the stop would not show it either
            warnings.warn("resource_tracker: process died unexpectedly, relaunching", UserWarning, stacklevel=1)
    finally:
        logging.disable(logging.NOTSET)
    assert seen == ["before"]
    assert caught == []
    assert procs.stop_signal() == signal.SIGINT


def test_the_stop_line_names_the_signal_the_phase_and_the_state(monkeypatch):
    from orchestrator.__main__ import stop_line

    monkeypatch.setattr(phases, "_current", ("start-up", None))
    phases.enter("weight sync", 9)
    line = stop_line("runs/demo", 130)
    assert line.startswith("interrupted (SIGINT) during weight sync of iteration 9: ")
    assert os.path.join("runs/demo", "state") in line and "run the same command to resume" in line
    assert "\n" not in line
    phases.enter("SFT warm-up")
    assert "(SIGTERM) during SFT warm-up:" in stop_line("out", 143)


def test_a_held_phase_waits_for_the_stop_and_the_phase_file_lists_every_phase(tmp_path, monkeypatch, recorded):
    phase_file = tmp_path / "phases"
    monkeypatch.setattr(phases, "_phase_file", None)  # restored after the test
    monkeypatch.setattr(phases, "_holds", frozenset())
    phases.configure_test_hooks({phases.PHASE_FILE_ENV: str(phase_file), phases.HOLD_ENV: "weight update@3, rollout@4"})
    monkeypatch.setattr(phases, "_current", ("start-up", None))
    phases.enter("rollout", 3)  # not held: returns at once
    phases.enter("weight sync", 3)
    held = threading.Thread(target=phases.reached, args=("weight update",))
    held.start()
    held.join(0.3)
    assert held.is_alive(), "the held point should wait for a stop"
    assert phases.current() == ("weight sync", 3)
    recorded(signal.SIGINT)
    held.join(5)
    assert not held.is_alive()
    assert phase_file.read_text().splitlines() == ["rollout 3", "weight sync 3", "weight update 3"]
    assert phases.describe() == "weight sync of iteration 3"


# A small job on the RL job's stop machinery: a spawned child that, like vLLM's engine core, takes SIGINT
# for its own end (and says so on stderr), and a phase held until the stop, in which the stop surfaces
# as it does in the job.
CHILD = """
import os, signal, sys, time

def engine_core(ready_path):
    def on_sigint(signum, frame):  # vLLM's engine core: SIGINT ends it, loudly
        raise SystemExit("engine core: SIGINT, shutting down")
    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # stopped by its parent (or a group's SIGTERM): quietly
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with open(ready_path, "w") as f:
        f.write("blocked" if blocked else "open")
    while True:
        time.sleep(0.05)
"""

JOB = """
import logging, multiprocessing, os, sys, threading, time

import stopchild
from ckpt_common.logs import setup_logging
from orchestrator import phases
from orchestrator.__main__ import install_stop_handling, run_stoppable, spawn_children_through_here

variant, out = sys.argv[1], sys.argv[2]
log = logging.getLogger("stopjob")


def body():
    ready = os.path.join(out, "child-ready")
    child = multiprocessing.get_context("spawn").Process(target=stopchild.engine_core, args=(ready,), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.02)
        log.info("engine up")
        if variant == "weight sync":
            # the update's req_func thread is held; once the stop is recorded it fails (the engine died),
            # the main thread's wait for it swallows the interrupt, and the update fails as its own error
            phases.enter("weight sync", 2)
            failed = []
            def req_func():
                phases.reached("weight update")
                failed.append(ConnectionError("EngineDeadError: EngineCore encountered an issue"))
            t = threading.Thread(target=req_func)
            t.start()
            try:
                while t.is_alive():
                    t.join(0.05)
            except BaseException:
                pass  # a library that swallows the interrupt, the worst case
            t.join()
            raise RuntimeError("UpdateFailed: rank 0: req_func raised EngineDeadError") from failed[0]
        phases.enter(variant, 2)  # held: the stop's KeyboardInterrupt (SystemExit for SIGTERM) ends the wait
        raise AssertionError("the hold ended without a stop")
    finally:
        log.warning("closing the engine")  # the console is quiet after the stop: not shown
        child.terminate()
        child.join(10)
        with open(os.path.join(out, "child-exit"), "w") as f:
            f.write(str(child.exitcode))
        if variant == "checkpoint write":
            raise OSError("closing the trainer: Broken pipe")  # a clean-up error after the stop


if __name__ == "__main__":
    phases.configure_test_hooks(os.environ)
    setup_logging("INFO")
    install_stop_handling(20.0)
    spawn_children_through_here()
    run_stoppable(body, os.path.join(out, "run"))
    print("finished")
"""


def _held(variant: str) -> str:
    """The point the job waits at (a weight sync: inside, the engine being asked to take the update)."""
    return "weight update 2" if variant == "weight sync" else f"{variant} 2"


def _start(tmp_path: pathlib.Path, variant: str, stderr) -> subprocess.Popen:
    (tmp_path / "stopchild.py").write_text(textwrap.dedent(CHILD))
    (tmp_path / "stopjob.py").write_text(textwrap.dedent(JOB))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
        **{phases.PHASE_FILE_ENV: str(tmp_path / "phases"), phases.HOLD_ENV: "@".join(_held(variant).rsplit(" ", 1))},
    )
    return subprocess.Popen(
        [sys.executable, "-m", "stopjob", variant, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,  # its own process group, which the signal goes to, as a terminal's does
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a shell starts it
    )


@pytest.mark.parametrize(
    "variant,sig",
    [
        ("rollout", signal.SIGINT),  # the interrupt straight through the main thread's wait
        ("weight sync", signal.SIGINT),  # the interrupt swallowed, an error chain of the engine's death instead
        ("checkpoint write", signal.SIGTERM),  # SIGTERM, and a clean-up that fails after it
    ],
)
def test_a_signal_to_the_process_group_in_any_phase_ends_the_job_with_one_line(tmp_path, variant, sig):
    stderr_path = tmp_path / "stderr"
    with open(stderr_path, "w") as stderr:
        proc = _start(tmp_path, variant, stderr)
    try:
        held = _held(variant)
        deadline = time.monotonic() + 60
        while not (tmp_path / "phases").exists() or held not in (tmp_path / "phases").read_text():
            assert proc.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "the job did not reach its held phase"
            time.sleep(0.02)
        start = time.monotonic()
        os.killpg(proc.pid, sig)
        stdout, _ = proc.communicate(timeout=30)
        stop_s = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = stderr_path.read_text()
    assert proc.returncode == 128 + sig, err
    assert stop_s < 10, f"the stop took {stop_s:.1f} s"
    assert "Traceback" not in err + stdout, err
    assert stdout == ""
    lines_after = err[err.index("engine up") :].splitlines()[1:]  # what the stop printed
    expected = f"interrupted ({signal.Signals(sig).name}) during {variant} of iteration 2: "
    assert len(lines_after) == 1 and lines_after[0].startswith(expected), err
    assert "run the same command to resume" in lines_after[0]
    # the spawned "engine core" ran with SIGINT blocked, so the job, not the Ctrl-C, ended it (a SIGTERM
    # to the group reaches it too)
    assert (tmp_path / "child-ready").read_text() == "blocked"
    assert (tmp_path / "child-exit").read_text() == "0"
