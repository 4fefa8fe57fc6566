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
from typing import Literal

Rank = tuple[int, ...]  # (pp_rank, tp_rank), or (pp_rank, tp_rank, ep_rank) when ep_size > 1
NormStyle = Literal["local", "te"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape facts the conversion needs (a dense Qwen2/Llama-style decoder)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = True
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # each expert's intermediate size (HF moe_intermediate_size)

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.num_experts is not None:
            if self.moe_ffn_hidden_size is None:
                raise NotImplementedError("MoE (num_experts) needs moe_ffn_hidden_size, the experts' intermediate size")
            for name in ("num_experts", "moe_ffn_hidden_size"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{name}={value!r} must be a positive int")
        elif self.moe_ffn_hidden_size is not None:
            raise ValueError("moe_ffn_hidden_size is set but num_experts is not")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @classmethod
    def from_hf_config(cls, config: Mapping) -> ModelShape:
        """From a Qwen2 ``config.json`` dict (or a transformers config's ``to_dict()``)."""
        moe = {}
        if config.get("num_experts") or config.get("num_local_experts"):
            if config.get("num_local_experts") or config.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
                raise NotImplementedError("MoE HF configs other than qwen2_moe / qwen3_moe are not converted")
            if config.get("shared_expert_intermediate_size"):
                raise NotImplementedError("MoE with a shared expert is not converted (see ModelShape)")
            if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
                raise NotImplementedError(
                    "MoE with dense layers (mlp_only_layers / decoder_sparse_step) is not converted"
                )
            moe = {"num_experts": config["num_experts"], "moe_ffn_hidden_size": config["moe_intermediate_size"]}
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", config.get("model_type", "qwen2") in ("qwen2", "qwen2_moe"))),
            **moe,
        )

    @property
    def q_heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Trainer-side model parallelism. ``layers_per_stage`` overrides the even PP split."""

    tp_size: int = 1
    pp_size: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    ep_size: int = 1  # expert parallelism (MoE); expert-TP is tp_size

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.layers_per_stage is not None:
            if len(self.layers_per_stage) != self.pp_size or min(self.layers_per_stage) < 1:
                raise ValueError(
                    f"layers_per_stage={self.layers_per_stage} must hold {self.pp_size} "
                    f"positive counts (one per PP stage)"
                )

    def ranks(self) -> list[Rank]:
        if self.ep_size == 1:
            return [(pp, tp) for pp in range(self.pp_size) for tp in range(self.tp_size)]
        return [(pp, tp, ep) for pp in range(self.pp_size) for tp in range(self.tp_size) for ep in range(self.ep_size)]

    def rank_of(self, piece: Piece) -> Rank:
        """The rank key of ``piece``: (pp, tp) when ep_size is 1, else (pp, tp, ep)."""
        if self.ep_size == 1:
            return (piece.pp_rank, piece.tp_rank)
        return (piece.pp_rank, piece.tp_rank, piece.ep_rank)


def global_expert_index(ep_rank: int, local_index: int, num_experts: int, ep_size: int) -> int:
    """Megatron's local expert ``local_index`` on EP rank ``ep_rank`` is HF expert ``ep_rank * (E / ep) + j``."""
    per_rank = _experts_per_rank(num_experts, ep_size)
    if not 0 <= ep_rank < ep_size or not 0 <= local_index < per_rank:
        raise ValueError(f"(ep_rank={ep_rank}, local={local_index}) is outside ep_size={ep_size} x {per_rank} experts")
    return ep_rank * per_rank + local_index


def local_expert_index(global_index: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """The inverse of ``global_expert_index``: HF expert ``global_index`` -> (ep_rank, local index)."""
    per_rank = _experts_per_rank(num_experts, ep_size)
    if not 0 <= global_index < num_experts:
        raise ValueError(f"expert {global_index} is outside num_experts={num_experts}")
    return divmod(global_index, per_rank)


def _experts_per_rank(num_experts: int, ep_size: int) -> int:
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    return num_experts // ep_size


def hf_param_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF Qwen2 parameter names and shapes for ``shape``, in HF order."""
    h, hd, ffn = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    q, kv = shape.num_attention_heads * hd, shape.num_query_groups * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        out[p + "self_attn.q_proj.weight"] = (q, h)
        if shape.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        if shape.qkv_bias:
            out[p + "self_attn.k_proj.bias"] = (kv,)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if shape.qkv_bias:
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if shape.num_experts is None:
            out.update(
                {
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (ffn, h),
                    p + "mlp.up_proj.weight": (ffn, h),
                    p + "mlp.down_proj.weight": (h, ffn),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                }
            )
            continue
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "mlp.gate.weight"] = (shape.num_experts, h)
        moe_ffn = shape.moe_ffn_hidden_size
        for e in range(shape.num_experts):
            x = f"{p}mlp.experts.{e}."
            out.update(
                {
                    x + "gate_proj.weight": (moe_ffn, h),
                    x + "up_proj.weight": (moe_ffn, h),
                    x + "down_proj.weight": (h, moe_ffn),
                }
            )
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


def stage_layers(num_layers: int, parallel: Parallelism, pp_rank: int) -> tuple[int, int]:
    """(offset, count) of PP stage ``pp_rank``: its local layer i is global layer offset + i."""
    if not 0 <= pp_rank < parallel.pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside pp_size={parallel.pp_size}")
    counts = parallel.layers_per_stage
    if counts is None:
        if num_layers % parallel.pp_size != 0:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pp_size={parallel.pp_size}; pass layers_per_stage"
            )
        counts = (num_layers // parallel.pp_size,) * parallel.pp_size
    if sum(counts) != num_layers:
        raise ValueError(f"layers_per_stage={counts} does not add up to num_layers={num_layers}")
    return sum(counts[:pp_rank]), counts[pp_rank]


@dataclasses.dataclass(frozen=True)
class Piece:
    """``length`` slices along ``dim``: HF ``hf_name[hf_start:]`` <-> Megatron ``mg_name[mg_start:]``
    on rank (pp_rank, tp_rank). ``primary`` is False for replicas (TP copies of replicated
    tensors, the last stage's copy of tied embeddings): Megatron->HF reads primaries only."""

    hf_name: str
    pp_rank: int
    tp_rank: int
    mg_name: str
    dim: int
    hf_start: int
    mg_start: int
    length: int
    primary: bool = True
    ep_rank: int = 0  # expert-parallel rank (0 for every piece of a dense model)

    def hf_byte_range(self, hf_shape: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
        """Byte range of this piece inside the (contiguous) HF tensor, when it is one range."""
        if any(size != 1 for size in hf_shape[: self.dim]):
            return None
        row_bytes = itemsize
        for size in hf_shape[self.dim + 1 :]:
            row_bytes *= size
        return self.hf_start * row_bytes, (self.hf_start + self.length) * row_bytes

    def clip(self, start: int, stop: int) -> Piece | None:
        """The part of this piece that falls in HF slice [start, stop) along ``dim``, or None."""
        lo, hi = max(start, self.hf_start), min(stop, self.hf_start + self.length)
        if lo >= hi:
            return None
        return dataclasses.replace(self, hf_start=lo, mg_start=self.mg_start + lo - self.hf_start, length=hi - lo)


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
