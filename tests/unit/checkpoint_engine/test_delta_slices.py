"""Deltas cut along tensor-parallel slices (checkpoint_engine.sharding.delta_slices, delta_sync's
RankSlices and multi-header wire): each rank of a TP engine takes only its own slices' entries and
ends with exactly the new version's values in its slices."""

from __future__ import annotations

import pytest
import torch

from checkpoint_engine.sharding.delta import DeltaMismatch
from checkpoint_engine.sharding.delta_slices import (
    apply_sliced,
    delta_slices,
    encode_sliced,
    overlaps,
    parse_slice_key,
    slice_key,
)
from checkpoint_engine.sharding.delta_sync import (
    HEADER,
    DeltaReceiver,
    RankSlices,
    from_wire,
    is_delta_name,
    to_wire,
)
from checkpoint_engine.sharding.shard_plan import plan_hf
from checkpoint_engine.sharding.slices import EngineLayout, SourceSlice
from ckpt_common.layout.shapes import ModelShape, hf_param_shapes

SHAPE = ModelShape(
    num_layers=1,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=96,
    vocab_size=200,
    tie_word_embeddings=True,
)


def versions(seed: int = 0, share: float = 0.05) -> tuple[dict, dict]:
    """(base, new) in bfloat16: `share` of every tensor's values moved by one last bit."""
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf_param_shapes(SHAPE).items()}
    new = {}
    for n, t in base.items():
        bits = t.view(torch.int16).clone().reshape(-1)
        moved = torch.rand(bits.numel(), generator=g) < share
        bits[moved] ^= 1
        new[n] = bits.view(torch.bfloat16).reshape(t.shape)
    return base, new


def rank_cache(base: dict, own: dict) -> dict:
    """What a rank's weight cache holds after a sharded pull of `base`: every tensor's shape, its own
    slices' rows read, the rest never read (here: NaN, so any use of them shows)."""
    out = {}
    for n, t in base.items():
        c = torch.full_like(t, float("nan"))
        for s in own.get(n, ()):
            if s.whole:
                c.copy_(t)
            else:
                c.narrow(s.dim, s.start, s.stop - s.start).copy_(t.narrow(s.dim, s.start, s.stop - s.start))
        out[n] = c
    return out


def own_of(plan, tp_rank: int) -> dict:
    got: dict[str, list] = {}
    for s in plan.by_dest[(tp_rank, 0)]:
        got.setdefault(s.name, []).append(s)
    return {n: tuple(got.get(n, ())) for n in plan.names}


@pytest.mark.parametrize(
    "key, s",
    [
        ("model.norm.weight", SourceSlice("model.norm.weight")),
        ("a.weight@0:0:32", SourceSlice("a.weight", 0, 0, 32)),
        ("o_proj.weight@1:32:64", SourceSlice("o_proj.weight", 1, 32, 64)),
    ],
)
def test_slice_keys_round_trip(key, s):
    assert slice_key(s) == key and parse_slice_key(key) == s


def test_a_bad_slice_key_is_refused_by_name():
    with pytest.raises(DeltaMismatch, match="x@0:a"):
        parse_slice_key("x@0:a")


@pytest.mark.parametrize(
    "a, b, want",
    [
        (SourceSlice("w", 0, 0, 4), SourceSlice("w", 0, 4, 8), False),
        (SourceSlice("w", 0, 0, 5), SourceSlice("w", 0, 4, 8), True),
        (SourceSlice("w"), SourceSlice("w", 0, 4, 8), True),
        (SourceSlice("w", 1, 0, 4), SourceSlice("w", 0, 4, 8), True),  # other dims: conservatively
    ],
)
def test_overlaps(a, b, want):
    assert overlaps(a, b) is want and overlaps(b, a) is want


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_applies_its_own_slices_exactly_and_takes_about_its_share(tp_size):
    plan = plan_hf(SHAPE, EngineLayout(tp_size=tp_size))
    base, new = versions()
    delta = encode_sliced(base, new, delta_slices(plan))
    assert any("@" in k for k in delta.tensors)  # sharded tensors are cut
    assert "model.norm.weight" in delta.tensors  # replicated: one whole entry
    total = delta.nbytes
    for rank in range(tp_size):
        own = own_of(plan, rank)
        cache = rank_cache(base, own)
        applied = apply_sliced(cache, delta, own.get)
        taken = sum(delta.tensors[k].nbytes for k in applied)
        for n, slices in own.items():
            for s in slices:
                got = cache[n] if s.whole else cache[n].narrow(s.dim, s.start, s.stop - s.start)
                want = new[n] if s.whole else new[n].narrow(s.dim, s.start, s.stop - s.start)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rank, slice_key(s))
        # the rank's entries: its share of the sharded values plus the replicated ones
        replicated = sum(d.nbytes for k, d in delta.tensors.items() if "@" not in k)
        assert taken <= (total - replicated) / tp_size * 1.25 + replicated, (rank, taken, total)


def test_a_rank_whose_slices_the_delta_does_not_cover_refuses_before_writing():
    plan2, plan4 = (plan_hf(SHAPE, EngineLayout(tp_size=t)) for t in (2, 4))
    base, new = versions()
    delta = encode_sliced(base, new, delta_slices(plan4))  # cut for TP 4, applied at TP 2: entries fit inside
    own = own_of(plan2, 0)
    cache = rank_cache(base, own)
    apply_sliced(cache, delta, own.get)  # TP 4's entries lie inside TP 2's slices: fine

    delta2 = encode_sliced(base, new, delta_slices(plan2))  # cut for TP 2, applied at TP 4: spans more rows
    own4 = own_of(plan4, 1)
    cache4 = rank_cache(base, own4)
    before = {n: t.clone() for n, t in cache4.items()}
    with pytest.raises(DeltaMismatch, match="another tensor-parallel layout"):
        apply_sliced(cache4, delta2, own4.get)
    for n, t in cache4.items():
        assert torch.equal(t.view(torch.int16), before[n].view(torch.int16)), n


