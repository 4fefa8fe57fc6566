"""Test-only faults in a weight update: what to break (`FaultSpec`), the one fault armed for the
next update (`FaultSlot`), and a bucket fault firing in its bucket (`BucketFault`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultSpec:
    """Test-only fault for the next update: `raise` in bucket `bucket`, or `stall` there for `stall_s`.

    `at` "start" or "finish": vLLM's weight-transfer backend (`vllm_ext.weight_transfer.engine`) raises
    in its `start_weight_update` or `finish_weight_update` instead (kind "raise" only); the bucket
    receive does not take such a fault. `marker_path`, if given, is created when the fault fires
    (lets a test act at that moment).
    """

    kind: Literal["raise", "stall"]
    bucket: int = 0
    stall_s: float = 5.0
    marker_path: str | None = None
    at: Literal["bucket", "start", "finish"] = "bucket"

    def __post_init__(self) -> None:
        if self.kind not in ("raise", "stall"):
            raise ValueError(f"kind must be 'raise' or 'stall', got {self.kind!r}")
        if self.at not in ("bucket", "start", "finish"):
            raise ValueError(f"at must be 'bucket', 'start' or 'finish', got {self.at!r}")
        if self.at != "bucket" and self.kind != "raise":
            raise ValueError(f"a fault at {self.at!r} can only raise, got kind {self.kind!r}")
        if isinstance(self.bucket, bool) or not isinstance(self.bucket, int) or self.bucket < 0:
            raise ValueError(f"bucket must be an int >= 0, got {self.bucket!r}")
        if not 0 < self.stall_s <= 600:
            raise ValueError(f"stall_s must be in (0, 600], got {self.stall_s!r}")

    def fire(self) -> None:
        """Write the marker (this process's pid), if any: the fault fires now."""
        if self.marker_path:
            with open(self.marker_path, "w") as fh:
                fh.write(f"{os.getpid()}\n")

    @classmethod
    def from_dict(cls, d: Mapping) -> FaultSpec:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown fault field(s) {unknown}")
        return cls(**d)


class FaultSlot:
    """The fault armed for the next update, at most one; the point it is `at` takes it once."""

    def __init__(self) -> None:
        self.armed: FaultSpec | None = None

    def arm(self, spec: FaultSpec | Mapping) -> FaultSpec:
        """Arm `spec` (a mapping is checked by `FaultSpec.from_dict`; a bad one leaves the slot as it was)."""
        self.armed = spec if isinstance(spec, FaultSpec) else FaultSpec.from_dict(spec)
        return self.armed

    def take(self, at: str) -> FaultSpec | None:
        """The armed fault if it is one `at` this point ("bucket", "start", "finish"), disarmed; else None."""
        fault = self.armed
        if fault is None or fault.at != at:
            return None
        self.armed = None
        return fault


class BucketFault:
    """The bucket fault one update took (or none): it fires once, when its bucket arrives."""

    def __init__(self, spec: FaultSpec | None) -> None:
        self.spec = spec

    def check(self, index: int) -> None:
        """Bucket `index` arrived: if it is the fault's, fire it (raise, or stall for `stall_s`)."""
        f = self.spec
        if f is None or f.bucket != index:
            return
        self.spec = None
        f.fire()
        if f.kind == "raise":
            raise RuntimeError(f"injected fault in bucket {index}")
        logger.warning("injected stall of %.1f s in bucket %d", f.stall_s, index)
        time.sleep(f.stall_s)
