"""Pure planning: where each tensor lives in host memory, and how tensors form buckets.

Nothing here touches memory, processes or the network; every function is table-tested.

    register:  [(name, dtype, shape)]  --layout_tensors-->  RankLayout (aligned offsets in chunks)
    gather:    {rank: RankLayout.metas} --check_global_metas--> names unique across ranks
    update:    {rank: metas} --plan_buckets(bucket_size_bytes)--> [Bucket(owner, chunk, byte range)]
               [bucket read in place?] --double_buffer_schedule--> [(half, acks needed before filling)]

A bucket is one contiguous byte range of one owner's chunk, so it moves with one copy and one
broadcast; tensor offsets inside it keep the chunk's alignment.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt_common.dtypes import itemsize

DEFAULT_ALIGN_BYTES = 256
MIN_ALIGN_BYTES = 16
# The default bucket size shrinks until a checkpoint is cut into PIPELINE_BUCKETS buckets (never below
# PIPELINE_MIN_BUCKET_BYTES): with one or two buckets the double buffer has nothing to overlap, and the
# engine's load of the last bucket adds to the read instead of hiding behind the next one.
PIPELINE_BUCKETS = 8
PIPELINE_MIN_BUCKET_BYTES = 16 * 2**20
# Across hosts (mode "relay") each bucket crosses two links in turn: the trainer's, then the first
# rank's broadcast to the others. A small update (a delta of a few tens of MiB) in 16 MiB buckets is
# two buckets, and the second link idles while the first fills: at 400 Mbit/s a 17 MB delta took
# 2.0 s in 16 MiB buckets and 1.1 s in 2 MiB ones (benchmarks/bench_hosts.py --delta,
# benchmarks/RESULTS.md). A link of tens of MB/s hides the per-bucket round trips (milliseconds).
PIPELINE_MIN_BUCKET_BYTES_RELAY = 2 * 2**20


def pipeline_min_bytes(mode: str) -> int:
    """The smallest default bucket for an update in `mode` (see PIPELINE_MIN_BUCKET_BYTES_RELAY)."""
    return PIPELINE_MIN_BUCKET_BYTES_RELAY if mode == "relay" else PIPELINE_MIN_BUCKET_BYTES


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor is, wherever it lives (`TensorMeta`: in host chunks; `host_memory.FileTensor`: in a file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorMeta(TensorSpec):
    """Where one registered tensor lives: `chunk` of its owner's host memory, at `offset_bytes`."""

    offset_bytes: int
    chunk: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset_bytes, self.chunk]

    @classmethod
    def from_wire(cls, item: Sequence) -> TensorMeta:
        if not isinstance(item, (list, tuple)) or len(item) != 5:
            raise ValueError(f"malformed tensor meta {item!r}")
        name, dtype, shape, offset, chunk = item
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise ValueError(f"malformed tensor meta {item!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
        if not isinstance(offset, int) or offset < 0 or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"tensor {name!r}: bad offset/chunk {offset!r}/{chunk!r}")
        itemsize(dtype)  # validates the dtype name
        return cls(name, dtype, tuple(shape), offset, chunk)


@dataclass(frozen=True)
class RankLayout:
    metas: tuple[TensorMeta, ...]
    chunk_sizes_bytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.chunk_sizes_bytes)


def layout_tensors(
    specs: Sequence[tuple[str, str, tuple[int, ...]]],
    *,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    max_chunk_bytes: int | None = None,
) -> RankLayout:
    """Place tensors, in order, at aligned offsets in chunks of at most `max_chunk_bytes`.

    A tensor larger than `max_chunk_bytes` gets a chunk of its own. Names must be unique.
    """
    if align_bytes < MIN_ALIGN_BYTES or align_bytes & (align_bytes - 1):
        raise ValueError(f"align_bytes must be a power of two >= {MIN_ALIGN_BYTES}, got {align_bytes}")
    if max_chunk_bytes is not None and max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
    seen: set[str] = set()
    metas: list[TensorMeta] = []
    chunk_sizes: list[int] = []
    chunk, cursor = 0, 0
    for name, dtype, shape in specs:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
        nbytes = math.prod(shape) * itemsize(dtype)
        offset = align_up(cursor, align_bytes)
        if max_chunk_bytes is not None and cursor > 0 and offset + nbytes > max_chunk_bytes:
            chunk_sizes.append(align_up(cursor, align_bytes))
            chunk, offset = chunk + 1, 0
        metas.append(TensorMeta(name, dtype, tuple(shape), offset, chunk))
        cursor = offset + nbytes
    if metas:
        chunk_sizes.append(align_up(max(cursor, 1), align_bytes))
    return RankLayout(tuple(metas), tuple(chunk_sizes))


def check_global_metas(rank_metas: Mapping[int, Sequence[TensorMeta]]) -> int:
    """Raise ValueError if a tensor name is owned by two ranks; return the number of tensors."""
    owner: dict[str, int] = {}
    for rank in sorted(rank_metas):
        for meta in rank_metas[rank]:
            if meta.name in owner:
                raise ValueError(
                    f"tensor {meta.name!r} is registered on rank {owner[meta.name]} and on rank {rank}; "
                    "each tensor must have exactly one owner rank"
                )
            owner[meta.name] = rank
    return len(owner)


@dataclass(frozen=True)
class Bucket:
    """One transfer unit: bytes [start_bytes, start_bytes + size_bytes) of `chunk` on `owner_rank`."""

    index: int
    owner_rank: int
    chunk: int
    start_bytes: int
    size_bytes: int
    tensors: tuple[TensorMeta, ...]


