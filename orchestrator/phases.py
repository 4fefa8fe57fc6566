"""What the RL job is doing now: for the line it prints when a signal stops it, and for tests.

::

    loop: enter("rollout", i) ... enter("training", i) ... enter("weight sync", i) ... enter("evaluation", i)
          ... enter("checkpoint write", i)                       (main thread: the phase for the stop line)
    Rollout's result callback: reached("rollout result")        (a request finished, others in flight)
    WeightSync's req_func thread: reached("weight update")       (the engines are receiving the weights)

Test hooks (read from the environment by the entry point, ``configure_test_hooks(os.environ)``; unset in
normal runs, which then do nothing here but note the phase):
``ORCHESTRATOR_TEST_PHASE_FILE``: every phase entered or point reached is appended to this file as a
line ``<name> <iteration>`` (iteration 1-based; ``-`` outside iterations). ``ORCHESTRATOR_TEST_HOLD``:
``<name>@<iteration>[,...]``: that thread waits there (the line already written) until a stop signal is
recorded, or 120 s, so a test can stop the job in that phase, however short it is otherwise (a weight
sync of the demo model takes tens of milliseconds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

PHASE_FILE_ENV = "ORCHESTRATOR_TEST_PHASE_FILE"
HOLD_ENV = "ORCHESTRATOR_TEST_HOLD"
HOLD_MAX_S = 120.0

_lock = threading.Lock()
_current: tuple[str, int | None] = ("start-up", None)
_phase_file: str | None = None
_holds: frozenset[str] = frozenset()


def configure_test_hooks(environ: Mapping[str, str]) -> None:
    """The test hooks from `environ` (the entry point's environment): none when its variables are unset."""
    global _phase_file, _holds
    _phase_file = environ.get(PHASE_FILE_ENV) or None
    _holds = frozenset(h.strip() for h in environ.get(HOLD_ENV, "").split(",") if h.strip())


def enter(name: str, iteration: int | None = None) -> None:
    """The main thread starts phase ``name`` (of 1-based ``iteration``, None outside iterations)."""
    global _current
    _current = (name, iteration)
    _mark(name, iteration)


def reached(name: str) -> None:
    """A point inside the current phase (any thread): the test hooks see it, the stop line does not."""
    _mark(name, _current[1])


def current() -> tuple[str, int | None]:
    return _current


def describe() -> str:
    """The current phase in words: ``"weight sync of iteration 9"``, ``"start-up"``."""
    name, iteration = _current
    return name if iteration is None else f"{name} of iteration {iteration}"


def _mark(name: str, iteration: int | None) -> None:
    if _phase_file:
        with _lock, open(_phase_file, "a") as f:
            f.write(f"{name} {'-' if iteration is None else iteration}\n")
    if f"{name}@{iteration}" in _holds:
        _hold()


def _hold() -> None:
    from ckpt_common.procs import stop_signal

    deadline = time.monotonic() + HOLD_MAX_S
    while stop_signal() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the main thread: the stop signal's KeyboardInterrupt ends this sleep at once
