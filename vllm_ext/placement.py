"""Where a checkpoint tensor lands in the engine's parameters, so that a pull can read it there.

`SlotProbe` runs the engine's own load function (vLLM's `model.load_weights`: name mapping, q/k/v
into qkv_proj, shards) on empty stand-ins of a bucket's tensors with every `copy_` recorded and not
run. A tensor whose loader is one plain copy of the whole tensor into a contiguous slice of the same
dtype and shape gets that slice as its slot; anything else (a cast, a transpose, a narrowed source
under tensor parallelism, several copies) gets None and is loaded from scratch memory as usual.
Each name is probed once per probe object.

After the bytes were read into the slots, the load function runs once more on the slots themselves
(so it records the names it loaded, as vLLM's load step checks); `skip_self_copies` turns each
copy of a slot onto itself into nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class RecordCopies(TorchDispatchMode):
    """Records the (destination, source) of every `copy_` run under it; `skip=True` also turns each
    into nothing (nothing is written)."""

    def __init__(self, skip: bool = False):
        super().__init__()
        self.skip = skip
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[0], args[1]))
            if self.skip:
                return args[0]
        return func(*args, **(kwargs or {}))


class _SkipSelfCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.skipped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and same_memory(args[0], args[1]):
            self.skipped += 1
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def skip_self_copies() -> Iterator[_SkipSelfCopies]:
    """Within: a `copy_` whose source is its destination (same address, shape, strides) does nothing."""
    with _SkipSelfCopies() as mode:
        yield mode


class SlotProbe:
    """Slots of checkpoint tensors in the memory `load_fn` writes to (see the module docstring)."""

    def __init__(self, load_fn: LoadFn):
        self._load_fn = load_fn
        self._slots: dict[str, torch.Tensor | None] = {}

    def __call__(self, items: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor | None]:
        """For each (name, dtype, shape): its slot, or None."""
        todo = [(n, d, s) for n, d, s in items if n not in self._slots]
        if todo:
            self._probe(todo)
        return [self._slots[n] for n, _, _ in items]

    def _probe(self, items: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        stand_ins = [(n, torch.empty(s, dtype=d)) for n, d, s in items]  # never written, never read
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
        for dst, src in record.copies:
            name = by_ptr.get(src.data_ptr())
            if name is not None:
                seen.setdefault(name, []).append((dst, src))
        yielded = dict(stand_ins)
        for name, copies in seen.items():
            if len(copies) != 1:
                continue
            dst, src = copies[0]
            if (
                same_memory(src, yielded[name])
                and dst.shape == src.shape
                and dst.dtype == src.dtype
                and dst.device.type == "cpu"
                and dst.is_contiguous()
            ):
                self._slots[name] = dst.detach()
