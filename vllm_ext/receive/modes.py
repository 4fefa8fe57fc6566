"""How one update's tensors reach the model's loaders in each reload mode: `ReloadStream`, the reload
running in a thread over an iterator fed batch by batch, and one strategy object per mode saying
what a bucket, the end of the transfer (Done) and an abort do.

    mode        a bucket's tensors                    at Done                      on abort
    streaming   kept, fed to the reload thread         join the thread              fill in, join
    end         kept                                   reload them all, join        (nothing started)
    bucket      loaded now, as views, before the Ack   nothing left                 partial load noted

A delta (`vllm_ext.receive.delta`) is reloaded whole at Done through `Reload.start`, in any mode.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
ReloadFn = Callable[[Iterator[tuple[str, torch.Tensor]]], None]


def reload_failed(e: BaseException) -> RuntimeError:
    """The error an update reports when the engine's reload raised `e`."""
    return RuntimeError(f"the engine's reload path failed: {type(e).__name__}: {e}")


class ReloadStream:
    """Runs `reload_fn` in a thread over an iterator fed batch by batch; `finish` joins it."""

    _END = None

    def __init__(self, reload_fn: ReloadFn):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.num_fed = 0
        self._thread = threading.Thread(target=self._run, args=(reload_fn,), daemon=True, name="ckpt-engine-reload")
        self._thread.start()

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (batch := self._queue.get()) is not self._END:
            yield from batch

    def _run(self, reload_fn: ReloadFn) -> None:
        try:
            with torch.no_grad():
                reload_fn(self._pairs())
        except BaseException as e:
            logger.exception("the reload path failed")
            self.error = e

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise reload_failed(self.error) from self.error

    def feed(self, pairs: NamedTensors) -> None:
        self.raise_if_failed()
        self.num_fed += len(pairs)
        self._queue.put(pairs)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def finish(self, timeout_s: float) -> None:
        self._queue.put(self._END)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine's reload path did not finish within {timeout_s:.0f} s")
        self.raise_if_failed()


class Model(Protocol):
    """What a reload reports to when it leaves the model unusable: the receiver."""

    reload_error: str | None

    def recover(self, why: str) -> None: ...


class Reload:
    """One update's reload through a `ReloadStream` (started by a mode, or by a delta at Done).

    `keeps`: a bucket's tensors must be kept (copied into the weight cache, or a view that stays
    valid until Done) before they reach the reload, since the PS reuses the buffer after the Ack."""

    name = ""
    keeps = True

    def __init__(self, reload_fn: ReloadFn, timeout_s: float) -> None:
        self.reload_fn = reload_fn
        self.timeout_s = timeout_s  # deadline for the reload to end once every bucket arrived
        self.stream: ReloadStream | None = None

    def start(self, pairs: NamedTensors) -> None:
        """Run the reload over `pairs` in a thread (more may be fed until `join`)."""
        self.stream = ReloadStream(self.reload_fn)
        self.stream.feed(pairs)

    def on_bucket(self, pairs: NamedTensors) -> None:
        """A bucket's tensors (the kept ones, when `keeps`), noted by the session as received."""

    def on_done(self, kept: Callable[[], NamedTensors]) -> None:
        """Every bucket arrived (a full update): start what runs only now. `kept`: the update's kept
        tensors, in the order received."""

    def join(self, model: Model) -> None:
        """Wait for the reload to end; if it failed, recover the model, forget the stream (nothing
        left for `abort` to end) and raise."""
        if self.stream is None:
            return
        try:
            self.stream.finish(self.timeout_s)
        except Exception as e:
            self.stream = None
            model.recover(f"reload failed: {type(e).__name__}: {e}")
            raise

    def abort(self, received: set[str], fill: Callable[[], NamedTensors] | None, model: Model) -> bool | None:
        """End the reload of a failed update so that the engine keeps serving. `fill`: the previous
        values of the names not received (None: there are none to take), fed before the end so that
        layers received in part are whole again. True / False: the reload ended with / without them;
        None: there was no reload to end, or it failed and `model` was recovered."""
        stream, self.stream = self.stream, None
        if stream is None:  # no reload started ("end" mode, or failed before the first bucket)
            return None
        if stream.error is not None or not stream.running:
            model.recover(f"reload failed: {type(stream.error).__name__}: {stream.error}")
            return None
        filled = False
        try:
            if fill is not None:
                stream.feed(fill())
                filled = True
            stream.finish(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the update is already failing; keep the first error
            model.recover(f"reload failed while aborting: {type(e).__name__}: {e}")
            return None
        return filled


class StreamingReload(Reload):
    """ "streaming": the first bucket starts the reload thread, every bucket feeds it, so the layers'
    processing overlaps the transfer of later buckets."""

    name = "streaming"

    def on_bucket(self, pairs: NamedTensors) -> None:
        if not pairs:
            return
        if self.stream is None:
            self.stream = ReloadStream(self.reload_fn)
        self.stream.feed(pairs)


class EndReload(Reload):
    """ "end": buckets are only kept; the whole reload runs after Done (slower, but an aborted update
    leaves the model's weights exactly as they were)."""

    name = "end"

    def on_done(self, kept: Callable[[], NamedTensors]) -> None:
        if self.stream is None and (pairs := kept()):
            self.start(pairs)


class BucketLoad(Reload):
    """ "bucket" (vLLM's load step): each bucket goes to the loaders before its Ack, as views of the
    PS's buffers (nothing kept); `unread` drops the tensors the engine's own reads already put into
    their parameter slots. `loaders_s`: time in the load function, summed over buckets."""

    name = "bucket"
    keeps = False

    def __init__(self, reload_fn: ReloadFn, timeout_s: float, unread: Callable[[NamedTensors], NamedTensors]) -> None:
        super().__init__(reload_fn, timeout_s)
        self._unread = unread
        self.loaders_s = 0.0

    def on_bucket(self, pairs: NamedTensors) -> None:
        rest = self._unread(pairs)
        if not rest:
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self.reload_fn(iter(rest))
        except Exception as e:
            raise reload_failed(e) from e
        self.loaders_s += time.perf_counter() - t0

    def abort(self, received: set[str], fill: Callable[[], NamedTensors] | None, model: Model) -> bool | None:
        if received:  # the loaders already wrote those parameters: nothing takes them back
            self.stream = None
            model.reload_error = "aborted load: only some buckets reached the parameters"
            return None
        return super().abort(received, fill, model)


def reload_for(
    mode: str, reload_fn: ReloadFn, timeout_s: float, unread: Callable[[NamedTensors], NamedTensors]
) -> Reload:
    """The strategy object of `mode` ("streaming", "end" or "bucket") for one update."""
    if mode == "bucket":
        return BucketLoad(reload_fn, timeout_s, unread)
    return {"streaming": StreamingReload, "end": EndReload}[mode](reload_fn, timeout_s)
