"""Versions of a model as an engine serves them after RL steps, for the delta-update tests."""

from __future__ import annotations

import torch


def adamw_bf16_versions(
    master: dict[str, torch.Tensor], num: int, lr: float, gen: torch.Generator
) -> list[dict[str, torch.Tensor]]:
    """`num` bf16 casts of the float32 `master` weights (requires_grad), one before each AdamW step
    on random gradients drawn from `gen`."""
    opt = torch.optim.AdamW(master.values(), lr=lr)
    out = []
    for _ in range(num):
        out.append({n: t.detach().to(torch.bfloat16) for n, t in master.items()})
        for t in master.values():
            t.grad = torch.randn(t.shape, generator=gen)
        opt.step()
    return out
