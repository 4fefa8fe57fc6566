"""The delta encodings (checkpoint_engine.sharding.delta): gap-coded positions, zstd per payload part,
the anchor policy, and refusals of corrupted input naming the tensor and what is wrong. Round trips
are compared bit for bit on bf16 and float8_e4m3fn tables, a block-scaled FP8 weight among them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.sharding.delta import (
    ENCODINGS,
    DeltaMismatch,
    TensorDelta,
    apply,
    apply_version,
    bytes_to_gaps,
    choose_encoding,
    choose_update,
    encode,
    encode_version,
    encoding_sizes,
    gap_width,
    gaps_to_bytes,
    pack_bits,
    pack_bits_torch,
    unpack_bits,
    unpack_bits_torch,
)
from checkpoint_engine.sharding.delta_sync import DeltaSender, from_wire, to_wire

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.bfloat16] + ([FP8] if FP8 is not None else [])
needs_fp8 = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def table(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype) if dtype != FP8 else (torch.randn(n, generator=g)).to(FP8)


def changed_at(base: torch.Tensor, where) -> torch.Tensor:
    """`base` with the last bit of the values at flat indices `where` flipped."""
    new = base.clone()
    bits(new)[torch.as_tensor(where, dtype=torch.int64)] ^= 1
    return new


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def round_trip(base: torch.Tensor, new: torch.Tensor, compress: bool) -> TensorDelta:
    delta = encode(base, new, compress=compress)
    target = base.clone()
    apply(target, delta, name="w")
    assert same_bits(target, new)
    return delta


# -- round trips --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "share,expected",
    [(0.0, "sparse"), (0.001, "gaps"), (0.01, "gaps"), (0.1, "gaps"), (0.33, "bitmask"), (1.0, "dense")],
)
def test_round_trips_are_bit_exact(dtype, share, expected, compress):
    n = 1 << 15
    base = table(dtype, n)
    where = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: round(share * n)]
    new = changed_at(base, where)
    delta = round_trip(base, new, compress)
    assert delta.encoding == expected and delta.num_changed == len(where)
    if compress and share >= 0.01:  # a few dozen values: zstd may not pay
        assert any(delta.compressed), "zstd pays on every part of these tables but was not kept"
        assert delta.nbytes < encode(base, new).nbytes


def test_no_change_all_changed_and_one_change_at_the_last_index():
    base = table(torch.bfloat16, 1000)
    none = round_trip(base, base.clone(), compress=True)
    assert (none.encoding, none.nbytes, none.num_changed) == ("sparse", 0, 0)
    everything = round_trip(base, changed_at(base, range(1000)), compress=False)
    assert everything.encoding == "dense" and everything.nbytes == 2000
    last = round_trip(base, changed_at(base, [999]), compress=False)
    assert (last.encoding, last.gap_width, last.nbytes) == ("gaps", 2, 2 + 2)  # gap 999 needs 2 bytes
    assert bytes_to_gaps(last.payload[0], 2).tolist() == [999]


@pytest.mark.parametrize(
    "where,n,width",
    [
        ([0, 255], 300, 1),  # largest gap 255: one byte
        ([3, 259], 300, 2),  # 256: two
        ([0, 65535, 65535 + 65537], 140000, 4),  # 65537: four bytes
    ],
)
def test_gap_width_follows_the_largest_gap(where, n, width):
    gaps = torch.diff(torch.tensor(where), prepend=torch.zeros(1, dtype=torch.int64))
    assert gap_width(int(gaps.max())) == width
    base = table(torch.bfloat16, n)
    delta = round_trip(base, changed_at(base, where), compress=False)
    if width < 4:
        assert (delta.encoding, delta.gap_width) == ("gaps", width)
    else:  # 4-byte gaps tie 4-byte sparse indices: the earlier in ENCODINGS
        assert delta.encoding == "sparse"


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_gap_bytes_round_trip_at_every_width(width):
    top = (1 << (8 * width)) - 1 if width < 8 else (1 << 62)
    indices = torch.cumsum(torch.tensor([0, 1, top, 1, top], dtype=torch.int64), 0)
    raw = gaps_to_bytes(indices, width)
    assert raw.dtype == torch.uint8 and raw.numel() == 5 * width
    assert torch.equal(torch.cumsum(bytes_to_gaps(raw, width), 0), indices)
    assert gap_width(top) == width
    # a hand-made gaps delta at this width applies (the encoder picks sparse at 4 and 8 bytes: a tie)
    n = int(indices[-1]) + 1 if width <= 2 else 300
    where = indices if width <= 2 else torch.tensor([1, 2, 100, 101, 299])
    base = table(torch.bfloat16, n)
    new = changed_at(base, where)
    forced = TensorDelta(
        "gaps",
        (n,),
        "bfloat16",
        (gaps_to_bytes(where, width), new[where].clone()),
        len(where),
        tensor_checksum(base),
        tensor_checksum(new),
        width,
    )
    target = base.clone()
    apply(target, forced, name="w")
    assert same_bits(target, new)


def test_a_table_past_two_to_the_16_goes_as_two_byte_gaps():
    n = (1 << 16) * 3 + 7
    base = table(torch.bfloat16, n)
    where = torch.arange(5, n, 97)  # every gap 97, but n >= 2**16: indices alone would need 4 bytes
    delta = round_trip(base, changed_at(base, where), compress=True)
    assert (delta.encoding, delta.gap_width) == ("gaps", 1)
    where = torch.tensor([0, 40000, 80000, 120000, 160000, n - 1])  # gaps < 2**16, indices up to 196614
    delta = round_trip(base, changed_at(base, where), compress=False)
    assert (delta.encoding, delta.gap_width, delta.nbytes) == ("gaps", 2, 6 * (2 + 2))


@needs_fp8
def test_block_scaled_fp8_weight_and_its_scales_round_trip():
    """A 256x384 weight quantised to fp8 e4m3 in 128x128 blocks, one float32 scale per block (amax/448);
    one optimizer-like step later both the fp8 tensor and the scales go through the encoder."""

    def quantise(w):
        blocks = w.reshape(2, 128, 3, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        return (blocks / scale[:, None, :, None]).to(FP8).reshape(256, 384), scale.float()

    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=g) * 0.02
    w2 = w - 2e-4 * torch.randn(256, 384, generator=g)
    (q1, s1), (q2, s2) = quantise(w), quantise(w2)
    base, new = {"w": q1, "w_scale": s1}, {"w": q2, "w_scale": s2}
    for compress in (False, True):
        delta = encode_version(base, new, compress=compress)
        assert 0 < delta.tensors["w"].num_changed < q1.numel()
        assert delta.tensors["w_scale"].num_changed > 0  # the block amax moved
        state = {k: t.clone() for k, t in base.items()}
        apply_version(state, delta)
        assert same_bits(state["w"], q2) and same_bits(state["w_scale"], s2)
        dequant = state["w"].float().reshape(2, 128, 3, 128) * state["w_scale"][:, None, :, None]
        want = q2.float().reshape(2, 128, 3, 128) * s2[:, None, :, None]
        assert torch.equal(dequant, want)


def test_the_torch_bit_packing_equals_numpys():
    mask = torch.rand(1003, generator=torch.Generator().manual_seed(0)) < 0.3
    assert torch.equal(pack_bits_torch(mask), pack_bits(mask))
    assert torch.equal(unpack_bits_torch(pack_bits(mask), 1003), mask)
    assert torch.equal(unpack_bits(pack_bits(mask), 1003), mask)


# -- the choice of encoding --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "numel,changed,itemsize,max_gap,expected",
    [
        (300, 2, 2, 255, "gaps"),  # 2 * (1 + 2) = 6 vs sparse 12, bitmask 42
        (300, 2, 2, 256, "gaps"),  # 2 * (2 + 2) = 8
        (70000, 2, 2, 65536, "sparse"),  # 4-byte gaps tie 4-byte indices: the earlier
        (2**31, 10, 2, 2**20, "gaps"),  # 10 * (4 + 2) vs int64 indices 10 * (8 + 2)
        (2**31, 10, 2, 2**31 - 1, "gaps"),
        (2**40, 10, 2, 2**33, "sparse"),  # 8-byte gaps tie int64 indices
        (800, 100, 2, 8, "bitmask"),  # bitmask 100 + 200 ties gaps 100 + 200: the earlier
        (800, 99, 2, 8, "gaps"),  # 297 vs 298
        (64, 0, 2, None, "sparse"),  # 0 bytes: sparse, gaps tie
    ],
)
def test_choose_encoding_with_gaps_table(numel, changed, itemsize, max_gap, expected):
    assert choose_encoding(numel, changed, itemsize, max_gap) == expected


def test_gaps_sizes_and_widths():
    assert ENCODINGS == ("dense", "sparse", "bitmask", "gaps")
    assert [gap_width(g) for g in (0, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1)] == [1, 1, 2, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="does not fit"):
        gap_width(2**64)
    assert encoding_sizes(1000, 10, 1)["gaps"] == 10 * (2 + 1)  # no max_gap: the widest, 999 -> 2 bytes
    assert encoding_sizes(1000, 10, 1, max_gap=200)["gaps"] == 10 * (1 + 1)


# -- the anchor policy -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "delta_bytes,full_bytes,max_ratio,since,every,kind,reason",
    [
        (10, 100, 0.5, 0, None, "delta", "10 of 100 bytes"),
        (10, 100, 0.5, 99, None, "delta", "10 of 100"),  # no anchors: any chain length
        (10, 100, 0.5, 0, 1, "full", "every 1 versions"),  # K = 1: every version full
        (10, 100, 0.5, 0, 3, "delta", "10 of 100"),
        (10, 100, 0.5, 1, 3, "delta", "10 of 100"),
        (10, 100, 0.5, 2, 3, "full", "an anchor: a full version every 3 versions (2 deltas since the last)"),
        (100, 100, 1.0, 0, None, "full", "not smaller than the full 100 bytes"),
        (101, 100, 1.0, 0, None, "full", "not smaller"),
        (99, 100, 1.0, 0, None, "delta", "99 of 100"),
        (0, 0, 1.0, 0, None, "full", "not smaller"),  # an empty version: nothing to save
        (51, 100, 0.5, 0, None, "full", "more than 0.5"),
    ],
)
def test_anchor_policy_table(delta_bytes, full_bytes, max_ratio, since, every, kind, reason):
    choice = choose_update("v1", "v1", delta_bytes, full_bytes, max_ratio, deltas_since_full=since, anchor_every=every)
    assert choice.kind == kind and reason in choice.reason


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_anchor_every_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="anchor_every"):
        choose_update("v1", "v1", 1, 100, anchor_every=bad)
    with pytest.raises(ValueError, match="anchor_every"):
        DeltaSender(anchor_every=bad)


def test_the_sender_sends_an_anchor_every_k_versions():
    sender = DeltaSender(anchor_every=3)
    base = table(torch.bfloat16, 4096)
    kinds, held = [], None
    for v in range(1, 9):
        new = {"w": changed_at(base, [v, 100 + v])}
        prepared = sender.prepare(f"v{v}", new, held)
        kinds.append(prepared.choice.kind)
        sender.commit(prepared)
        held = f"v{v}"
    # v1: no version yet; then 2 deltas and a full version, again and again
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full", "delta"]


# -- corrupted input -----------------------------------------------------------------------------------------
@pytest.fixture
def gaps_delta():
    base = table(torch.bfloat16, 4096)
    new = changed_at(base, [3, 10, 700, 4000])
    delta = encode(base, new)
    assert (delta.encoding, delta.gap_width) == ("gaps", 2)
    return base, new, delta


def refused(base, delta, match):
    """apply refuses `delta` with DeltaMismatch matching `match` and names tensor 'w'."""
    target = base.clone()
    with pytest.raises(DeltaMismatch, match=match) as e:
        apply(target, delta, name="w")
    assert "tensor 'w'" in str(e.value)
    return target


def test_a_truncated_payload_is_refused_and_nothing_written(gaps_delta):
    base, _, delta = gaps_delta
    short = dataclasses.replace(delta, payload=(delta.payload[0][:-1], delta.payload[1]))
    assert same_bits(refused(base, short, "truncated payload"), base)
    one_part = dataclasses.replace(delta, payload=delta.payload[:1])
    refused(base, one_part, "payload has 1 parts, expected 2")


def test_an_unknown_gap_width_is_refused(gaps_delta):
    base, _, delta = gaps_delta
    refused(base, dataclasses.replace(delta, gap_width=3), r"gap width 3 is unknown; known: \[1, 2, 4, 8\]")


def test_indices_out_of_range_or_not_increasing_are_refused(gaps_delta):
    base, _, delta = gaps_delta
    gaps = bytes_to_gaps(delta.payload[0], 2)
    past = gaps.clone()
    past[-1] = 4096 - 700  # the last index lands on 4096
    bad = dataclasses.replace(delta, payload=(gaps_to_bytes(torch.cumsum(past, 0), 2), delta.payload[1]))
    assert same_bits(refused(base, bad, r"index 4096 out of range \[0, 4096\)"), base)
    repeat = gaps.clone()
    repeat[2] = 0  # index 10 twice
    raw = repeat.to(torch.int32).view(torch.uint8).view(-1, 4)[:, :2].contiguous().reshape(-1)
    refused(base, dataclasses.replace(delta, payload=(raw, delta.payload[1])), "not increasing")
    sparse = encode(base, changed_at(base, [1, 2]))
    sparse = dataclasses.replace(
        sparse, encoding="sparse", payload=(torch.tensor([1, 4096], dtype=torch.int32), sparse.payload[1])
    )
    refused(base, sparse, r"sparse index out of range \[0, 4096\)")


def test_checksum_mismatches_are_refused(gaps_delta):
    base, _, delta = gaps_delta
    wrong_values = delta.payload[1].clone()
    bits(wrong_values)[0] ^= 4
    refused(base, dataclasses.replace(delta, payload=(delta.payload[0], wrong_values)), "checksum after applying")
    other_base = changed_at(base, [5])
    target = other_base.clone()
    with pytest.raises(DeltaMismatch, match=r"tensor 'w': base checksum .* nothing written"):
        apply(target, delta, name="w")
    assert same_bits(target, other_base)


def test_bad_zstd_frames_are_refused():
    base = table(torch.bfloat16, 1 << 14)
    where = torch.randperm(1 << 14, generator=torch.Generator().manual_seed(2))[:1500]
    delta = encode(base, changed_at(base, where), compress=True)
    assert delta.compressed == (True, True)
    frame = delta.payload[1]
    for bad, match in [
        (frame[:-7], "bad zstd frame"),  # cut short
        (torch.full((64,), 7, dtype=torch.uint8), "bad zstd frame"),  # not zstd at all
        (torch.zeros(0, dtype=torch.uint8), "bad zstd frame"),
    ]:
        corrupted = dataclasses.replace(delta, payload=(delta.payload[0], bad))
        assert same_bits(refused(base, corrupted, match), base)
    # a good frame of the wrong size: another tensor's values
    other = encode(base, changed_at(base, where[:1000]), compress=True)
    refused(base, dataclasses.replace(delta, payload=(delta.payload[0], other.payload[1])), "truncated payload")
    refused(base, dataclasses.replace(delta, compressed=(True,)), "1 compression flags for 2 payload parts")
    not_bytes = dataclasses.replace(delta, payload=(delta.payload[0], frame.view(torch.int8)))
    refused(base, not_bytes, "not bytes")


def test_compressed_deltas_survive_the_wire_form_and_a_bad_flag_is_refused():
    base = {"a": table(torch.bfloat16, 5000), "b": table(torch.bfloat16, 64, seed=1)}
    new = {"a": changed_at(base["a"], range(0, 5000, 9)), "b": base["b"].clone()}
    wire = to_wire(encode_version(base, new, compress=True), "v1", "v2")
    _, _, delta = from_wire(wire)
    assert delta.tensors["a"].compressed and delta.tensors["a"].encoding == "gaps"
    state = {k: t.clone() for k, t in base.items()}
    apply_version(state, delta)
    assert all(same_bits(state[k], new[k]) for k in new)

    import json

    header = json.loads(bytes(wire["__ce_delta__"].numpy()).decode())
    header["tensors"]["a"]["compressed"] = ["yes", 1]
    bad = dict(wire, __ce_delta__=torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8))
    with pytest.raises(DeltaMismatch, match="unreadable delta header.*compression flag"):
        from_wire(bad)
