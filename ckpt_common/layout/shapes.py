"""Model shapes and parallel layouts of the HF <-> Megatron conversion (pure, no megatron import):
``ModelShape`` (dense or MoE, from an HF config), ``Parallelism`` (TP, PP, EP; ranks), the global <->
local expert index, the HF tensors' shapes, each PP stage's layers, and ``Piece`` (one entry of the
piece table). ``pieces`` builds the piece table on these; ``trainer.megatron.convert`` copies by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
