"""One update's use of the receiver's weight cache (`vllm_ext.weight_cache.WeightCache`): which
tensor goes to the reload (a copy in the cache, or the view itself when its buffer stays valid until
Done and no cache is kept), the previous values an abort can fill in, and what the cache holds after
the update (only its names, mirroring the model)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from vllm_ext.receive.modes import NamedTensors
from vllm_ext.weight_cache import WeightCache


class CacheUse:
    """The cache in one update in reload mode `mode`, with the receiver's `weight_cache` setting."""

    def __init__(self, cache: WeightCache, *, weight_cache: bool, mode: str) -> None:
        self.cache = cache
        self.weight_cache = weight_cache
        self.fallback_ok = cache.matches_model  # untouched names still hold the model's values
        self._commits = weight_cache and mode != "bucket"  # per bucket nothing is cached
        self._views_ok = not weight_cache and mode == "streaming"  # stable buffers go uncopied
        self.stable_ranges: list[tuple[int, int]] = []  # address ranges of buffers valid until Done
        self.num_zero_copy = 0

    def on_hello(self, hello, buffers: Sequence[torch.Tensor | None]) -> None:
        if self._views_ok:
            self.stable_ranges = [
                (b.data_ptr(), b.data_ptr() + b.numel())
                for i, b in enumerate(buffers)
                if i in set(hello.stable_buffers)
            ]

    def _is_stable(self, view: torch.Tensor) -> bool:
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        return any(lo <= start and end <= hi for lo, hi in self.stable_ranges)

    def keep(self, name: str, view: torch.Tensor) -> torch.Tensor:
        """The tensor to hand to the reload: the view itself when it stays valid until Done and no
        cache is kept, else the cached copy."""
        if self.stable_ranges and self._is_stable(view):
            self.num_zero_copy += 1
            return view
        return self.cache.store(name, view)

    def kept(self, order: Sequence[str]) -> NamedTensors:
        """The cached tensors of `order`'s names, in that order (the "end" mode's whole reload)."""
        return [(n, self.cache.get(n)) for n in order]

    def stale(self) -> None:
        """A bucket arrived: the cache no longer mirrors the model until the update completes."""
        self.cache.matches_model = False

    def commit(self, received: set[str], slots_fn: Callable[[], Mapping[str, torch.Tensor]] | None) -> int | None:
        """The update completed: the cache keeps only its names, now the model's values, and moves
        them into the engine memory `slots_fn` offers; how many it adopted (None: none offered, or
        nothing was cached)."""
        if not self._commits:
            return None
        self.cache.retain_only(received)
        self.cache.matches_model = True
        return self.cache.adopt(slots_fn()) if slots_fn is not None else None

    def previous(self, received: set[str]) -> Callable[[], NamedTensors] | None:
        """The previous values of the names an aborted update did not bring (None: the cache does
        not hold the model's values)."""
        if not self.fallback_ok:
            return None
        return lambda: self.cache.items_except(received)

    def after_abort(self, filled: bool) -> str | None:
        """The aborted update's reload ended, with the previous values filled in or not: the cache
        mirrors the (mixed) model only if filled; else why the model is partly undefined."""
        self.cache.matches_model = filled
        if filled:
            return None
        why = (
            "weight_cache is off"
            if not self.weight_cache
            else "no copy of the previous weights: the cache is filled by a completed update"
        )
        return (
            f"aborted update without previous values to fill in ({why}): layers "
            "that were only partly received hold undefined values until the next update"
        )
