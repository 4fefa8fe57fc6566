"""A megatron-core GPTModel (TP=1, CPU, gloo) loaded with converted HF weights gives HF's logits.

Tolerance: float32, max |megatron - HF| <= 1e-5 over all logits (measured ~3e-7: the two compute
attention and RMSNorm in different orders)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
transformers = pytest.importorskip("transformers")

from ckpt_common.layout.shapes import ModelShape, Parallelism  # noqa: E402
from demo.tiny_model import VOCAB_SIZE  # noqa: E402
from tests.unit.trainer.tiny import tiny_hf  # noqa: E402
from trainer.megatron import cpu_compat  # noqa: E402
from trainer.megatron import model as mg_model  # noqa: E402
from trainer.megatron.convert import megatron_to_hf  # noqa: E402

LOGITS_ATOL = 1e-5
GPU_LOGITS_ATOL = 1e-3  # GPU kernels (TF32 where enabled) differ more than CPU's


def hf_logits(hf_config: dict, state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf_config)).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(ids).logits


def test_tp1_logits_equal_hf_and_state_converts_back(parallel):
    hf_config, state = tiny_hf()
    config = mg_model.MegatronModelConfig(tp_size=1)
    model, norm_style = mg_model.build_gpt_model(hf_config, config)
    mg_model.load_hf_weights(model, state, hf_config, config, norm_style)
    ids = torch.randint(0, VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    device = next(model.parameters()).device  # CUDA on a GPU machine (no CPU redirects there)
    model.eval()
    with torch.no_grad():
        logits = model(ids.to(device), positions.to(device), None).cpu()
    reference = hf_logits(hf_config, state, ids)
    diff = (logits - reference).abs().max().item()
    print(f"TP=1 max |megatron - HF| logits: {diff:.3g}")
    assert logits.shape == reference.shape and diff <= (LOGITS_ATOL if device.type == "cpu" else GPU_LOGITS_ATOL)

    back = megatron_to_hf({(0, 0): mg_model.megatron_state(model)}, ModelShape.from_hf_config(hf_config), Parallelism())
    assert set(back) == set(state) and all(torch.equal(back[n].cpu(), state[n]) for n in state)


def test_tp1_backward_runs_on_cpu(parallel):
    hf_config, state = tiny_hf(seed=2)
    config = mg_model.MegatronModelConfig(tp_size=1)
    # training keeps the logits vocab-parallel (megatron's cross entropy works on the shards)
    model, norm_style = mg_model.build_gpt_model(hf_config, config, parallel_output=True)
    mg_model.load_hf_weights(model, state, hf_config, config, norm_style)
    model.train()
    ids = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(8))
    ids = ids.to(next(model.parameters()).device)
    positions = torch.arange(15, device=ids.device).expand(2, -1)
    loss = model(ids[:, :-1], positions, None, labels=ids[:, 1:]).float().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_no_redirects_and_logits_equal_hf():
    """On GPU: no CPU redirects, the TransformerEngine spec where installed (else local), HF's logits."""
    if torch.distributed.is_initialized():
        pytest.skip("a default process group is already initialized in this pytest process")
    hf_config, state = tiny_hf()
    mg_model.init_parallel(1)
    try:
        config = mg_model.MegatronModelConfig(tp_size=1)
        model, norm_style = mg_model.build_gpt_model(hf_config, config)
        assert cpu_compat.active_cpu_redirects() == ()
        mg_model.load_hf_weights(model, {n: t.cuda() for n, t in state.items()}, hf_config, config, norm_style)
        ids = torch.randint(1, VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(7))
        model.eval()
        with torch.no_grad():
            logits = model(ids.cuda(), torch.arange(24).expand(2, -1).cuda(), None).cpu()
        diff = (logits - hf_logits(hf_config, state, ids)).abs().max().item()
        assert diff <= GPU_LOGITS_ATOL, diff
    finally:
        mg_model.close_parallel()
