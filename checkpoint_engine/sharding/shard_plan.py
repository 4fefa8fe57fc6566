"""Sharding-aware transfer, planned from shapes: which slice of each HF-layout tensor every
inference engine rank (vLLM TP x EP) consumes, so the daemon sends a rank its slice, not the model.

Pure: no tensors, no processes; every rule is table-tested.

    ModelShape + EngineLayout --plan_hf--> ShardPlan {(tp_rank, ep_rank): (SourceSlice, ...)}
    ShardPlan + {name: (dtype, shape)} --bytes_for / full_bytes--> bytes a rank receives / the model
    SourceSlice + shape + dtype --byte_ranges--> [(start, stop)] of the row-major tensor
    ... + Parallelism --plan_megatron--> MegatronPlan: per rank, each slice's Megatron pieces
    (source, layout, dtypes, quantization) --fingerprint--> key; PlanCache: one plan per key

Rules (rank r of T tensor-parallel ranks; what vLLM's loaders take):

    q_proj, gate_proj, up_proj (+bias)   column-parallel: rows split evenly along dim 0
    k_proj, v_proj (+bias)               kv heads split over TP; with num_kv_heads < T each kv head is
                                         replicated on T / num_kv_heads ranks: rank r takes kv head
                                         r * num_kv_heads // T (vLLM's QKVParallelLinear)
    o_proj, down_proj                    row-parallel: split along dim 1 (o_proj.bias: whole)
    embed_tokens, lm_head                vocab-parallel, mirroring VocabParallelEmbedding's default
                                         padding: the vocab is padded to a multiple of 64
                                         (DEFAULT_VOCAB_PADDING_SIZE), rank r takes rows
                                         [r * c, (r + 1) * c) with c = ceil(padded / T), clipped to
                                         the real vocab; a rank whose rows are all padding gets none
    norms, mlp.gate (router)             replicated: the whole tensor on every rank
    mlp.experts.<e>.*                    expert e lives on EP rank e // (num_experts / E_p); inside
                                         that EP group, split over TP like the dense MLP (gate/up
                                         dim 0, down dim 1). Non-expert tensors: the same on every
                                         EP rank. (vLLM's --enable-expert-parallel differs: its
                                         experts are not TP-split, EP spans TP x DP ranks; this
                                         planner keeps the one simple rule.)

A slice that covers a whole dim is written as the whole tensor (`SourceSlice(name)`), so TP 1 plans
hold whole tensors only (`normalize_slice`). A name the planner does not know raises ValueError
naming it: a guessed rule would silently corrupt weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from checkpoint_engine.buckets import TensorSpec
from checkpoint_engine.sharding.slices import EngineLayout, SourceSlice
from ckpt_common.dtypes import itemsize
from ckpt_common.layout.pieces import hf_sources, sources_of_slice
from ckpt_common.layout.shapes import ModelShape, NormStyle, Parallelism, Piece, hf_param_shapes

Dest = tuple[int, int]  # (tp_rank, ep_rank), as EngineLayout.ranks names it
SpecLike = TensorSpec | tuple[str, Sequence[int]]  # a TensorSpec, or (dtype, shape)
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
PLAN_VERSION = 1  # part of every fingerprint: bump when a rule changes, so cached plans are rebuilt

_LAYER = r"model\.layers\.\d+\."
# (pattern, rule); the expert patterns capture the expert index
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), rule)
    for p, rule in (
        (r"model\.embed_tokens\.weight|lm_head\.weight", "vocab"),
        (_LAYER + r"self_attn\.q_proj\.(weight|bias)", "q"),
        (_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)", "kv"),
        (_LAYER + r"self_attn\.o_proj\.weight", "row"),
        (_LAYER + r"mlp\.(gate|up)_proj\.weight", "col"),
        (_LAYER + r"mlp\.down_proj\.weight", "row"),
        (_LAYER + r"mlp\.experts\.(\d+)\.(gate|up)_proj\.weight", "expert_col"),
        (_LAYER + r"mlp\.experts\.(\d+)\.down_proj\.weight", "expert_row"),
        (_LAYER + r"self_attn\.o_proj\.bias|" + _LAYER + r"mlp\.gate\.weight", "whole"),
        (_LAYER + r"(input_layernorm|post_attention_layernorm)\.weight|model\.norm\.weight", "whole"),
    )
)


@dataclass(frozen=True)
class ShardPlan:
    """Per destination (tp_rank, ep_rank): the slices of source tensors it consumes, sorted by name
    (one slice per tensor). `names`: every source tensor the plan covers, sorted. Do not mutate."""

    layout: EngineLayout
    names: tuple[str, ...]
    by_dest: dict[Dest, tuple[SourceSlice, ...]]

    def slices(self, dest: Dest) -> tuple[SourceSlice, ...]:
        if dest not in self.by_dest:
            raise ValueError(f"destination {dest!r} is not a (tp_rank, ep_rank) of {self.layout}")
        return self.by_dest[dest]

    def bytes_for(self, dest: Dest, specs: Mapping[str, SpecLike]) -> int:
        """Bytes destination `dest` receives: the sum of its slices' sizes."""
        return sum(_slice_bytes(s, specs) for s in self.slices(dest))

    def full_bytes(self, specs: Mapping[str, SpecLike]) -> int:
        """Bytes of every tensor the plan covers, whole (what an unsharded transfer sends each rank)."""
        return sum(_slice_bytes(SourceSlice(n), specs) for n in self.names)


