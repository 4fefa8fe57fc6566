"""ShardProbe: each rank's slices learned from weight loaders run on stand-ins; against vLLM's own
tensor-parallel layers (their loaders on CPU, with the TP group stubbed to rank r of 2)."""

from __future__ import annotations

import types

import pytest
import torch

from checkpoint_engine.sharding.slices import SourceSlice
from vllm_ext.shard_probe import ShardProbe, merge_slices, slice_of_view


def S(name, dim=None, start=0, stop=0):
    return SourceSlice(name, dim, start, stop)


BASE = torch.empty(8, 6)


@pytest.mark.parametrize(
    ("view", "expected"),
    [
        (BASE, S("w")),
        (BASE.narrow(0, 2, 3), S("w", 0, 2, 5)),
        (BASE.narrow(1, 3, 3), S("w", 1, 3, 6)),
        (BASE[5], S("w", 0, 5, 6)),  # one row
        (BASE.t().narrow(0, 1, 2), S("w", 1, 1, 3)),  # a transposed narrow is still rows of dim 1
        (BASE.narrow(0, 2, 3).narrow(1, 0, 2), S("w")),  # a box cut in two dims: whole
        (BASE[::2], S("w")),  # every other row: no single range
        (BASE.view(torch.int32), S("w")),  # reinterpreted bytes
    ],
)
def test_slice_of_view(view, expected):
    assert slice_of_view("w", BASE, view) == expected


def test_merge_slices():
    assert merge_slices("w", []) == ()
    assert merge_slices("w", [S("w", 0, 4, 6), S("w", 0, 0, 2), S("w", 0, 2, 3)]) == (S("w", 0, 0, 3), S("w", 0, 4, 6))
    assert merge_slices("w", [S("w", 0, 0, 2), S("w")]) == (S("w"),)
    assert merge_slices("w", [S("w", 0, 0, 2), S("w", 1, 0, 2)]) == (S("w"),)


class FakeRank:
    """A loader shaped like vLLM's at TP rank `rank` of 2: a column shard, a row shard, a replicated
    norm, a statistic computed from a tensor, a skipped name, and a loader that fails on one name."""

    def __init__(self, rank: int, fail: bool = False):
        self.rank, self.fail = rank, fail
        self.col = torch.zeros(2, 4)
        self.row = torch.zeros(4, 2)
        self.norm = torch.zeros(4)
        self.scale = torch.zeros(())

    def load(self, weights):
        for name, w in weights:
            if name == "col":
                self.col.copy_(w.narrow(0, 2 * self.rank, 2))
            elif name == "row":
                self.row.copy_(w.narrow(1, 2 * self.rank, 2))
            elif name == "norm":
                self.norm.copy_(w)
            elif name == "stat":
                self.scale.copy_(w.abs().max())
            elif self.fail:
                raise KeyError(name)
            # "other": another rank's expert, skipped


ITEMS = [
    (n, torch.float32, s)
    for n, s in [("col", (4, 4)), ("row", (4, 4)), ("norm", (4,)), ("stat", (4,)), ("other", (4,))]
]


@pytest.mark.parametrize("rank", [0, 1])
def test_probe_learns_each_ranks_slices_and_writes_nothing(rank):
    m = FakeRank(rank)
    got = ShardProbe(m.load)(ITEMS)
    assert got == {
        "col": (S("col", 0, 2 * rank, 2 * rank + 2),),
        "row": (S("row", 1, 2 * rank, 2 * rank + 2),),
        "norm": (S("norm"),),
        "stat": (S("stat"),),  # read by abs(): needed whole
        "other": (),
    }
    assert not m.col.any() and not m.row.any() and not m.norm.any()


def test_a_loader_that_refuses_stand_ins_makes_every_tensor_whole():
    got = ShardProbe(FakeRank(0, fail=True).load)(ITEMS)
    assert got == {n: (S(n),) for n, _, _ in ITEMS}


# -- vLLM's own layers ------------------------------------------------------------------------------------------
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 96, 1000


@pytest.fixture
def vllm_rank(monkeypatch):
    """Builds vLLM's parallel layers as TP rank `rank` of `size` on CPU (the TP group stubbed)."""
    pytest.importorskip("vllm")
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config

    def build(rank: int, size: int):
        import vllm.model_executor.layers.linear as linear
        import vllm.model_executor.layers.vocab_parallel_embedding as vocab

        monkeypatch.setattr(ps, "_TP", types.SimpleNamespace(rank_in_group=rank, world_size=size))
        dtype = torch.bfloat16
        with set_current_vllm_config(VllmConfig()):
            layers = {
                "qkv": linear.QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, params_dtype=dtype),
                "o": linear.RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, params_dtype=dtype),
                "gate_up": linear.MergedColumnParallelLinear(HIDDEN, [FFN, FFN], bias=False, params_dtype=dtype),
                "down": linear.RowParallelLinear(FFN, HIDDEN, bias=False, params_dtype=dtype),
                "embed": vocab.VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=dtype),
            }
        norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=dtype), requires_grad=False)
        # name -> (layer, parameter, shard id): the stacked-parameter mapping a Qwen2 load_weights uses
        route = {
            "q_proj.weight": ("qkv", "weight", "q"),
            "k_proj.weight": ("qkv", "weight", "k"),
            "v_proj.weight": ("qkv", "weight", "v"),
            "q_proj.bias": ("qkv", "bias", "q"),
            "k_proj.bias": ("qkv", "bias", "k"),
            "o_proj.weight": ("o", "weight", None),
            "gate_proj.weight": ("gate_up", "weight", 0),
            "up_proj.weight": ("gate_up", "weight", 1),
            "down_proj.weight": ("down", "weight", None),
            "embed_tokens.weight": ("embed", "weight", None),
        }

        def load(weights):
            for name, w in weights:
                if name == "norm.weight":
                    norm.data.copy_(w)
                    continue
                layer, attr, shard = route[name]
                param = getattr(layers[layer], attr)
                args = (shard,) if shard is not None else ()
                param.weight_loader(param, w, *args)

        return load

    return build


