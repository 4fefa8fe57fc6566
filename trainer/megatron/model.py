"""The demo's architecture (tiny Qwen2: GQA, SwiGLU, RMSNorm, RoPE, untied embeddings, qkv bias)
as a megatron-core GPTModel, on CPU through gloo or on GPU.

    HF config.json ──▶ transformer_config(...) ──▶ TransformerConfig
    init_parallel(tp, pp) ── gloo (CPU) / nccl (GPU) process group, parallel_state ──┐
    build_gpt_model(hf_config) ◀─────────────────────────────────────────────────────┘
        CPU: apply_cpu_redirects(), local layer spec (RMSNorm), use_cpu_initialization
        GPU: TransformerEngine spec where installed (norms fused into linear_qkv/linear_fc1)
    load_hf_weights(model, hf_state_dict) ── convert.hf_to_megatron for this rank ──▶ model
    megatron_state(model) ── this rank's tensors, Megatron names (for convert.megatron_to_hf)

megatron is imported inside the functions, so importing this module is cheap. On CPU,
build_gpt_model applies trainer.megatron.cpu_compat's redirects after importing the GPT stack;
code that imports more of megatron later (optimizer, schedules) calls apply_cpu_redirects() again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import torch

from ckpt_common.dtypes import dtype_from_name
from ckpt_common.layout.shapes import ModelShape, NormStyle, Parallelism, Rank
from trainer.megatron.convert import hf_to_megatron

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MegatronModelConfig:
    """How to build the GPTModel (the model's shape comes from the HF config)."""

    tp_size: int = 1
    pp_size: int = 1
    params_dtype: str = "float32"
    use_transformer_engine: bool | None = None  # None: TE spec on GPU where installed, else local

    def __post_init__(self) -> None:
        Parallelism(tp_size=self.tp_size, pp_size=self.pp_size)  # validates the sizes
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"params_dtype={self.params_dtype!r} must be float32, bfloat16 or float16")

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(tp_size=self.tp_size, pp_size=self.pp_size)


def transformer_config(
    hf_config: Mapping,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool = True,
):
    """A megatron ``TransformerConfig`` equivalent to a Qwen2 HF config (dense, no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = ModelShape.from_hf_config(hf_config)
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.get('hidden_act')!r}: only SwiGLU (silu) is mapped")
    rope_scaling = hf_config.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling={rope_scaling!r} is not mapped (only default RoPE)")
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype if pp_size > 1 else None,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=True,
        # CPU-safe: no fused CUDA kernels.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
    )


def _rope_theta(hf_config: Mapping) -> float:
    params = hf_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))


def init_parallel(tp_size: int, pp_size: int = 1, seed: int = 1234) -> None:
    """torch.distributed (gloo on CPU, nccl on GPU) + megatron's parallel_state.

    Uses torchrun's environment when set; a single process without it gets a world of one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.get_world_size() % (tp_size * pp_size) != 0:
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tp*pp={tp_size * pp_size}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp_size, pp_size)
    if torch.cuda.is_available():
        # Weight init forks the model-parallel CUDA RNG stream: it must be seeded (per TP rank) first.
        # On CPU cpu_compat replaces that fork with the default generator.
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def close_parallel() -> None:
    """Undo ``init_parallel`` (megatron's groups, then the default process group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def this_rank() -> Rank:
    """(pp_rank, tp_rank) of this process in megatron's parallel_state."""
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())


def _use_te(requested: bool | None) -> bool:
    if requested is False or not torch.cuda.is_available():
        if requested:
            raise ValueError("use_transformer_engine=True needs CUDA")
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if requested:
            raise ValueError("use_transformer_engine=True but transformer_engine is not installed") from None
        return False
    return True


def build_gpt_model(
    hf_config: Mapping, config: MegatronModelConfig = MegatronModelConfig(), *, parallel_output: bool = False
):
    """The GPTModel stage of this rank (``init_parallel`` first). Returns (model, norm_style).

    ``parallel_output=False`` gathers the vocab-parallel logits on every TP rank."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    from trainer.megatron.cpu_compat import apply_cpu_redirects

    if not torch.cuda.is_available():
        apply_cpu_redirects()
    dtype = dtype_from_name(config.params_dtype)
    tconfig = transformer_config(
        hf_config,
        tp_size=config.tp_size,
        pp_size=config.pp_size,
        params_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    te = _use_te(config.use_transformer_engine)
    if te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=spec,
        vocab_size=hf_config["vocab_size"],
        max_sequence_length=hf_config.get("max_position_embeddings", 4096),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
    )
    if torch.cuda.is_available():
        model = model.cuda()
    norm_style: NormStyle = "te" if te else "local"
    logger.info("GPTModel built: tp=%d pp=%d rank=%s spec=%s", config.tp_size, config.pp_size, this_rank(), norm_style)
    return model, norm_style


def megatron_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent tensors, Megatron names (no ``_extra_state``)."""
    return {
        name: tensor
        for name, tensor in model.state_dict().items()
        if not name.endswith("_extra_state") and isinstance(tensor, torch.Tensor)
    }


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Mapping,
    config: MegatronModelConfig,
    norm_style: NormStyle = "local",
) -> None:
    """Copy this rank's share of an HF state dict into the model; every parameter must be covered."""
    rank = this_rank()
    shard = hf_to_megatron(
        hf_state_dict, ModelShape.from_hf_config(hf_config), config.parallelism, norm_style=norm_style, ranks=[rank]
    )[rank]
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(shard))
    unexpected = sorted(set(shard) - set(params))
    if missing or unexpected:
        raise RuntimeError(
            f"rank {rank}: converted shard does not match the model: missing={missing}, unexpected={unexpected}"
        )
    for name, tensor in shard.items():
        if params[name].shape != tensor.shape:
            raise RuntimeError(
                f"rank {rank}: {name}: model shape {tuple(params[name].shape)}, converted {tuple(tensor.shape)}"
            )
        params[name].copy_(tensor)
