"""The engine side's weight-version state machine.

    initial ──begin──▶ receiving(v→v+1) ──complete──▶ ready(v+1)
                            │
                            └──abort──▶ incomplete(v→v+1 aborted) ──begin──▶ receiving ...

`incomplete` is reported until a later update completes: an engine never claims a version whose
weights it did not fully receive.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum


class WeightsStatus(str, Enum):
    INITIAL = "initial"  # weights the engine started with (e.g. dummy); no update received yet
    RECEIVING = "receiving"
    READY = "ready"
    INCOMPLETE = "incomplete"


class StateError(RuntimeError):
    """An illegal transition of the weight-version state machine."""


@dataclass
class EngineWeightState:
    version: int = 0
    status: WeightsStatus = WeightsStatus.INITIAL
    checkpoint: str | None = None
    pending_checkpoint: str | None = None
    last_error: str | None = None
    updated_at_s: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def begin(self, checkpoint: str) -> None:
        with self._lock:
            if self.status is WeightsStatus.RECEIVING:
                raise StateError(f"an update to version {self.version + 1} is already in progress")
            self.status = WeightsStatus.RECEIVING
            self.pending_checkpoint = checkpoint

    def name_pending(self, checkpoint: str) -> None:
        """The update in progress brings the weights of `checkpoint`, not of the checkpoint it was sent
        as: a delta names the version it brings (sent as another checkpoint, e.g. beside a daemon's
        registered full version); the engine then holds that name, the next delta's base."""
        with self._lock:
            if self.status is not WeightsStatus.RECEIVING:
                raise StateError(f"name_pending() in state {self.status.value}")
            self.pending_checkpoint = checkpoint

    def complete(self) -> int:
        with self._lock:
            if self.status is not WeightsStatus.RECEIVING:
                raise StateError(f"complete() in state {self.status.value}")
            self.version += 1
            self.status = WeightsStatus.READY
            self.checkpoint, self.pending_checkpoint = self.pending_checkpoint, None
            self.last_error = None
            self.updated_at_s = time.time()
            return self.version

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.status is not WeightsStatus.RECEIVING:
                raise StateError(f"abort() in state {self.status.value}")
            self.status = WeightsStatus.INCOMPLETE
            self.last_error = f"update {self.version}->{self.version + 1} aborted: {reason}"

    def invalidate(self, reason: str) -> None:
        """Weights that completed turn out not to be what the engine computes with (a check after the
        update): incomplete until the next update completes."""
        with self._lock:
            self.status = WeightsStatus.INCOMPLETE
            self.last_error = f"version {self.version} failed its check: {reason}"

    def report(self) -> dict:
        """JSON-ready view: what a health endpoint or `collective_rpc` returns."""
        with self._lock:
            return {
                "version": self.version,
                "status": self.status.value,
                "checkpoint": self.checkpoint,
                "pending_checkpoint": self.pending_checkpoint,
                "weights_complete": self.status in (WeightsStatus.READY, WeightsStatus.INITIAL),
                "last_error": self.last_error,
                "updated_at_s": self.updated_at_s,
            }
