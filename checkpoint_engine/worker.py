"""Engine side of a weight update, engine-agnostic.

`update_weights_from_ipc` connects to its PS rank, maps the shared buffers once per update (or
reuses the mappings of earlier updates from a `MappingCache` the engine keeps), hands
`run` a list of `(name, tensor)` views for every bucket, and calls `post_hook` at the end. The views
alias shared memory that is reused two buckets later and are read-only on CPU: `run` must copy
what it keeps (loading into the model's parameters does).

    recv Hello ─▶ map buffers ─▶ Ready ─▶ { recv Bucket ─▶ run(views) ─▶ Ack }* ─▶ recv Done ─▶ post_hook ─▶ Ack
                                          any failure ─▶ Error ─▶ wait Abort ─▶ state incomplete, raise

Tensors the engine reads itself (remote buffers, `engine_reads`): those with a place in the model
are all read from Hello on; the others land in scratch, and a bucket of them is begun before its
turn when it arrives while the bucket before is still being read (two buckets in flight).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

import torch
import zmq

from checkpoint_engine import protocol as P
from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.state import EngineWeightState
from checkpoint_engine.transport.devices import open_buffer
from checkpoint_engine.transport.engine_reads import EngineReads
from checkpoint_engine.transport.shm import MappingCache
from ckpt_common.dtypes import dtype_from_name

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


class UpdateAborted(RuntimeError):
    """The update was aborted; the engine's weights are incomplete until a later update succeeds."""


def extract_views(buffers: list[torch.Tensor], tensors: tuple[P.WireTensor, ...]) -> NamedTensors:
    out: NamedTensors = []
    for t in tensors:
        if t.buffer >= len(buffers):
            raise P.ProtocolError(f"tensor {t.name!r} names buffer {t.buffer} but Hello shared {len(buffers)}")
        buffer = buffers[t.buffer]
        dtype = dtype_from_name(t.dtype)
        nbytes = dtype.itemsize
        for d in t.shape:
            nbytes *= d
        end = t.offset_bytes + nbytes
        if end > buffer.numel():
            raise P.ProtocolError(f"tensor {t.name!r} [{t.offset_bytes}, {end}) exceeds the shared buffer")
        if t.offset_bytes % dtype.itemsize:
            raise P.ProtocolError(f"tensor {t.name!r} offset {t.offset_bytes} is not aligned for {t.dtype}")
        out.append((t.name, buffer[t.offset_bytes : end].view(dtype).view(t.shape)))
    return out


def _verify(views: NamedTensors, tensors: tuple[P.WireTensor, ...]) -> None:
    for (name, view), meta in zip(views, tensors):
        if meta.checksum is not None and tensor_checksum(view) != meta.checksum:
            raise RuntimeError(f"checksum mismatch for tensor {name!r}: the bytes arrived corrupted")


