"""The sharding-aware transfer planner: per engine rank (TP x EP), which slice of each HF tensor."""

from __future__ import annotations

import pytest

from checkpoint_engine.buckets import TensorSpec
from checkpoint_engine.sharding.shard_plan import (
    MegatronPlan,
    PlanCache,
    byte_ranges,
    fingerprint,
    normalize_slice,
    plan_hf,
    plan_megatron,
    vocab_range,
)
from checkpoint_engine.sharding.slices import EngineLayout, SourceSlice
from ckpt_common.layout.shapes import ModelShape, Parallelism, hf_param_shapes

DENSE = ModelShape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    vocab_size=1000,
)
MOE = ModelShape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    vocab_size=1000,
    num_experts=4,
    moe_ffn_hidden_size=32,
)
L0 = "model.layers.0."
L1 = "model.layers.1."


def by_name(plan, dest):
    return {s.name: s for s in plan.slices(dest)}


S = SourceSlice
WHOLE = None  # the expected slice is the whole tensor


@pytest.mark.parametrize(
    "tp,rank,expected",
    [
        # TP 1: every tensor whole
        (1, 0, {L0 + "self_attn.q_proj.weight": WHOLE, "model.embed_tokens.weight": WHOLE, "lm_head.weight": WHOLE}),
        (
            2,
            1,
            {
                L0 + "self_attn.q_proj.weight": (0, 32, 64),
                L0 + "self_attn.q_proj.bias": (0, 32, 64),
                L0 + "self_attn.k_proj.weight": (0, 16, 32),  # kv head 1 of 2
                L1 + "self_attn.v_proj.bias": (0, 16, 32),
                L0 + "self_attn.o_proj.weight": (1, 32, 64),
                L0 + "mlp.gate_proj.weight": (0, 64, 128),
                L0 + "mlp.up_proj.weight": (0, 64, 128),
                L0 + "mlp.down_proj.weight": (1, 64, 128),
                "model.embed_tokens.weight": (0, 512, 1000),  # 1024 padded / 2, clipped to 1000
                "lm_head.weight": (0, 512, 1000),
                L0 + "input_layernorm.weight": WHOLE,
                L0 + "post_attention_layernorm.weight": WHOLE,
                "model.norm.weight": WHOLE,
            },
        ),
        (
            2,
            0,
            {
                L0 + "self_attn.q_proj.weight": (0, 0, 32),
                L0 + "self_attn.k_proj.weight": (0, 0, 16),
                "model.embed_tokens.weight": (0, 0, 512),
            },
        ),
        (
            4,
            1,
            {
                L0 + "self_attn.q_proj.weight": (0, 16, 32),
                L0 + "self_attn.k_proj.weight": (0, 0, 16),  # 2 kv heads on 4 ranks: ranks 0, 1 take head 0
                L0 + "self_attn.v_proj.weight": (0, 0, 16),
                L0 + "self_attn.o_proj.weight": (1, 16, 32),
                L0 + "mlp.gate_proj.weight": (0, 32, 64),
                L0 + "mlp.down_proj.weight": (1, 32, 64),
                "model.embed_tokens.weight": (0, 256, 512),
            },
        ),
        (
            4,
            2,
            {
                L0 + "self_attn.k_proj.weight": (0, 16, 32),  # ranks 2, 3 take kv head 1
                L1 + "self_attn.k_proj.bias": (0, 16, 32),
                "lm_head.weight": (0, 512, 768),
            },
        ),
        (4, 3, {L0 + "self_attn.v_proj.weight": (0, 16, 32), "lm_head.weight": (0, 768, 1000)}),
    ],
)
def test_dense_slices(tp, rank, expected):
    plan = plan_hf(DENSE, EngineLayout(tp_size=tp))
    got = by_name(plan, (rank, 0))
    for name, want in expected.items():
        assert got[name] == (S(name) if want is WHOLE else S(name, *want)), name


def _coverage(plan, shapes):
    """name -> per-element count of destinations holding it, along the dim it is split on."""
    out = {}
    for name in plan.names:
        slices = [s for dest in plan.layout.ranks for s in plan.slices(dest) if s.name == name]
        dim = next((s.dim for s in slices if not s.whole), 0)
        counts = [0] * shapes[name][dim]
        for s in slices:
            for i in range(*((0, len(counts)) if s.whole else (s.start, s.stop))):
                counts[i] += 1
        out[name] = counts
    return out