def test_a_whole_tensor_delta_on_a_sliced_rank_is_refused_and_an_unknown_tensor_named():
    plan = plan_hf(SHAPE, EngineLayout(tp_size=2))
    base, new = versions()
    own = own_of(plan, 0)
    whole = encode_sliced(base, new, None)
    with pytest.raises(DeltaMismatch, match="spans rows this rank does not hold"):
        apply_sliced(rank_cache(base, own), whole, own.get)
    sliced = encode_sliced(base, new, delta_slices(plan))
    with pytest.raises(DeltaMismatch, match="not known"):
        apply_sliced(rank_cache(base, own), sliced, {}.get)


def test_a_rank_holding_whole_tensors_takes_a_sliced_delta_whole():
    """A TP 1 cache (everything whole) applies every entry of a delta cut for TP 2."""
    plan = plan_hf(SHAPE, EngineLayout(tp_size=2))
    base, new = versions()
    cache = {n: t.clone() for n, t in base.items()}
    delta = encode_sliced(base, new, delta_slices(plan))
    assert sorted(apply_sliced(cache, delta)) == sorted(delta.tensors)
    whole_own = {n: (SourceSlice(n),) for n in base}
    cache2 = {n: t.clone() for n, t in base.items()}
    apply_sliced(cache2, delta, whole_own.get)
    for n in base:
        assert torch.equal(cache[n].view(torch.int16), new[n].view(torch.int16)), n
        assert torch.equal(cache2[n].view(torch.int16), new[n].view(torch.int16)), n


def test_a_wrong_base_slice_is_refused_and_nothing_written():
    plan = plan_hf(SHAPE, EngineLayout(tp_size=2))
    base, new = versions()
    own = own_of(plan, 1)
    cache = rank_cache(base, own)
    name = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: its slice is along dim 1
    (s,) = own[name]
    assert s.dim == 1
    cache[name].narrow(1, s.start, 1).add_(1)
    before = {n: t.clone() for n, t in cache.items()}
    with pytest.raises(DeltaMismatch, match="base checksum"):
        apply_sliced(cache, encode_sliced(base, new, delta_slices(plan)), own.get)
    for n, t in cache.items():
        assert torch.equal(t.view(torch.int16), before[n].view(torch.int16)), n


def test_the_wire_merges_each_sender_ranks_header_and_a_rank_reads_only_its_parts():
    plan = plan_hf(SHAPE, EngineLayout(tp_size=2))
    base, new = versions()
    names = sorted(base)
    wire = {}
    for r in range(2):  # two sender ranks, each its share of the tensors
        mine = names[r::2]
        delta = encode_sliced({n: base[n] for n in mine}, {n: new[n] for n in mine}, delta_slices(plan), compress=True)
        wire.update(to_wire(delta, "A", "B", header=f"{HEADER}/{r}"))
    assert all(is_delta_name(n) for n in wire)
    own = own_of(plan, 0)
    probed = []

    def probe(items):
        probed.extend(n for n, _, _ in items)
        return {n: own[n] for n, _, _ in items}

    rank = RankSlices(probe)
    rank([(n, t.dtype, tuple(t.shape)) for n, t in base.items()])  # the full pull before: slices learned
    asked = rank([(n, t.dtype, tuple(t.shape)) for n, t in wire.items()])
    assert not any(is_delta_name(n) for n in probed)  # the model's loaders never see a delta's tensors
    skipped = [n for n, s in asked.items() if s == ()]
    assert skipped and all("@" in n for n in skipped)
    receiver = DeltaReceiver(rank)
    for n, t in wire.items():
        if asked[n]:  # what the rank read; the others' bytes never arrived (garbage here)
            assert receiver.take(n, t)
        else:
            assert receiver.take(n, torch.zeros_like(t))
    cache = rank_cache(base, own)
    assert receiver.finish(cache, "A", sliced=True) == "B"
    for n, slices in own.items():
        for s in slices:
            got = cache[n] if s.whole else cache[n].narrow(s.dim, s.start, s.stop - s.start)
            want = new[n] if s.whole else new[n].narrow(s.dim, s.start, s.stop - s.start)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), n

    other = dict(wire)
    other[f"{HEADER}/1"] = to_wire(encode_sliced({}, {}, None), "A", "C", header=f"{HEADER}/1")[f"{HEADER}/1"]
    with pytest.raises(DeltaMismatch, match="disagree"):
        from_wire(other)
    with pytest.raises(DeltaMismatch, match="is from 'A', but this engine holds 'Z'"):
        _finish_with_wrong_base(rank, wire, base, own)


def _finish_with_wrong_base(rank, wire, base, own):
    receiver = DeltaReceiver(rank)
    for n, t in wire.items():
        receiver.take(n, t)
    receiver.finish(rank_cache(base, own), "Z", sliced=True)


def test_a_sliced_cache_without_a_slice_plan_is_refused():
    base, new = versions()
    receiver = DeltaReceiver()
    for n, t in to_wire(encode_sliced(base, new, None), "A", "B").items():
        receiver.take(n, t)
    with pytest.raises(DeltaMismatch, match="no slice plan"):
        receiver.finish({n: t.clone() for n, t in base.items()}, "A", sliced=True)


def test_a_header_name_that_is_not_a_delta_header_is_refused():
    with pytest.raises(ValueError, match="__ce_delta__"):
        to_wire(encode_sliced({}, {}, None), "A", "B", header="other")
