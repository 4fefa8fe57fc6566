"""The vocabulary of sharded transfer: which part of a source tensor one engine rank consumes.

Shared by the layout planner (`sharding.shard_plan`: from a model's shapes and the engine's TP x EP) and the
learned planner (`vllm_ext.shard_probe`: from the engine's own weight loaders run on recording
tensors), so a plan from either can be compared slice by slice. Pure: no tensors, no processes.

    SourceSlice(name, dim, start, stop)    rows [start, stop) of `name` along `dim`
                                           (dim None: the whole tensor, start/stop ignored = 0/0)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class EngineLayout:
    """How the inference engine shards a model: tensor parallel x expert parallel ranks.

    vLLM's rank numbering: rank = ep_rank * tp_size + tp_rank is not assumed; a destination is named
    by its (tp_rank, ep_rank) pair."""

    tp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineLayout.{name}={value!r} must be a positive int")

    @property
    def ranks(self) -> list[tuple[int, int]]:
        """Every destination as (tp_rank, ep_rank), in a stable order."""
        return [(tp, ep) for ep in range(self.ep_size) for tp in range(self.tp_size)]


@dataclass(frozen=True, order=True)
class SourceSlice:
    """Rows [start, stop) of source tensor `name` along `dim`; dim None is the whole tensor."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def __post_init__(self) -> None:
        if self.dim is None:
            if (self.start, self.stop) != (0, 0):
                raise ValueError(f"{self.name}: a whole-tensor slice has no range (got [{self.start}, {self.stop}))")
        elif not (0 <= self.start < self.stop):
            raise ValueError(
                f"{self.name}: slice [{self.start}, {self.stop}) along dim {self.dim} is empty or negative"
            )

    @property
    def whole(self) -> bool:
        return self.dim is None
