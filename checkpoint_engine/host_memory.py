"""Registering a checkpoint: copy its tensors into aligned host chunks owned by this rank.

Sources are safetensors files (read straight into the chunks, header validated by us) and/or
in-memory tensors. The layout comes from `buckets.layout_tensors`; buckets later slice the chunks.

Zero-copy registration (CPU transport): tensors that are views of a `SharedTensorBuffer` of this
process (one memfd segment, filled in place, possibly by other processes on this host) are adopted:
the segment itself becomes the checkpoint's chunk (`adopt_shared_buffer`), nothing is copied.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from checkpoint_engine.buckets import DEFAULT_ALIGN_BYTES, RankLayout, TensorMeta, TensorSpec, layout_tensors
from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.protocol import BufferHandle
from checkpoint_engine.transport import shm
from checkpoint_engine.transport.devices import HostChunk
from ckpt_common.dtypes import dtype_from_name, dtype_from_safetensors, dtype_name, itemsize

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class FileTensor(TensorSpec):
    path: str
    start_bytes: int  # absolute offset in the file
    nbytes: int


def read_safetensors_index(path: str) -> list[FileTensor]:
    """Parse and validate a safetensors header; raise ValueError naming the file and the problem."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise ValueError(f"{path}: corrupt safetensors header length {n} (file has {size} bytes)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ValueError(f"checkpoint file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtype_from_safetensors(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: bad header entry for tensor {name!r}: {e}") from None
        nbytes = math.prod(shape) * itemsize(dtype)
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise ValueError(
                f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but needs {nbytes} bytes inside a "
                f"{size - base}-byte data section (truncated or corrupt file?)"
            )
        out.append(FileTensor(name, dtype, shape, path, base + begin, nbytes))
    return out


class HostMemoryPool:
    """Host chunks of unregistered checkpoints, kept for the next registration of the same sizes.

    An RL run registers a new checkpoint of the same shapes every iteration and unregisters the
    previous one: reusing its chunks skips allocating and page-faulting fresh memory, and engines
    that keep their mappings (``shm.MappingCache``) find the same segments again. With
    ``enabled=False`` a released chunk is freed at once. Chunks that a registration did not reuse
    are freed once it completes (``trim``), so the pool never holds more than one unregistered
    generation; ``trim()`` frees everything now.
    """

    def __init__(self, alloc_host: Callable[[int], HostChunk], *, enabled: bool) -> None:
        self._alloc_host = alloc_host
        self.enabled = enabled
        self._free: dict[int, list[HostChunk]] = {}
        self.num_reused = 0
        self.num_allocated = 0

    @property
    def free_bytes(self) -> int:
        return sum(size * len(chunks) for size, chunks in self._free.items())

    def alloc(self, nbytes: int) -> HostChunk:
        free = self._free.get(nbytes)
        if free:
            raw = free.pop()
            self.num_reused += 1
        else:
            raw = self._alloc_host(nbytes)
            self.num_allocated += 1
        return HostChunk(raw.tensor, raw.handle, lambda: self._release(nbytes, raw))

    def _release(self, nbytes: int, raw: HostChunk) -> None:
        if self.enabled:
            self._free.setdefault(nbytes, []).append(raw)
        else:
            raw.close()

    def trim(self) -> None:
        """Free every pooled chunk."""
        free, self._free = self._free, {}
        for chunks in free.values():
            for c in chunks:
                c.close()


@dataclass
class RegisteredCheckpoint:
    name: str
    layout: RankLayout
    chunks: list[HostChunk]
    _checksums: dict[str, int] | None = field(default=None, repr=False)
    adopted: bool = False  # the chunk is a SharedTensorBuffer's segment (registered without a copy)

    def chunk(self, index: int) -> torch.Tensor:
        return self.chunks[index].tensor

    def close(self) -> None:
        for c in self.chunks:
            c.close()
        self.chunks = []

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.layout.metas)

    def view(self, meta: TensorMeta) -> torch.Tensor:
        raw = self.chunk(meta.chunk)[meta.offset_bytes : meta.offset_bytes + meta.nbytes]
        return raw.view(dtype_from_name(meta.dtype)).view(meta.shape)

    def checksums(self) -> dict[str, int]:
        if self._checksums is None:
            self._checksums = {m.name: tensor_checksum(self.view(m)) for m in self.layout.metas}
        return self._checksums


