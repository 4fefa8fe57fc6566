"""Delta updates: per version, send only the engine-dtype values that changed since the engine's version.

After one RL step most low-precision engine values keep their bits (on the demo: 99 % of float32
values change, 33 % of their bfloat16 casts, 1 % of float8), so the cast weights of version v differ
from those of v-1 in few places. Everything here is pure (no processes, no network) and table-tested.

    sender, per tensor:   base (engine dtype, version v-1, kept in host memory)   new (cast of version v)
        encode(base, new) --bits differ?--> mask (k of n changed)
                          --fewest bytes--> TensorDelta(dense | bitmask | sparse, crc32(base), crc32(new))
    sender, per version:  encode_version({name: base}, {name: new}) --> VersionDelta (bytes, changed share)
        choose_update(engine's version, delta's base version, delta bytes, full bytes) --> "delta" | "full"
    engine, per version:  apply_version(weights, delta)
        every crc32(weights[name]) == base_checksum?  (no: DeltaMismatch, nothing written)
        --write the changed values--> crc32(weights[name]) == new_checksum?  (no: DeltaMismatch)

Values are compared as bit patterns (viewed as an integer dtype of the same width), so -0.0 vs +0.0
and NaNs with other payloads count as changes and a round trip is bitwise exact.

Encodings, for n elements of s bytes of which k changed (bytes on the wire = `TensorDelta.nbytes`):
    dense    n*s                      the whole new tensor
    bitmask  ceil(n/8) + k*s          one bit per element (little-endian in each byte) + the changed values
    sparse   k*i + k*s                flat indices (int32: i = 4; int64: i = 8 when n >= 2**31) + the values
The smallest wins; ties go to the simpler one, in the order dense, sparse, bitmask.

Host memory: the sender must keep the base version, i.e. one more copy of the whole model in the engine
dtype in host memory (for a 7B model in bfloat16: 14 GiB more), for as long as an engine may hold it.
Without it there is nothing to diff against and every update is a full one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from checkpoint_engine.checksum import tensor_checksum
from ckpt_common.dtypes import dtype_from_name, dtype_name

ENCODINGS = ("dense", "sparse", "bitmask")  # tie order: the simpler first
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-pattern views
_INT32_INDEX_LIMIT = 2**31  # flat indices below it fit int32


class DeltaMismatch(ValueError):
    """A delta does not fit the tensor it is applied to (other version, corrupted base, bad payload)."""


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name is not None else "tensor"


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's change from its base to its new value: `payload` (CPU, contiguous) per `encoding`:
    dense (new values,), bitmask (packed bits uint8, changed values), sparse (indices, changed values)."""

    encoding: str
    shape: tuple[int, ...]
    dtype: str  # ckpt_common.dtypes name
    payload: tuple[torch.Tensor, ...]
    num_changed: int
    base_checksum: int
    new_checksum: int

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


def encoding_sizes(numel: int, num_changed: int, itemsize: int) -> dict[str, int]:
    """Exact payload bytes of each encoding for `num_changed` of `numel` values of `itemsize` bytes."""
    index_size = 4 if numel < _INT32_INDEX_LIMIT else 8
    values = num_changed * itemsize
    return {
        "dense": numel * itemsize,
        "sparse": num_changed * index_size + values,
        "bitmask": (numel + 7) // 8 + values,
    }


def choose_encoding(numel: int, num_changed: int, itemsize: int) -> str:
    """The encoding with the fewest bytes; ties go to the earlier one in ENCODINGS (the simpler)."""
    sizes = encoding_sizes(numel, num_changed, itemsize)
    return min(ENCODINGS, key=lambda e: (sizes[e], ENCODINGS.index(e)))


def _bits(t: torch.Tensor, name: str | None) -> torch.Tensor:
    """The flat bit patterns of `t` as an integer tensor of the same width (a view when contiguous)."""
    int_dtype = _INT_OF_WIDTH.get(t.element_size())
    if int_dtype is None:
        raise ValueError(f"{_label(name)}: dtype {t.dtype} has no integer view of {t.element_size()} bytes")
    return t.reshape(-1).view(int_dtype)


