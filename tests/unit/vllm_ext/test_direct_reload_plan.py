"""`plan_direct_reload`: when the direct CPU reload may stand in for vLLM's, and what it touches."""

from __future__ import annotations

import pytest

from vllm_ext.direct_reload import DirectPlan, DirectReloader, ModuleFacts, plan_direct_reload

QWEN_LIKE = [
    ModuleFacts("model.embed_tokens", "embedding", 64 * 32),
    ModuleFacts("model.layers.0.input_layernorm", "none", 32),
    ModuleFacts("model.layers.0.self_attn.qkv_proj", "linear", 96, weight_removed=True, has_restore_meta=True),
    ModuleFacts("model.layers.0.self_attn.attn", "other", 0),  # attention: a quant method, no parameters
    ModuleFacts("model.layers.0.mlp.down_proj", "linear", 0, weight_removed=True, has_restore_meta=True),
    ModuleFacts("model.layers.0.mlp.act", "none", 0),
    ModuleFacts("lm_head", "embedding", 64 * 32),
]
OK = {"platform": "cpu", "quantization": None, "lora": False, "tp_size": 1}


def test_qwen_like_cpu_model_is_planned():
    plan = plan_direct_reload(**OK, modules=QWEN_LIKE)
    assert plan == DirectPlan(
        True,
        None,
        staged=("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"),
        processed=(
            "model.embed_tokens",
            "model.layers.0.self_attn.qkv_proj",
            "model.layers.0.mlp.down_proj",
            "lm_head",
        ),
    )


def test_linear_that_kept_its_weight_is_processed_without_staging():
    mods = [ModuleFacts("kv_b_proj", "linear", 128, weight_removed=False)]  # e.g. MLA's unpacked kv_b_proj
    assert plan_direct_reload(**OK, modules=mods) == DirectPlan(True, None, staged=(), processed=("kv_b_proj",))


@pytest.mark.parametrize(
    "overrides, mods, reason",
    [
        ({"platform": "cuda"}, QWEN_LIKE, "platform 'cuda'"),
        ({"quantization": "fp8"}, QWEN_LIKE, "quantized model (fp8)"),
        ({"lora": True}, QWEN_LIKE, "LoRA"),
        ({"tp_size": 2}, QWEN_LIKE, "tensor parallel size 2"),
        ({}, QWEN_LIKE + [ModuleFacts("experts", "other", 10)], "module 'experts' has parameters and a quant method"),
        ({}, [ModuleFacts("q", "linear", 0, weight_removed=True, has_restore_meta=False)], "module 'q': packed weight"),
    ],
)
def test_unsupported_cases_name_the_obstacle(overrides, mods, reason):
    plan = plan_direct_reload(**{**OK, **overrides}, modules=mods)
    assert not plan.supported and plan.staged == () and plan.processed == ()
    assert reason in plan.reason


def test_reloader_refuses_an_unsupported_plan():
    with pytest.raises(ValueError, match="does not apply: platform"):
        DirectReloader(object(), plan_direct_reload(**{**OK, "platform": "cuda"}, modules=[]))
