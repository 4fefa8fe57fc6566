"""Pure HF <-> Megatron conversion (trainer.megatron.convert): tables on hand-made tensors, round trips."""

from __future__ import annotations

import pytest
import torch

from ckpt_common.layout.pieces import conversion_pieces, hf_sources
from ckpt_common.layout.shapes import ModelShape, Parallelism, hf_param_shapes, stage_layers
from tests.unit.trainer.tiny import layout_shape, random_hf
from trainer.megatron.convert import hf_to_megatron, megatron_to_hf


def _labelled_hf(shape: ModelShape) -> dict[str, torch.Tensor]:
    """Row r of q/k/v (and gate/up) is filled with a label: q 0.., k 100.., v 200.., gate 300.., up 400.."""
    sd = random_hf(shape)
    base = {"q_proj": 0, "k_proj": 100, "v_proj": 200, "gate_proj": 300, "up_proj": 400}
    for name, tensor in sd.items():
        for key, offset in base.items():
            if f".{key}." in name:
                labels = torch.arange(tensor.shape[0], dtype=torch.float32) + offset
                sd[name] = labels.view(-1, *([1] * (tensor.dim() - 1))).expand_as(tensor).clone()
    return sd


def _row_labels(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in (tensor if tensor.dim() == 1 else tensor[:, 0]).tolist()]


def _tp_row_labels(shape: ModelShape, tp: int, key: str) -> list[list[int]]:
    """The row labels of layer 0's Megatron tensor `key` on each TP rank, converted from `_labelled_hf`."""
    shards = hf_to_megatron(_labelled_hf(shape), shape, Parallelism(tp_size=tp))
    return [_row_labels(shards[(0, r)][f"decoder.layers.0.{key}"]) for r in range(tp)]


# ── the grouped-query interleave and the gate/up layout, on hand-made tensors ────────────────────

# head_dim=1, 4 q heads, 2 groups: q0 q1 | k0 | v0 || q2 q3 | k1 | v1
QKV_TABLE = [
    (1, [[0, 1, 100, 200, 2, 3, 101, 201]]),
    (2, [[0, 1, 100, 200], [2, 3, 101, 201]]),
    # tp > groups: megatron splits the interleaved tensor evenly, a rank holds part of a group
    (4, [[0, 1], [100, 200], [2, 3], [101, 201]]),
]


@pytest.mark.parametrize("tp,expected", QKV_TABLE)
@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_qkv_interleave_table(tp, expected, kind):
    shape = layout_shape(num_layers=1, hidden_size=4, head_dim=1, ffn_hidden_size=8, vocab_size=8)
    assert _tp_row_labels(shape, tp, f"self_attention.linear_qkv.{kind}") == expected


def test_qkv_interleave_head_dim_two_eight_heads():
    # head_dim=2, 8 q heads in 2 groups of 4: each group is 4*2 q rows, 2 k rows, 2 v rows
    dims = dict(hidden_size=16, num_attention_heads=8, num_query_groups=2, head_dim=2, ffn_hidden_size=8)
    shape = layout_shape(num_layers=1, vocab_size=8, **dims)
    rank0, rank1 = _tp_row_labels(shape, 2, "self_attention.linear_qkv.weight")
    assert rank0 == list(range(8)) + [100, 101, 200, 201]
    assert rank1 == list(range(8, 16)) + [102, 103, 202, 203]


FC1_TABLE = [
    (1, [[300, 301, 302, 303, 400, 401, 402, 403]]),
    (2, [[300, 301, 400, 401], [302, 303, 402, 403]]),
    (4, [[300, 400], [301, 401], [302, 402], [303, 403]]),
]


@pytest.mark.parametrize("tp,expected", FC1_TABLE)
def test_fc1_is_gate_shard_then_up_shard(tp, expected):
    shape = layout_shape(num_layers=1, hidden_size=4, head_dim=1, num_query_groups=4, ffn_hidden_size=4, vocab_size=8)
    assert _tp_row_labels(shape, tp, "mlp.linear_fc1.weight") == expected


def test_row_column_vocab_splits_and_replicated_norms():
    shape = layout_shape()
    hf = random_hf(shape)
    shards = hf_to_megatron(hf, shape, Parallelism(tp_size=2))
    for r in range(2):
        mg = shards[(0, r)]
        assert torch.equal(
            mg["decoder.layers.1.self_attention.linear_proj.weight"],
            hf["model.layers.1.self_attn.o_proj.weight"][:, r * 8 : (r + 1) * 8],
        )
        assert torch.equal(
            mg["decoder.layers.0.mlp.linear_fc2.weight"],
            hf["model.layers.0.mlp.down_proj.weight"][:, r * 12 : (r + 1) * 12],
        )
        assert torch.equal(
            mg["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"][r * 16 : (r + 1) * 16]
        )
        assert torch.equal(mg["output_layer.weight"], hf["lm_head.weight"][r * 16 : (r + 1) * 16])
        assert torch.equal(mg["decoder.layers.0.input_layernorm.weight"], hf["model.layers.0.input_layernorm.weight"])
        assert torch.equal(
            mg["decoder.layers.0.pre_mlp_layernorm.weight"], hf["model.layers.0.post_attention_layernorm.weight"]
        )
        assert torch.equal(mg["decoder.final_layernorm.weight"], hf["model.norm.weight"])
        assert all(t.is_contiguous() for t in mg.values())


