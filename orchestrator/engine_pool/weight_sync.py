"""Trainer -> engines through the checkpoint engine, once per iteration.

::

    trainer.named_tensors() ──register_checkpoint("policy-v{n}")──▶ ParameterServer (rank 0 of 1,
                                                                    CPU transport, host memory)
                            ──gather_metas──▶ plan ──update(req_func)──▶ engine workers
                                                     (buckets through shared memory, reloaded
                                                      in place by vllm_ext's worker extension)
    then unregister "policy-v{n-1}": the parameter server keeps only the newest version

With ``sync.delta`` the version registered is, where it pays, a delta against the version the engine
holds (``checkpoint_engine.sharding.delta_sync``: the values that changed, applied by the engine onto
its copy of that version); the first version, and any the engine refuses as a delta, go whole.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import torch

from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.sharding.delta_sync import DeltaSender
from checkpoint_engine.types import ReqFunc
from orchestrator import phases
from orchestrator.config import SyncConfig

logger = logging.getLogger(__name__)


def delta_sender(config: SyncConfig) -> DeltaSender | None:
    """The delta sender `sync.delta*` asks for (one per sync: it keeps the base), or None."""
    if not config.delta:
        return None
    return DeltaSender(config.delta_max_ratio, anchor_every=config.delta_anchor_every, compress=config.delta_compress)


@dataclasses.dataclass(frozen=True)
class SyncResult:
    version: int
    total_s: float  # register + gather + update + unregister
    update_s: float  # the checkpoint engine's own update time
    total_bytes: int
    num_buckets: int
    kind: str = "full"  # "delta": only the changed values were sent (sync.delta)
    reason: str = ""  # why full or delta (sync.delta)


class WeightSync:
    """Owns the in-process ParameterServer; ``push`` makes the engine serve the given weights."""

    def __init__(self, config: SyncConfig, req_func: ReqFunc | None) -> None:
        update = UpdateConfig(
            bucket_size_bytes=config.bucket_size_bytes,
            engine_timeout_s=config.timeout_s,
            engine_connect_timeout_s=config.timeout_s,
            req_func_timeout_s=config.timeout_s,
        )
        # reuse_host_memory: every iteration registers the same shapes, so v+1 lands in v-1's chunks
        # (no fresh page faults here, and the engine finds segments it already has mapped).
        self.ps = ParameterServer(
            rank=0, world_size=1, config=ParameterServerConfig(transport="cpu", update=update, reuse_host_memory=True)
        )
        self.req_func = req_func
        self._current: str | None = None  # the version the engine holds, as far as this sync knows
        self.delta = delta_sender(config)
        self.updating: str | None = None  # the version being pushed now ("policy-vN"), for `for_engine`

    @classmethod
    def for_engine(cls, config: SyncConfig, engine) -> WeightSync:
        """The sync of one ``RolloutEngine``: its req_func, told each version's name (what vLLM reports
        in /weight_info and with its outputs, where the engine takes updates through its weight-transfer
        API)."""
        sync = cls(config, None)
        sync.req_func = engine.weight_req_func(config.timeout_s, weight_version=lambda: sync.updating)
        return sync

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> SyncResult:
        name = f"policy-v{version}"
        start = time.monotonic()
        prepared = None
        tensors, kind, reason = dict(named_tensors), "full", ""
        if self.delta is not None:
            prepared = self.delta.prepare(name, named_tensors, self._current)
            tensors, kind, reason = prepared.tensors, prepared.choice.kind, prepared.choice.reason
        try:
            metrics = self._send(name, tensors)
        except Exception as e:  # re-raised unless a delta was refused: then the full version goes
            if prepared is None or kind != "delta":
                raise
            reason = f"the engine refused the delta ({e}); sent the full version"
            logger.warning("weights v%d: %s", version, reason)
            prepared = self.delta.full(prepared, reason)
            tensors, kind = prepared.tensors, "full"
            metrics = self._send(name, tensors)
        if prepared is not None:
            self.delta.commit(prepared)  # the next delta's base
            logger.info("weights v%d: %s update, %d bytes (%s)", version, kind, metrics.total_bytes, reason)
        total_s = time.monotonic() - start
        logger.debug("weights v%d synced in %.3f s (%s, %s)", version, total_s, kind, metrics.summary())
        return SyncResult(
            version=version,
            total_s=total_s,
            update_s=metrics.total_s,
            total_bytes=metrics.total_bytes,
            num_buckets=metrics.num_buckets,
            kind=kind,
            reason=reason,
        )

    def _send(self, name: str, tensors: Mapping[str, torch.Tensor]):
        """Register `tensors` as `name`, update the engine, keep only `name` registered."""
        if name in self.ps.checkpoints():  # a retried push of the same version
            self.ps.unregister_checkpoint(name)
        self.ps.register_checkpoint(name, named_tensors=dict(tensors))
        try:
            self.ps.gather_metas(name)
            self.updating = name
            metrics = self.ps.update(name, self._req_func)
        except BaseException:
            if self.delta is not None:  # a refused delta is registered again whole under this name
                self.ps.unregister_checkpoint(name)
            raise
        if self._current is not None and self._current != name:
            self.ps.unregister_checkpoint(self._current)
        self._current = name
        return metrics

    def _req_func(self, addresses) -> None:
        phases.reached("weight update")  # on the update's req_func thread: the engine is asked to receive
        self.req_func(addresses)

    def close(self) -> None:
        self.ps.close()
