"""Where a checkpoint tensor lands in the engine's parameters, so that a pull can read it there.

`SlotProbe` runs the engine's own load function (vLLM's `model.load_weights`: name mapping, q/k/v
into qkv_proj, shards) on empty stand-ins of a bucket's tensors, with every `copy_` recorded and
not run, and the memory every other (non-view) op reads or writes recorded too. A tensor gets a slot
when its loader's whole effect on those bytes is one plain copy of the whole tensor into a contiguous
slice of the same dtype and shape, which no other op of the load touches and no other copy writes.
Anything else (a cast, a transpose, a narrowed source under tensor parallelism, several copies, tied
weights copied into the same bytes, a scale computed from the weight) gets None and is loaded from
scratch memory as usual. Each name is probed once per probe object. The engine probes a whole
update at once (Hello lists its tensors), or, in a load step the daemon told what to expect, the
whole version before the update begins (`WeightReceiver.probe_ahead`), so "no other op" covers every
bucket's loaders: the reads into slots may then land in any order relative to the loads of other
tensors.

The probe is the loaders' one run for the tensors that got slots: every other op of their load (a
padding row zeroed beside the slot, the names vLLM's load step counts) ran during the probe, and
once the bytes were read into the slot nothing is left to do (`SlotProbe.holds`). The engine runs
its load function again only for the tensors without a slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes seen the same way: address, shape, strides, dtype and device."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) byte address `t` covers (None: no elements). Torch strides are >= 0."""
    if t.numel() == 0:
        return None
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


class RecordCopies(TorchDispatchMode):
    """Records the (destination, source) of every `copy_` run under it; `skip=True` also turns each
    into nothing (nothing is written). `touched`: the byte ranges of every tensor another op (not a
    view) took as an argument, in place targets included."""

    def __init__(self, skip: bool = False):
        super().__init__()
        self.skip = skip
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.touched: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[0], args[1]))
            if self.skip:
                return args[0]
        elif not func.is_view:
            for a in tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.device.type == "cpu":
                    r = byte_range(a)
                    if r is not None:
                        self.touched.append(r)
        return func(*args, **kwargs)


class RangeSet:
    """Byte ranges [lo, hi) merged and sorted once, so that asking whether a range meets any of them
    is one bisect (the probe of a whole update asks once per tensor, against every op's ranges)."""

    def __init__(self, ranges: Iterable[tuple[int, int]]):
        self._lo: list[int] = []
        self._hi: list[int] = []
        for lo, hi in sorted(ranges):
            if self._hi and lo <= self._hi[-1]:
                self._hi[-1] = max(self._hi[-1], hi)
            else:
                self._lo.append(lo)
                self._hi.append(hi)

    def meets(self, r: tuple[int, int] | None) -> bool:
        """`r` shares a byte with one of the ranges (an empty `r` meets nothing)."""
        if r is None:
            return False
        i = bisect.bisect_left(self._lo, r[1]) - 1  # the last merged range starting before r ends
        return i >= 0 and self._hi[i] > r[0]


def overlapping(ranges: list[tuple[int, int] | None]) -> set[int]:
    """Indices of the non-empty [lo, hi) ranges that share a byte with another one (n log n)."""
    order = sorted((r[0], r[1], i) for i, r in enumerate(ranges) if r is not None)
    out: set[int] = set()
    reach, reach_i = -1, -1  # the furthest end among ranges starting earlier, and whose
    for lo, hi, i in order:
        if lo < reach:  # starts inside an earlier range
            out.update((i, reach_i))
        if hi > reach:
            reach, reach_i = hi, i
    return out


def plain_slot(
    copies: list[tuple[torch.Tensor, torch.Tensor]], source: torch.Tensor, touched: RangeSet
) -> torch.Tensor | None:
    """The slot of `source`, given the (destination, source) copies recorded from it and the ranges
    other ops touched (`RecordCopies`): the destination of its one copy when that copy takes all of
    `source`, as it is, into a contiguous CPU slice of the same dtype and shape that no other op
    reads or writes, and no other op computes from `source`. Else None."""
    if len(copies) != 1:
        return None
    dst, src = copies[0]
    if (
        same_memory(src, source)
        and dst.shape == src.shape
        and dst.dtype == src.dtype
        and dst.device.type == "cpu"
        and dst.is_contiguous()
        and not touched.meets(byte_range(dst))
        and not touched.meets(byte_range(src))
    ):
        return dst.detach()
    return None


class SlotProbe:
    """Slots of checkpoint tensors in the memory `load_fn` writes to (see the module docstring)."""

    def __init__(self, load_fn: LoadFn):
        self._load_fn = load_fn
        self._slots: dict[str, torch.Tensor | None] = {}
        self.num_probed = 0  # names probed so far (each once)

    def __call__(self, items: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor | None]:
        """For each (name, dtype, shape): its slot, or None."""
        todo = [(n, d, s) for n, d, s in items if n not in self._slots]
        if todo:
            self._probe(todo)
        return [self._slots[n] for n, _, _ in items]

    def holds(self, name: str, tensor: torch.Tensor) -> bool:
        """`tensor` is `name`'s slot: its bytes are in the parameters and its load already ran."""
        slot = self._slots.get(name)
        return slot is not None and same_memory(slot, tensor)

    def _probe(self, items: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        stand_ins = [(n, torch.empty(s, dtype=d)) for n, d, s in items]  # never written, never read
        self.num_probed += len(stand_ins)
        by_ptr = {t.data_ptr(): n for n, t in stand_ins if t.numel()}
        for n, _ in stand_ins:
            self._slots[n] = None
        record = RecordCopies(skip=True)
        try:
            with record, torch.no_grad():
                self._load_fn(iter(stand_ins))
        except Exception:  # noqa: BLE001 - a loader that refuses stand-ins: those tensors load as usual
            return
        seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        shared = overlapping([byte_range(dst) for dst, _ in record.copies])  # two copies write these bytes
        contested: set[str] = set()
        touched = RangeSet(record.touched)
        for k, (dst, src) in enumerate(record.copies):
            name = by_ptr.get(src.data_ptr())
            if name is not None:
                seen.setdefault(name, []).append((dst, src))
                if k in shared:
                    contested.add(name)
        yielded = dict(stand_ins)
        for name, copies in seen.items():
            self._slots[name] = None if name in contested else plain_slot(copies, yielded[name], touched)
