"""Child processes end with their parent.

Two mechanisms, both needed:
- ``exit_on_signals()`` (entry points only): SIGTERM (and SIGINT) raise ``SystemExit`` in the main
  thread, so ``finally`` blocks that stop servers run, as they do for Ctrl-C.
- ``die_with_parent`` (``preexec_fn`` of ``subprocess.Popen``): the kernel sends the child SIGTERM
  when the thread that started it dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``). Start such
  children from the main thread (or one that lives as long as they should).

    parent ──SIGTERM/SIGINT──▶ SystemExit ──▶ finally: child.terminate()
    parent ──SIGKILL──▶ kernel ──SIGTERM──▶ child (its own handler stops its children)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

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