# ── round trips ─────────────────────────────────────────────────────────────────────────────────

ROUND_TRIPS = [
    (layout_shape(), 1, 1),
    (layout_shape(), 2, 1),
    (layout_shape(), 4, 1),
    (layout_shape(), 1, 2),
    (layout_shape(), 2, 2),
    (layout_shape(), 4, 2),
    (layout_shape(num_attention_heads=8, num_query_groups=4, head_dim=2), 4, 2),
    (layout_shape(num_query_groups=4), 2, 1),  # MHA
    (layout_shape(num_query_groups=1), 2, 1),  # MQA, tp > groups
    (layout_shape(qkv_bias=False), 2, 2),
    (layout_shape(tie_word_embeddings=True), 2, 1),
    (layout_shape(tie_word_embeddings=True), 2, 2),
]


@pytest.mark.parametrize("shape,tp,pp", ROUND_TRIPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bit_exact(shape, tp, pp, dtype):
    hf = random_hf(shape, dtype)
    parallel = Parallelism(tp_size=tp, pp_size=pp)
    shards = hf_to_megatron(hf, shape, parallel)
    assert sorted(shards) == parallel.ranks()
    back = megatron_to_hf(shards, shape, parallel)
    assert list(back) == list(hf_sources(shape, parallel))
    assert set(back) == set(hf)
    for name in hf:
        assert back[name].dtype == dtype and torch.equal(back[name], hf[name]), name
    # the element count is preserved, TP replicas aside
    replicated = sum(t.numel() for n, t in hf.items() if n.endswith("norm.weight")) * (tp - 1)
    tied_copy = hf["model.embed_tokens.weight"].numel() if shape.tie_word_embeddings and pp > 1 else 0
    assert (
        sum(t.numel() for s in shards.values() for t in s.values())
        == sum(t.numel() for t in hf.values()) + replicated + tied_copy
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_shards_to_hf_to_megatron(tp):
    shape, parallel = layout_shape(), Parallelism(tp_size=tp, pp_size=2)
    gen = torch.Generator().manual_seed(3)
    template = hf_to_megatron(random_hf(shape), shape, parallel)
    shards = {rank: {n: torch.randn(t.shape, generator=gen) for n, t in sd.items()} for rank, sd in template.items()}
    for rank, sd in shards.items():  # replicated norms are equal on every TP rank, as in a real run
        for name in sd:
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                sd[name] = shards[(rank[0], 0)][name]
    again = hf_to_megatron(megatron_to_hf(shards, shape, parallel), shape, parallel)
    for rank in shards:
        assert set(again[rank]) == set(shards[rank])
        for name in shards[rank]:
            assert torch.equal(again[rank][name], shards[rank][name]), (rank, name)


def test_pp_layer_offsets_in_names():
    shape, parallel = layout_shape(num_layers=4), Parallelism(tp_size=1, pp_size=2)
    hf = random_hf(shape)
    shards = hf_to_megatron(hf, shape, parallel)
    first, last = shards[(0, 0)], shards[(1, 0)]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert "embedding.word_embeddings.weight" not in last and "decoder.final_layernorm.weight" not in first
    assert {n.split(".")[2] for n in last if n.startswith("decoder.layers.")} == {"0", "1"}
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.2.mlp.down_proj.weight"])
    assert torch.equal(last["decoder.layers.1.input_layernorm.weight"], hf["model.layers.3.input_layernorm.weight"])


STAGES = [
    (4, Parallelism(pp_size=1), [(0, 4)]),
    (4, Parallelism(pp_size=2), [(0, 2), (2, 2)]),
    (6, Parallelism(pp_size=3), [(0, 2), (2, 2), (4, 2)]),
    (5, Parallelism(pp_size=2, layers_per_stage=(2, 3)), [(0, 2), (2, 3)]),
]


@pytest.mark.parametrize("num_layers,parallel,expected", STAGES)
def test_stage_layers(num_layers, parallel, expected):
    assert [stage_layers(num_layers, parallel, p) for p in range(parallel.pp_size)] == expected


def test_uneven_stages_round_trip():
    shape, parallel = layout_shape(num_layers=3), Parallelism(tp_size=2, pp_size=2, layers_per_stage=(1, 2))
    hf = random_hf(shape)
    back = megatron_to_hf(hf_to_megatron(hf, shape, parallel), shape, parallel)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_te_norm_names():
    shape = layout_shape(num_layers=1)
    mg = hf_to_megatron(random_hf(shape), shape, Parallelism(), norm_style="te")[(0, 0)]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mg
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mg
    assert "decoder.layers.0.input_layernorm.weight" not in mg


def test_sources_cover_every_hf_tensor_once_with_byte_ranges():
    shape, parallel = layout_shape(num_layers=4), Parallelism(tp_size=2, pp_size=2)
    shapes = hf_param_shapes(shape)
    for name, pieces in hf_sources(shape, parallel).items():
        covered = 0
        for p in pieces:
            assert p.hf_start == covered, name  # sorted, no gaps, no overlaps
            covered += p.length
        assert covered == shapes[name][pieces[0].dim]
    q = hf_sources(shape, parallel)["model.layers.3.self_attn.q_proj.weight"]
    # layer 3 lives on pp stage 1 as local layer 1; q rows of group g come from tp rank g
    assert [(p.pp_rank, p.tp_rank, p.mg_name, p.hf_start, p.mg_start, p.length) for p in q] == [
        (1, 0, "decoder.layers.1.self_attention.linear_qkv.weight", 0, 0, 8),
        (1, 1, "decoder.layers.1.self_attention.linear_qkv.weight", 8, 0, 8),
    ]
    assert q[1].hf_byte_range(shapes["model.layers.3.self_attn.q_proj.weight"], 4) == (8 * 16 * 4, 16 * 16 * 4)
    o = hf_sources(shape, parallel)["model.layers.0.self_attn.o_proj.weight"]
    assert o[0].dim == 1 and o[0].hf_byte_range((16, 16), 4) is None


def test_replicas_are_not_primary():
    pieces = conversion_pieces(layout_shape(tie_word_embeddings=True), Parallelism(tp_size=2, pp_size=2))
    norms = [p for p in pieces if p.hf_name == "model.norm.weight"]
    assert [(p.tp_rank, p.primary) for p in norms] == [(0, True), (1, False)]
    tied = [p for p in pieces if p.mg_name == "output_layer.weight"]
    assert tied and all(not p.primary and p.pp_rank == 1 for p in tied)


def test_from_hf_config_of_the_tiny_model():
    from demo.tiny_model import TinyModelConfig, param_shapes

    config = TinyModelConfig(num_layers=2, hidden_size=128, intermediate_size=256)
    shape = ModelShape.from_hf_config(config.hf_config())
    assert (shape.num_query_groups, shape.head_dim, shape.qkv_bias) == (2, 32, True)
    assert hf_param_shapes(shape) == param_shapes(config)


ERRORS = [
    (lambda: ModelShape(2, 16, 4, 3, 4, 24, 32), ValueError, "not divisible by num_query_groups"),
    (lambda: layout_shape(num_experts=8), NotImplementedError, "MoE"),
    (lambda: ModelShape.from_hf_config({"num_experts": 4}), NotImplementedError, "MoE"),
    (lambda: Parallelism(tp_size=0), ValueError, "tp_size"),
    (lambda: Parallelism(pp_size=2, layers_per_stage=(1,)), ValueError, "layers_per_stage"),
    (lambda: stage_layers(3, Parallelism(pp_size=2), 0), ValueError, "not divisible by pp_size"),
    (lambda: stage_layers(4, Parallelism(pp_size=2), 2), ValueError, "outside"),
    (lambda: conversion_pieces(layout_shape(ffn_hidden_size=6), Parallelism(tp_size=4)), ValueError, "ffn_hidden_size"),
    (lambda: conversion_pieces(layout_shape(vocab_size=30), Parallelism(tp_size=4)), ValueError, "not divisible by tp"),
    (lambda: conversion_pieces(layout_shape(), Parallelism(), norm_style="apex"), ValueError, "norm_style"),
]


@pytest.mark.parametrize("make,error,message", ERRORS)
def test_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_missing_tensors_are_named():
    shape = layout_shape()
    hf = random_hf(shape)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        hf_to_megatron(hf, shape, Parallelism())
    shards = hf_to_megatron(random_hf(shape), shape, Parallelism(tp_size=2))
    del shards[(0, 1)]["decoder.layers.0.mlp.linear_fc1.weight"]
    with pytest.raises(ValueError, match=r"tp=1\) lacks decoder.layers.0.mlp.linear_fc1.weight"):
        megatron_to_hf(shards, shape, Parallelism(tp_size=2))
    with pytest.raises(ValueError, match="no Megatron shard"):
        megatron_to_hf({(0, 0): shards[(0, 0)]}, shape, Parallelism(tp_size=2))


def test_one_rank_only():
    shape, parallel = layout_shape(), Parallelism(tp_size=2, pp_size=2)
    hf = random_hf(shape)
    mine = hf_to_megatron(hf, shape, parallel, ranks=[(1, 1)])
    assert list(mine) == [(1, 1)]
    full = hf_to_megatron(hf, shape, parallel)
    assert all(torch.equal(mine[(1, 1)][n], full[(1, 1)][n]) for n in full[(1, 1)])


def test_megatron_to_hf_into_preallocated_tensors():
    shape, parallel = layout_shape(), Parallelism(tp_size=2)
    hf = random_hf(shape)
    shards = hf_to_megatron(hf, shape, parallel)
    flat = torch.zeros(sum(t.numel() for t in hf.values()))
    out, offset = {}, 0
    for name, tensor in hf.items():
        out[name] = flat[offset : offset + tensor.numel()].view(tensor.shape)
        offset += tensor.numel()
    back = megatron_to_hf(shards, shape, parallel, out=out)
    assert all(back[n] is out[n] and torch.equal(out[n], hf[n]) for n in hf)
    assert torch.equal(flat, torch.cat([t.flatten() for t in hf.values()]))
    with pytest.raises(ValueError, match="expected"):
        megatron_to_hf(shards, shape, parallel, out={"lm_head.weight": torch.zeros(3)})


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_rank_slices_assemble_the_hf_checkpoint(tp, pp):
    from trainer.megatron.convert import rank_slices

    shape, parallel = layout_shape(), Parallelism(tp_size=tp, pp_size=pp)
    hf = random_hf(shape)
    shards = hf_to_megatron(hf, shape, parallel)
    rebuilt = {name: torch.full(dims, float("nan")) for name, dims in hf_param_shapes(shape).items()}
    for rank, shard in shards.items():
        for piece, view in rank_slices(shard, shape, parallel, rank):
            assert view.data_ptr() >= min(t.data_ptr() for t in shard.values())  # a view, no copy
            rebuilt[piece.hf_name].narrow(piece.dim, piece.hf_start, piece.length).copy_(view)
    assert all(torch.equal(rebuilt[n], hf[n]) for n in hf)


def test_copy_threads_restores_torch_threads():
    from trainer.megatron.convert import copy_threads_context

    before = torch.get_num_threads()
    with copy_threads_context(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with copy_threads_context(None):
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="copy_threads"), copy_threads_context(0):
        pass


@pytest.mark.parametrize(
    "extra,qkv_bias",
    [
        ({"model_type": "qwen2"}, True),
        ({}, True),
        ({"model_type": "llama"}, False),
        ({"model_type": "llama", "attention_bias": True}, True),
    ],
)
def test_qkv_bias_from_hf_config(extra, qkv_bias):
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 24,
        "vocab_size": 32,
        **extra,
    }
    assert ModelShape.from_hf_config(config).qkv_bias is qkv_bias


def test_sources_of_an_inference_tp_shard():
    from ckpt_common.layout.pieces import sources_of_slice

    shape = layout_shape(num_layers=1)  # 4 q heads of 4 rows, 2 groups
    sources = hf_sources(shape, Parallelism(tp_size=2))
    # an inference rank holding q heads 1..2 (rows 4..12) reads from both trainer TP ranks
    got = [
        (p.tp_rank, p.mg_start, p.hf_start, p.length)
        for p in sources_of_slice(sources, "model.layers.0.self_attn.q_proj.weight", 0, 4, 12)
    ]
    assert got == [(0, 4, 4, 4), (1, 0, 8, 4)]
    # k of group 1 = rows 4..8 of k_proj sit after group 1's 8 q rows on trainer rank 1
    got = [
        (p.tp_rank, p.mg_start, p.length)
        for p in sources_of_slice(sources, "model.layers.0.self_attn.k_proj.weight", 0, 4, 8)
    ]
    assert got == [(1, 8, 4)]
    # o_proj is split along dim 1 (inputs); a row slice is not expressible
    with pytest.raises(ValueError, match="split dim 1"):
        sources_of_slice(sources, "model.layers.0.self_attn.o_proj.weight", 0, 0, 8)
    with pytest.raises(ValueError, match="outside"):
        sources_of_slice(sources, "model.layers.0.self_attn.k_proj.weight", 0, 4, 9)
    # the pieces really hold those rows
    hf = random_hf(shape)
    shards = hf_to_megatron(hf, shape, Parallelism(tp_size=2))
    for p in sources_of_slice(sources, "model.layers.0.self_attn.q_proj.weight", 0, 4, 12):
        assert torch.equal(
            shards[(0, p.tp_rank)][p.mg_name].narrow(0, p.mg_start, p.length),
            hf[p.hf_name].narrow(0, p.hf_start, p.length),
        )