SHAPES = {
    "q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
    "k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "q_proj.bias": (HEADS * HEAD_DIM,),
    "k_proj.bias": (KV_HEADS * HEAD_DIM,),
    "o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
    "gate_proj.weight": (FFN, HIDDEN),
    "up_proj.weight": (FFN, HIDDEN),
    "down_proj.weight": (HIDDEN, FFN),
    "embed_tokens.weight": (VOCAB, HIDDEN),
    "norm.weight": (HIDDEN,),
}


@pytest.mark.parametrize("rank", [0, 1])
def test_vllm_layers_at_tp2_read_their_shards(vllm_rank, rank):
    got = ShardProbe(vllm_rank(rank, 2))([(n, torch.bfloat16, s) for n, s in SHAPES.items()])
    q, kv, ffn = HEADS * HEAD_DIM // 2, KV_HEADS * HEAD_DIM // 2, FFN // 2
    vocab_rows = 512  # 1000 padded to 1024 (a multiple of 64), 512 rows per rank; rank 1's end at 1000
    expected = {
        "q_proj.weight": S("q_proj.weight", 0, rank * q, (rank + 1) * q),
        "k_proj.weight": S("k_proj.weight", 0, rank * kv, (rank + 1) * kv),
        "v_proj.weight": S("v_proj.weight", 0, rank * kv, (rank + 1) * kv),
        "q_proj.bias": S("q_proj.bias", 0, rank * q, (rank + 1) * q),
        "k_proj.bias": S("k_proj.bias", 0, rank * kv, (rank + 1) * kv),
        "o_proj.weight": S("o_proj.weight", 1, rank * q, (rank + 1) * q),
        "gate_proj.weight": S("gate_proj.weight", 0, rank * ffn, (rank + 1) * ffn),
        "up_proj.weight": S("up_proj.weight", 0, rank * ffn, (rank + 1) * ffn),
        "down_proj.weight": S("down_proj.weight", 1, rank * ffn, (rank + 1) * ffn),
        "embed_tokens.weight": S("embed_tokens.weight", 0, rank * vocab_rows, min(VOCAB, (rank + 1) * vocab_rows)),
        "norm.weight": S("norm.weight"),
    }
    assert got == {n: (s,) for n, s in expected.items()}
    total = sum(torch.Size(s).numel() for s in SHAPES.values())
    kept = 0
    for (slc,) in got.values():
        shape = SHAPES[slc.name]
        numel = torch.Size(shape).numel()
        kept += numel if slc.whole else numel // shape[slc.dim] * (slc.stop - slc.start)
    assert kept / total < 0.55


def test_vllm_kv_heads_fewer_than_ranks_are_replicated(vllm_rank):
    """TP 4 with 2 kv heads: ranks 0-1 read kv head 0, ranks 2-3 kv head 1 (vLLM replicates them)."""
    shapes = {"k_proj.weight": SHAPES["k_proj.weight"], "q_proj.weight": SHAPES["q_proj.weight"]}
    for rank in range(4):
        got = ShardProbe(vllm_rank(rank, 4))([(n, torch.bfloat16, s) for n, s in shapes.items()])
        head = rank * KV_HEADS // 4
        assert got["k_proj.weight"] == (S("k_proj.weight", 0, head * HEAD_DIM, (head + 1) * HEAD_DIM),)
        assert got["q_proj.weight"] == (S("q_proj.weight", 0, rank * HEAD_DIM, (rank + 1) * HEAD_DIM),)


HF_PREFIX = {
    "embed_tokens.weight": "model.",
    "norm.weight": "model.",
    "gate_proj.weight": "model.layers.0.mlp.",
    "up_proj.weight": "model.layers.0.mlp.",
    "down_proj.weight": "model.layers.0.mlp.",
}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_learned_slices_equal_the_layout_planners(vllm_rank, tp_size):
    """The two planners agree slice by slice: vLLM's loaders (learned) and the shape rules (planned)."""
    from checkpoint_engine.sharding.shard_plan import plan_hf
    from checkpoint_engine.sharding.slices import EngineLayout
    from ckpt_common.layout.shapes import ModelShape

    shape = ModelShape(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        head_dim=HEAD_DIM,
        ffn_hidden_size=FFN if tp_size == 2 else 96,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    hf = {n: HF_PREFIX.get(n, "model.layers.0.self_attn.") + n for n in SHAPES}
    plan = plan_hf(shape, EngineLayout(tp_size=tp_size), names=hf.values())
    for rank in range(tp_size):
        learned = ShardProbe(vllm_rank(rank, tp_size))([(n, torch.bfloat16, s) for n, s in SHAPES.items()])
        as_hf = {SourceSlice(hf[s.name], s.dim, s.start, s.stop) for slices in learned.values() for s in slices}
        assert as_hf == set(plan.slices((rank, 0))), f"rank {rank} of {tp_size}"
