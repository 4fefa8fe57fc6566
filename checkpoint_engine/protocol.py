"""Typed control messages between a ParameterServer rank and its engine worker.

Encoded with msgpack (never pickle). Every message is a map with a "t" tag; `decode` validates
the tag and the field types and raises ProtocolError naming what is wrong.

    PS rank                                   engine worker
    Hello(update, checkpoint, buffer) ──────▶ map shared buffer once
                                      ◀────── Ready(version)
    Bucket(i, tensors@offsets)        ──────▶ run(views)            (buckets i and i+1 in flight)
                                      ◀────── Ack(i) | Error(i, reason)
    Done(update)                      ──────▶ post_hook()
                                      ◀────── Ack(-1)  (engine now at version+1)
    Abort(reason)                     ──────▶ engine marks its weights incomplete
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack


ABORT_ACK = -2  # Ack index that confirms an Abort


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""


@dataclass(frozen=True)
class BufferHandle:
    """How the engine maps the shared double buffer: POSIX shm path, or CUDA IPC storage handle."""

    kind: str  # "shm" | "cuda"
    size_bytes: int
    path: str = ""
    cuda_args: tuple = ()

    def __post_init__(self) -> None:
        if self.kind not in ("shm", "cuda"):
            raise ProtocolError(f"buffer kind must be 'shm' or 'cuda', got {self.kind!r}")
        if self.size_bytes <= 0:
            raise ProtocolError(f"buffer size_bytes must be positive, got {self.size_bytes}")
        if self.kind == "shm" and not self.path.startswith("/dev/shm/"):
            raise ProtocolError(f"shm buffer path must be under /dev/shm/, got {self.path!r}")


@dataclass(frozen=True)
class WireTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int  # inside the shared buffer
    checksum: int | None = None


@dataclass(frozen=True)
class Hello:
    TAG: ClassVar[str] = "hello"
    update_id: str
    checkpoint: str
    num_buckets: int
    buffer: BufferHandle
    verify_checksums: bool = False


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
    index: int  # bucket index, or -1 for Done


@dataclass(frozen=True)
class Error:
    TAG: ClassVar[str] = "error"
    index: int
    reason: str


MESSAGES = {cls.TAG: cls for cls in (Hello, Bucket, Done, Abort, Ready, Ack, Error)}
Message = Hello | Bucket | Done | Abort | Ready | Ack | Error

_TYPES: dict[str, type | tuple[type, ...]] = {
    "update_id": str, "checkpoint": str, "num_buckets": int, "verify_checksums": bool,
    "index": int, "reason": str, "version": int, "status": str,
}


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"t": msg.TAG}
    for f in fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, BufferHandle):
            value = {"kind": value.kind, "size_bytes": value.size_bytes, "path": value.path,
                     "cuda_args": list(value.cuda_args)}
        elif f.name == "tensors":
            value = [[t.name, t.dtype, list(t.shape), t.offset_bytes, t.checksum] for t in value]
        body[f.name] = value
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types
        raise ProtocolError(f"undecodable message ({len(data)} bytes): {e}") from None
    if not isinstance(body, dict) or body.get("t") not in MESSAGES:
        raise ProtocolError(f"unknown message tag {body.get('t') if isinstance(body, dict) else body!r}")
    cls = MESSAGES[body.pop("t")]
    names = {f.name for f in fields(cls)}
    if set(body) - names:
        raise ProtocolError(f"{cls.__name__}: unexpected fields {sorted(set(body) - names)}")
    kwargs: dict[str, Any] = {}
    for name, value in body.items():
        if name == "buffer":
            value = _decode_buffer(value)
        elif name == "tensors":
            value = _decode_tensors(value)
        elif name in _TYPES and (not isinstance(value, _TYPES[name]) or
                                 (_TYPES[name] is int and isinstance(value, bool))):
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
        return BufferHandle(kind=value["kind"], size_bytes=int(value["size_bytes"]),
                            path=str(value.get("path", "")), cuda_args=tuple(value.get("cuda_args", ())))
    except KeyError as e:
        raise ProtocolError(f"buffer handle misses field {e}") from None


def _decode_tensors(value: Any) -> tuple[WireTensor, ...]:
    if not isinstance(value, list):
        raise ProtocolError("bucket tensors must be a list")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 5 and isinstance(item[0], str)
                and isinstance(item[1], str) and isinstance(item[2], list)
                and all(isinstance(d, int) and d >= 0 for d in item[2])
                and isinstance(item[3], int) and item[3] >= 0
                and (item[4] is None or isinstance(item[4], int))):
            raise ProtocolError(f"malformed tensor entry {item!r}")
        out.append(WireTensor(item[0], item[1], tuple(item[2]), item[3], item[4]))
    return tuple(out)
