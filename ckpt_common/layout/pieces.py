"""The HF Qwen2 <-> Megatron-core layout as a table of pieces: pure, no tensors copied, no megatron import.

    HF tensor (e.g. q_proj)                      Megatron tensor on rank (pp, tp)
    rows [hf_start, hf_start+length) along dim ──▶ rows [mg_start, mg_start+length) along dim
                                                  (one Piece; a tensor is a list of pieces)

Layouts (Megatron's, for a dense GPT with SwiGLU, RMSNorm, RoPE):

    linear_qkv  column-parallel; the unsharded tensor is grouped per query group g:
                [q heads of g | k head of g | v head of g] for g = 0..ng-1, split evenly over TP
                ranks (also when ng < tp: a rank then holds part of one group, as megatron does)
    linear_fc1  column-parallel; rank r holds [gate shard r ; up shard r]
    linear_proj, linear_fc2          row-parallel: split along dim 1
    word_embeddings, output_layer    vocab-parallel: split along dim 0
    norms                            replicated on every TP rank
    decoder.layers.<i>               local layer i of PP stage p is global layer offset(p) + i
    norm_style "te"                  TransformerEngine spec: the norms live in linear_qkv /
                                     linear_fc1 as layer_norm_weight

MoE (Qwen2-MoE / Qwen3-MoE-style MLP without shared experts; megatron-core's local spec,
``get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)``, SequentialMLP experts):

    HF model.layers.<i>.mlp.gate.weight [E, h]        ──▶ decoder.layers.<i>.mlp.router.weight
                                                          (replicated over TP and EP)
    HF model.layers.<i>.mlp.experts.<e>.{gate,up}_proj ──▶ ...mlp.experts.local_experts.<j>.linear_fc1
    HF model.layers.<i>.mlp.experts.<e>.down_proj      ──▶ ...mlp.experts.local_experts.<j>.linear_fc2
        global expert e lives on EP rank e // (E / ep) as local expert j = e % (E / ep)
        (``global_expert_index`` / ``local_expert_index``); expert-TP = TP: fc1 is split like
        the dense fc1 ([gate shard r ; up shard r]) and fc2 along dim 1
    non-expert tensors                  replicated over EP ranks (EP is carved out of DP)

``ModelShape(num_experts=E, moe_ffn_hidden_size=I)`` (``from_hf_config`` reads ``qwen2_moe`` /
``qwen3_moe`` configs; a shared expert, ``mlp_only_layers`` or ``decoder_sparse_step != 1`` raise
NotImplementedError, as does ``num_experts`` without ``moe_ffn_hidden_size``). Ranks: with
``Parallelism(ep_size=1)`` a rank is (pp, tp) as for dense models; with ``ep_size > 1`` it is
(pp, tp, ep) (``Parallelism.rank_of``). ``Piece.ep_rank`` is 0 for every dense piece, so the
dense table is unchanged. MoE is converted for norm_style "local" only (TransformerEngine's
grouped experts use other names). The qwen3_moe attention's q_norm/k_norm are not in this table.
The names were read off a megatron-core 0.16.1 MoE GPTModel built on CPU (TP=1, EP=1), which
also gives transformers' Qwen2-MoE logits (tests/unit/trainer/test_megatron_moe_model.py: allgather
dispatcher, since alltoall creates a CUDA stream; ``moe_utils.te_general_gemm`` set to None, since
megatron reads it undefined without TransformerEngine). EP/TP > 1 are checked by the pure tables only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from ckpt_common.layout.shapes import (
    ModelShape,
    NormStyle,
    Parallelism,
    Piece,
    Rank,
    _experts_per_rank,
    global_expert_index,
    stage_layers,
)


@dataclasses.dataclass(frozen=True)
class _Segment:
    hf_name: str
    hf_start: int
    length: int


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    """One Megatron tensor: its unsharded layout as HF segments along ``dim``, and how TP shards it."""

    mg_name: str
    pp_rank: int
    dim: int
    segments: tuple[_Segment, ...]
    split: bool  # True: even split over TP ranks along dim; False: replicated
    primary: bool = True
    ep_rank: int | None = None  # None: on every EP rank (primary on EP rank 0); else that EP rank only


def _whole(hf_name: str, size: int) -> tuple[_Segment, ...]:
    return (_Segment(hf_name, 0, size),)


def _qkv_segments(shape: ModelShape, hf_prefix: str, kind: str) -> tuple[_Segment, ...]:
    hd, qpg = shape.head_dim, shape.q_heads_per_group
    segments = []
    for group in range(shape.num_query_groups):
        segments.append(_Segment(f"{hf_prefix}q_proj.{kind}", group * qpg * hd, qpg * hd))
        segments.append(_Segment(f"{hf_prefix}k_proj.{kind}", group * hd, hd))
        segments.append(_Segment(f"{hf_prefix}v_proj.{kind}", group * hd, hd))
    return tuple(segments)


def _fc1_segments(
    shape: ModelShape, hf_prefix: str, tp_size: int, ffn: int | None = None, what: str = "ffn_hidden_size"
) -> tuple[_Segment, ...]:
    ffn = shape.ffn_hidden_size if ffn is None else ffn
    if ffn % tp_size != 0:
        raise ValueError(f"{what}={ffn} is not divisible by tp_size={tp_size}")
    shard = ffn // tp_size
    segments = []
    for tp in range(tp_size):
        segments.append(_Segment(f"{hf_prefix}gate_proj.weight", tp * shard, shard))
        segments.append(_Segment(f"{hf_prefix}up_proj.weight", tp * shard, shard))
    return tuple(segments)


def _layer_tensor_specs(
    shape: ModelShape, parallel: Parallelism, global_layer: int, pp_rank: int, local_layer: int, norm_style: NormStyle
) -> list[_TensorSpec]:
    h, hd = shape.hidden_size, shape.head_dim
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * hd
    hf = f"model.layers.{global_layer}."
    mg = f"decoder.layers.{local_layer}."
    attn_norm = "self_attention.linear_qkv.layer_norm_weight" if norm_style == "te" else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if norm_style == "te" else "pre_mlp_layernorm.weight"
    specs = [
        _TensorSpec(mg + attn_norm, pp_rank, 0, _whole(hf + "input_layernorm.weight", h), split=False),
        _TensorSpec(
            mg + "self_attention.linear_qkv.weight",
            pp_rank,
            0,
            _qkv_segments(shape, hf + "self_attn.", "weight"),
            split=True,
        ),
        _TensorSpec(
            mg + "self_attention.linear_proj.weight",
            pp_rank,
            1,
            _whole(hf + "self_attn.o_proj.weight", shape.num_attention_heads * hd),
            split=True,
        ),
        _TensorSpec(mg + mlp_norm, pp_rank, 0, _whole(hf + "post_attention_layernorm.weight", h), split=False),
    ]
    if shape.num_experts is not None:
        specs += _moe_tensor_specs(shape, parallel, hf, mg, pp_rank)
    else:
        specs += [
            _TensorSpec(
                mg + "mlp.linear_fc1.weight",
                pp_rank,
                0,
                _fc1_segments(shape, hf + "mlp.", parallel.tp_size),
                split=True,
            ),
            _TensorSpec(
                mg + "mlp.linear_fc2.weight",
                pp_rank,
                1,
                _whole(hf + "mlp.down_proj.weight", shape.ffn_hidden_size),
                split=True,
            ),
        ]
    if shape.qkv_bias:
        specs.insert(
            2,
            _TensorSpec(
                mg + "self_attention.linear_qkv.bias",
                pp_rank,
                0,
                _qkv_segments(shape, hf + "self_attn.", "bias"),
                split=True,
            ),
        )
    assert sum(s.length for s in specs[1].segments) == qkv_rows
    return specs


def _moe_tensor_specs(shape: ModelShape, parallel: Parallelism, hf: str, mg: str, pp_rank: int) -> list[_TensorSpec]:
    """The router and every expert of one MoE layer (replacing the dense fc1/fc2)."""
    num_experts, moe_ffn, ep_size = shape.num_experts, shape.moe_ffn_hidden_size, parallel.ep_size
    assert num_experts is not None and moe_ffn is not None
    per_rank = _experts_per_rank(num_experts, ep_size)
    specs = [
        _TensorSpec(mg + "mlp.router.weight", pp_rank, 0, _whole(hf + "mlp.gate.weight", num_experts), split=False)
    ]
    for ep in range(ep_size):
        for local in range(per_rank):
            x = f"{hf}mlp.experts.{global_expert_index(ep, local, num_experts, ep_size)}."
            m = f"{mg}mlp.experts.local_experts.{local}."
            fc1 = _fc1_segments(shape, x, parallel.tp_size, moe_ffn, "moe_ffn_hidden_size")
            specs.append(_TensorSpec(m + "linear_fc1.weight", pp_rank, 0, fc1, split=True, ep_rank=ep))
            fc2 = _whole(x + "down_proj.weight", moe_ffn)
            specs.append(_TensorSpec(m + "linear_fc2.weight", pp_rank, 1, fc2, split=True, ep_rank=ep))
    return specs


def _tensor_specs(shape: ModelShape, parallel: Parallelism, norm_style: NormStyle) -> list[_TensorSpec]:
    last = parallel.pp_size - 1
    vocab, h = shape.vocab_size, shape.hidden_size
    specs = [
        _TensorSpec("embedding.word_embeddings.weight", 0, 0, _whole("model.embed_tokens.weight", vocab), split=True)
    ]
    for pp_rank in range(parallel.pp_size):
        offset, count = stage_layers(shape.num_layers, parallel, pp_rank)
        for local in range(count):
            specs += _layer_tensor_specs(shape, parallel, offset + local, pp_rank, local, norm_style)
    specs.append(_TensorSpec("decoder.final_layernorm.weight", last, 0, _whole("model.norm.weight", h), split=False))
    if not shape.tie_word_embeddings:
        specs.append(_TensorSpec("output_layer.weight", last, 0, _whole("lm_head.weight", vocab), split=True))
    elif parallel.pp_size > 1:
        # Megatron keeps a copy of the tied embedding on the last stage as output_layer.weight.
        specs.append(
            _TensorSpec(
                "output_layer.weight", last, 0, _whole("model.embed_tokens.weight", vocab), split=True, primary=False
            )
        )
    return specs


def _pieces_of(spec: _TensorSpec, tp_size: int, ep_size: int = 1) -> Iterator[Piece]:
    if spec.ep_rank is not None:
        for piece in _tp_pieces_of(spec, tp_size):
            yield dataclasses.replace(piece, ep_rank=spec.ep_rank)
        return
    yield from _tp_pieces_of(spec, tp_size)  # EP rank 0 (the only one of a dense model): primaries
    for ep in range(1, ep_size):
        for piece in _tp_pieces_of(spec, tp_size):
            yield dataclasses.replace(piece, ep_rank=ep, primary=False)


def _tp_pieces_of(spec: _TensorSpec, tp_size: int) -> Iterator[Piece]:
    total = sum(s.length for s in spec.segments)
    if not spec.split:
        for tp in range(tp_size):
            start = 0
            for seg in spec.segments:
                yield Piece(
                    seg.hf_name,
                    spec.pp_rank,
                    tp,
                    spec.mg_name,
                    spec.dim,
                    seg.hf_start,
                    start,
                    seg.length,
                    primary=spec.primary and tp == 0,
                )
                start += seg.length
        return
    if total % tp_size != 0:
        raise ValueError(f"{spec.mg_name}: size {total} along dim {spec.dim} is not divisible by tp_size={tp_size}")
    shard = total // tp_size
    start = 0  # position of the segment in the unsharded tensor
    for seg in spec.segments:
        pos = start
        while pos < start + seg.length:
            tp = pos // shard
            stop = min(start + seg.length, (tp + 1) * shard)
            yield Piece(
                seg.hf_name,
                spec.pp_rank,
                tp,
                spec.mg_name,
                spec.dim,
                seg.hf_start + (pos - start),
                pos - tp * shard,
                stop - pos,
                primary=spec.primary,
            )
            pos = stop
        start += seg.length


def conversion_pieces(shape: ModelShape, parallel: Parallelism, norm_style: NormStyle = "local") -> list[Piece]:
    """Every piece of the mapping, in Megatron order. Also the per-destination description:
    for each HF tensor, which slices come from which Megatron rank and tensor (primaries)."""
    if norm_style not in ("local", "te"):
        raise ValueError(f"norm_style={norm_style!r} must be 'local' or 'te'")
    if shape.num_experts is not None and norm_style != "local":
        raise NotImplementedError("MoE is converted for the local spec only (norm_style='local')")
    if shape.num_experts is None and parallel.ep_size != 1:
        raise ValueError(f"ep_size={parallel.ep_size} needs an MoE shape (num_experts)")
    pieces: list[Piece] = []
    for spec in _tensor_specs(shape, parallel, norm_style):
        pieces.extend(_pieces_of(spec, parallel.tp_size, parallel.ep_size))
    return pieces


def hf_sources(shape: ModelShape, parallel: Parallelism, norm_style: NormStyle = "local") -> dict[str, list[Piece]]:
    """HF name -> the primary pieces that fill it, ordered by position in the HF tensor."""
    out: dict[str, list[Piece]] = {}
    for piece in conversion_pieces(shape, parallel, norm_style):
        if piece.primary:
            out.setdefault(piece.hf_name, []).append(piece)
    for pieces in out.values():
        pieces.sort(key=lambda p: p.hf_start)
    return out


def writer_pieces(shape: ModelShape, parallel: Parallelism, norm_style: NormStyle = "local") -> dict[Rank, list[Piece]]:
    """Which HF slices each Megatron rank writes into one shared HF-layout buffer (every rank listed,
    in Megatron order): its primary pieces. Each HF element is written by exactly one rank: a split
    tensor's slice by the rank that holds it, a replicated one (norms) by TP rank 0 of its stage
    only, the last stage's copy of a tied embedding by nobody (stage 0 writes the embedding).
    With EP: an expert by the EP rank that holds it, a non-expert tensor by EP rank 0 only."""
    out: dict[Rank, list[Piece]] = {rank: [] for rank in parallel.ranks()}
    for piece in conversion_pieces(shape, parallel, norm_style):
        if piece.primary:
            out[parallel.rank_of(piece)].append(piece)
    return out


def sources_of_slice(sources: Mapping[str, list[Piece]], hf_name: str, dim: int, start: int, stop: int) -> list[Piece]:
    """Which Megatron (rank, tensor, slice) pieces fill HF slice [start, stop) of ``hf_name`` along
    ``dim``: what a destination that needs only a shard (an inference TP rank) must fetch.
    ``sources`` is ``hf_sources(...)``. A slice along another dim than the pieces' is not expressible
    as pieces (ValueError); slice whole pieces' rows instead."""
    if hf_name not in sources:
        raise ValueError(f"{hf_name!r} is not an HF tensor of this model")
    pieces = sources[hf_name]
    if pieces[0].dim != dim:
        raise ValueError(f"{hf_name}: the Megatron pieces split dim {pieces[0].dim}, not dim {dim}")
    out = [clipped for p in pieces if (clipped := p.clip(start, stop)) is not None]
    if sum(p.length for p in out) != stop - start:
        raise ValueError(f"{hf_name}: slice [{start}, {stop}) along dim {dim} is outside the tensor")
    return out
