"""Deltas cut along the engine's tensor-parallel slices, so that a sharded pull and a delta compose.

A tensor-parallel engine rank keeps only its slices of a sharded tensor (its weight cache holds the
whole tensor's shape with only those rows read, `checkpoint_engine.transport.engine_reads`). A delta
of the whole tensor cannot be applied there: its base checksum covers rows the rank never read. So
the sender encodes each tensor per slice, one entry per distinct slice any engine rank consumes
(`delta_slices(plan)`, from the layout planner), and each rank reads and applies only the entries of
its own slices:

    sender:  plan (every rank's slices) --delta_slices--> {name: distinct slices}
             encode_sliced(base, new, slices) --> VersionDelta keyed "name@dim:start:stop"
                                                  (a whole tensor keeps its plain name)
    rank:    the entries that overlap its slices (`overlaps`), read and kept; the others never read
             apply_sliced(cache, delta, own) --> every own slice covered by entries it took?
                 every taken entry inside the rows the rank holds?  (no: DeltaMismatch, nothing written)
                 every taken entry's base checksum (over that slice's values)?  (no: DeltaMismatch)
                 --> each slice written in place, its new checksum verified

Each entry is an ordinary `TensorDelta` of the slice's values (contiguous, row-major), so the
encodings, compression and checks are `checkpoint_engine.sharding.delta`'s. Pure: no processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from checkpoint_engine.sharding.delta import DeltaMismatch, TensorDelta, VersionDelta, apply_all, encode
from checkpoint_engine.sharding.shard_plan import ShardPlan
from checkpoint_engine.sharding.slices import SourceSlice

SLICE_MARK = "@"  # "name@dim:start:stop": an entry for rows [start, stop) of `name` along dim
# this rank's slices of a tensor: () when it consumes none, None when it is not known here
OwnSlices = Callable[[str], "tuple[SourceSlice, ...] | None"]


def slice_key(s: SourceSlice) -> str:
    return s.name if s.whole else f"{s.name}{SLICE_MARK}{s.dim}:{s.start}:{s.stop}"


def parse_slice_key(key: str) -> SourceSlice:
    """`slice_key`'s inverse; DeltaMismatch naming a key that is not one."""
    name, mark, rows = key.rpartition(SLICE_MARK)
    if not mark:
        return SourceSlice(key)
    try:
        dim, start, stop = (int(x) for x in rows.split(":"))
        return SourceSlice(name, dim, start, stop)
    except ValueError as e:
        raise DeltaMismatch(f"delta entry {key!r} is not 'name{SLICE_MARK}dim:start:stop' ({e})") from None


def slice_view(t: torch.Tensor, s: SourceSlice) -> torch.Tensor:
    """The rows of `t` that `s` names (a view; the whole tensor for a whole slice)."""
    if s.whole:
        return t
    if not 0 <= s.dim < t.dim() or s.stop > t.shape[s.dim]:
        raise DeltaMismatch(f"slice {slice_key(s)} does not fit a tensor of shape {tuple(t.shape)}")
    return t.narrow(s.dim, s.start, s.stop - s.start)


def delta_slices(plan: ShardPlan) -> dict[str, tuple[SourceSlice, ...]]:
    """Per tensor, every distinct slice any rank of `plan` consumes; a tensor some rank takes whole is
    one whole entry (replicated norms, or a TP 1 plan)."""
    found: dict[str, set[SourceSlice]] = {}
    for slices in plan.by_dest.values():
        for s in slices:
            found.setdefault(s.name, set()).add(s)
    return {
        name: (SourceSlice(name),) if any(s.whole for s in got) else tuple(sorted(got)) for name, got in found.items()
    }


def tp_delta_slices(
    hf_config: Mapping, tp_size: int, names: Iterable[str]
) -> dict[str, tuple[SourceSlice, ...]] | None:
    """The slices the ranks of a `tp_size` tensor-parallel engine consume of the HF tensors `names` of
    the model whose config.json is `hf_config`, to cut a delta along (each worker that pulled only its
    slices then takes only their changed values); None at TP 1 (whole tensors). ValueError as
    `plan_hf` raises it (a field that does not divide, a name without a sharding rule)."""
    if tp_size <= 1:
        return None
    from checkpoint_engine.sharding.shard_plan import plan_hf
    from checkpoint_engine.sharding.slices import EngineLayout
    from ckpt_common.layout.shapes import ModelShape

    return delta_slices(plan_hf(ModelShape.from_hf_config(dict(hf_config)), EngineLayout(tp_size=tp_size), names=names))


