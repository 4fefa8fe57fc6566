"""Weight sync into every engine of a local pool: one in-process ParameterServer rank, one update each.

::

    PoolWeightSync.push(v): register v once (one CPU rank) ──▶ for each member serving or waiting:
        ParameterServer.update(v, that engine's req_func) (it reads the memfd chunks in place) ──▶
        weights_in(member); a failed update marks the member down (the others go on) ──▶ unregister v-1
    bring_up(member) (the healer's): the current version into one restarted member, under the same lock

With ``sync.delta`` the version registered is, where it pays, the delta against v-1 (every member
holds v-1: a member that missed a version is down, and the healer brings it up with a full one). The
members that refuse the delta (a restarted engine without the base, a vLLM engine without its weight
cache) take the full version, registered under the same name once the delta's round is over. A
``bring_up`` after a delta first swaps the registered delta for the full version (the sender's base):
a restarted engine holds nothing to apply a delta to.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping

import torch

from orchestrator.config import SyncConfig
from orchestrator.engine_pool.pool import EnginePool
from orchestrator.engine_pool.pool_members import Member
from orchestrator.engine_pool.weight_sync import SyncResult, WeightSync

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolSyncResult(SyncResult):
    engine_update_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per engine reached
    engine_kind: dict[str, str] = dataclasses.field(default_factory=dict)  # "delta" | "full", per engine reached


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
        self._registered_kind = "full"  # what is registered under `_current`: the full version or a delta
        pool.set_bring_up(self.bring_up)

    def _register(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        if name in self.ps.checkpoints():  # a retried push, or the full version after the delta's round
            self.ps.unregister_checkpoint(name)
        self.ps.register_checkpoint(name, named_tensors=dict(tensors))
        self.ps.gather_metas(name)

    def _update_each(
        self, name: str, version: int, targets: list[tuple[Member, int]], per_engine: dict[str, float], *, last: bool
    ) -> tuple[object | None, list[tuple[Member, int, str]]]:
        """Update every target to `name`; (metrics of one that took it, the failures). With `last`, a
        failure marks its member down; otherwise it is returned for the full version's round."""
        metrics, failed = None, []
        for member, epoch in targets:
            t0 = time.monotonic()
            try:
                metrics = self.ps.update(name, self.pool.weight_req_func_of(member, self.timeout_s, name))
            except Exception as e:  # noqa: BLE001 - one engine's failure must not stop the others' update
                if last:
                    self.pool.report_failure(member, epoch, f"weight update to v{version}: {e}")
                else:
                    failed.append((member, epoch, str(e)))
                continue
            per_engine[member.name] = round(time.monotonic() - t0, 4)
            self.pool.weights_in(member, version, epoch)
        return metrics, failed

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> PoolSyncResult:
        name = f"policy-v{version}"
        with self._lock:
            start = time.monotonic()
            prepared, kind, reason = None, "full", ""
            tensors: Mapping[str, torch.Tensor] = named_tensors
            if self.delta is not None:
                prepared = self.delta.prepare(name, named_tensors, self._current)
                tensors, kind, reason = prepared.tensors, prepared.choice.kind, prepared.choice.reason
            self._register(name, tensors)
            per_engine: dict[str, float] = {}
            targets = self.pool.sync_targets()
            metrics, refused = self._update_each(name, version, targets, per_engine, last=kind != "delta")
            engine_kind = dict.fromkeys(per_engine, kind)
            if refused:  # the delta's round is over: the full version, under the same name, for the rest
                for member, _, why in refused:
                    logger.warning(
                        "weights v%d: %s refused the delta (%s); sending the full version", version, member.name, why
                    )
                full = self.delta.full(prepared, f"{len(refused)} of {len(targets)} engines refused the delta")
                self._register(name, full.tensors)
                kind = "full"
                rest = [(member, epoch) for member, epoch, _ in refused]
                full_metrics, _ = self._update_each(name, version, rest, per_engine, last=True)
                metrics = metrics or full_metrics
                engine_kind.update({m.name: "full" for m, _ in rest if m.name in per_engine})
                if any(k == "delta" for k in engine_kind.values()):
                    reason = f"{prepared.choice.reason}; {full.choice.reason}, which took the full version"
                else:
                    reason = full.choice.reason
            if metrics is None:
                raise RuntimeError(
                    f"weights v{version} reached no engine of the pool ({self.pool.metrics()['engine_states']}); "
                    f"see the engine logs in {self.pool.log_dir}"
                )
            if prepared is not None:
                self.delta.commit(prepared)  # the next delta's base (every member reached holds it)
                logger.info("weights v%d: %s", version, ", ".join(f"{n} {k}" for n, k in engine_kind.items()))
            if self._current is not None and self._current != name:
                self.ps.unregister_checkpoint(self._current)
            self._current, self._version, self._registered_kind = name, version, kind
            total_s = time.monotonic() - start
        logger.debug("weights v%d synced into %d engines in %.3f s: %s", version, len(per_engine), total_s, per_engine)
        kinds = set(engine_kind.values())
        return PoolSyncResult(
            version=version,
            total_s=total_s,
            update_s=sum(per_engine.values()),
            total_bytes=metrics.total_bytes,
            num_buckets=metrics.num_buckets,
            kind=kinds.pop() if len(kinds) == 1 else "mixed",
            reason=reason,
            engine_update_s=per_engine,
            engine_kind=engine_kind,
        )

    def bring_up(self, member: Member) -> None:
        """Healer: the current version into ``member`` alone (nothing pushed yet: the next push does it)."""
        with self._lock:
            epoch = member.epoch
            if self._current is None:
                return
            if self._registered_kind == "delta":  # a restarted engine holds no base: it takes the full version
                self._register(self._current, self.delta.base)
                self._registered_kind = "full"
            self.ps.update(self._current, self.pool.weight_req_func_of(member, self.timeout_s, self._current))
            self.pool.weights_in(member, self._version, epoch)

    def close(self) -> None:
        self.pool.stop_healing()  # no bring_up may use the PS once it is closed
        super().close()