@dataclass(frozen=True)
class MegatronFetch:
    """HF slice `slice` of one destination, and the Megatron pieces (rank + tensor + rows) that hold it,
    ordered by position in the HF tensor (`ckpt_common.layout.pieces.sources_of_slice`)."""

    slice: SourceSlice
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class MegatronPlan(ShardPlan):
    """A ShardPlan whose slices are fed from a Megatron trainer: `fetches[dest]` lines up with
    `by_dest[dest]`, one MegatronFetch per slice."""

    fetches: dict[Dest, tuple[MegatronFetch, ...]] = field(default_factory=dict)


def plan_hf(shape: ModelShape, layout: EngineLayout, names: Iterable[str] | None = None) -> ShardPlan:
    """The slices each engine rank consumes of the HF tensors `names` (default: every tensor of
    `shape`, as `hf_param_shapes` lists them). Raises ValueError naming the field that does not
    divide, or every name that is not a tensor of this model."""
    shapes = _check(shape, layout)
    if names is None:
        wanted = sorted(shapes)
    else:
        wanted = sorted(set(names))
        known = set(shapes) | {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(shape.num_layers)}
        unknown = [n for n in wanted if n not in known or _rule(n) is None]
        if unknown:
            raise ValueError(f"unknown tensor name(s) for this model, no sharding rule: {unknown}")
    by_dest: dict[Dest, tuple[SourceSlice, ...]] = {}
    for dest in layout.ranks:
        out = [s for n in wanted if (s := _slice_of(shape, layout, shapes, n, dest)) is not None]
        by_dest[dest] = tuple(sorted(out, key=lambda s: s.name))
    return ShardPlan(layout, tuple(wanted), by_dest)


def plan_megatron(
    shape: ModelShape,
    parallel: Parallelism,
    layout: EngineLayout,
    norm_style: NormStyle = "local",
    names: Iterable[str] | None = None,
) -> MegatronPlan:
    """`plan_hf`, plus for each slice the Megatron pieces (of `parallel`'s ranks) that hold it: what
    the daemon fetches from which trainer rank for each engine rank. Replicated tensors come from
    their primary copy (TP rank 0, EP rank 0) only."""
    plan = plan_hf(shape, layout, names)
    sources = hf_sources(shape, parallel, norm_style)
    shapes = hf_param_shapes(shape)
    fetches: dict[Dest, tuple[MegatronFetch, ...]] = {}
    for dest, slices in plan.by_dest.items():
        out = []
        for s in slices:
            if s.name not in sources:
                raise ValueError(f"{s.name!r} has no Megatron source (not in the HF <-> Megatron piece table)")
            # a whole tensor: every primary piece, i.e. the full range along the pieces' dim
            dim = sources[s.name][0].dim if s.whole else s.dim
            start, stop = (0, shapes[s.name][dim]) if s.whole else (s.start, s.stop)
            pieces = sources_of_slice(sources, s.name, dim, start, stop)
            out.append(MegatronFetch(s, tuple(pieces)))
        fetches[dest] = tuple(out)
    return MegatronPlan(plan.layout, plan.names, plan.by_dest, fetches)


