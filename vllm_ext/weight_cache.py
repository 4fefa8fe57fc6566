"""Checkpoint-format weights an engine keeps between updates, and their checksum.

The shared buffer's views are only valid while a bucket is being handled, and vLLM's reload path
buffers a layer's tensors until the whole layer has arrived (a layer may span buckets), so every
received tensor is first copied into a cached tensor of the same name. The cached tensors are
allocated on the first update and reused by later ones (no page faults, no allocator churn).

    bucket views ──store()──▶ cached tensor per name ──▶ reload path (copies into the model)

The checksum is defined on these checkpoint-format tensors, not on the model's parameters: after
loading, vLLM repacks weights into kernel layouts (on CPU the linear weights become oneDNN handles
and the parameters are emptied), so parameters cannot be compared with a checkpoint. Two engines
that received the same checkpoint report the same value, and `checkpoint_checksum` computes it on
the trainer side from the tensors it registered.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping

import torch

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.transport.prefault import prefault

logger = logging.getLogger(__name__)


def checkpoint_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> str:
    """Hex digest of a checkpoint: SHA-256 over (name, dtype, shape, CRC-32 of bytes), in name order."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    records = sorted(
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_checksum(t)) for name, t in items
    )
    h = hashlib.sha256()
    for name, dtype, shape, crc in records:
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{crc:08x}\n".encode())
    return h.hexdigest()[:32]


class WeightCache:
    """Checkpoint-format tensors by name, reused across updates.

    `matches_model` is True while the cached tensors are exactly what the model holds (for every
    name): after a completed update, and after an aborted streaming update that was completed with
    the previous values. Only then is `checksum()` defined and can missing names be filled in.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self.matches_model = False
        self.num_allocations = 0  # how many tensors had to be (re)allocated, for tests and logs

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def store(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """Copy `src` into the cached tensor `name` (reallocated if shape, dtype or device changed)."""
        dst = self._tensors.get(name)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device:
            dst = torch.empty(src.shape, dtype=src.dtype, device=src.device)
            prefault((dst,))  # one call maps its pages, instead of a fault per page in the copy below
            self._tensors[name] = dst
            self.num_allocations += 1
        dst.copy_(src)
        return dst

    def adopt(self, slots: Mapping[str, torch.Tensor]) -> int:
        """Keep the named tensors in the given storage from now on (the engine's own staging memory,
        so a received tensor is copied once, into the place the engine loads from). The current
        values move there; names not cached, or whose shape/dtype/device differ, are ignored.
        Returns how many names are now held in adopted storage."""
        count = 0
        for name, slot in slots.items():
            cur = self._tensors.get(name)
            if cur is None or cur.shape != slot.shape or cur.dtype != slot.dtype or cur.device != slot.device:
                continue
            if cur.data_ptr() != slot.data_ptr():
                slot.copy_(cur)
                self._tensors[name] = slot
            count += 1
        return count

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def items_except(self, names: set[str]) -> list[tuple[str, torch.Tensor]]:
        """Cached tensors whose names are not in `names` (the ones an aborted update did not bring)."""
        return [(n, t) for n, t in self._tensors.items() if n not in names]

    def retain_only(self, names: set[str]) -> None:
        """Drop tensors of names the last complete update did not contain."""
        for n in [n for n in self._tensors if n not in names]:
            del self._tensors[n]

    def checksum(self) -> str | None:
        """`checkpoint_checksum` of the cached tensors, or None when they do not describe the model."""
        if not self.matches_model or not self._tensors:
            return None
        return checkpoint_checksum(self._tensors)