def plan_buckets(rank_metas: Mapping[int, Sequence[TensorMeta]], bucket_size_bytes: int) -> list[Bucket]:
    """Cut every owner's tensors into contiguous buckets of at most `bucket_size_bytes`.

    Buckets of different owners are interleaved (round robin) so consecutive buckets come from
    different sources. Raises ValueError naming a tensor that does not fit in one bucket.
    """
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
    per_owner: list[list[tuple[int, int, int, int, tuple[TensorMeta, ...]]]] = []
    for rank in sorted(rank_metas):
        runs: list[tuple[int, int, int, int, tuple[TensorMeta, ...]]] = []
        metas = sorted(rank_metas[rank], key=lambda m: (m.chunk, m.offset_bytes))
        cur: list[TensorMeta] = []
        for meta in metas:
            if meta.nbytes > bucket_size_bytes:
                raise ValueError(
                    f"tensor {meta.name!r} (rank {rank}) needs {meta.nbytes} bytes, more than "
                    f"bucket_size_bytes={bucket_size_bytes}; set bucket_size_bytes to at least {meta.nbytes}"
                )
            if cur and (
                meta.chunk != cur[0].chunk or meta.offset_bytes + meta.nbytes - cur[0].offset_bytes > bucket_size_bytes
            ):
                runs.append(_close(rank, cur))
                cur = []
            cur.append(meta)
        if cur:
            runs.append(_close(rank, cur))
        per_owner.append(runs)
    buckets: list[Bucket] = []
    for i in range(max((len(r) for r in per_owner), default=0)):
        for runs in per_owner:
            if i < len(runs):
                rank, chunk, start, size, tensors = runs[i]
                buckets.append(Bucket(len(buckets), rank, chunk, start, size, tensors))
    return buckets


def double_buffer_schedule(in_place: Sequence[bool], in_place_lag: int = 2) -> list[tuple[int | None, int]]:
    """For each bucket of an update, in order: the double-buffer half it fills (None: the engine
    reads it in place, e.g. a rank's own chunk) and how many buckets the engine must have acked
    before it is filled.

    A bucket that fills a half waits for the ack of the last bucket that filled the same half; a
    bucket read in place waits for the ack of the bucket `in_place_lag` before it (the engine stays
    at most that many buckets behind, so an abort reaches it soon). With every bucket in a half this
    is the usual "ack i-2 before bucket i". When buckets read in place sit between them (a pull
    whose rank owns part of the checkpoint), the next read only waits for the half it reuses, so it
    overlaps the engine's load of the bucket just read instead of following it.
    """
    if in_place_lag < 1:
        raise ValueError(f"in_place_lag={in_place_lag!r} must be >= 1")
    out: list[tuple[int | None, int]] = []
    last_filled: list[int] = [-1, -1]  # per half: the last bucket that filled it
    halves_used = 0
    for i, direct in enumerate(in_place):
        if direct:
            out.append((None, max(i - in_place_lag + 1, 0)))
        else:
            half = halves_used % 2
            halves_used += 1
            out.append((half, last_filled[half] + 1))
            last_filled[half] = i
    return out


def _close(rank: int, metas: list[TensorMeta]) -> tuple[int, int, int, int, tuple[TensorMeta, ...]]:
    start = metas[0].offset_bytes
    end = max(m.offset_bytes + m.nbytes for m in metas)
    return rank, metas[0].chunk, start, end - start, tuple(metas)


def choose_bucket_size(
    rank_metas: Mapping[int, Sequence[TensorMeta]],
    *,
    requested_bytes: int | None,
    default_bytes: int,
    budget_bytes: int | None,
    num_buffers: int = 2,
    pipeline_buckets: int = PIPELINE_BUCKETS,
    pipeline_min_bytes: int = PIPELINE_MIN_BUCKET_BYTES,
) -> int:
    """The bucket size for an update.

    An explicit `requested_bytes` wins (tensors that do not fit then fail in `plan_buckets`). Otherwise
    the default, lowered to total / `pipeline_buckets` (not below `pipeline_min_bytes`) so the
    pipeline has buckets to overlap, never more than the whole checkpoint, raised to the largest
    tensor, capped by `budget_bytes / num_buffers`. Raises ValueError when even the largest tensor
    does not fit in the memory budget.
    """
    if requested_bytes is not None:
        if requested_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {requested_bytes}")
        return requested_bytes
    largest = max((m.nbytes for metas in rank_metas.values() for m in metas), default=0)
    total = sum(m.nbytes for metas in rank_metas.values() for m in metas)
    pipelined = max(-(-total // pipeline_buckets), pipeline_min_bytes)
    size = align_up(max(min(default_bytes, pipelined, total), largest, 1), MIN_ALIGN_BYTES)
    if budget_bytes is not None:
        cap = budget_bytes // num_buffers
        if largest > cap:
            raise ValueError(
                f"the largest tensor needs {largest} bytes but the memory budget allows buckets of "
                f"{cap} bytes ({num_buffers} buffers in {budget_bytes} bytes); free memory or lower the "
                "tensor size"
            )
        size = min(size, max(cap // MIN_ALIGN_BYTES * MIN_ALIGN_BYTES, largest))
    return size


def plan_digest(buckets: Sequence[Bucket]) -> bytes:
    """A 16-byte digest of a plan; ranks compare digests before moving any byte."""
    h = hashlib.blake2b(digest_size=16)
    for b in buckets:
        h.update(f"{b.index}|{b.owner_rank}|{b.chunk}|{b.start_bytes}|{b.size_bytes}".encode())
        for m in b.tensors:
            h.update(f"|{m.name}|{m.dtype}|{m.shape}|{m.offset_bytes}".encode())
    return h.digest()
