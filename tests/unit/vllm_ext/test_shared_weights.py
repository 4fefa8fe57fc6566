"""Which modules a reload must process again because they share a parameter with another module
(vllm_ext.shared_weights.plan_reprocess), as a table; and the kernel check on small real layers."""

from __future__ import annotations

import pytest

from vllm_ext.shared_weights import ParamFacts, plan_reprocess

EMB, LIN, NONE, OTHER = "embedding", "linear", "none", "other"


def facts(*rows):
    return [ParamFacts(module, param, storage, method) for module, param, storage, method in rows]


@pytest.mark.parametrize(
    "rows, reprocess, refused, groups",
    [
        # untied: nothing shared, nothing to redo
        (
            [
                ("model.embed_tokens", "weight", 1, EMB),
                ("model.norm", "weight", 2, NONE),
                ("lm_head", "weight", 3, EMB),
            ],
            (),
            (),
            (),
        ),
        # tied embeddings: the head's packed copy is derived from the embedding's values: both processed
        (
            [
                ("model.embed_tokens", "weight", 1, EMB),
                ("model.norm", "weight", 2, NONE),
                ("lm_head", "weight", 1, EMB),
            ],
            ("model.embed_tokens", "lm_head"),
            (),
            (("model.embed_tokens.weight", "lm_head.weight"),),
        ),
        # a draft model's head tied to the target's embedding (another model object, same storage)
        (
            [
                ("model.embed_tokens", "weight", 1, EMB),
                ("lm_head", "weight", 5, EMB),
                ("drafter.lm_head", "weight", 1, EMB),
            ],
            ("model.embed_tokens", "drafter.lm_head"),
            (),
            (("model.embed_tokens.weight", "drafter.lm_head.weight"),),
        ),
        # a linear sharing its weight with another module: its CPU processing drops the weight, named
        (
            [("a.proj", "weight", 7, LIN), ("b.proj", "weight", 7, LIN), ("c", "weight", 8, LIN)],
            (),
            ("a.proj", "b.proj"),
            (("a.proj.weight", "b.proj.weight"),),
        ),
        # an unknown quant method sharing storage is refused too; plain modules need nothing
        ([("q", "weight", 4, OTHER), ("n", "weight", 4, NONE)], (), ("q",), (("q.weight", "n.weight"),)),
        # empty or meta tensors (storage 0) are never "shared"
        ([("a", "weight", 0, EMB), ("b", "weight", 0, EMB)], (), (), ()),
        # two parameters of one module on one storage (a fused view) are not sharing with another module
        ([("fused", "w1", 9, LIN), ("fused", "w2", 9, LIN)], (), (), ()),
    ],
)
def test_plan_reprocess(rows, reprocess, refused, groups):
    plan = plan_reprocess(facts(*rows))
    assert (plan.reprocess, plan.refused, plan.groups) == (reprocess, refused, groups)


def _head(vocab: int = 64, hidden: int = 32, seed: int = 0):
    """A module as vLLM's CPU backend builds a (tied) LM head: a weight and vLLM's own embedding method,
    processed (on CPU: the packed copy its GEMM reads)."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)), False)
    m.quant_method = UnquantizedEmbeddingMethod()
    m.quant_method.process_weights_after_loading(m)
    return m


def test_the_kernel_check_finds_a_head_computing_with_stale_values_and_passes_once_processed_again():
    import torch

    from vllm_ext.kernel_check import KernelMismatch, check_kernels

    head = _head()
    report = check_kernels([("lm_head", head)])
    assert (report.modules_checked, report.failed) == (1, [])
    assert report.max_rel_err < 1e-4, report
    # new values in the parameter (what a reload of the tied embedding does): the kernel lags behind
    head.weight.data.copy_(torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))
    stale_by_cpu_packing = torch.nn.functional.linear(torch.ones(1, 32), head.weight) != head.quant_method.apply(
        head, torch.ones(1, 32)
    )
    if not stale_by_cpu_packing.any():
        pytest.skip("this vLLM build computes the head from the parameter itself: nothing can go stale")
    with pytest.raises(KernelMismatch, match=r"lm_head: relative error"):
        check_kernels([("lm_head", head)])
    head.quant_method.process_weights_after_loading(head)
    assert check_kernels([("lm_head", head)]).failed == []


def test_the_kernel_check_compares_with_a_given_reference_and_counts_what_it_cannot_check():
    import torch

    from vllm_ext.kernel_check import KernelMismatch, check_kernels

    head, other = _head(seed=2), _head(seed=3)
    with pytest.raises(KernelMismatch, match="head"):
        check_kernels([("head", head)], references={head: other.weight})  # the reference differs
    packed = _head(seed=4)
    packed._parameters["weight"] = torch.nn.Parameter(torch.empty(0), False)  # as the CPU packing leaves a linear
    report = check_kernels([("packed", packed), ("plain", torch.nn.LayerNorm(4))])
    assert (report.modules_checked, report.modules_unchecked) == (0, 1)
