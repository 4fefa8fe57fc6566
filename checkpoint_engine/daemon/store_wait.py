"""Deadline waits on a torch.distributed Store that stay quiet while they wait.

`Store.wait(keys, timeout)` has c10d's socket layer print two warnings ("waitForInput ... timed
out") every time its timeout passes, so a wait in slices (the daemon's idle relay: one slice every
5 s) filled the logs. `wait_for_keys` instead polls `Store.check` (one round trip that never times
out) with a growing pause, 1 ms doubling up to `max_pause_s`, until every key is set, its deadline
passes or `stop` is set: every wait still has a deadline, and a key is seen within `max_pause_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

FIRST_PAUSE_S = 0.001
MAX_PAUSE_S = 0.02


def wait_for_keys(
    store: Any,
    keys: Sequence[str],
    timeout_s: float,
    *,
    stop: threading.Event | None = None,
    max_pause_s: float = MAX_PAUSE_S,
) -> bool:
    """True once every key of `keys` is set in `store`; False when `timeout_s` passes or `stop` is set first."""
    keys = list(keys)
    deadline = time.monotonic() + timeout_s
    pause = FIRST_PAUSE_S
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0 or (stop is not None and stop.is_set()):
            return False
        if stop is not None:
            stop.wait(min(pause, left))
        else:
            time.sleep(min(pause, left))
        pause = min(2 * pause, max_pause_s)
    return True