def update_weights_from_ipc(
    zmq_ctx: zmq.Context,
    zmq_handle: str,
    device_id: int | None,
    *,
    run: Callable[[NamedTensors], None],
    post_hook: Callable[[], None] | None = None,
    state: EngineWeightState | None = None,
    timeout_s: float = 600.0,
    mapping_cache: MappingCache | None = None,
    on_hello: Callable[[P.Hello, list[torch.Tensor]], None] | None = None,
    remote_reads: EngineReads | None = None,
) -> EngineWeightState:
    """Receive one update from the PS rank listening at `zmq_handle`; return the engine's state.

    `timeout_s` bounds every wait for the next message. Raises UpdateAborted (after marking the
    state incomplete) when the update fails anywhere. `mapping_cache` (CPU): keep the shared
    segments mapped between updates instead of mapping them afresh each time. `on_hello(hello,
    buffers)` runs once the buffers are mapped: views into `buffers[i]` for i in
    `hello.stable_buffers` stay valid until Done, so `run` may keep them without copying.
    `remote_reads`: how this engine reads tensors of "remote" buffers itself (`engine_reads`);
    without it, an update that sends such buffers fails at once, naming why.
    """
    state = state if state is not None else EngineWeightState()
    sock = zmq_ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(zmq_handle)
    buffers: list[torch.Tensor | None] = []
    started = reading = False
    try:
        hello = _recv(sock, timeout_s, "the update's Hello")
        if not isinstance(hello, P.Hello):
            raise P.ProtocolError(f"expected Hello, got {type(hello).__name__}")
        state.begin(hello.checkpoint)
        started = True
        if any(h.kind == "remote" for h in hello.buffers):
            if remote_reads is None:
                raise RuntimeError(
                    "the parameter server asked this engine to read the weights itself (remote buffers), "
                    "but the engine has no transfer engine for that"
                )
            reading = True
            remote_reads.begin(hello.buffers, hello.p2p_host, hello.tensors)
        buffers = [None if h.kind == "remote" else open_buffer(h, device_id, mapping_cache) for h in hello.buffers]
        bad = [i for i in hello.stable_buffers if i >= len(buffers)]
        if bad:
            raise P.ProtocolError(f"Hello.stable_buffers names buffers {bad} but only {len(buffers)} were shared")
        if on_hello is not None:
            on_hello(hello, buffers)
        sock.send(P.encode(P.Ready(version=state.version, status=state.status.value)))
        return _serve(sock, hello, buffers, run, post_hook, state, timeout_s, remote_reads)
    except BaseException as e:
        if started and state.status.value == "receiving":
            state.abort(_short(e))
        if isinstance(e, UpdateAborted):
            raise
        raise UpdateAborted(f"weight update failed on the engine side: {_short(e)}") from e
    finally:
        buffers.clear()
        if reading:
            remote_reads.end()
        if mapping_cache is not None:
            mapping_cache.end_update()
        sock.close()


def _remote(hello: P.Hello, tensors: tuple[P.WireTensor, ...]) -> list[P.WireTensor]:
    n = len(hello.buffers)
    return [t for t in tensors if t.buffer < n and hello.buffers[t.buffer].kind == "remote"]


class StartedBucket:
    """One bucket begun: views of mapped buffers now, and the reads of its remote tensors in flight."""

    def __init__(
        self, buffers: list[torch.Tensor | None], hello: P.Hello, tensors: tuple[P.WireTensor, ...], reads
    ) -> None:
        remote = _remote(hello, tensors)
        names = {t.name for t in remote}
        self._tensors = tensors
        mapped = tuple(t for t in tensors if t.name not in names)
        self._local = dict(extract_views(buffers, mapped))
        if reads is not None and mapped and any(h.kind == "remote" for h in hello.buffers):
            reads.note_mapped(mapped)  # a pull the engine reads: its own rank's shard is mapped, counted here
        self._reads = reads.start(hello.buffers, remote) if remote else None

    def done(self) -> bool:
        return self._reads is None or self._reads.done()

    def views(self) -> NamedTensors:
        """The bucket's (name, tensor)s in order, once its reads have landed."""
        got = dict(self._reads.finish()) if self._reads is not None else {}
        return [(t.name, got[t.name] if t.name in got else self._local[t.name]) for t in self._tensors]


def _look_ahead(sock, hello, buffers, reads, current: StartedBucket, index: int, early: list, ahead: dict) -> None:
    """While bucket `index`'s reads are in flight, take the next message off the socket; if it is
    bucket `index + 1` and its reads run no loader (`EngineReads.knows`), start them now, so that two
    buckets' reads overlap. The message is queued in `early` either way."""
    while not current.done():
        if not sock.poll(1, zmq.POLLIN):
            continue
        msg = P.decode(sock.recv())
        early.append(msg)
        if isinstance(msg, P.Bucket) and msg.index == index + 1 and reads.knows(_remote(hello, msg.tensors)):
            try:
                ahead[msg.index] = StartedBucket(buffers, hello, msg.tensors, reads)
            except Exception as e:  # noqa: BLE001 - raised when that bucket's turn comes
                ahead[msg.index] = e
        return


