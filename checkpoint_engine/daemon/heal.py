"""Self-healing on rank 0: once a rank's `Watchdog` (engine_process.py) marked its engine failed, the
`Healer` thread relays a restart of every failed engine and its update to the current checkpoint
through the daemon's `Driver` (see engines.py for the whole path). An engine that died while sleeping
is put back to sleep at its level once healed, so a colocated trainer keeps its device memory.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from checkpoint_engine.daemon.driver import Driver

logger = logging.getLogger(__name__)


class Healer:
    """Rank 0: restarts failed engines and brings them to the current checkpoint (see engines.py)."""

    def __init__(self, driver: Driver, interval_s: float, max_attempts: int):
        self.driver, self.interval_s, self.max_attempts = driver, interval_s, max_attempts
        self._stop = threading.Event()
        self._attempts: dict[int, int] = {}  # per rank: heals since it last served
        self._thread = threading.Thread(target=self._loop, name="engine-healer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.heal_once()
            except Exception:  # the healer must outlive one bad round (a store hiccup): logged, next round
                logger.exception("engine healer round failed")

    def heal_once(self) -> None:
        failed, asleep = [], {}
        for rec in self.driver.board.records():
            r, state = rec["rank"], rec["state"]
            if state in ("serving", "sleeping"):
                self._attempts.pop(r, None)
            elif state == "failed":
                n = self._attempts.get(r, 0)
                if n < self.max_attempts:
                    failed.append(r)
                    level = (rec.get("last_failure") or {}).get("sleep_level")
                    if level:
                        asleep[r] = level
                elif n == self.max_attempts:
                    self._attempts[r] = n + 1  # say it once
                    logger.error("rank %d: engine still failed after %d heals; giving up: %s", r, n, rec["last_error"])
        if not failed or self._stop.is_set():
            return
        for r in failed:
            self._attempts[r] = self._attempts.get(r, 0) + 1
        logger.warning("healing the engines of ranks %s (checkpoint %r)", failed, self.driver.current)
        result = self.driver.run({"op": "engine_start", "ranks": failed, "name": self.driver.current, "heal": True})
        if result["ok"]:
            logger.info("healed the engines of ranks %s", failed)
            # an engine that died asleep (colocated training) goes back to sleep, at its level
            for level in sorted(set(asleep.values())):
                ranks = sorted(r for r, lv in asleep.items() if lv == level)
                # right after the start: wait (bounded) for a request that took the driver meanwhile
                back = self.driver.run(
                    {"op": "engine_sleep", "ranks": ranks, "level": level}, wait_s=self.driver.relay.result_timeout_s
                )
                if not back["ok"]:
                    logger.error("ranks %s healed but not put back to sleep: %s", ranks, back.get("errors"))
        else:
            logger.error("heal of ranks %s failed: %s", failed, result.get("errors"))

    def stop(self) -> None:
        self._stop.set()

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
