"""The tiny Qwen2 models the trainer tests share (no pytest import: tests/integration/dist workers use it too)."""

from __future__ import annotations

import torch

from ckpt_common.layout.shapes import ModelShape, hf_param_shapes
from demo.tiny_model import TinyModelConfig, random_state_dict

# The HF trainer tests' model: 2 layers, hidden 64, one head, SwiGLU 128; init std 0.1 (clear logit margins).
SMALL = TinyModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128, init_std=0.1
)


def one_layer_bf16(**overrides) -> TinyModelConfig:
    """The smallest model the dtype tests use: 1 layer, hidden 64, one head, SwiGLU 64, bfloat16 weights."""
    fields = dict(num_layers=1, hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=64)
    return TinyModelConfig(**(fields | {"dtype": "bfloat16"} | overrides))


def tiny_config(num_layers: int = 2) -> TinyModelConfig:
    """The Megatron tests' model: hidden 128, GQA 4 heads / 2 KV heads, SwiGLU 256, float32."""
    return TinyModelConfig(
        num_layers=num_layers,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
    )


def tiny_hf(seed: int = 1, num_layers: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config dict, HF state dict) of `tiny_config(num_layers)` with random biases and norm weights
    (the tiny model's own init has zeros and ones there)."""
    config = tiny_config(num_layers)
    state = random_state_dict(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    for name, tensor in state.items():
        if name.endswith(".bias") or name.endswith("norm.weight"):
            state[name] = tensor + 0.1 * torch.randn(tensor.shape, generator=gen)
    return config.hf_config(), state


def layout_shape(**overrides) -> ModelShape:
    """The conversion tests' shape: 2 layers, hidden 16, GQA 4 heads / 2 groups of dim 4, SwiGLU 24, vocab 32."""
    fields = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=4,
        ffn_hidden_size=24,
        vocab_size=32,
    )
    return ModelShape(**(fields | overrides))


def random_hf(shape: ModelShape, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF tensors of every name and shape ``shape`` has."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(dims, generator=gen).to(dtype) for name, dims in hf_param_shapes(shape).items()}
