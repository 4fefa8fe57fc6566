"""Typed control messages between a ParameterServer rank and its engine worker.

Encoded with msgpack (never pickle). Every message is a map with a "t" tag; `decode` validates
the tag and the field types and raises ProtocolError naming what is wrong.

    PS rank                                   engine worker
    Hello(update, checkpoint, buffers) ─────▶ map the shared buffers once (remote buffers: the
                                              engine reads those tensors itself, engine_reads.py,
                                              and Hello lists them all)
                                      ◀────── Ready(version)
    Bucket(i, tensors@offsets)        ──────▶ run(views)            (buckets i and i+1 in flight)
                                      ◀────── Ack(i) | Error(i, reason)
    Done(update)                      ──────▶ post_hook()
                                      ◀────── Ack(DONE_ACK)  (engine now at version+1)
    Abort(reason)                     ──────▶ engine marks its weights incomplete
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

DONE_ACK = -1  # Ack (and Error) index that answers Done
ABORT_ACK = -2  # Ack index that confirms an Abort


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""


@dataclass(frozen=True)
class BufferHandle:
    """How the engine reaches one buffer: a memfd of a PS process (CPU), a CUDA IPC handle, or
    ("remote") an owner's registered chunk that the engine reads itself through Mooncake: `peer` is
    the owner's transfer-engine address, `ptr` the chunk's address there."""

    kind: str  # "fd" | "cuda" | "remote"
    size_bytes: int
    pid: int = 0
    fd: int = -1
    cuda_args: tuple = ()
    peer: str = ""
    ptr: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("fd", "cuda", "remote"):
            raise ProtocolError(f"buffer kind must be 'fd', 'cuda' or 'remote', got {self.kind!r}")
        if not isinstance(self.size_bytes, int) or self.size_bytes <= 0:
            raise ProtocolError(f"buffer size_bytes must be a positive int, got {self.size_bytes!r}")
        if self.kind == "fd" and (self.pid <= 0 or self.fd < 0):
            raise ProtocolError(f"fd buffer needs a pid and an fd, got pid={self.pid} fd={self.fd}")
        if self.kind == "remote" and (not isinstance(self.peer, str) or not self.peer or self.ptr <= 0):
            raise ProtocolError(
                f"remote buffer needs a peer address and a pointer, got peer={self.peer!r} ptr={self.ptr}"
            )


@dataclass(frozen=True)
class WireTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: int  # index into Hello.buffers
    offset_bytes: int  # inside that buffer
    checksum: int | None = None


@dataclass(frozen=True)
class Hello:
    TAG: ClassVar[str] = "hello"
    update_id: str
    checkpoint: str
    num_buckets: int
    buffers: tuple[BufferHandle, ...]
    verify_checksums: bool = False
    # Indices of buffers whose bytes stay unchanged until Done (registered host chunks, as opposed
    # to the double buffer, which is overwritten two buckets later): views into them may be kept
    # for the whole update without copying.
    stable_buffers: tuple[int, ...] = ()
    # With "remote" buffers: the address the engine's own transfer engine announces (its PS rank's)
    p2p_host: str = ""
    # With "remote" buffers: every tensor of the update, buckets in order, so that the engine finds
    # where each lands before the first bucket (its Bucket messages name the same tensors again)
    tensors: tuple[WireTensor, ...] = ()


@dataclass(frozen=True)
class Bucket:
    TAG: ClassVar[str] = "bucket"
    index: int
    tensors: tuple[WireTensor, ...] = field(default=())


@dataclass(frozen=True)
class Done:
    TAG: ClassVar[str] = "done"
    update_id: str


@dataclass(frozen=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    reason: str


@dataclass(frozen=True)
class Ready:
    TAG: ClassVar[str] = "ready"
    version: int
    status: str


@dataclass(frozen=True)
class Ack:
    TAG: ClassVar[str] = "ack"
    index: int  # bucket index, DONE_ACK or ABORT_ACK


@dataclass(frozen=True)
class Error:
    TAG: ClassVar[str] = "error"
    index: int
    reason: str


MESSAGES = {cls.TAG: cls for cls in (Hello, Bucket, Done, Abort, Ready, Ack, Error)}
Message = Hello | Bucket | Done | Abort | Ready | Ack | Error

_TYPES: dict[str, type | tuple[type, ...]] = {
    "update_id": str,
    "checkpoint": str,
    "num_buckets": int,
    "verify_checksums": bool,
    "p2p_host": str,
    "index": int,
    "reason": str,
    "version": int,
    "status": str,
}


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"t": msg.TAG}
    for f in fields(msg):
        value = getattr(msg, f.name)
        if f.name == "buffers":
            value = [
                {
                    "kind": b.kind,
                    "size_bytes": b.size_bytes,
                    "pid": b.pid,
                    "fd": b.fd,
                    "cuda_args": list(b.cuda_args),
                    "peer": b.peer,
                    "ptr": b.ptr,
                }
                for b in value
            ]
        elif f.name == "tensors":
            value = [[t.name, t.dtype, list(t.shape), t.buffer, t.offset_bytes, t.checksum] for t in value]
        body[f.name] = value
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ProtocolError(f"undecodable message ({len(data)} bytes): {e}") from None
    if not isinstance(body, dict) or body.get("t") not in MESSAGES:
        raise ProtocolError(f"unknown message tag {body.get('t') if isinstance(body, dict) else body!r}")
    cls = MESSAGES[body.pop("t")]
    names = {f.name for f in fields(cls)}
    if set(body) - names:
        raise ProtocolError(f"{cls.__name__}: unexpected fields {sorted(set(body) - names)}")
    kwargs: dict[str, Any] = {}
    for name, value in body.items():
        if name == "buffers":
            if not isinstance(value, list) or not value:
                raise ProtocolError("Hello.buffers must be a non-empty list")
            value = tuple(_decode_buffer(v) for v in value)
        elif name == "tensors":
            value = _decode_tensors(value)
        elif name == "stable_buffers":
            if not isinstance(value, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
            ):
                raise ProtocolError(f"Hello.stable_buffers must be a list of buffer indices, got {value!r}")
            value = tuple(value)
        elif name in _TYPES and (
            not isinstance(value, _TYPES[name]) or (_TYPES[name] is int and isinstance(value, bool))
        ):
            raise ProtocolError(f"{cls.__name__}.{name}: expected {_TYPES[name]}, got {value!r}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ProtocolError(f"{cls.__name__}: {e}") from None


def _decode_buffer(value: Any) -> BufferHandle:
    if not isinstance(value, dict):
        raise ProtocolError(f"buffer handle must be a map, got {type(value).__name__}")
    try:
        return BufferHandle(
            kind=value["kind"],
            size_bytes=value["size_bytes"],
            pid=int(value.get("pid", 0)),
            fd=int(value.get("fd", -1)),
            cuda_args=tuple(value.get("cuda_args", ())),
            peer=str(value.get("peer", "")),
            ptr=int(value.get("ptr", 0)),
        )
    except KeyError as e:
        raise ProtocolError(f"buffer handle misses field {e}") from None
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"bad buffer handle: {e}") from None


def _decode_tensors(value: Any) -> tuple[WireTensor, ...]:
    if not isinstance(value, list):
        raise ProtocolError("bucket tensors must be a list")
    out = []
    for item in value:
        if not (
            isinstance(item, list)
            and len(item) == 6
            and isinstance(item[0], str)
            and isinstance(item[1], str)
            and isinstance(item[2], list)
            and all(isinstance(d, int) and d >= 0 for d in item[2])
            and isinstance(item[3], int)
            and item[3] >= 0
            and isinstance(item[4], int)
            and item[4] >= 0
            and (item[5] is None or isinstance(item[5], int))
        ):
            raise ProtocolError(f"malformed tensor entry {item!r}")
        out.append(WireTensor(item[0], item[1], tuple(item[2]), item[3], item[4], item[5]))
    return tuple(out)