def slice_nbytes(s: SourceSlice, shape: Sequence[int], dtype: str) -> int:
    """Bytes of slice `s` of a `dtype` tensor of `shape`."""
    total = math.prod(shape) * itemsize(dtype)
    if s.whole:
        return total
    _check_slice(s, shape)
    return total // shape[s.dim] * (s.stop - s.start)


def byte_ranges(s: SourceSlice, shape: Sequence[int], dtype: str) -> list[tuple[int, int]]:
    """The contiguous byte ranges [start, stop) of a row-major tensor that slice `s` covers, in
    order, adjacent ones merged: a dim-0 slice (or a 1-D bias) is one range, a dim-1 slice of a 2-D
    tensor one range per row (one range in all when it spans every column)."""
    size = itemsize(dtype)
    if s.whole:
        total = math.prod(shape) * size
        return [(0, total)] if total else []
    _check_slice(s, shape)
    inner = math.prod(shape[s.dim + 1 :]) * size  # bytes of one step along dim
    stride = shape[s.dim] * inner  # bytes of one step of the dims before it
    out: list[tuple[int, int]] = []
    for outer in range(math.prod(shape[: s.dim])):
        lo, hi = outer * stride + s.start * inner, outer * stride + s.stop * inner
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        elif hi > lo:
            out.append((lo, hi))
    return out


