"""Versions of a model as an engine serves them after RL steps, for the delta-update tests."""

from __future__ import annotations

import torch


def adamw_bf16_versions(
    master: dict[str, torch.Tensor], num: int, lr: float, gen: torch.Generator
) -> list[dict[str, torch.Tensor]]:
    """`num` bf16 casts of the float32 `master` weights (requires_grad), one before each AdamW step
    on random gradients drawn from `gen`."""
    return adamw_versions(master, num, lr, gen, lambda n, t: {n: t.to(torch.bfloat16)})


def adamw_versions(
    master: dict[str, torch.Tensor], num: int, lr: float, gen: torch.Generator, cast
) -> list[dict[str, torch.Tensor]]:
    """`num` versions of the float32 `master` weights (requires_grad), one before each AdamW step on
    random gradients drawn from `gen`; `cast(name, weight)` -> the engine's tensors of that weight."""
    opt = torch.optim.AdamW(master.values(), lr=lr)
    out = []
    for _ in range(num):
        version: dict[str, torch.Tensor] = {}
        for n, t in master.items():
            version.update(cast(n, t.detach()))
        out.append(version)
        for t in master.values():
            t.grad = torch.randn(t.shape, generator=gen)
        opt.step()
    return out


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_block_cast(name: str, w: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    """A 2-D weight as block-scaled FP8 engines serve it (DeepSeek-V3's and Kimi-K2's layout):
    `name` in float8_e4m3fn, each `block` x `block` tile scaled so its largest magnitude is 448, and
    `name`_scale_inv, the float32 scale of each tile (the weight is q * scale)."""
    rows, cols = w.shape
    if rows % block or cols % block:
        raise ValueError(f"{name}: {rows}x{cols} is not a whole number of {block}x{block} blocks")
    tiles = w.reshape(rows // block, block, cols // block, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return {name: q, f"{name}_scale_inv": scale.float()}