def register_tensors(
    name: str,
    *,
    files: Sequence[str] | None,
    named_tensors: Mapping[str, torch.Tensor] | None,
    alloc_host: Callable[[int], HostChunk],
    align_bytes: int,
    max_chunk_bytes: int | None,
) -> RegisteredCheckpoint:
    file_tensors = [t for path in (files or []) for t in read_safetensors_index(str(path))]
    mem = dict(named_tensors or {})
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    seen: dict[str, str] = {}
    for ft in file_tensors:
        if ft.name in seen:
            raise ValueError(f"duplicate tensor name {ft.name!r} in {seen[ft.name]} and {ft.path}")
        seen[ft.name] = ft.path
        specs.append((ft.name, ft.dtype, ft.shape))
    for tname, t in mem.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"named_tensors[{tname!r}] is a {type(t).__name__}, not a torch.Tensor")
        if tname in seen:
            raise ValueError(f"duplicate tensor name {tname!r} in {seen[tname]} and named_tensors")
        seen[tname] = "named_tensors"
        try:
            specs.append((tname, dtype_name(t.dtype), tuple(t.shape)))
        except ValueError as e:
            raise ValueError(f"tensor {tname!r}: {e}") from None
    layout = layout_tensors(specs, align_bytes=align_bytes, max_chunk_bytes=max_chunk_bytes)
    ckpt = RegisteredCheckpoint(name, layout, [])
    try:
        for n in layout.chunk_sizes_bytes:
            ckpt.chunks.append(alloc_host(n))
        metas = {m.name: m for m in layout.metas}
        _fill_from_files(ckpt, file_tensors, metas)
        for tname, t in mem.items():
            dst = ckpt.view(metas[tname])
            dst.copy_(t.detach().reshape(dst.shape))
    except BaseException:
        ckpt.close()
        raise
    logger.info(
        "registered checkpoint %r: %d tensors, %.3f GiB in %d chunks",
        name,
        len(specs),
        ckpt.nbytes / 2**30,
        len(ckpt.chunks),
    )
    return ckpt


def _fill_from_files(ckpt: RegisteredCheckpoint, file_tensors: list[FileTensor], metas: dict[str, TensorMeta]) -> None:
    by_file: dict[str, list[FileTensor]] = {}
    for ft in file_tensors:
        by_file.setdefault(ft.path, []).append(ft)
    for path, items in by_file.items():
        with open(path, "rb", buffering=0) as f:
            for ft in sorted(items, key=lambda x: x.start_bytes):
                if ft.nbytes == 0:
                    continue
                meta = metas[ft.name]
                dst = ckpt.chunk(meta.chunk)[meta.offset_bytes : meta.offset_bytes + ft.nbytes]
                if dst.device.type != "cpu":
                    raise AssertionError("host chunks must live in host memory")
                f.seek(ft.start_bytes)
                view = memoryview(dst.numpy())
                got = 0
                while got < ft.nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{path}: unexpected end of file reading tensor {ft.name!r}")
                    got += n


# SharedTensorBuffers alive in this process, by the address of their mapping (found by data pointer).
_LIVE_BUFFERS: dict[int, weakref.ref] = {}