def normalize_slice(s: SourceSlice, shape: Sequence[int]) -> SourceSlice:
    """`s`, written as the whole tensor when it spans its whole dim (how plans write such slices)."""
    if not s.whole and (s.start, s.stop) == (0, shape[s.dim]):
        return SourceSlice(s.name)
    return s


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int] | None:
    """Rows [start, stop) of a vocab-parallel tensor at `tp_rank`, or None when they are all padding."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = -(-padded // tp_size)
    start, stop = tp_rank * per_rank, min((tp_rank + 1) * per_rank, vocab_size)
    return (start, stop) if start < stop else None


def fingerprint(source: Any, layout: EngineLayout, dtypes: Mapping[str, str], quantization: str | None = None) -> str:
    """A stable key (16 hex digits of sha256) of everything a plan depends on: the source layout
    (a ModelShape, or e.g. a (ModelShape, Parallelism, norm_style) tuple), the engine layout, every
    tensor's dtype and the engine's quantization. Any changed input changes it; so does PLAN_VERSION."""
    doc = [PLAN_VERSION, _canonical(source), _canonical(layout), _canonical(dict(dtypes)), quantization]
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


T = TypeVar("T")


class PlanCache:
    """Plans by fingerprint, built once each; at most `max_entries` kept (the oldest is dropped)."""

    def __init__(self, max_entries: int = 16) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r} must be >= 1")
        self.max_entries = max_entries
        self.builds = 0  # how many times `build` ran
        self._plans: dict[str, Any] = {}

    def get_or_build(self, key: str, build: Callable[[], T]) -> T:
        if key not in self._plans:
            plan = build()
            self.builds += 1
            if len(self._plans) >= self.max_entries:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return self._plans[key]

    def __len__(self) -> int:
        return len(self._plans)


# -- internals ---------------------------------------------------------------------------------------


def _check(shape: ModelShape, layout: EngineLayout) -> dict[str, tuple[int, ...]]:
    """Raise ValueError naming the first shape field the layout does not divide; the HF shapes."""
    tp, kv = layout.tp_size, shape.num_query_groups
    if shape.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={shape.num_attention_heads} is not divisible by tp_size={tp}")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"num_query_groups (num_key_value_heads)={kv} and tp_size={tp}: one must divide the other")
    if shape.is_moe:
        if shape.moe_ffn_hidden_size % tp:
            raise ValueError(f"moe_ffn_hidden_size={shape.moe_ffn_hidden_size} is not divisible by tp_size={tp}")
        if shape.num_experts % layout.ep_size:
            raise ValueError(f"num_experts={shape.num_experts} is not divisible by ep_size={layout.ep_size}")
    else:
        if shape.ffn_hidden_size % tp:
            raise ValueError(f"ffn_hidden_size={shape.ffn_hidden_size} is not divisible by tp_size={tp}")
        if layout.ep_size != 1:
            raise ValueError(f"ep_size={layout.ep_size} needs an MoE shape (num_experts)")
    return hf_param_shapes(shape)


def _rule(name: str) -> tuple[str, int | None] | None:
    """(rule, expert index or None) of an HF tensor name, or None when no rule matches."""
    for pattern, rule in _RULES:
        if m := pattern.fullmatch(name):
            return rule, int(m.group(1)) if rule.startswith("expert") else None
    return None


def _slice_of(
    shape: ModelShape, layout: EngineLayout, shapes: Mapping[str, tuple[int, ...]], name: str, dest: Dest
) -> SourceSlice | None:
    """The slice of `name` that destination `dest` consumes, or None when it consumes none."""
    found = _rule(name)
    assert found is not None, name  # plan_hf checked every name against the rules
    rule, expert = found
    tp_rank, ep_rank = dest
    tp = layout.tp_size
    if rule == "whole":
        return SourceSlice(name)
    dims = shapes[name]
    if expert is not None:
        if expert // (shape.num_experts // layout.ep_size) != ep_rank:
            return None  # this expert lives on another EP rank
        rule = "col" if rule == "expert_col" else "row"
    if rule == "vocab":
        rows = vocab_range(dims[0], tp, tp_rank)
        return None if rows is None else normalize_slice(SourceSlice(name, 0, *rows), dims)
    if rule == "kv":
        hd, kv = shape.head_dim, shape.num_query_groups
        heads = max(kv // tp, 1)  # kv heads per rank (1, replicated, when kv < tp)
        first = tp_rank * heads if kv >= tp else tp_rank * kv // tp
        return normalize_slice(SourceSlice(name, 0, first * hd, (first + heads) * hd), dims)
    dim = 1 if rule == "row" else 0  # "q" and "col" split rows; "row" splits columns
    per = dims[dim] // tp
    return normalize_slice(SourceSlice(name, dim, tp_rank * per, (tp_rank + 1) * per), dims)


def _slice_bytes(s: SourceSlice, specs: Mapping[str, SpecLike]) -> int:
    """Bytes of `s`, its tensor's dtype and shape read from a TensorSpec or a (dtype, shape) pair."""
    if s.name not in specs:
        raise ValueError(f"no dtype/shape given for tensor {s.name!r}")
    spec = specs[s.name]
    dtype, dims = (spec.dtype, spec.shape) if isinstance(spec, TensorSpec) else spec
    return slice_nbytes(s, tuple(dims), dtype)


def _check_slice(s: SourceSlice, shape: Sequence[int]) -> None:
    if s.dim is None or not 0 <= s.dim < len(shape) or s.stop > shape[s.dim]:
        raise ValueError(f"{s.name}: slice [{s.start}, {s.stop}) along dim {s.dim} is outside shape {tuple(shape)}")


def _canonical(obj: Any) -> Any:
    """A JSON-able, order-stable form of `obj` (dataclasses by type and fields); refuses other objects,
    whose repr need not be stable."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _canonical(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__type__": type(obj).__qualname__, **fields}
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"fingerprint: cannot key a {type(obj).__name__} ({obj!r}); pass dataclasses, mappings, scalars")
