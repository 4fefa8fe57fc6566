"""Delta updates: per version, send only the engine-dtype values that changed since the engine's version.

After one RL step most low-precision engine values keep their bits (on the demo: 99 % of float32
values change, 33 % of their bfloat16 casts, 1 % of float8), so the cast weights of version v differ
from those of v-1 in few places. Everything here is pure (no processes, no network) and table-tested.

    sender, per tensor:   base (engine dtype, version v-1, kept in host memory)   new (cast of version v)
        encode(base, new) --bits differ?--> mask (k of n changed)
                          --fewest bytes--> dense | sparse | bitmask | gaps   (+ zstd per part, if smaller)
                          --> TensorDelta(payload parts, crc32(base), crc32(new))
    sender, per version:  encode_version({name: base}, {name: new}) --> VersionDelta (bytes, changed share)
        choose_update(engine's version, delta's base version, delta bytes, full bytes,
                      deltas since the last full version, anchor_every) --> "delta" | "full"
    engine, per version:  apply_version(weights, delta)
        every tensor: payload well formed (zstd frames, sizes, gap width, indices in range) and
        crc32(weights[name]) == base_checksum?  (no: DeltaMismatch naming the tensor, nothing written)
        --write the changed values--> crc32(weights[name]) == new_checksum?  (no: DeltaMismatch)

Values are compared as bit patterns (viewed as an integer dtype of the same width), so -0.0 vs +0.0
and NaNs with other payloads count as changes and a round trip is bitwise exact. The values sent are
the NEW values (never differences), so nothing drifts however many deltas follow each other.

Encodings, for n elements of s bytes of which k changed (bytes on the wire = `TensorDelta.nbytes`):
    dense    n*s                      the whole new tensor
    sparse   k*i + k*s                flat indices (int32: i = 4; int64: i = 8 when n >= 2**31) + the values
    bitmask  ceil(n/8) + k*s          one bit per element (little-endian in each byte) + the changed values
    gaps     k*w + k*s                the gaps between consecutive changed flat indices (the first: its
                                      index), each in w bytes little-endian, w the narrowest of 1, 2, 4, 8
                                      that holds the largest gap (recorded as `gap_width`) + the values
The smallest wins; ties go to the earlier one in ENCODINGS (dense, sparse, bitmask, gaps: the older
and simpler first), so sparse wins only where gaps need as many bytes as an index. Gaps win below about
1/(8w) changed (12.5 % when every gap is under 256, 6.25 % under 65536), the bitmask above, dense when
(almost) everything changed.

Compression (`compress=True`): each payload part is compressed with zstd (level 1, after splitting
multi-byte elements into byte planes, the first bytes of every element first: Blosc's "shuffle") and
the frame is kept only if it is smaller than the part (`TensorDelta.compressed` says which). Measured
on an AMD EPYC (`lscpu`: "AMD EPYC", 2 vCPUs, 1 torch thread; `benchmarks/bench_delta_encoding.py`: a
4096x4096 N(0, 0.02) weight, bf16 and fp8 e4m3 in 128x128 blocks with float32 scales, a share of the
values moved by one last bit at random places), compressed / raw bytes of each part:
    bf16 changed values           0.69-0.72  (the sign-and-exponent plane has few values; 0.78 unshuffled)
    fp8 e4m3 changed values       0.82
    gaps at 1 % changed (2 bytes) 0.54       (the high bytes are mostly 0)
    gaps at 10 % changed (1 byte) 0.59
    bitmask at 33 % changed       0.92
so a whole delta goes as 0.63-0.72 of its raw bytes in bf16 and 0.63-0.85 in fp8 (1 %, 10 %, 33 %
changed), for zstd's ~0.28 GB/s a core: it pays where the wire is slower than that, not on one host.

Anchors (`choose_update(..., anchor_every=K)`): a full version every K versions (after K-1 deltas in
a row), and whenever the delta is not smaller than the full version (or more than `max_ratio` of it).

Host memory: the sender must keep the base version, i.e. one more copy of the whole model in the engine
dtype in host memory (for a 7B model in bfloat16: 14 GiB more), for as long as an engine may hold it.
Without it there is nothing to diff against and every update is a full one. Applying a version keeps
each tensor's decoded payload (decompressed parts, int64 indices) from the checks to the writes.

Devices: encode and apply take tensors on any device (the comparison, indices, gaps and writes are torch
ops on the tensors' device); only the payload's bytes are moved to the CPU (the wire) and back, and
each tensor's bytes for its CRC-32 (checkpoint_engine.checksum hashes on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from checkpoint_engine.checksum import tensor_checksum
from ckpt_common.dtypes import dtype_from_name, dtype_name

ENCODINGS = ("dense", "sparse", "bitmask", "gaps")  # tie order: the earlier (older, simpler) first
GAP_WIDTHS = (1, 2, 4, 8)  # bytes per gap
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-pattern views
_INT32_INDEX_LIMIT = 2**31  # flat indices below it fit int32
ZSTD_LEVEL = 1  # level 3 was no smaller on these payloads (bf16 values 0.71 vs 0.69) and 1.6x slower


class DeltaMismatch(ValueError):
    """A delta does not fit the tensor it is applied to (other version, corrupted base, bad payload)."""


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name is not None else "tensor"


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's change from its base to its new value: `payload` (CPU, contiguous) per `encoding`:
    dense (new values,), sparse (indices, changed values), bitmask (packed bits uint8, changed values),
    gaps (gaps as uint8 bytes, `gap_width` each, changed values). A part marked in `compressed` is a
    uint8 zstd frame of that part's bytes (byte planes first when its elements have several bytes)."""

    encoding: str
    shape: tuple[int, ...]
    dtype: str  # ckpt_common.dtypes name
    payload: tuple[torch.Tensor, ...]
    num_changed: int
    base_checksum: int
    new_checksum: int
    gap_width: int = 0  # bytes per gap (gaps only)
    compressed: tuple[bool, ...] = ()  # per payload part; () = none

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the payload tensors' bytes."""
        return sum(t.numel() * t.element_size() for t in self.payload)

    @property
    def full_bytes(self) -> int:
        """Bytes of a full update of this tensor."""
        return self.numel * dtype_from_name(self.dtype).itemsize


