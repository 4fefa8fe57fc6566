"""MoE in the HF <-> Megatron piece table (ckpt_common.layout.pieces): global <-> local expert indices
over EP ranks, coverage, and bit-exact round trips at TP/EP/PP 1-2. Pure: no megatron import."""

from __future__ import annotations

import pytest
import torch

from ckpt_common.layout.pieces import conversion_pieces, hf_sources, sources_of_slice, writer_pieces
from ckpt_common.layout.shapes import ModelShape, Parallelism, global_expert_index, hf_param_shapes, local_expert_index
from tests.unit.trainer.tiny import layout_shape, random_hf
from trainer.megatron.convert import hf_to_megatron, megatron_to_hf, rank_slices, write_rank_slices


def _moe_shape(**overrides) -> ModelShape:
    return layout_shape(**({"num_experts": 4, "moe_ffn_hidden_size": 8} | overrides))


GRID = [(tp, ep, pp) for tp in (1, 2) for ep in (1, 2) for pp in (1, 2)]


# ── global <-> local expert indices ──────────────────────────────────────────────────────────────

# (num_experts, ep_size) -> for each EP rank, the global experts its local experts 0.. are
EXPERT_TABLE = [
    (8, 1, [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (4, 4, [[0], [1], [2], [3]]),
]


@pytest.mark.parametrize("num_experts,ep,expected", EXPERT_TABLE)
def test_global_local_expert_index_table(num_experts, ep, expected):
    got = [[global_expert_index(r, j, num_experts, ep) for j in range(num_experts // ep)] for r in range(ep)]
    assert got == expected
    for r, experts in enumerate(expected):
        for j, e in enumerate(experts):
            assert local_expert_index(e, num_experts, ep) == (r, j)


@pytest.mark.parametrize(
    "call",
    [
        lambda: global_expert_index(2, 0, 8, 2),
        lambda: global_expert_index(0, 4, 8, 2),
        lambda: local_expert_index(8, 8, 2),
        lambda: local_expert_index(0, 6, 4),
    ],
)
def test_expert_index_errors(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_names_on_each_ep_rank(ep):
    shape = _moe_shape(num_layers=1)
    parallel = Parallelism(ep_size=ep)
    for piece in conversion_pieces(shape, parallel):
        if ".mlp.experts." not in piece.hf_name:
            continue
        global_e = int(piece.hf_name.split(".mlp.experts.")[1].split(".")[0])
        local_j = int(piece.mg_name.split(".local_experts.")[1].split(".")[0])
        assert local_expert_index(global_e, 4, ep) == (piece.ep_rank, local_j)


# ── the table: names, coverage, replicas ─────────────────────────────────────────────────────────


def test_hf_names_and_megatron_names_tp1_ep1():
    shape = _moe_shape(num_layers=1, num_experts=2)
    assert [n for n in hf_param_shapes(shape) if ".mlp." in n] == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.0.mlp.experts.0.down_proj.weight",
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight",
    ]
    shard = hf_to_megatron(random_hf(shape), shape, Parallelism())[(0, 0)]
    assert {n: tuple(t.shape) for n, t in shard.items() if ".mlp." in n} == {
        "decoder.layers.0.mlp.router.weight": (2, 16),
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": (16, 16),
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight": (16, 8),
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight": (16, 16),
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight": (16, 8),
    }
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in shard
    assert not any("linear_fc1" in n and "experts" not in n for n in shard)


def test_tp2_ep2_shards_labelled():
    """Rank (pp, tp, ep): EP rank 1 holds experts 2, 3 as local 0, 1; fc1 is [gate shard tp ; up shard tp]."""
    shape = _moe_shape(num_layers=1)
    sd = random_hf(shape)
    for e in range(4):
        for kind, base in (("gate_proj", 0), ("up_proj", 100)):
            rows = torch.arange(8, dtype=torch.float32) + base + 1000 * e
            sd[f"model.layers.0.mlp.experts.{e}.{kind}.weight"] = rows[:, None].expand(8, 16).clone()
    shards = hf_to_megatron(sd, shape, Parallelism(tp_size=2, ep_size=2))
    assert set(shards) == {(0, tp, ep) for tp in range(2) for ep in range(2)}
    fc1 = shards[(0, 1, 1)]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert fc1[:, 0].tolist() == [2004, 2005, 2006, 2007, 2104, 2105, 2106, 2107]
    fc2 = shards[(0, 1, 1)]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(fc2, sd["model.layers.0.mlp.experts.3.down_proj.weight"][:, 4:])
    for rank, shard in shards.items():  # non-expert tensors: the (pp, tp) shard on every EP rank
        assert torch.equal(shard["decoder.layers.0.mlp.router.weight"], sd["model.layers.0.mlp.gate.weight"])
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert torch.equal(shard[qkv], shards[(0, rank[1], 0)][qkv])


@pytest.mark.parametrize("tp,ep,pp", GRID + [(2, 4, 2), (1, 4, 1)])
def test_every_hf_element_is_written_by_exactly_one_rank(tp, ep, pp):
    shape = _moe_shape(tie_word_embeddings=pp == 2)
    parallel = Parallelism(tp_size=tp, pp_size=pp, ep_size=ep)
    table = writer_pieces(shape, parallel)
    assert set(table) == set(parallel.ranks())
    assert all(len(rank) == (2 if ep == 1 else 3) for rank in table)
    hf_shapes = hf_param_shapes(shape)
    count = {name: torch.zeros(dims, dtype=torch.int32) for name, dims in hf_shapes.items()}
    for rank, pieces in table.items():
        for p in pieces:
            assert parallel.rank_of(p) == rank
            if ".mlp.experts." in p.hf_name:  # an expert is written by the EP rank that holds it
                assert local_expert_index(int(p.hf_name.split(".")[5]), 4, ep)[0] == p.ep_rank
            else:  # everything else by EP rank 0
                assert p.ep_rank == 0
            count[p.hf_name].narrow(p.dim, p.hf_start, p.length).add_(1)
    assert all(bool((c == 1).all()) for c in count.values())


@pytest.mark.parametrize("tp,ep,pp", GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bit_exact(tp, ep, pp, dtype):
    shape = _moe_shape(tie_word_embeddings=(tp + ep + pp) % 2 == 1)
    parallel = Parallelism(tp_size=tp, pp_size=pp, ep_size=ep)
    sd = random_hf(shape, dtype, seed=tp * 10 + ep * 3 + pp)
    shards = hf_to_megatron(sd, shape, parallel)
    assert set(shards) == set(parallel.ranks())
    back = megatron_to_hf(shards, shape, parallel)
    assert set(back) == set(sd)
    assert all(back[n].dtype == dtype and torch.equal(back[n], sd[n]) for n in sd)
    again = hf_to_megatron(back, shape, parallel)  # and Megatron -> HF -> Megatron
    assert all(torch.equal(again[r][n], shards[r][n]) for r in shards for n in shards[r])


@pytest.mark.parametrize("tp,ep,pp", [(2, 2, 2), (1, 2, 1), (2, 1, 1)])
def test_each_rank_writing_its_slices_rebuilds_the_hf_checkpoint(tp, ep, pp):
    shape = _moe_shape()
    parallel = Parallelism(tp_size=tp, pp_size=pp, ep_size=ep)
    sd = random_hf(shape, seed=5)
    shards = hf_to_megatron(sd, shape, parallel)
    out = {n: torch.full_like(t, float("nan")) for n, t in sd.items()}
    for rank in reversed(parallel.ranks()):
        write_rank_slices(shards[rank], out, shape, parallel, rank)
        for piece, view in rank_slices(shards[rank], shape, parallel, rank):
            assert view.data_ptr() >= shards[rank][piece.mg_name].data_ptr()
    assert all(torch.equal(out[n], sd[n]) for n in sd)


def test_sources_of_an_expert_slice():
    shape = _moe_shape(num_layers=1)
    parallel = Parallelism(tp_size=2, ep_size=2)
    sources = hf_sources(shape, parallel)
    got = [
        (p.pp_rank, p.tp_rank, p.ep_rank, p.mg_name, p.mg_start, p.length)
        for p in sources_of_slice(sources, "model.layers.0.mlp.experts.3.up_proj.weight", 0, 2, 6)
    ]
    fc1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert got == [(0, 0, 1, fc1, 6, 2), (0, 1, 1, fc1, 4, 2)]
    router = sources_of_slice(sources, "model.layers.0.mlp.gate.weight", 0, 0, 4)
    assert [(p.tp_rank, p.ep_rank, p.primary) for p in router] == [(0, 0, True)]


def test_missing_ep_shard_is_named():
    shape = _moe_shape(num_layers=1)
    parallel = Parallelism(ep_size=2)
    shards = hf_to_megatron(random_hf(shape), shape, parallel)
    del shards[(0, 0, 1)]
    with pytest.raises(ValueError, match=r"no Megatron shard for rank \(pp=0, tp=0, ep=1\)"):
        megatron_to_hf(shards, shape, parallel)


QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "num_hidden_layers": 2,
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 32,
    "shared_expert_intermediate_size": 0,
}


def test_from_hf_config_qwen2_moe():
    shape = ModelShape.from_hf_config(QWEN2_MOE)
    assert shape == _moe_shape()
    assert shape.qkv_bias and shape.is_moe


@pytest.mark.parametrize(
    "make,error,message",
    [
        (
            lambda: ModelShape.from_hf_config(QWEN2_MOE | {"shared_expert_intermediate_size": 8}),
            NotImplementedError,
            "shared",
        ),
        (lambda: ModelShape.from_hf_config(QWEN2_MOE | {"mlp_only_layers": [1]}), NotImplementedError, "dense layers"),
        (
            lambda: ModelShape.from_hf_config(QWEN2_MOE | {"decoder_sparse_step": 2}),
            NotImplementedError,
            "dense layers",
        ),
        (lambda: ModelShape.from_hf_config(QWEN2_MOE | {"model_type": "mixtral"}), NotImplementedError, "MoE"),
        (lambda: _moe_shape(moe_ffn_hidden_size=None), NotImplementedError, "moe_ffn_hidden_size"),
        (lambda: _moe_shape(num_experts=0), ValueError, "num_experts"),
        (lambda: _moe_shape(num_experts=None), ValueError, "moe_ffn_hidden_size is set"),
        (lambda: Parallelism(ep_size=0), ValueError, "ep_size"),
        (lambda: conversion_pieces(_moe_shape(), Parallelism(ep_size=3)), ValueError, "divisible by ep_size=3"),
        (lambda: conversion_pieces(_moe_shape(), Parallelism(tp_size=16)), ValueError, "moe_ffn_hidden_size=8"),
        (lambda: conversion_pieces(_moe_shape(), Parallelism(), "te"), NotImplementedError, "local"),
        (
            lambda: conversion_pieces(_moe_shape(num_experts=None, moe_ffn_hidden_size=None), Parallelism(ep_size=2)),
            ValueError,
            "MoE",
        ),
    ],
)
def test_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()
