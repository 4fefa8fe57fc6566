"""The tiny Qwen2 the Megatron tests share (no pytest import: tests/integration/dist workers use it too)."""

from __future__ import annotations

import torch

from demo.tiny_model import TinyModelConfig, random_state_dict


def tiny_hf(seed: int = 1, num_layers: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config dict, HF state dict): hidden 128, GQA 4 heads / 2 KV heads, SwiGLU 256, float32,
    with random biases and norm weights (the tiny model's own init has zeros and ones there)."""
    config = TinyModelConfig(
        num_layers=num_layers,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
    )
    state = random_state_dict(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    for name, tensor in state.items():
        if name.endswith(".bias") or name.endswith("norm.weight"):
            state[name] = tensor + 0.1 * torch.randn(tensor.shape, generator=gen)
    return config.hf_config(), state
