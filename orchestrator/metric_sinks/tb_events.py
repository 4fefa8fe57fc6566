"""TensorBoard event files, written and read by hand: TFRecord framing around protobuf ``Event`` messages.

::

    EventFileWriter.add_scalars(step, {tag: value}) ──▶ DIR/events.out.tfevents.<time>.<host>.<pid>.<n>
        (the file is created on the first event; its first record is Event{file_version: "brain.Event:2"})

    one record:  uint64 length | masked crc32c(length) | Event bytes | masked crc32c(Event bytes)
    Event:       wall_time (1, double)  step (2, varint)  file_version (3, string)  summary (5, Summary)
    Summary:     value (1, repeated Value)      Value: tag (1, string)  simple_value (2, float)

    read_records ──both CRCs checked──▶ decode_event ──▶ Event(wall_time, step, file_version, scalars)
    truncate_events(path, max_step): drops the events of steps > max_step (atomic rewrite; a resumed run
        calls it so that no step it writes again is also in an older file)

Neither TensorFlow nor tensorboard is needed: the format is small and fixed (TensorBoard reads
``simple_value`` scalars as it reads tf.summary's). crc32c is CRC-32 with the Castagnoli polynomial,
table-driven in pure Python: fast enough for one record per iteration and for rereading a run's history
on resume.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import pathlib
import socket
import struct
import time
from collections.abc import Iterator, Mapping

from ckpt_common.fsutil import atomic_write_bytes, fsync_dir

logger = logging.getLogger(__name__)

FILE_VERSION = "brain.Event:2"
FILE_MARKER = "tfevents"  # TensorBoard reads the files of a folder whose names contain it
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_FLOAT32_MAX = 3.4028234663852886e38


class CorruptEventFile(ValueError):
    """An event file whose bytes do not parse: a CRC mismatch, a torn record, a malformed Event."""


# -- crc32c -----------------------------------------------------------------------------------------
def _crc32c_table() -> tuple[int, ...]:
    """The 256 CRC values of one byte for the reflected Castagnoli polynomial 0x82F63B78."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, the checksum TFRecord uses."""
    crc = _U32
    table = _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _U32


def masked_crc32c(data: bytes) -> int:
    """TFRecord stores the CRC rotated right by 15 bits plus a constant, so that a CRC of data that
    itself holds CRCs does not degenerate."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


# -- TFRecord framing -------------------------------------------------------------------------------
def frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC (all little-endian)."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def read_records(path: str | os.PathLike[str], *, tolerate_damaged_tail: bool = False) -> list[bytes]:
    """The data of every record in the file, each checked against both CRCs.

    A damaged record (a torn one at the end: the writer was killed mid-write; or a CRC mismatch) raises
    ``CorruptEventFile``; with ``tolerate_damaged_tail`` it ends the reading instead, with a warning,
    and the records before it are returned (what a resumed run keeps)."""
    blob = pathlib.Path(path).read_bytes()
    records: list[bytes] = []
    pos = 0
    while pos < len(blob):
        problem = _record_problem(blob, pos)
        if problem is not None:
            message = f"{path}: the record at byte {pos} {problem}"
            if not tolerate_damaged_tail:
                raise CorruptEventFile(message)
            logger.warning("%s; keeping the %d records before it", message, len(records))
            break
        (length,) = struct.unpack_from("<Q", blob, pos)
        records.append(blob[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
    return records


def _record_problem(blob: bytes, pos: int) -> str | None:
    """Why the record starting at ``pos`` is unreadable, or None when both its CRCs match."""
    if len(blob) - pos < 12:
        return "is torn (the file ends inside its length header)"
    header = blob[pos : pos + 8]
    (header_crc,) = struct.unpack_from("<I", blob, pos + 8)
    if masked_crc32c(header) != header_crc:
        return "has a length that fails its CRC"
    (length,) = struct.unpack("<Q", header)
    if pos + 12 + length + 4 > len(blob):
        return f"is torn (its {length} bytes of data run past the end of the file)"
    data = blob[pos + 12 : pos + 12 + length]
    (data_crc,) = struct.unpack_from("<I", blob, pos + 12 + length)
    if masked_crc32c(data) != data_crc:
        return "has data that fails its CRC"
    return None


# -- protobuf encoding of Event ---------------------------------------------------------------------
def _varint(value: int) -> bytes:
    """Base-128 varint; a negative int64 as its 64-bit two's complement (ten bytes), as protobuf does."""
    value &= _U64
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    """A float32; finite values beyond its range become +-inf (what a float32 cast gives)."""
    if abs(value) > _FLOAT32_MAX:
        value = math.copysign(math.inf, value)
    return struct.pack("<f", value)


def encode_event(
    wall_time: float,
    *,
    step: int | None = None,
    file_version: str | None = None,
    scalars: Mapping[str, float] | None = None,
) -> bytes:
    """The protobuf bytes of one ``tensorflow.Event``: a file-version header or a summary of scalars."""
    out = _key(1, 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode("utf-8"))
    if scalars:
        summary = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode("utf-8")) + _key(2, 5) + _float32(value))
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, summary)
    return out


