"""A megatron-core MoE GPTModel (local spec, SequentialMLP experts, TP=1, EP=1, CPU, gloo) against the
MoE piece table: its state_dict names and shapes are the table's, it loads converted HF Qwen2-MoE
weights (no shared expert) and gives transformers' Qwen2MoeForCausalLM logits, and converts back
bit-exact.

CPU notes (megatron-core 0.16.1 without TransformerEngine): the alltoall token dispatcher creates a
``torch.cuda.Stream`` in its constructor, so the test uses the allgather dispatcher; the router's
gating linear reads the module global ``te_general_gemm``, which is never defined when the
TransformerEngine import fails (NameError), so the test sets it to None for its duration.

HF side: transformers 5 keeps the experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, h],
``mlp.experts.down_proj`` [E, h, I]); the checkpoint layout (per-expert ``gate_proj``/``up_proj``/
``down_proj``) is what the table converts, so the test fuses it for the HF model. "No shared expert"
is ``shared_expert_intermediate_size=0`` (zero-row shared MLP: its output is exactly 0).
Routing: megatron's default (top-k, then softmax over the k) is HF's ``norm_topk_prob=True``.
Tolerance: float32, max |megatron - HF| <= 1e-5 (measured 1.6e-6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
transformers = pytest.importorskip("transformers")

from ckpt_common.layout.shapes import ModelShape, Parallelism, hf_param_shapes  # noqa: E402
from trainer.megatron import cpu_compat  # noqa: E402
from trainer.megatron import model as mg_model  # noqa: E402
from trainer.megatron.convert import hf_to_megatron, megatron_to_hf  # noqa: E402

LOGITS_ATOL = 1e-5

HF_CONFIG = {
    "model_type": "qwen2_moe",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "shared_expert_intermediate_size": 0,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def _hf_state(shape: ModelShape, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, dims in hf_param_shapes(shape).items():
        noise = 0.1 * torch.randn(dims, generator=gen)
        out[name] = noise + 1.0 if name.endswith("norm.weight") else noise
    return out


def _fused_hf(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The checkpoint layout -> transformers 5's in-memory Qwen2-MoE (fused experts, empty shared expert)."""
    out = {n: t for n, t in state.items() if ".mlp.experts." not in n}
    h = shape.hidden_size
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}.mlp."
        experts = range(shape.num_experts)
        out[p + "experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([state[f"{p}experts.{e}.gate_proj.weight"], state[f"{p}experts.{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        out[p + "experts.down_proj"] = torch.stack([state[f"{p}experts.{e}.down_proj.weight"] for e in experts])
        out[p + "shared_expert.gate_proj.weight"] = torch.zeros(0, h)
        out[p + "shared_expert.up_proj.weight"] = torch.zeros(0, h)
        out[p + "shared_expert.down_proj.weight"] = torch.zeros(h, 0)
        out[p + "shared_expert_gate.weight"] = torch.zeros(1, h)
    return out


def _build_moe_model():
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    cpu_compat.apply_cpu_redirects()
    tconfig = dataclasses.replace(
        mg_model.transformer_config(HF_CONFIG),
        num_moe_experts=HF_CONFIG["num_experts"],
        moe_router_topk=HF_CONFIG["num_experts_per_tok"],
        moe_ffn_hidden_size=HF_CONFIG["moe_intermediate_size"],
        moe_router_pre_softmax=False,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=1,
    )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=HF_CONFIG["num_experts"], moe_grouped_gemm=False, normalization="RMSNorm"
    )
    cpu_compat.apply_cpu_redirects()
    return GPTModel(
        config=tconfig,
        transformer_layer_spec=spec,
        vocab_size=HF_CONFIG["vocab_size"],
        max_sequence_length=HF_CONFIG["max_position_embeddings"],
        pre_process=True,
        post_process=True,
        parallel_output=False,
        position_embedding_type="rope",
        rotary_base=HF_CONFIG["rope_theta"],
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU MoE test (on GPU the TransformerEngine grouped experts' names apply)"
)
def test_moe_model_names_logits_and_round_trip(parallel, monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), raising=False)
    shape = ModelShape.from_hf_config(HF_CONFIG)
    state = _hf_state(shape)
    model = _build_moe_model()

    shard = hf_to_megatron(state, shape, Parallelism())[(0, 0)]
    model_state = mg_model.megatron_state(model)
    assert {n: tuple(t.shape) for n, t in shard.items()} == {n: tuple(t.shape) for n, t in model_state.items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard[name])

    ids = torch.randint(0, HF_CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    config = transformers.Qwen2MoeConfig(**{k: v for k, v in HF_CONFIG.items() if k != "model_type"})
    hf_model = transformers.Qwen2MoeForCausalLM(config).eval()
    hf_model.load_state_dict(_fused_hf(state, shape), strict=True)
    with torch.no_grad():
        reference = hf_model(ids).logits
    diff = (logits - reference).abs().max().item()
    print(f"MoE TP=1 EP=1 max |megatron - HF| logits: {diff:.3g}")
    assert logits.shape == reference.shape and diff <= LOGITS_ATOL

    back = megatron_to_hf({(0, 0): mg_model.megatron_state(model)}, shape, Parallelism())
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
