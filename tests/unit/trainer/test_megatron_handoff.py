"""Which Megatron rank writes which HF slice of the shared buffer (layout.writer_pieces), and the
per-rank write (convert.write_rank_slices): pure tables, no megatron, no processes."""

from __future__ import annotations

import pytest
import torch

from ckpt_common.layout.pieces import writer_pieces
from ckpt_common.layout.shapes import ModelShape, Parallelism, hf_param_shapes
from trainer.megatron.convert import hf_to_megatron, megatron_to_hf, write_rank_slices

# 1 layer, 4 heads in 2 query groups (head_dim 2), ffn 8, vocab 6: small enough to spell out.
SHAPE = ModelShape(
    num_layers=1,
    hidden_size=8,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=2,
    ffn_hidden_size=8,
    vocab_size=6,
)
L = "model.layers.0."

# hf name -> {tp rank: [(dim, hf_start, hf_stop)]} at TP=2, PP=1
TP2_TABLE = {
    "model.embed_tokens.weight": {0: [(0, 0, 3)], 1: [(0, 3, 6)]},  # vocab-parallel
    L + "input_layernorm.weight": {0: [(0, 0, 8)], 1: []},  # replicated: TP rank 0 only
    L + "self_attn.q_proj.weight": {0: [(0, 0, 4)], 1: [(0, 4, 8)]},  # query group g on rank g
    L + "self_attn.q_proj.bias": {0: [(0, 0, 4)], 1: [(0, 4, 8)]},
    L + "self_attn.k_proj.weight": {0: [(0, 0, 2)], 1: [(0, 2, 4)]},
    L + "self_attn.k_proj.bias": {0: [(0, 0, 2)], 1: [(0, 2, 4)]},
    L + "self_attn.v_proj.weight": {0: [(0, 0, 2)], 1: [(0, 2, 4)]},
    L + "self_attn.v_proj.bias": {0: [(0, 0, 2)], 1: [(0, 2, 4)]},
    L + "self_attn.o_proj.weight": {0: [(1, 0, 4)], 1: [(1, 4, 8)]},  # row-parallel: columns
    L + "post_attention_layernorm.weight": {0: [(0, 0, 8)], 1: []},
    L + "mlp.gate_proj.weight": {0: [(0, 0, 4)], 1: [(0, 4, 8)]},
    L + "mlp.up_proj.weight": {0: [(0, 0, 4)], 1: [(0, 4, 8)]},
    L + "mlp.down_proj.weight": {0: [(1, 0, 4)], 1: [(1, 4, 8)]},
    "model.norm.weight": {0: [(0, 0, 8)], 1: []},
    "lm_head.weight": {0: [(0, 0, 3)], 1: [(0, 3, 6)]},
}


@pytest.mark.parametrize("hf_name", sorted(TP2_TABLE))
def test_tp2_writer_table(hf_name):
    table = writer_pieces(SHAPE, Parallelism(tp_size=2))
    assert set(table) == {(0, 0), (0, 1)}
    for tp in (0, 1):
        got = [(p.dim, p.hf_start, p.hf_start + p.length) for p in table[(0, tp)] if p.hf_name == hf_name]
        assert sorted(got) == TP2_TABLE[hf_name][tp], (hf_name, tp)


@pytest.mark.parametrize(
    "shape,parallel",
    [
        (SHAPE, Parallelism(tp_size=1)),
        (SHAPE, Parallelism(tp_size=2)),
        (
            ModelShape(1, 8, 4, 2, 2, 8, 8),
            Parallelism(tp_size=4),
        ),  # more TP ranks than query groups: a rank holds part of one
        (ModelShape(2, 8, 4, 2, 2, 8, 6), Parallelism(tp_size=2, pp_size=2)),
        (ModelShape(2, 8, 4, 4, 2, 8, 6, tie_word_embeddings=True), Parallelism(tp_size=2, pp_size=2)),
    ],
    ids=["tp1", "tp2", "tp4", "tp2xpp2", "tp2xpp2-tied"],
)
def test_every_hf_element_is_written_by_exactly_one_rank(shape, parallel):
    shapes = hf_param_shapes(shape)
    counts = {name: torch.zeros(dims, dtype=torch.int32) for name, dims in shapes.items()}
    table = writer_pieces(shape, parallel)
    assert set(table) == set(parallel.ranks())
    for pieces in table.values():
        for p in pieces:
            counts[p.hf_name].narrow(p.dim, p.hf_start, p.length).add_(1)
    for name, count in counts.items():
        assert bool((count == 1).all()), name
    last = parallel.pp_size - 1
    for (pp, _), pieces in table.items():
        if pp == last and last > 0 and shape.tie_word_embeddings:
            assert not any(p.hf_name == "model.embed_tokens.weight" for p in pieces)  # stage 0 writes it


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_each_rank_writing_its_slices_rebuilds_the_hf_checkpoint(out_dtype):
    parallel = Parallelism(tp_size=2, pp_size=2)
    shape = ModelShape(2, 8, 4, 2, 2, 8, 6)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(d, generator=g) for n, d in hf_param_shapes(shape).items()}
    shards = hf_to_megatron(hf, shape, parallel)
    out = {n: torch.full(t.shape, float("nan"), dtype=out_dtype) for n, t in hf.items()}
    written = 0
    for rank in parallel.ranks():  # each rank alone, in any order
        written += write_rank_slices(shards[rank], out, shape, parallel, rank)
    assert written == sum(t.numel() * t.element_size() for t in out.values())
    want = megatron_to_hf(shards, shape, parallel)
    assert all(torch.equal(out[n], want[n].to(out_dtype)) for n in want)


def test_missing_output_tensor_is_named():
    parallel = Parallelism(tp_size=2)
    shards = hf_to_megatron(
        {n: torch.zeros(d) for n, d in hf_param_shapes(SHAPE).items()}, SHAPE, parallel, ranks=[(0, 1)]
    )
    with pytest.raises(ValueError, match="out lacks model.embed_tokens.weight"):
        write_rank_slices(shards[(0, 1)], {}, SHAPE, parallel, (0, 1))