def gap_width(max_gap: int) -> int:
    """The narrowest of GAP_WIDTHS whose unsigned integers hold `max_gap`."""
    for w in GAP_WIDTHS:
        if max_gap < 1 << (8 * w):
            return w
    raise ValueError(f"gap {max_gap} does not fit {GAP_WIDTHS[-1]} bytes")


def encoding_sizes(numel: int, num_changed: int, itemsize: int, max_gap: int | None = None) -> dict[str, int]:
    """Exact payload bytes of each encoding (before compression) for `num_changed` of `numel` values of
    `itemsize` bytes; `max_gap`: the largest gap between changed indices (None: the widest possible)."""
    index_size = 4 if numel < _INT32_INDEX_LIMIT else 8
    values = num_changed * itemsize
    widest = gap_width(max(numel - 1, 0)) if max_gap is None else gap_width(max_gap)
    return {
        "dense": numel * itemsize,
        "sparse": num_changed * index_size + values,
        "bitmask": (numel + 7) // 8 + values,
        "gaps": num_changed * widest + values,
    }


def choose_encoding(numel: int, num_changed: int, itemsize: int, max_gap: int | None = None) -> str:
    """The encoding with the fewest bytes; ties go to the earlier one in ENCODINGS (the simpler)."""
    sizes = encoding_sizes(numel, num_changed, itemsize, max_gap)
    return min(ENCODINGS, key=lambda e: (sizes[e], ENCODINGS.index(e)))


def _bits(t: torch.Tensor, name: str | None) -> torch.Tensor:
    """The flat bit patterns of `t` as an integer tensor of the same width (a view when contiguous)."""
    int_dtype = _INT_OF_WIDTH.get(t.element_size())
    if int_dtype is None:
        raise ValueError(f"{_label(name)}: dtype {t.dtype} has no integer view of {t.element_size()} bytes")
    return t.reshape(-1).view(int_dtype)


