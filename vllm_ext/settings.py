"""The engine-side settings of the vLLM receiver; importable without torch (the launcher builds
vLLM's command line from their defaults before anything heavy is imported)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

from ckpt_common.validate import check_literals

ReloadMode = Literal["streaming", "end"]
ReloadImpl = Literal["auto", "direct", "vllm"]


@dataclass(frozen=True)
class ReceiverConfig:
    """Engine-side settings (for vLLM: `--additional-config '{"checkpoint_engine": {...}}'`)."""

    timeout_s: float = 600.0  # deadline of every wait for the parameter server
    reload_mode: ReloadMode = "streaming"
    reload_timeout_s: float = 600.0  # deadline for the reload to finish once the last bucket arrived
    keep_mappings: bool = True  # keep the PS's shared segments mapped between updates (CPU)
    # Keep a copy of the checkpoint-format weights (host memory = model size): it lets an aborted
    # streaming update fill in the previous values and defines weights_checksum. Off: tensors
    # that stay valid until Done (the PS's registered chunks, one host) go to the reload without
    # a copy; only double-buffer tensors are copied; no checksum, no fill-in after an abort.
    weight_cache: bool = True
    # Which reload the vLLM worker runs: "direct" (vllm_ext.direct_reload: CPU backend, unquantized,
    # one TP rank), "vllm" (vLLM's reload_weights), "auto" (direct where it applies, else vLLM's).
    reload_impl: ReloadImpl = "auto"
    # A tensor-parallel worker's pull it reads itself reads only its slices; a slice needing more
    # byte ranges than this (a row-parallel tensor: one per row) is read as the one range covering
    # them: over TCP thousands of row-sized reads cost more than the bytes they save
    # (benchmarks/bench_sharded.py). 0: every slice row by row (RDMA).
    sharded_max_ranges_per_tensor: int = 64
    # After each reload, run every linear/embedding layer's kernel on a few fixed rows and compare
    # with its weights (vllm_ext.kernel_check): a layer computing with stale values fails the update
    # (the engine reports incomplete). A 4-row GEMM per layer; off only to save that.
    kernel_check: bool = True

    def __post_init__(self) -> None:
        for name in ("timeout_s", "reload_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not isinstance(self.weight_cache, bool):
            raise ValueError(f"weight_cache must be true or false, got {self.weight_cache!r}")
        if not isinstance(self.kernel_check, bool):
            raise ValueError(f"kernel_check must be true or false, got {self.kernel_check!r}")
        if not isinstance(self.keep_mappings, bool):
            raise ValueError(f"keep_mappings must be true or false, got {self.keep_mappings!r}")
        v = self.sharded_max_ranges_per_tensor
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"sharded_max_ranges_per_tensor must be an int >= 0 (0: no limit), got {v!r}")
        check_literals(self)

    @classmethod
    def from_dict(cls, d: Mapping | None) -> ReceiverConfig:
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown checkpoint_engine setting(s) {unknown}; known: {[f.name for f in fields(cls)]}")
        return cls(**d)