def encode_sliced(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    slices: Mapping[str, Sequence[SourceSlice]] | None,
    *,
    compress: bool = False,
) -> VersionDelta:
    """One TensorDelta per (tensor, slice): `slices` per name (a name without any: the whole tensor;
    None: every tensor whole, i.e. `encode_version`'s delta)."""
    if set(base) != set(new):
        missing, extra = sorted(set(base) - set(new)), sorted(set(new) - set(base))
        raise ValueError(f"new version vs base: tensors missing {missing}, unexpected {extra}")
    out: dict[str, TensorDelta] = {}
    for name, b in base.items():
        if SLICE_MARK in name:
            raise ValueError(f"tensor name {name!r} contains {SLICE_MARK!r}, which names a delta's slices")
        for s in (slices or {}).get(name) or (SourceSlice(name),):
            key = slice_key(s)
            out[key] = encode(
                slice_view(b, s).contiguous(), slice_view(new[name], s).contiguous(), name=key, compress=compress
            )
    return VersionDelta(out)


def overlaps(a: SourceSlice, b: SourceSlice) -> bool:
    """Whether the two slices of one tensor share rows (slices along different dims always may)."""
    if a.whole or b.whole or a.dim != b.dim:
        return True
    return a.start < b.stop and b.start < a.stop


def _within(s: SourceSlice, held: Sequence[SourceSlice]) -> bool:
    """Whether the rows of `s` lie inside one of the `held` slices."""
    return any(h.whole or (not s.whole and h.dim == s.dim and h.start <= s.start and s.stop <= h.stop) for h in held)


def _covered(own: SourceSlice, entries: Sequence[SourceSlice], shape: Sequence[int]) -> bool:
    """Whether `entries` (slices of one tensor of `shape`) together cover every row of `own`."""
    if any(e.whole for e in entries):
        return True
    if own.whole:  # the rank holds the whole tensor: entries along one dim must span all of it
        dims = {e.dim for e in entries if shape[e.dim] > 0}
        return any(_covered(SourceSlice(own.name, d, 0, shape[d]), entries, shape) for d in dims)
    reach = own.start
    for e in sorted(x for x in entries if x.dim == own.dim):
        if e.start <= reach < e.stop:
            reach = e.stop
    return reach >= own.stop


def apply_sliced(state: Mapping[str, torch.Tensor], delta: VersionDelta, own: OwnSlices | None = None) -> list[str]:
    """Apply the entries of `delta` to `state` (each tensor whole-shaped, as the rank's cache holds it)
    in place; the keys applied. `own`: this rank's slices of each tensor (None: the rank holds every
    tensor whole and applies every entry). Nothing is written unless every check passes: each of the
    rank's slices covered, each entry within what the rank holds, every base checksum."""
    by_name: dict[str, list[tuple[str, SourceSlice, TensorDelta]]] = {}
    for key, d in delta.tensors.items():
        s = parse_slice_key(key)
        by_name.setdefault(s.name, []).append((key, s, d))
    if set(by_name) != set(state):  # the delta brings the whole version: every tensor, no other
        missing, extra = sorted(set(by_name) - set(state)), sorted(set(state) - set(by_name))
        raise DeltaMismatch(f"engine weights vs delta: tensors missing {missing[:5]}, unexpected {extra[:5]}")
    targets: list[tuple[str, torch.Tensor, TensorDelta, torch.Tensor]] = []  # (key, contiguous, delta, where)
    for name, entries in by_name.items():
        held = (SourceSlice(name),) if own is None else own(name)
        if held is None:
            raise DeltaMismatch(
                f"tensor {name!r}: this rank's slices of it are not known (no pull brought it here yet)"
            )
        if not held:
            continue  # another rank's tensor: this rank consumes none of it
        for o in held:
            if not _covered(o, [s for _, s, _ in entries], state[name].shape):
                raise DeltaMismatch(
                    f"tensor {name!r}: the delta's entries {[k for k, _, _ in entries]} do not cover this rank's "
                    f"{slice_key(o)} (the delta was cut for another tensor-parallel layout)"
                )
        for key, s, d in entries:
            if own is not None and not any(overlaps(s, o) for o in held):
                continue
            if not _within(s, held):
                raise DeltaMismatch(
                    f"delta entry {key!r} spans rows this rank does not hold (it holds "
                    f"{[slice_key(o) for o in held]}): the delta was cut for another tensor-parallel layout"
                )
            where = slice_view(state[name], s)
            targets.append((key, where if where.is_contiguous() else where.contiguous(), d, where))
    apply_all([(key, t, d) for key, t, d, _ in targets])
    for _, t, _, where in targets:
        if t.data_ptr() != where.data_ptr():  # a slice along a later dim: written to a copy, copied back
            where.copy_(t)
    return [key for key, _, _, _ in targets]