# -- bit and gap packing: torch ops on the tensors' device (numpy's packbits where that is the CPU) ----------
_BIT_WEIGHTS = [1 << i for i in range(8)]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as bytes, bit i of byte j = mask[8j + i]; on the mask's device."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    return pack_bits_torch(mask)


def pack_bits_torch(mask: torch.Tensor) -> torch.Tensor:
    """pack_bits with torch ops only (any device; the same bytes as numpy's packbits)."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """pack_bits' inverse: `numel` bools (the padding bits of the last byte dropped); on packed's device."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(bool))
    return unpack_bits_torch(packed, numel)


def unpack_bits_torch(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """unpack_bits with torch ops only (any device)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return (packed.reshape(-1, 1) & weights).ne(0).reshape(-1)[:numel]


def gaps_to_bytes(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Ascending int64 flat indices as their gaps (the first: its index), `width` bytes little-endian each."""
    gaps = torch.diff(indices, prepend=indices.new_zeros(1))
    return gaps.view(torch.uint8).view(-1, 8)[:, :width].contiguous().reshape(-1)  # torch is little-endian


def bytes_to_gaps(raw: torch.Tensor, width: int) -> torch.Tensor:
    """gaps_to_bytes' bytes back to int64 gaps (not yet summed), on raw's device."""
    k = raw.numel() // width
    padded = torch.zeros(k, 8, dtype=torch.uint8, device=raw.device)
    padded[:, :width] = raw.view(k, width)
    return padded.view(torch.int64).reshape(k)


# -- zstd per payload part ------------------------------------------------------------------------------------
def _planes(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes of `width`-byte elements as byte planes (every element's first byte, then every second...)."""
    return raw.view(-1, width).t().contiguous().reshape(-1) if width > 1 else raw


def _unplanes(raw: torch.Tensor, width: int) -> torch.Tensor:
    return raw.view(width, -1).t().contiguous().reshape(-1) if width > 1 else raw


def _compress(part: torch.Tensor, width: int) -> torch.Tensor | None:
    """The part (CPU) as a uint8 zstd frame of its byte planes, or None when that is not smaller."""
    if part.numel() == 0:
        return None
    raw = _planes(part.reshape(-1).view(torch.uint8), width)
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(memoryview(raw.numpy()))
    if len(frame) >= raw.numel():
        return None
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)


def _decompress(frame: torch.Tensor, nbytes: int, width: int, label: str, i: int) -> torch.Tensor:
    """A part's frame back to its `nbytes` bytes; DeltaMismatch for anything but one frame of that size."""
    if frame.dtype != torch.uint8 or frame.dim() != 1:
        raise DeltaMismatch(f"{label}: compressed payload part {i} is {frame.dtype} {tuple(frame.shape)}, not bytes")
    data = memoryview(frame.contiguous().numpy())
    try:
        size = zstandard.frame_content_size(data)  # checked first: a frame may claim any size
        if size != nbytes:
            raise DeltaMismatch(
                f"{label}: payload part {i}'s zstd frame holds {size} bytes, expected {nbytes} (truncated payload)"
            )
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise DeltaMismatch(f"{label}: payload part {i} is a bad zstd frame ({e})") from None
    if len(raw) != nbytes:
        raise DeltaMismatch(f"{label}: payload part {i}'s zstd frame gave {len(raw)} bytes, expected {nbytes}")
    return _unplanes(torch.frombuffer(bytearray(raw), dtype=torch.uint8), width)


def _layout(delta: TensorDelta, label: str) -> list[tuple[torch.dtype, int, int]]:
    """(dtype, numel, byte-plane width) of each raw payload part, as the encoding defines them."""
    try:
        value_dtype = dtype_from_name(delta.dtype)
    except ValueError as e:
        raise DeltaMismatch(f"{label}: {e}") from None
    n, k, s = delta.numel, delta.num_changed, value_dtype.itemsize
    values = (value_dtype, k, s)
    if delta.encoding == "dense":
        return [(value_dtype, n, s)]
    if delta.encoding == "sparse":
        index = torch.int32 if n < _INT32_INDEX_LIMIT else torch.int64
        return [(index, k, index.itemsize), values]
    if delta.encoding == "bitmask":
        return [(torch.uint8, (n + 7) // 8, 1), values]
    if delta.encoding == "gaps":
        if delta.gap_width not in GAP_WIDTHS:
            raise DeltaMismatch(f"{label}: gap width {delta.gap_width!r} is unknown; known: {list(GAP_WIDTHS)}")
        return [(torch.uint8, k * delta.gap_width, delta.gap_width), values]
    raise DeltaMismatch(f"{label}: unknown encoding {delta.encoding!r}; known: {list(ENCODINGS)}")


def encode(
    base: torch.Tensor,
    new: torch.Tensor,
    *,
    name: str | None = None,
    base_checksum: int | None = None,
    compress: bool = False,
) -> TensorDelta:
    """The delta that turns `base` into `new` (same shape, dtype and device). `base_checksum`: pass the
    previous delta's new_checksum to skip re-reading the base (it must be the base's CRC-32).
    `compress`: zstd each payload part, kept where smaller."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(
            f"{_label(name)}: base is {base.dtype} {tuple(base.shape)} but new is {new.dtype} {tuple(new.shape)}"
        )
    new_flat = new.detach().reshape(-1)
    changed = _bits(base.detach(), name) != _bits(new_flat, name)
    k, n, s = int(torch.count_nonzero(changed)), new.numel(), new.element_size()  # count_nonzero: ~20x sum
    sizes = encoding_sizes(n, k, s)
    best_other = min(v for e, v in sizes.items() if e != "gaps")
    indices, max_gap = None, None
    if k and k * (1 + s) < best_other:  # gaps could win: find the largest gap
        indices = changed.nonzero().reshape(-1)
        max_gap = int(torch.diff(indices, prepend=indices.new_zeros(1)).max())
    encoding = choose_encoding(n, k, s, max_gap)
    width = 0
    if encoding == "dense":
        parts: list[torch.Tensor] = [new_flat.to("cpu", copy=True)]
    else:
        if encoding == "bitmask":
            parts = [pack_bits(changed).cpu(), new_flat[changed].cpu()]
        else:
            indices = changed.nonzero().reshape(-1) if indices is None else indices
            values = new_flat.index_select(0, indices).cpu()  # ~2x a bool-mask select once indices exist
            if encoding == "sparse":
                index_dtype = torch.int32 if n < _INT32_INDEX_LIMIT else torch.int64
                parts = [indices.to(index_dtype).cpu().contiguous(), values]
            else:
                width = gap_width(max_gap)
                parts = [gaps_to_bytes(indices, width).cpu(), values]
    flags: tuple[bool, ...] = ()
    if compress:
        plane_widths = [width if encoding == "gaps" and i == 0 else p.element_size() for i, p in enumerate(parts)]
        frames = [_compress(p, w) for p, w in zip(parts, plane_widths)]
        flags = tuple(f is not None for f in frames)
        parts = [p if f is None else f for p, f in zip(parts, frames)]
    return TensorDelta(
        encoding,
        tuple(new.shape),
        dtype_name(new.dtype),
        tuple(parts),
        k,
        tensor_checksum(base) if base_checksum is None else base_checksum,
        tensor_checksum(new),
        width,
        flags if any(flags) else (),
    )


def _raw_parts(delta: TensorDelta, label: str) -> list[torch.Tensor]:
    """The payload's parts decompressed and typed per the encoding; DeltaMismatch naming what is wrong."""
    layout = _layout(delta, label)
    if len(delta.payload) != len(layout):
        raise DeltaMismatch(f"{label}: {delta.encoding} payload has {len(delta.payload)} parts, expected {len(layout)}")
    flags = delta.compressed or (False,) * len(layout)
    if len(flags) != len(layout):
        raise DeltaMismatch(f"{label}: {len(flags)} compression flags for {len(layout)} payload parts")
    parts = []
    for i, (part, flag, (dtype, numel, width)) in enumerate(zip(delta.payload, flags, layout)):
        if flag:
            part = _decompress(part.cpu(), numel * dtype.itemsize, width, label, i).view(dtype)
        parts.append(part)
    sizes = [t.numel() for t in parts]
    expected = [numel for _, numel, _ in layout]
    if sizes != expected:
        raise DeltaMismatch(
            f"{label}: {delta.encoding} payload has {sizes} elements, expected {expected} (a truncated payload)"
        )
    for i, (part, (dtype, _, _)) in enumerate(zip(parts, layout)):
        if part.dtype != dtype:
            raise DeltaMismatch(f"{label}: payload part {i} is {part.dtype}, expected {dtype}")
    return [p.reshape(-1) for p in parts]


def _check(base: torch.Tensor, delta: TensorDelta, name: str | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Everything that can be checked before writing: shape, dtype, payload structure and frames, indices,
    base checksum. Returns what to write: (int64 indices or bool mask or None for dense, values), on
    base's device."""
    label = _label(name)
    if tuple(base.shape) != delta.shape or dtype_name(base.dtype) != delta.dtype:
        raise DeltaMismatch(
            f"{label}: delta is for {delta.dtype} {delta.shape}, tensor is {dtype_name(base.dtype)} {tuple(base.shape)}"
        )
    if not base.is_contiguous():
        raise DeltaMismatch(f"{label}: the tensor is not contiguous, a delta cannot be applied in place")
    parts = [p.to(base.device) for p in _raw_parts(delta, label)]
    n, k = delta.numel, delta.num_changed
    where: torch.Tensor | None = None
    if delta.encoding == "sparse":
        where = parts[0].to(torch.int64)
        if k and (int(where.min()) < 0 or int(where.max()) >= n):
            raise DeltaMismatch(f"{label}: sparse index out of range [0, {n})")
    elif delta.encoding == "gaps":
        gaps = bytes_to_gaps(parts[0], delta.gap_width)
        if k and _bad_gaps(gaps, n):
            raise DeltaMismatch(f"{label}: gap-coded index out of range [0, {n}) or not increasing")
        where = torch.cumsum(gaps, 0)
        if k and int(where[-1]) >= n:
            raise DeltaMismatch(f"{label}: gap-coded index {int(where[-1])} out of range [0, {n})")
    elif delta.encoding == "bitmask":
        where = unpack_bits(parts[0], n)
        if int(torch.count_nonzero(where)) != k:
            raise DeltaMismatch(f"{label}: the bitmask does not mark {k} changed values")
    actual = tensor_checksum(base)
    if actual != delta.base_checksum:
        raise DeltaMismatch(
            f"{label}: base checksum {actual:#010x} is not the delta's base {delta.base_checksum:#010x} "
            "(another version, or a corrupted base); nothing written"
        )
    return where, parts[-1]


def _bad_gaps(gaps: torch.Tensor, n: int) -> bool:
    """A first gap below 0, a later one below 1 (indices not increasing) or any gap >= n."""
    if int(gaps[0]) < 0 or int(gaps.max()) >= n:
        return True
    return gaps.numel() > 1 and int(gaps[1:].min()) < 1


def _write(
    base: torch.Tensor, delta: TensorDelta, checked: tuple[torch.Tensor | None, torch.Tensor], name: str | None
) -> None:
    """Write the changed values (`_check`'s result) into `base`, then verify the result's checksum."""
    dst = _bits(base, name)  # a view: writes land in base
    where, values = checked
    if delta.encoding == "dense":
        dst.copy_(_bits(values, name))
    elif delta.encoding == "bitmask":
        dst.masked_scatter_(where, _bits(values, name))  # fills the marked places in order; ~2x a bool index put
    else:
        dst[where] = _bits(values, name)
    actual = tensor_checksum(base)
    if actual != delta.new_checksum:
        raise DeltaMismatch(
            f"{_label(name)}: checksum after applying is {actual:#010x}, expected {delta.new_checksum:#010x} "
            "(a corrupted delta); the tensor holds neither version now"
        )


def apply(base: torch.Tensor, delta: TensorDelta, *, name: str | None = None) -> None:
    """Turn `base` into the delta's new value in place; DeltaMismatch before writing anything when the
    base is not the delta's base or the payload is malformed, and after writing when the result's
    checksum is wrong."""
    _write(base, delta, _check(base, delta, name), name)


@dataclass(frozen=True)
class UpdateChoice:
    kind: str  # "delta" | "full"
    reason: str  # a sentence for logs and status


def choose_update(
    engine_version: str | None,
    base_version: str | None,
    delta_bytes: int,
    full_bytes: int,
    max_ratio: float = 0.5,
    *,
    deltas_since_full: int = 0,
    anchor_every: int | None = None,
) -> UpdateChoice:
    """Delta or full update for an engine holding `engine_version`, given a delta from `base_version`.

    Full when the engine holds no version or another one than the delta's base, when this version is an
    anchor (`anchor_every`=K: after K-1 deltas in a row, `deltas_since_full` counting them; None: no
    anchors), when the delta is not smaller than the full version, or more than `max_ratio` of it."""
    if not 0 < max_ratio <= 1:
        raise ValueError(f"max_ratio={max_ratio} must be in (0, 1]")
    if anchor_every is not None and (
        isinstance(anchor_every, bool) or not isinstance(anchor_every, int) or anchor_every < 1
    ):
        raise ValueError(f"anchor_every={anchor_every!r} must be None or an integer >= 1")
    if engine_version is None:
        return UpdateChoice("full", "the engine holds no version yet (new or healed engine)")
    if base_version is None:
        return UpdateChoice("full", "this version has no delta (no base version kept)")
    if engine_version != base_version:
        return UpdateChoice(
            "full", f"the engine holds version {engine_version!r}, the delta is from {base_version!r} (skipped version)"
        )
    if anchor_every is not None and deltas_since_full + 1 >= anchor_every:
        return UpdateChoice(
            "full",
            f"an anchor: a full version every {anchor_every} versions ({deltas_since_full} deltas since the last)",
        )
    if delta_bytes >= full_bytes:
        return UpdateChoice("full", f"the delta is {delta_bytes} bytes, not smaller than the full {full_bytes} bytes")
    if delta_bytes > max_ratio * full_bytes:
        return UpdateChoice(
            "full", f"the delta is {delta_bytes} bytes, more than {max_ratio:g} of the full {full_bytes} bytes"
        )
    return UpdateChoice("delta", f"the delta is {delta_bytes} of {full_bytes} bytes, from the engine's version")


@dataclass(frozen=True)
class VersionDelta:
    """Every tensor's delta between two versions (Mapping: name -> TensorDelta, in the base's order)."""

    tensors: Mapping[str, TensorDelta]

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.tensors.values())

    @property
    def full_bytes(self) -> int:
        return sum(d.full_bytes for d in self.tensors.values())

    @property
    def num_changed(self) -> int:
        return sum(d.num_changed for d in self.tensors.values())

    @property
    def numel(self) -> int:
        return sum(d.numel for d in self.tensors.values())

    @property
    def changed_share(self) -> float:
        """Changed values / all values (0.0 for an empty version)."""
        return self.num_changed / self.numel if self.numel else 0.0


def _same_names(have: Mapping[str, object], want: Mapping[str, object], what: str, error: type[Exception]) -> None:
    if set(have) != set(want):
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        raise error(f"{what}: tensors missing {missing}, unexpected {extra}")


def encode_version(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, compress: bool = False
) -> VersionDelta:
    """encode() of every tensor; both versions must name the same tensors."""
    _same_names(new, base, "new version vs base", ValueError)
    return VersionDelta({name: encode(t, new[name], name=name, compress=compress) for name, t in base.items()})


def apply_version(state: Mapping[str, torch.Tensor], delta: VersionDelta) -> None:
    """apply() of every tensor in place: every tensor is checked first (a mismatch anywhere writes
    nothing; the decoded payloads are kept until written), then each is written and verified."""
    _same_names(state, delta.tensors, "engine weights vs delta", DeltaMismatch)
    apply_all([(name, state[name], d) for name, d in delta.tensors.items()])


def apply_all(targets: Sequence[tuple[str, torch.Tensor, TensorDelta]]) -> None:
    """apply() of each (label, contiguous tensor, delta), all checked before any is written."""
    checked = [_check(t, d, label) for label, t, d in targets]
    for (label, t, d), c in zip(targets, checked, strict=True):
        _write(t, d, c, label)