def _serve(sock, hello, buffers, run, post_hook, state, timeout_s, reads=None) -> EngineWeightState:
    expected = 0
    failed: str | None = None
    early: list[P.Message] = []  # taken off the socket while a bucket's reads were in flight
    ahead: dict[int, StartedBucket | Exception] = {}  # the next bucket, begun early
    while True:
        msg = early.pop(0) if early else _recv(sock, timeout_s, f"bucket {expected} of {hello.num_buckets}")
        if isinstance(msg, P.Abort):
            if state.status.value == "receiving":
                state.abort(msg.reason)
            sock.send(P.encode(P.Ack(index=P.ABORT_ACK)))  # the PS returns once our state is honest
            raise UpdateAborted(msg.reason)
        if failed is not None:
            continue  # after an error only Abort matters; buckets already in flight are dropped
        if isinstance(msg, P.Bucket):
            if msg.index != expected:
                raise P.ProtocolError(f"expected bucket {expected}, got {msg.index}")
            try:
                started = ahead.pop(msg.index, None) or StartedBucket(buffers, hello, msg.tensors, reads)
                if isinstance(started, Exception):
                    raise started
                if reads is not None and not early:
                    _look_ahead(sock, hello, buffers, reads, started, msg.index, early, ahead)
                views = started.views()
                if hello.verify_checksums:
                    _verify(views, msg.tensors)
                run(views)
                if buffers[0] is not None and buffers[0].is_cuda:
                    torch.cuda.current_stream(buffers[0].device).synchronize()
            except Exception as e:  # noqa: BLE001 - reported to the PS, which aborts all ranks
                failed = f"bucket {msg.index}: {_short(e)}"
                state.abort(failed)
                logger.error("weight update failed in %s\n%s", failed, traceback.format_exc())
                sock.send(P.encode(P.Error(index=msg.index, reason=failed)))
                continue
            sock.send(P.encode(P.Ack(index=msg.index)))
            expected += 1
        elif isinstance(msg, P.Done):
            if expected != hello.num_buckets:
                raise P.ProtocolError(f"Done after {expected} of {hello.num_buckets} buckets")
            try:
                if post_hook is not None:
                    post_hook()
            except Exception as e:  # noqa: BLE001 - reported to the PS, which aborts all ranks
                failed = f"post_hook: {_short(e)}"
                state.abort(failed)
                sock.send(P.encode(P.Error(index=P.DONE_ACK, reason=failed)))
                continue
            state.complete()
            sock.send(P.encode(P.Ack(index=P.DONE_ACK)))
            return state
        else:
            raise P.ProtocolError(f"unexpected {type(msg).__name__} during an update")


def _recv(sock: zmq.Socket, timeout_s: float, what: str) -> P.Message:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            raise TimeoutError(
                f"no message from the parameter server within {timeout_s:.0f} s while waiting for {what}"
            )
        if sock.poll(min(remaining_ms, 1000), zmq.POLLIN):
            return P.decode(sock.recv())


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 400 else text[:397] + "..."


def __getattr__(name: str):
    """Compat shim: ``checkpoint_engine.worker.VllmColocateWorkerExtension`` is the path MoonshotAI's
    checkpoint-engine documents for vLLM's ``--worker-extension-cls``. The class lives on the vLLM
    side (``vllm_ext.worker``) and is imported only when asked for, so importing this module never
    imports vLLM. This is the engine core's only reference upward (vLLM resolves the flag with
    ``importlib.import_module`` + ``getattr``, which reaches this hook)."""
    if name == "VllmColocateWorkerExtension":
        from vllm_ext.worker import VllmColocateWorkerExtension

        return VllmColocateWorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
