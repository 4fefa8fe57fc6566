"""Colocated mode on a GPU: the trainer lends its device memory to the engines and takes it back
(`trainer.offload.DeviceOffload`), and training goes on exactly as if it had never moved."""

from __future__ import annotations

import pytest
import torch

from trainer.offload import DeviceOffload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    ).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, 256, device="cuda", generator=g)
    model(x).square().mean().backward()
    opt.step()


def test_release_frees_the_device_and_reclaim_resumes_bit_exact():
    model, opt = _model_and_optimizer(0)
    twin, twin_opt = _model_and_optimizer(0)
    for s in range(2):
        _step(model, opt, s)
        _step(twin, twin_opt, s)
    params_before = [p for p in model.parameters()]
    offload = DeviceOffload(model, lambda: opt)
    held = torch.cuda.memory_allocated()
    report = offload.release()
    assert offload.released and report.moved_bytes > 0
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    # what is left on the device is the twin's: every moved byte freed (no reference kept anywhere)
    assert torch.cuda.memory_allocated() <= held - report.moved_bytes + 4096
    assert report.device_allocated_bytes <= held - report.moved_bytes + 4096
    assert offload.release().moved_bytes == 0  # released once
    back = offload.reclaim()
    assert back.moved_bytes == report.moved_bytes and not offload.released
    assert [p for p in model.parameters()] == params_before  # the same Parameter objects
    for s in range(2, 4):
        _step(model, opt, s)
        _step(twin, twin_opt, s)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_reset_optimizer_reuses_the_pinned_copies():
    model, opt = _model_and_optimizer(1)
    box = {"opt": opt}
    offload = DeviceOffload(model, lambda: box["opt"])
    _step(model, box["opt"], 0)
    offload.release()
    host = {k: v.data_ptr() for k, v in offload._host.items()}
    offload.reclaim()
    box["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-3)  # k1.5 resets it every iteration
    _step(model, box["opt"], 1)
    offload.release()
    assert {k: v.data_ptr() for k, v in offload._host.items()} == host  # no new pinned memory
    offload.reclaim()