def encode(
    base: torch.Tensor, new: torch.Tensor, *, name: str | None = None, base_checksum: int | None = None
) -> TensorDelta:
    """The delta that turns `base` into `new` (same shape and dtype). `base_checksum`: pass the previous
    delta's new_checksum to skip re-reading the base (it must be the base's CRC-32)."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(
            f"{_label(name)}: base is {base.dtype} {tuple(base.shape)} but new is {new.dtype} {tuple(new.shape)}"
        )
    new_bits = _bits(new.detach(), name)
    changed = _bits(base.detach(), name) != new_bits
    k, n = int(torch.count_nonzero(changed)), new.numel()  # count_nonzero: ~20x faster than sum on CPU
    encoding = choose_encoding(n, k, new.element_size())
    if encoding == "dense":
        payload: tuple[torch.Tensor, ...] = (new.detach().reshape(-1).to("cpu", copy=True),)
    else:
        values = new.detach().reshape(-1)[changed].cpu().contiguous()
        if encoding == "sparse":
            index_dtype = torch.int32 if n < _INT32_INDEX_LIMIT else torch.int64
            indices = changed.nonzero().reshape(-1).to(index_dtype).cpu().contiguous()
            payload = (indices, values)
        else:
            packed = np.packbits(changed.cpu().numpy(), bitorder="little")
            payload = (torch.from_numpy(packed), values)
    return TensorDelta(
        encoding,
        tuple(new.shape),
        dtype_name(new.dtype),
        payload,
        k,
        tensor_checksum(base) if base_checksum is None else base_checksum,
        tensor_checksum(new),
    )


def _unpack(packed: torch.Tensor, numel: int) -> np.ndarray:
    """The bitmask payload as `numel` bools (the padding bits of the last byte dropped)."""
    return np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(bool)


def _check(base: torch.Tensor, delta: TensorDelta, name: str | None) -> None:
    """Everything that can be checked before writing: shape, dtype, payload structure, base checksum."""
    label = _label(name)
    if tuple(base.shape) != delta.shape or dtype_name(base.dtype) != delta.dtype:
        raise DeltaMismatch(
            f"{label}: delta is for {delta.dtype} {delta.shape}, tensor is {dtype_name(base.dtype)} {tuple(base.shape)}"
        )
    if not base.is_contiguous():
        raise DeltaMismatch(f"{label}: the tensor is not contiguous, a delta cannot be applied in place")
    n, k = delta.numel, delta.num_changed
    expected = {"dense": [n], "sparse": [k, k], "bitmask": [(n + 7) // 8, k]}.get(delta.encoding)
    if expected is None:
        raise DeltaMismatch(f"{label}: unknown encoding {delta.encoding!r}; known: {list(ENCODINGS)}")
    if [t.numel() for t in delta.payload] != expected:
        raise DeltaMismatch(
            f"{label}: {delta.encoding} payload has {[t.numel() for t in delta.payload]} elements, expected {expected}"
        )
    if delta.encoding == "sparse" and k:
        indices = delta.payload[0]
        if int(indices.min()) < 0 or int(indices.max()) >= n:
            raise DeltaMismatch(f"{label}: sparse indices out of range [0, {n})")
    if delta.encoding == "bitmask" and np.count_nonzero(_unpack(delta.payload[0], n)) != k:
        raise DeltaMismatch(f"{label}: the bitmask does not mark {k} changed values")
    actual = tensor_checksum(base)
    if actual != delta.base_checksum:
        raise DeltaMismatch(
            f"{label}: base checksum {actual:#010x} is not the delta's base {delta.base_checksum:#010x} "
            "(another version, or a corrupted base); nothing written"
        )


def _write(base: torch.Tensor, delta: TensorDelta, name: str | None) -> None:
    """Write the changed values into `base` (checked by _check), then verify the result's checksum."""
    dst = _bits(base, name)  # a view: writes land in base
    values = delta.payload[-1].to(base.device)
    if delta.encoding == "dense":
        dst.copy_(_bits(values, name))
    elif delta.encoding == "sparse":
        dst[delta.payload[0].to(device=base.device, dtype=torch.int64)] = _bits(values, name)
    else:
        mask = torch.from_numpy(_unpack(delta.payload[0], delta.numel)).to(base.device)
        dst.masked_scatter_(mask, _bits(values, name))  # fills the marked places in order; ~2x a bool index put
    actual = tensor_checksum(base)
    if actual != delta.new_checksum:
        raise DeltaMismatch(
            f"{_label(name)}: checksum after applying is {actual:#010x}, expected {delta.new_checksum:#010x} "
            "(a corrupted delta); the tensor holds neither version now"
        )


def apply(base: torch.Tensor, delta: TensorDelta, *, name: str | None = None) -> None:
    """Turn `base` into the delta's new value in place; DeltaMismatch before writing anything when the
    base is not the delta's base, and after writing when the result's checksum is wrong."""
    _check(base, delta, name)
    _write(base, delta, name)


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
) -> UpdateChoice:
    """Delta or full update for an engine holding `engine_version`, given a delta from `base_version`."""
    if not 0 < max_ratio <= 1:
        raise ValueError(f"max_ratio={max_ratio} must be in (0, 1]")
    if engine_version is None:
        return UpdateChoice("full", "the engine holds no version yet (new or healed engine)")
    if base_version is None:
        return UpdateChoice("full", "this version has no delta (no base version kept)")
    if engine_version != base_version:
        return UpdateChoice(
            "full", f"the engine holds version {engine_version!r}, the delta is from {base_version!r} (skipped version)"
        )
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


def encode_version(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> VersionDelta:
    """encode() of every tensor; both versions must name the same tensors."""
    _same_names(new, base, "new version vs base", ValueError)
    return VersionDelta({name: encode(t, new[name], name=name) for name, t in base.items()})


def apply_version(state: Mapping[str, torch.Tensor], delta: VersionDelta) -> None:
    """apply() of every tensor in place: every tensor is checked first (a mismatch anywhere writes
    nothing), then each is written and verified."""
    _same_names(state, delta.tensors, "engine weights vs delta", DeltaMismatch)
    for name, d in delta.tensors.items():
        _check(state[name], d, name)
    for name, d in delta.tensors.items():
        _write(state[name], d, name)
