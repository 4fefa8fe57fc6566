"""A delta update (`checkpoint_engine.sharding.delta_sync`) on the engine side: its tensors are
taken aside as they arrive (the bucket's buffer is reused after the Ack) and, at Done, applied onto
the weight cache's copy of the version the engine serves; the result is what the reload gets."""

from __future__ import annotations

from checkpoint_engine.sharding.delta import DeltaMismatch
from checkpoint_engine.sharding.delta_sync import DeltaReceiver, RankSlices
from checkpoint_engine.state import EngineWeightState
from vllm_ext.receive.caching import CacheUse
from vllm_ext.receive.modes import NamedTensors


class DeltaIntake:
    """One update's delta, if it is one. `held_checkpoint`: the version the engine holds before it
    (a delta's base must be that one); `rank_slices`: a tensor-parallel rank's slices (only their
    entries are kept); `whole_only`: the reload takes whole weights only (vLLM's load step)."""

    def __init__(self, rank_slices: RankSlices | None, held_checkpoint: str | None, *, whole_only: bool) -> None:
        self.receiver = DeltaReceiver(rank_slices)
        self.held_checkpoint = held_checkpoint
        self.nbytes = 0
        self.reloaded: int | None = None  # tensors the delta's reload took (the whole model, or the changed)
        self._whole_only = whole_only

    @property
    def is_delta(self) -> bool:
        return self.receiver.is_delta

    @property
    def changed(self) -> set[str]:
        """After `apply`: the tensors whose values the delta changed (this rank's entries)."""
        return self.receiver.changed

    def take(self, views: NamedTensors) -> NamedTensors:
        """Keep a delta's tensors aside (copied: the buffer is reused after the Ack); the rest."""
        rest = []
        for name, t in views:
            if self.receiver.take(name, t):
                self.nbytes += t.numel() * t.element_size()
            else:
                rest.append((name, t))
        if len(rest) < len(views) and self._whole_only:
            raise DeltaMismatch("vLLM's load step takes whole weights: a delta needs a version loaded before it")
        return rest

    def apply(
        self, caching: CacheUse, refusal: str | None, received: set[str], state: EngineWeightState, *, sliced: bool
    ) -> NamedTensors:
        """The delta onto the cache's copy of the version held (every base checksum checked before
        anything is written); returns the whole model, for the reload: the network carries only the
        changes, but vLLM's layer-wise reload wants every tensor of a layer it reloads (a reload
        that keeps the layers it is not given takes only `changed`).
        `refusal`: why the engine cannot apply a delta (`WeightReceiver.delta_refusal`), or None;
        `received`: the whole tensors this update brought too (a delta cannot be mixed with them);
        `state`: the engine's, which then names the delta's version; `sliced`: the cache holds
        only this rank's slices."""
        cache = caching.cache
        why = refusal
        if why is None and received:
            why = f"the update mixes whole tensors ({len(received)}) with a delta"
        if why is not None:
            # nothing of the delta was written; whole tensors of a mixed update were (cached, reloaded)
            cache.matches_model = caching.fallback_ok and not received
            raise DeltaMismatch(f"this engine cannot apply a delta update: {why}")
        weights = dict(cache.items_except(set()))
        try:
            self.receiver.finish(weights, self.held_checkpoint, state, sliced=sliced)
        except DeltaMismatch:
            cache.matches_model = True  # every base checksum is checked first: nothing was written
            raise
        return list(weights.items())