class SharedTensorBuffer:
    """Named tensors at aligned offsets in ONE memfd segment created by this process: a checkpoint
    written in place, then registered by a ParameterServer of this process without a copy.

        buf = SharedTensorBuffer([(name, dtype, shape), ...])    layout: buckets.layout_tensors, one chunk
        this process writes buf.tensors[name]; another process on this host writes
            SharedTensorBuffer.views(shm.map_writable(buf.ref), buf.layout)   (/proc/<pid>/fd/<fd>)
        ps.register_checkpoint(name, named_tensors=buf.tensors)   adopted: the segment is the chunk
        ps.unregister_checkpoint(name)                            released: buf may be written again

    ``register_checkpoint`` adopts when every tensor it is given is the view of ``buf.tensors`` of
    the same name (dtype, shape, offset), no files come with them, the transport is the CPU one and
    the buffer is not adopted already; otherwise it copies as usual. While adopted
    (``adopted_by`` names the checkpoint) engines and P2P readers read these bytes: the owner must
    not write them (take another buffer). ``close()`` of an adopted buffer waits for the release.
    """

    def __init__(
        self, specs: Sequence[tuple[str, str, tuple[int, ...]]], *, align_bytes: int = DEFAULT_ALIGN_BYTES, tag="shared"
    ) -> None:
        self.layout = layout_tensors(specs, align_bytes=align_bytes)  # no max_chunk_bytes: one chunk
        if len(self.layout.chunk_sizes_bytes) != 1:
            raise ValueError("a SharedTensorBuffer needs at least one tensor")
        self._segment: shm.Segment | None = shm.Segment(self.layout.chunk_sizes_bytes[0], tag)
        self.ref = self._segment.ref
        self.tensors = self.views(self._segment.tensor, self.layout)
        self.adopted_by: str | None = None
        self._closing = False
        self._base = self._segment.tensor.data_ptr()
        _LIVE_BUFFERS[self._base] = weakref.ref(self)

    @staticmethod
    def views(raw: torch.Tensor, layout: RankLayout) -> dict[str, torch.Tensor]:
        """{name: typed view} of a mapping (uint8) of a buffer's segment laid out as ``layout``."""
        out = {}
        for m in layout.metas:
            out[m.name] = raw[m.offset_bytes : m.offset_bytes + m.nbytes].view(dtype_from_name(m.dtype)).view(m.shape)
        return out

    @property
    def nbytes(self) -> int:
        return self.ref.size_bytes

    def contains(self, ptr: int) -> bool:
        return self._segment is not None and self._base <= ptr < self._base + self.ref.size_bytes

    def close(self) -> None:
        """Free the segment now, or when the checkpoint that adopted it is unregistered."""
        self._closing = True
        if self.adopted_by is None:
            self._free()

    def _release(self) -> None:
        self.adopted_by = None
        if self._closing:
            self._free()

    def _free(self) -> None:
        if self._segment is None:
            return
        _LIVE_BUFFERS.pop(self._base, None)
        self.tensors = {}
        self._segment.close()
        self._segment = None

    def __del__(self) -> None:  # never adopted (a checkpoint's chunk keeps its buffer alive): free the fd
        entry = _LIVE_BUFFERS.get(getattr(self, "_base", None))
        if entry is not None and entry() is None:  # our entry (a later buffer at this address has a live one)
            _LIVE_BUFFERS.pop(self._base, None)
        if getattr(self, "_segment", None) is not None:
            self._segment.close()


def find_shared_buffer(named_tensors: Mapping[str, torch.Tensor], align_bytes: int) -> SharedTensorBuffer | None:
    """The buffer ``register_checkpoint`` may adopt for ``named_tensors``, or None (then it copies)."""
    if not named_tensors:
        return None
    first = next(iter(named_tensors.values()))
    if not isinstance(first, torch.Tensor) or first.device.type != "cpu":
        return None
    buffer = None
    for ref in list(_LIVE_BUFFERS.values()):
        candidate = ref()
        if candidate is not None and candidate.contains(first.data_ptr()):
            buffer = candidate
            break
    if buffer is None:
        return None
    why = None
    if buffer.adopted_by is not None:
        why = f"it is registered already as {buffer.adopted_by!r}"
    else:
        for tname, t in named_tensors.items():
            view = buffer.tensors.get(tname)
            if not isinstance(t, torch.Tensor) or view is None or t.device.type != "cpu":
                why = f"{tname!r} is not one of its tensors"
            elif t.data_ptr() != view.data_ptr() or t.dtype != view.dtype or t.shape != view.shape:
                why = f"{tname!r} is not its view of that name"
            elif not t.is_contiguous() or (t.data_ptr() - buffer._base) % align_bytes:
                why = f"{tname!r} is not contiguous at a multiple of align_bytes={align_bytes}"
            if why:
                break
    if why:
        logger.info("tensors lie in a shared buffer but are copied: %s", why)
        return None
    return buffer


def adopt_shared_buffer(
    name: str, named_tensors: Mapping[str, torch.Tensor], buffer: SharedTensorBuffer
) -> RegisteredCheckpoint:
    """Register ``named_tensors`` (checked by ``find_shared_buffer``) in place: the buffer's segment
    is the checkpoint's one chunk until it is unregistered (no copy, no new memory)."""
    assert buffer._segment is not None and buffer.adopted_by is None
    metas = tuple(m for m in buffer.layout.metas if m.name in named_tensors)
    layout = RankLayout(metas, buffer.layout.chunk_sizes_bytes)
    ref = buffer.ref
    handle = BufferHandle(kind="fd", size_bytes=ref.size_bytes, pid=ref.pid, fd=ref.fd)
    buffer.adopted_by = name
    chunk = HostChunk(buffer._segment.tensor, handle, buffer._release)
    ckpt = RegisteredCheckpoint(name, layout, [chunk], adopted=True)
    logger.info(
        "registered checkpoint %r without a copy: %d tensors, %.3f GiB adopted from a shared buffer",
        name,
        len(metas),
        ckpt.nbytes / 2**30,
    )
    return ckpt
