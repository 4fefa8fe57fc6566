"""A trainer's device memory handed to the inference engines and back (colocated mode on GPUs).

k1.5's hybrid deployment runs training and inference on the same GPUs: after a training step the
trainer moves what it holds on the device to host memory, so the engines can start (or wake) with
the whole device, and takes it back before the next step:

    train ─▶ release(): parameters, buffers, gradients, optimizer state ─▶ pinned host copies,
             the device's cached blocks returned (torch.cuda.empty_cache)
    ... the engines start, are updated, roll out, stop ...
    reclaim(): the same tensors back on the device, the same Parameter objects (the optimizer's
             references stay valid) ─▶ train

The pinned host buffers are allocated at the first release and kept, so later releases are plain
copies. On a CPU trainer both calls do nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class OffloadReport:
    seconds: float = 0.0
    moved_bytes: int = 0
    device_allocated_bytes: int = 0  # torch.cuda.memory_allocated after the move

    def record(self, prefix: str) -> dict[str, float | int]:
        """The metrics of a move ({} when nothing moved: a CPU trainer)."""
        return {f"{prefix}_s": round(self.seconds, 4), f"{prefix}_bytes": self.moved_bytes} if self.moved_bytes else {}


class DeviceOffload:
    """Moves `model`'s tensors and `optimizer`'s state between its device and pinned host memory.

    `optimizer` is read at each call (a trainer replaces its optimizer when it resets it)."""

    def __init__(self, model: torch.nn.Module, optimizer=lambda: None):
        self._model = model
        self._optimizer = optimizer
        self._host: dict[tuple[str, int], torch.Tensor] = {}  # slot -> its pinned host copy
        self._device: torch.device | None = None  # where the tensors were at release
        self.released = False

    def _slots(self):
        """(key, get, put) for every tensor the trainer holds, keyed by kind and position (the same
        key for the same tensor across releases, also after the optimizer was replaced): parameters,
        their gradients, buffers, the optimizer's state tensors."""
        params = list(self._model.parameters())
        for i, p in enumerate(params):
            yield ("param", i), (lambda p=p: p.data), (lambda t, p=p: setattr(p, "data", t))
        for i, p in enumerate(params):
            if p.grad is not None:
                yield ("grad", i), (lambda p=p: p.grad), (lambda t, p=p: setattr(p, "grad", t))
        buffers = [(m, n) for m in self._model.modules() for n, b in m._buffers.items() if b is not None]
        for i, (m, n) in enumerate(buffers):
            yield ("buffer", i), (lambda m=m, n=n: m._buffers[n]), (lambda t, m=m, n=n: m._buffers.__setitem__(n, t))
        opt = self._optimizer()
        if opt is None:
            return
        states = [(st, n) for p in params if p in opt.state for st in [opt.state[p]] for n in sorted(st)]
        for i, (st, n) in enumerate(states):
            if isinstance(st[n], torch.Tensor) and st[n].dim() > 0:  # 0-dim step counters stay put
                yield ("state", i), (lambda st=st, n=n: st[n]), (lambda t, st=st, n=n: st.__setitem__(n, t))

    def release(self) -> OffloadReport:
        """Everything on the device -> pinned host memory; the device's cache emptied. No-op on CPU."""
        report = OffloadReport()
        if self.released:
            return report
        t0 = time.perf_counter()
        moved = 0
        seen = set()
        for key, get, put in self._slots():
            t = get()
            if t.device.type != "cuda":
                continue
            seen.add(key)
            self._device = t.device
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self._host[key] = host
            host.copy_(t, non_blocking=True)
            put(host)
            moved += t.numel() * t.element_size()
        t = None  # the last tensor moved: no reference left here to keep its device memory
        self._host = {k: v for k, v in self._host.items() if k in seen}  # what no longer exists: freed
        if self._device is not None and moved:
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()
            report.device_allocated_bytes = torch.cuda.memory_allocated(self._device)
        self.released = moved > 0
        report.seconds, report.moved_bytes = time.perf_counter() - t0, moved
        if moved:
            logger.info("released %.2f GiB of device memory in %.3f s", moved / 2**30, report.seconds)
        return report

    def reclaim(self) -> OffloadReport:
        """The released tensors back on the device (the pinned copies kept for the next release)."""
        report = OffloadReport()
        if not self.released:
            return report
        t0 = time.perf_counter()
        moved = 0
        for key, get, put in self._slots():
            t = get()
            if key in self._host and t.data_ptr() == self._host[key].data_ptr():
                put(t.to(self._device, non_blocking=True))
                moved += t.numel() * t.element_size()
        torch.cuda.synchronize(self._device)
        report.device_allocated_bytes = torch.cuda.memory_allocated(self._device)
        self.released = False
        report.seconds, report.moved_bytes = time.perf_counter() - t0, moved
        return report
