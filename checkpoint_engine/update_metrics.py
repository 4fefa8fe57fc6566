"""Per-update metrics: bytes, time per stage, throughput; one JSON line per update."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from checkpoint_engine.types import Mode

logger = logging.getLogger(__name__)


@dataclass
class UpdateMetrics:
    checkpoint: str
    rank: int
    world_size: int
    mode: Mode  # how the bytes moved: "collective", "local", "p2p" or "p2p_engine"
    num_buckets: int = 0
    num_tensors: int = 0
    bucket_size_bytes: int = 0
    total_bytes: int = 0
    open_s: float = 0.0  # the mode's buffers (source.open) and the engine link
    setup_s: float = 0.0  # engine connect: Hello -> Ready, then agree
    copy_in_s: float = 0.0
    broadcast_s: float = 0.0
    engine_wait_s: float = 0.0  # waiting for the engine's acks (load not hidden by the pipeline)
    agree_s: float = 0.0  # cross-rank status exchanges
    finish_s: float = 0.0  # post_hook + req_func join
    close_s: float = 0.0  # link closed, the shared buffers released
    total_s: float = 0.0
    ok: bool = False
    error: str | None = None
    started_at_s: float = field(default_factory=time.time)

    @property
    def gib_per_s(self) -> float:
        return self.total_bytes / 2**30 / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gib_per_s"] = round(self.gib_per_s, 4)
        for k, v in d.items():
            if isinstance(v, float) and k != "started_at_s":
                d[k] = round(v, 6)
        return d

    def summary(self) -> str:
        return (
            f"update {self.checkpoint!r} ({self.mode}): {self.total_bytes / 2**30:.3f} GiB in "
            f"{self.num_buckets} buckets, "
            f"{self.total_s:.3f} s ({self.gib_per_s:.2f} GiB/s; copy-in {self.copy_in_s:.3f} s, "
            f"broadcast {self.broadcast_s:.3f} s, engine wait {self.engine_wait_s:.3f} s)"
        )


def append_jsonl(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
