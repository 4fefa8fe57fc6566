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

    def __post_init__(self) -> None:
        for name in ("timeout_s", "reload_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not isinstance(self.weight_cache, bool):
            raise ValueError(f"weight_cache must be true or false, got {self.weight_cache!r}")
        if not isinstance(self.keep_mappings, bool):
            raise ValueError(f"keep_mappings must be true or false, got {self.keep_mappings!r}")
        check_literals(self)

    @classmethod
    def from_dict(cls, d: Mapping | None) -> ReceiverConfig:
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown checkpoint_engine setting(s) {unknown}; known: {[f.name for f in fields(cls)]}")
        return cls(**d)
