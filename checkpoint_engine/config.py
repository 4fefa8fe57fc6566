"""Frozen, validated configuration of the parameter server and of one update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from checkpoint_engine.transport.mooncake import P2PConfig
from checkpoint_engine.types import REQUESTED_MODES, RequestedMode
from ckpt_common.validate import check_literals

MiB = 2**20

Transport = Literal["auto", "cpu", "cuda"]  # `ParameterServerConfig.transport`, daemon `--transport`
P2PReader = Literal["rank", "engine"]  # `UpdateConfig.p2p_reader`, daemon `--p2p-reader`


@dataclass(frozen=True)
class UpdateConfig:
    bucket_size_bytes: int | None = None  # None: default, raised to the largest tensor, capped by the budget
    default_bucket_size_bytes: int = 128 * MiB
    memory_budget_bytes: int | None = None  # for the two shared buffers; None: what /dev/shm or the GPU has free
    engine_connect_timeout_s: float = 120.0
    engine_timeout_s: float = 300.0  # per bucket ack
    req_func_timeout_s: float = 600.0
    # (checksums: ParameterServerConfig.verify_checksums is the one switch; they are computed at gather_metas)
    progress: bool = False
    metrics_path: str | None = None
    # "collective": broadcast every bucket across ranks (gloo/NCCL); "local": all ranks share one host
    # and engines read each owner's registered chunks directly (CPU); "auto": local when possible.
    mode: RequestedMode = "auto"
    # Who reads a P2P pull: "rank" (the PS rank reads into the shared double buffer, the engine loads
    # from there) or "engine" (the engine's own transfer engine reads into its parameters; CPU).
    p2p_reader: P2PReader = "rank"
    agree_every_buckets: int = 8  # cross-rank status exchange period (failures abort within this many)
    keep_buffers: bool = True  # keep the double buffer between updates
    # mode "relay" with every rank taking part: each rank keeps its share of the version it relayed (every
    # members-th bucket, a copy in host memory: about M / world bytes per rank) and the ranks register it
    # under the same name, so that a heal pulls the version from the ranks, also once its owners (the
    # trainer's memory) are busy or gone; unregistering the name frees it
    keep_relayed: bool = True

    def __post_init__(self) -> None:
        if self.mode not in REQUESTED_MODES:
            *first, last = REQUESTED_MODES
            raise ValueError(f"mode must be {', '.join(map(repr, first))} or {last!r}, got {self.mode!r}")
        if self.p2p_reader not in ("rank", "engine"):
            raise ValueError(f"p2p_reader must be 'rank' or 'engine', got {self.p2p_reader!r}")
        if not isinstance(self.keep_relayed, bool):
            raise ValueError(f"keep_relayed must be true or false, got {self.keep_relayed!r}")
        if not isinstance(self.agree_every_buckets, int) or self.agree_every_buckets < 1:
            raise ValueError(f"agree_every_buckets must be an int >= 1, got {self.agree_every_buckets!r}")
        for name in ("bucket_size_bytes", "memory_budget_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.default_bucket_size_bytes <= 0:
            raise ValueError(f"default_bucket_size_bytes must be positive, got {self.default_bucket_size_bytes}")
        for name in ("engine_connect_timeout_s", "engine_timeout_s", "req_func_timeout_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")


@dataclass(frozen=True)
class ParameterServerConfig:
    transport: Transport = "auto"
    p2p: P2PConfig | None = None  # start a Mooncake transfer engine: needed to serve or take P2P updates
    metadata_url: str | None = None  # None/"memory://": in-process; "etcd://host:port/prefix": etcd
    align_bytes: int = 256
    max_chunk_bytes: int | None = 1024 * MiB
    collective_timeout_s: float = 300.0
    verify_checksums: bool = False  # compute per-tensor checksums at gather_metas, verify on the engine
    # Keep an unregistered checkpoint's host chunks for the next registration of the same sizes
    # (RL: a new checkpoint every iteration); unregister then frees memory only at the next register.
    reuse_host_memory: bool = False
    update: UpdateConfig = UpdateConfig()

    def __post_init__(self) -> None:
        check_literals(self)
        if self.align_bytes < 16 or self.align_bytes & (self.align_bytes - 1):
            raise ValueError(f"align_bytes must be a power of two >= 16, got {self.align_bytes}")
        if self.max_chunk_bytes is not None and self.max_chunk_bytes <= 0:
            raise ValueError(f"max_chunk_bytes must be positive or None, got {self.max_chunk_bytes}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