# -- protobuf decoding ------------------------------------------------------------------------------
@dataclasses.dataclass
class Event:
    """What this module reads of an ``Event``: other fields (graphs, images, ...) are skipped."""

    wall_time: float
    step: int = 0
    file_version: str | None = None
    scalars: dict[str, float] = dataclasses.field(default_factory=dict)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise CorruptEventFile("a varint runs past its message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value & _U64, pos


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of a message: an int for varints, else the bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
        elif wire_type in (1, 5):  # fixed 64 / fixed 32 bits
            size = 8 if wire_type == 1 else 4
            value, pos = data[pos : pos + size], pos + size
        elif wire_type == 2:
            size, pos = _read_varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        else:  # groups (3, 4) are not used by Event
            raise CorruptEventFile(f"field {field} has wire type {wire_type}, which Event does not use")
        if pos > len(data):
            raise CorruptEventFile(f"field {field} runs past its message")
        yield field, wire_type, value


def decode_event(data: bytes) -> Event:
    """The ``Event`` of one record's data (``CorruptEventFile`` if it is not a well-formed message)."""
    event = Event(wall_time=0.0)
    for field, wire_type, value in _fields(data):
        if field == 1 and wire_type == 1:
            (event.wall_time,) = struct.unpack("<d", value)
        elif field == 2 and wire_type == 0:
            event.step = value - (1 << 64) if value >= 1 << 63 else value  # int64
        elif field == 3 and wire_type == 2:
            event.file_version = value.decode("utf-8")
        elif field == 5 and wire_type == 2:
            for f, w, summary_value in _fields(value):
                if f == 1 and w == 2:
                    tag, scalar = _decode_value(summary_value)
                    if scalar is not None:
                        event.scalars[tag] = scalar
    return event


def _decode_value(data: bytes) -> tuple[str, float | None]:
    """A Summary.Value's tag and simple_value (None when it holds something else: an image, a tensor)."""
    tag, scalar = "", None
    for field, wire_type, value in _fields(data):
        if field == 1 and wire_type == 2:
            tag = value.decode("utf-8")
        elif field == 2 and wire_type == 5:
            (scalar,) = struct.unpack("<f", value)
    return tag, scalar


def read_events(path: str | os.PathLike[str], *, tolerate_damaged_tail: bool = False) -> list[Event]:
    """Every event of a file, in order (``read_records`` for the checks)."""
    return [decode_event(r) for r in read_records(path, tolerate_damaged_tail=tolerate_damaged_tail)]


# -- files ------------------------------------------------------------------------------------------
def event_files(logdir: str | os.PathLike[str]) -> list[pathlib.Path]:
    """The event files in ``logdir``, oldest first (their names start with the creation time)."""
    logdir = pathlib.Path(logdir)
    if not logdir.is_dir():
        return []
    return sorted(p for p in logdir.iterdir() if p.is_file() and FILE_MARKER in p.name and not p.name.startswith("."))


def truncate_events(path: str | os.PathLike[str], max_step: int) -> tuple[list[Event], int]:
    """Drop the events of steps > ``max_step`` (and a damaged tail) from an event file; returns the kept
    events and how many summary events were dropped. The file is rewritten atomically (kept records
    byte for byte), or removed when no summary is left in it."""
    path = pathlib.Path(path)
    records = read_records(path, tolerate_damaged_tail=True)
    events = [decode_event(r) for r in records]
    kept = [(r, e) for r, e in zip(records, events) if e.step <= max_step]
    dropped = sum(1 for e in events if e.step > max_step and e.scalars)
    if not any(e.scalars for _, e in kept):
        path.unlink()
        fsync_dir(path.parent)
        return [], dropped
    data = b"".join(frame(r) for r, _ in kept)
    if data != path.read_bytes():
        atomic_write_bytes(path, data)
    return [e for _, e in kept], dropped


class EventFileWriter:
    """Appends scalar events to a new event file in ``logdir``, created on the first event (a job that
    has nothing left to run leaves no empty file). Each event is flushed: a killed run loses at most a
    torn last record, which ``truncate_events`` drops on resume."""

    _counter = itertools.count()  # a process's files never share a name, even within one second

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = pathlib.Path(logdir)
        self.path: pathlib.Path | None = None
        self._file = None

    def add_scalars(self, step: int, scalars: Mapping[str, float], wall_time: float | None = None) -> None:
        if self._file is None:
            self._open()
        self._write(encode_event(time.time() if wall_time is None else wall_time, step=step, scalars=scalars))

    def _open(self) -> None:
        self.logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.{FILE_MARKER}.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.logdir / f"{name}.{next(self._counter)}"
        self._file = open(self.path, "xb")  # held open for the run; "x": never onto an existing file
        self._write(encode_event(time.time(), file_version=FILE_VERSION))

    def _write(self, event: bytes) -> None:
        self._file.write(frame(event))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