@pytest.mark.parametrize(
    "shape,tp,ep",
    [(DENSE, 1, 1), (DENSE, 2, 1), (DENSE, 4, 1), (MOE, 1, 1), (MOE, 4, 1), (MOE, 1, 2), (MOE, 2, 2), (MOE, 4, 4)],
)
def test_union_over_ranks_covers_every_tensor_exactly(shape, tp, ep):
    shapes = hf_param_shapes(shape)
    plan = plan_hf(shape, EngineLayout(tp_size=tp, ep_size=ep))
    assert plan.names == tuple(sorted(shapes))
    for name, counts in _coverage(plan, shapes).items():
        if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
            want = tp * ep  # replicated on every rank
        elif ".experts." in name:
            want = 1  # one EP group, split over its TP ranks
        elif "k_proj" in name or "v_proj" in name:
            want = ep * max(tp // shape.num_query_groups, 1)  # replicated kv heads
        else:
            want = ep  # TP-split, the same on every EP rank
        assert set(counts) == {want}, (name, sorted(set(counts)))


def test_tied_embeddings_have_no_lm_head_and_padding_only_ranks_get_nothing():
    tiny = ModelShape(1, 64, 4, 2, 16, 128, vocab_size=10, tie_word_embeddings=True)
    plan = plan_hf(tiny, EngineLayout(tp_size=4))
    assert "lm_head.weight" not in plan.names
    assert by_name(plan, (0, 0))["model.embed_tokens.weight"] == S("model.embed_tokens.weight")  # rows [0, 10)
    for rank in (1, 2, 3):
        assert "model.embed_tokens.weight" not in by_name(plan, (rank, 0))
    assert [vocab_range(10, 4, r) for r in range(4)] == [(0, 10), None, None, None]
    assert [vocab_range(130, 2, r) for r in range(2)] == [(0, 96), (96, 130)]  # 130 -> 192 padded


@pytest.mark.parametrize(
    "tp,ep,dest,experts,gate_rows",
    [
        (1, 1, (0, 0), {0, 1, 2, 3}, None),
        (2, 1, (1, 0), {0, 1, 2, 3}, (16, 32)),
        (1, 2, (0, 0), {0, 1}, None),
        (1, 2, (0, 1), {2, 3}, None),
        (2, 2, (0, 1), {2, 3}, (0, 16)),
        (2, 2, (1, 0), {0, 1}, (16, 32)),
    ],
)
def test_moe_experts_per_ep_rank(tp, ep, dest, experts, gate_rows):
    plan = plan_hf(MOE, EngineLayout(tp_size=tp, ep_size=ep))
    got = by_name(plan, dest)
    for layer in (L0, L1):
        held = {int(n.split(".")[5]) for n in got if n.startswith(layer + "mlp.experts.")}
        assert held == experts
        assert got[layer + "mlp.gate.weight"] == S(layer + "mlp.gate.weight")  # router: replicated
    e = min(experts)
    gate, down = f"{L1}mlp.experts.{e}.gate_proj.weight", f"{L1}mlp.experts.{e}.down_proj.weight"
    if gate_rows is None:
        assert (got[gate], got[down]) == (S(gate), S(down))
    else:
        assert (got[gate], got[down]) == (S(gate, 0, *gate_rows), S(down, 1, *gate_rows))
    assert got[L0 + "self_attn.q_proj.weight"] == normalize_slice(
        S(L0 + "self_attn.q_proj.weight", 0, dest[0] * 64 // tp, (dest[0] + 1) * 64 // tp), (64, 64)
    )


def test_bytes_per_rank_at_tp2_bf16():
    specs = {n: ("bfloat16", s) for n, s in hf_param_shapes(DENSE).items()}
    specs["model.norm.weight"] = TensorSpec("model.norm.weight", "bfloat16", (64,))  # either form
    plan = plan_hf(DENSE, EngineLayout(tp_size=2))
    full = plan.full_bytes(specs)
    assert full == 2 * 202_304
    per_rank = [plan.bytes_for((r, 0), specs) for r in range(2)]
    # rank 0: embed/lm_head rows [0, 512), half of every linear, all norms; rank 1: 488 vocab rows
    assert per_rank == [2 * 102_848, 2 * 99_776]
    ratios = [b / full for b in per_rank]
    assert ratios == [pytest.approx(0.5084, abs=1e-4), pytest.approx(0.4932, abs=1e-4)]
    assert max(ratios) <= 0.55
    assert plan_hf(DENSE, EngineLayout()).bytes_for((0, 0), specs) == full
    with pytest.raises(ValueError, match="no dtype/shape given for tensor 'lm_head.weight'"):
        plan.bytes_for((0, 0), {k: v for k, v in specs.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"destination \(2, 0\)"):
        plan.bytes_for((2, 0), specs)


@pytest.mark.parametrize(
    "s,shape,dtype,ranges",
    [
        (S("w", 0, 1, 3), (4, 6), "float32", [(24, 72)]),  # dim 0: one range
        (S("w", 1, 2, 4), (4, 6), "float32", [(8, 16), (32, 40), (56, 64), (80, 88)]),  # dim 1: one per row
        (S("w", 1, 0, 6), (4, 6), "float32", [(0, 96)]),  # every column: rows merge
        (S("w", 1, 0, 3), (1, 6), "bfloat16", [(0, 6)]),
        (S("b", 0, 4, 8), (10,), "bfloat16", [(8, 16)]),  # 1-D bias
        (S("w"), (4, 6), "float32", [(0, 96)]),  # whole
        (S("w", 1, 1, 2), (2, 3, 2), "int8", [(2, 4), (8, 10)]),  # 3-D, middle dim
    ],
)
def test_byte_ranges(s, shape, dtype, ranges):
    assert byte_ranges(s, shape, dtype) == ranges


@pytest.mark.parametrize("s,shape", [(S("w", 0, 2, 5), (4, 6)), (S("w", 2, 0, 1), (4, 6))])
def test_byte_ranges_rejects_slices_outside_the_tensor(s, shape):
    with pytest.raises(ValueError, match="outside shape"):
        byte_ranges(s, shape, "float32")


def _fetch(plan, dest, name):
    return next(f for f in plan.fetches[dest] if f.slice.name == name)


def test_megatron_tp2_to_vllm_tp2_each_slice_from_the_matching_rank():
    plan = plan_megatron(DENSE, Parallelism(tp_size=2), EngineLayout(tp_size=2))
    assert isinstance(plan, MegatronPlan)
    assert plan.by_dest == plan_hf(DENSE, EngineLayout(tp_size=2)).by_dest
    for r in range(2):
        assert [f.slice for f in plan.fetches[(r, 0)]] == list(plan.slices((r, 0)))
        for name, mg, mg_start in [
            (L0 + "self_attn.q_proj.weight", "decoder.layers.0.self_attention.linear_qkv.weight", 0),
            (L0 + "self_attn.k_proj.weight", "decoder.layers.0.self_attention.linear_qkv.weight", 32),
            (L1 + "mlp.gate_proj.weight", "decoder.layers.1.mlp.linear_fc1.weight", 0),
            (L1 + "mlp.up_proj.weight", "decoder.layers.1.mlp.linear_fc1.weight", 64),  # [gate r ; up r]
            (L0 + "self_attn.o_proj.weight", "decoder.layers.0.self_attention.linear_proj.weight", 0),
        ]:
            (piece,) = _fetch(plan, (r, 0), name).pieces
            assert (piece.tp_rank, piece.mg_name, piece.mg_start) == (r, mg, mg_start), name
        # a replicated norm comes from its primary copy on TP rank 0
        (norm,) = _fetch(plan, (r, 0), L0 + "input_layernorm.weight").pieces
        assert (norm.tp_rank, norm.mg_name, norm.length) == (0, "decoder.layers.0.input_layernorm.weight", 64)
    # Megatron splits the (unpadded) vocab 500/500, vLLM takes rows [0, 512): two Megatron ranks
    embed = _fetch(plan, (0, 0), "model.embed_tokens.weight").pieces
    assert [(p.tp_rank, p.hf_start, p.mg_start, p.length) for p in embed] == [(0, 0, 0, 500), (1, 500, 0, 12)]


def test_megatron_tp1_to_vllm_tp2_everything_from_rank0():
    plan = plan_megatron(DENSE, Parallelism(tp_size=1), EngineLayout(tp_size=2))
    for r in range(2):
        for fetch in plan.fetches[(r, 0)]:
            assert {p.tp_rank for p in fetch.pieces} == {0}
        (q,) = _fetch(plan, (r, 0), L0 + "self_attn.q_proj.weight").pieces
        # Megatron's unsharded qkv groups [q g0 | k g0 | v g0 | q g1 | ...]: q heads of group r at 64r
        assert (q.hf_start, q.mg_start, q.length) == (32 * r, 64 * r, 32)
        (up,) = _fetch(plan, (r, 0), L0 + "mlp.up_proj.weight").pieces
        assert (up.hf_start, up.mg_start, up.length) == (64 * r, 128 + 64 * r, 64)


def test_megatron_ep2_to_vllm_ep2_experts_from_the_matching_ep_rank():
    plan = plan_megatron(MOE, Parallelism(tp_size=1, ep_size=2), EngineLayout(tp_size=1, ep_size=2))
    for ep in range(2):
        for fetch in plan.fetches[(0, ep)]:
            if ".experts." in fetch.slice.name:
                assert {p.ep_rank for p in fetch.pieces} == {ep}
            else:
                assert {p.ep_rank for p in fetch.pieces} == {0}  # primaries of replicated tensors


BASE = (DENSE, EngineLayout(tp_size=2), {"a": "bfloat16", "b": "float32"}, None)


@pytest.mark.parametrize(
    "changed",
    [
        (ModelShape(2, 64, 4, 2, 16, 128, vocab_size=1001), *BASE[1:]),
        (ModelShape(2, 64, 4, 2, 16, 128, vocab_size=1000, tie_word_embeddings=True), *BASE[1:]),
        ((DENSE, Parallelism(tp_size=2), "local"), *BASE[1:]),
        (DENSE, EngineLayout(tp_size=4), *BASE[2:]),
        (DENSE, EngineLayout(tp_size=2, ep_size=2), *BASE[2:]),
        (*BASE[:2], {"a": "float16", "b": "float32"}, None),
        (*BASE[:2], {"a": "bfloat16", "b": "float32", "c": "int8"}, None),
        (*BASE[:3], "fp8"),
    ],
)
def test_fingerprint_changes_with_every_input(changed):
    assert fingerprint(*changed) != fingerprint(*BASE)


def test_fingerprint_is_stable():
    key = fingerprint(*BASE)
    assert len(key) == 16 and int(key, 16) >= 0
    same_shape = ModelShape(2, 64, 4, 2, 16, 128, vocab_size=1000)
    assert fingerprint(same_shape, EngineLayout(tp_size=2), {"b": "float32", "a": "bfloat16"}) == key
    with pytest.raises(TypeError, match="cannot key a object"):
        fingerprint(object(), EngineLayout(), {})


def test_plan_cache_builds_once_per_key():
    cache = PlanCache(max_entries=2)
    calls = []

    def build(tp):
        calls.append(tp)
        return plan_hf(DENSE, EngineLayout(tp_size=tp))

    keys = {tp: fingerprint(DENSE, EngineLayout(tp_size=tp), {}) for tp in (1, 2, 4)}
    first = cache.get_or_build(keys[2], lambda: build(2))
    assert cache.get_or_build(keys[2], lambda: build(2)) is first
    assert calls == [2] and cache.builds == 1
    cache.get_or_build(keys[1], lambda: build(1))
    cache.get_or_build(keys[4], lambda: build(4))  # evicts the oldest (tp 2)
    assert len(cache) == 2 and calls == [2, 1, 4]
    cache.get_or_build(keys[2], lambda: build(2))
    assert calls == [2, 1, 4, 2]


@pytest.mark.parametrize(
    "shape,layout,match",
    [
        (DENSE, EngineLayout(tp_size=3), "num_attention_heads=4 is not divisible by tp_size=3"),
        (ModelShape(1, 64, 6, 3, 8, 64, 100), EngineLayout(tp_size=2), r"num_query_groups \(num_key_value_heads\)=3"),
        (ModelShape(1, 64, 8, 2, 8, 100, 100), EngineLayout(tp_size=8), "ffn_hidden_size=100 is not divisible"),
        (MOE, EngineLayout(ep_size=3), "num_experts=4 is not divisible by ep_size=3"),
        (
            ModelShape(1, 64, 4, 2, 16, 128, 100, num_experts=4, moe_ffn_hidden_size=30),
            EngineLayout(tp_size=4),
            "moe_ffn_hidden_size=30 is not divisible by tp_size=4",
        ),
        (DENSE, EngineLayout(ep_size=2), "ep_size=2 needs an MoE shape"),
    ],
)
def test_bad_layouts_raise_naming_the_field(shape, layout, match):
    with pytest.raises(ValueError, match=match):
        plan_hf(shape, layout)


def test_unknown_tensor_names_raise_listing_them():
    bad = [
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.2.mlp.up_proj.weight",  # layer outside the model
        "model.layers.0.mlp.experts.0.up_proj.weight",  # an expert of a dense model
    ]
    with pytest.raises(ValueError, match="unknown tensor name") as info:
        plan_hf(DENSE, EngineLayout(tp_size=2), ["model.norm.weight", *bad])
    assert all(name in str(info.value) for name in bad)
    # o_proj.bias (not in Qwen2, but a known rule) is replicated: whole on every rank
    plan = plan_hf(DENSE, EngineLayout(tp_size=2), [L0 + "self_attn.o_proj.bias"])
    assert plan.slices((1, 0)) == (S(L0 + "self_attn.o_proj.bias"),)
