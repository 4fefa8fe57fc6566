"""Weight sync into every engine of a local pool: one in-process ParameterServer rank, one update each.

::

    PoolWeightSync.push(v): register v once (one CPU rank) ──▶ for each member serving or waiting:
        ParameterServer.update(v, that engine's req_func) (it reads the memfd chunks in place) ──▶
        weights_in(member); a failed update marks the member down (the others go on) ──▶ unregister v-1
    bring_up(member) (the healer's): the current version into one restarted member, under the same lock
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping

import torch

from orchestrator.config import SyncConfig
from orchestrator.engines.pool import EnginePool
from orchestrator.engines.pool_members import Member
from orchestrator.engines.weight_sync import SyncResult, WeightSync

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolSyncResult(SyncResult):
    engine_update_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per engine reached


class PoolWeightSync(WeightSync):
    """The in-process ParameterServer (one CPU rank) pushing each version into every engine of a pool.

    One registration per version, then one ``update`` per engine with that engine's req_func (each
    engine maps the PS's chunks and reads them in place). An engine whose update fails is marked down
    (the healer brings it back); the push fails only when no engine took the version. ``bring_up``
    (the healer's) updates one restarted engine to the current version under the same lock, so an
    engine never misses a version that was pushed while it restarted."""

    def __init__(self, config: SyncConfig, pool: EnginePool) -> None:
        super().__init__(config, req_func=None)
        self.pool = pool
        self.timeout_s = config.timeout_s
        self._lock = threading.Lock()
        self._version: int | None = None
        pool.set_bring_up(self.bring_up)

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> PoolSyncResult:
        name = f"policy-v{version}"
        with self._lock:
            start = time.monotonic()
            if name in self.ps.checkpoints():  # a retried push of the same version
                self.ps.unregister_checkpoint(name)
            self.ps.register_checkpoint(name, named_tensors=dict(named_tensors))
            self.ps.gather_metas(name)
            per_engine: dict[str, float] = {}
            metrics = None
            for member, epoch in self.pool.sync_targets():
                t0 = time.monotonic()
                try:
                    metrics = self.ps.update(name, self.pool.weight_req_func_of(member, self.timeout_s, name))
                except Exception as e:  # noqa: BLE001 - one engine's failure must not stop the others' update
                    self.pool.report_failure(member, epoch, f"weight update to v{version}: {e}")
                    continue
                per_engine[member.name] = round(time.monotonic() - t0, 4)
                self.pool.weights_in(member, version, epoch)
            if metrics is None:
                raise RuntimeError(
                    f"weights v{version} reached no engine of the pool ({self.pool.metrics()['engine_states']}); "
                    f"see the engine logs in {self.pool.log_dir}"
                )
            if self._current is not None and self._current != name:
                self.ps.unregister_checkpoint(self._current)
            self._current, self._version = name, version
            total_s = time.monotonic() - start
        logger.debug("weights v%d synced into %d engines in %.3f s: %s", version, len(per_engine), total_s, per_engine)
        return PoolSyncResult(
            version=version,
            total_s=total_s,
            update_s=sum(per_engine.values()),
            total_bytes=metrics.total_bytes,
            num_buckets=metrics.num_buckets,
            engine_update_s=per_engine,
        )

    def bring_up(self, member: Member) -> None:
        """Healer: the current version into ``member`` alone (nothing pushed yet: the next push does it)."""
        with self._lock:
            epoch = member.epoch
            if self._current is None:
                return
            self.ps.update(self._current, self.pool.weight_req_func_of(member, self.timeout_s, self._current))
            self.pool.weights_in(member, self._version, epoch)

    def close(self) -> None:
        self.pool.stop_healing()  # no bring_up may use the PS once it is closed
        super().close()
