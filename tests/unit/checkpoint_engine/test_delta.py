import dataclasses
import math

import pytest
import torch

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.sharding.delta import (
    DeltaMismatch,
    apply,
    apply_version,
    choose_encoding,
    choose_update,
    encode,
    encode_version,
    encoding_sizes,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

N = 4096  # numel of the density table


def bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.reshape(-1).view(width)


def pair(dtype: torch.dtype, n: int, changed: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, new) of `n` values where exactly `changed` of them have other bits."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=g) * 0.5).to(dtype)
    new = base.clone()
    idx = torch.randperm(n, generator=g)[:changed]
    # flip the lowest mantissa bit: always another bit pattern, of the same dtype
    bits(new)[idx] ^= 1
    return base, new


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


# For N values of s bytes, k changed: gaps (k*w + k*s, w = 1 or 2 bytes at N = 4096) while k*w < N/8,
# bitmask (N/8 + k*s) until it reaches N*s (above 1 - 1/(8s) changed), then dense; nothing changed: sparse
# (0 bytes, ties gaps: the earlier).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "density,expected",
    [(0.0, "sparse"), (1e-4, "gaps"), (0.01, "gaps"), (0.3, "bitmask"), (1.0, "dense")],
)
def test_round_trip_is_bitwise_exact_with_the_expected_encoding(dtype, density, expected):
    changed = math.ceil(density * N)
    base, new = pair(dtype, N, changed)
    delta = encode(base, new)
    assert delta.encoding == expected
    assert delta.num_changed == changed
    changed_at = (bits(base) != bits(new)).nonzero().reshape(-1)
    max_gap = int(torch.diff(changed_at, prepend=changed_at.new_zeros(1)).max()) if changed else 0
    assert delta.nbytes == encoding_sizes(N, changed, base.element_size(), max_gap)[expected]
    assert delta.nbytes == sum(t.numel() * t.element_size() for t in delta.payload)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in delta.payload)
    target = base.clone()
    apply(target, delta)
    assert_bitwise_equal(target, new)


@pytest.mark.parametrize(
    "numel,changed,itemsize,expected",
    [
        (0, 0, 2, "dense"),  # every size 0: the simplest
        (1, 1, 2, "dense"),  # 2 vs bitmask 1 + 2, sparse 4 + 2
        (64, 0, 2, "sparse"),  # nothing to send
        (64, 1, 2, "gaps"),  # 1 + 2 vs sparse 6, bitmask 10, dense 128
        (64, 8, 2, "bitmask"),  # 24 vs sparse 48
        (64, 60, 2, "dense"),  # bitmask 8 + 120 = 128 ties dense 128: the simpler
        (8, 1, 4, "bitmask"),  # 1 + 4 vs sparse 8
        (64, 1, 1, "gaps"),  # 2 vs sparse 5, bitmask 9
        (64, 3, 1, "gaps"),  # 6 vs bitmask 11, sparse 15
        (64, 8, 1, "bitmask"),  # bitmask 8 + 8 = 16 ties gaps 8 * 2: the earlier
        (64, 56, 1, "dense"),  # bitmask 64 ties dense 64
    ],
)
def test_choose_encoding_table(numel, changed, itemsize, expected):
    assert choose_encoding(numel, changed, itemsize) == expected


def test_sparse_indices_widen_to_int64_past_two_to_the_31():
    assert encoding_sizes(2**31 - 1, 10, 2)["sparse"] == 10 * (4 + 2)
    assert encoding_sizes(2**31, 10, 2)["sparse"] == 10 * (8 + 2)
    assert encoding_sizes(2**31, 10, 2)["bitmask"] == 2**28 + 20


def test_signed_zero_and_nan_payloads_count_as_changes():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.float32)
    new = base.clone()
    new[0] = -0.0
    bits(new)[2] = bits(base)[2] ^ 1  # another NaN payload
    delta = encode(base, new)
    assert delta.num_changed == 2
    target = base.clone()
    apply(target, delta)
    assert_bitwise_equal(target, new)


def test_corrupted_base_is_refused_and_left_untouched():
    base, new = pair(torch.bfloat16, N, 40)
    delta = encode(base, new)
    corrupted = base.clone()
    bits(corrupted)[7] ^= 2
    before = corrupted.clone()
    with pytest.raises(DeltaMismatch, match=r"tensor 'w'.*base checksum.*nothing written"):
        apply(corrupted, delta, name="w")
    assert_bitwise_equal(corrupted, before)


def test_wrong_shape_and_corrupted_delta_are_refused():
    base, new = pair(torch.float16, N, 40)
    delta = encode(base, new)
    with pytest.raises(DeltaMismatch, match=r"tensor 'w': delta is for float16 \(4096,\)"):
        apply(base[:-1].clone(), delta, name="w")
    bad_values = delta.payload[1].clone()
    bad_values[0] = bad_values[0] + 1
    bad = dataclasses.replace(delta, payload=(delta.payload[0], bad_values))
    target = base.clone()
    with pytest.raises(DeltaMismatch, match="checksum after applying"):
        apply(target, bad, name="w")
    short = dataclasses.replace(delta, payload=(delta.payload[0], delta.payload[1][:-1]))
    with pytest.raises(DeltaMismatch, match="payload has"):
        apply(base.clone(), short)


def test_apply_version_with_one_bad_tensor_changes_nothing():
    base = {f"t{i}": pair(torch.bfloat16, N, 0, seed=i)[0] for i in range(3)}
    new = {name: pair(torch.bfloat16, N, 100, seed=i)[1] for i, name in enumerate(base)}
    delta = encode_version(base, new)
    state = {name: t.clone() for name, t in base.items()}
    bits(state["t2"])[0] ^= 1  # the last one checked: the first two would have been written
    before = {name: t.clone() for name, t in state.items()}
    with pytest.raises(DeltaMismatch, match="'t2'"):
        apply_version(state, delta)
    for name in state:
        assert_bitwise_equal(state[name], before[name])
    bits(state["t2"])[0] ^= 1
    apply_version(state, delta)
    for name in state:
        assert_bitwise_equal(state[name], new[name])


def test_version_names_must_match():
    t = torch.zeros(4)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        encode_version({"a": t, "b": t}, {"a": t})
    delta = encode_version({"a": t}, {"a": t})
    with pytest.raises(DeltaMismatch, match=r"unexpected \['b'\]"):
        apply_version({"a": t, "b": t}, delta)


@pytest.mark.parametrize(
    "engine,base,delta_bytes,kind,reason",
    [
        (None, "v1", 10, "full", "no version"),
        ("v1", None, 10, "full", "no delta"),
        ("v0", "v1", 10, "full", "skipped version"),
        ("v1", "v1", 51, "full", "more than 0.5"),
        ("v1", "v1", 50, "delta", "50 of 100 bytes"),
        ("v1", "v1", 0, "delta", "0 of 100 bytes"),
    ],
)
def test_choose_update_table(engine, base, delta_bytes, kind, reason):
    choice = choose_update(engine, base, delta_bytes, 100)
    assert choice.kind == kind
    assert reason in choice.reason


def test_choose_update_rejects_a_bad_ratio():
    with pytest.raises(ValueError, match="max_ratio"):
        choose_update("v1", "v1", 1, 100, max_ratio=0)


def test_checksums_and_version_totals():
    base, new = pair(torch.float32, 1000, 10)
    delta = encode_version({"a": base}, {"a": new})
    d = delta.tensors["a"]
    assert (d.base_checksum, d.new_checksum) == (tensor_checksum(base), tensor_checksum(new))
    assert delta.full_bytes == 4000 and delta.changed_share == pytest.approx(0.01)
    assert d.encoding == "gaps" and d.gap_width in (1, 2)
    assert delta.nbytes == d.nbytes == 10 * (d.gap_width + 4)


def test_one_small_lr_step_changes_few_bf16_values():
    """Master weights N(0,1)*0.02 in float32, one step w - 1e-5 * g: most bf16 casts keep their bits."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g) * 0.02
    w2 = w - 1e-5 * torch.randn(256, 1024, generator=g)
    base, new = w.to(torch.bfloat16), w2.to(torch.bfloat16)
    delta = encode(base, new)
    share = delta.num_changed / base.numel()
    assert 0 < share < 0.3  # about 0.2: how often a 1e-5 step crosses a bf16 rounding edge (ulp 1.2e-4 at 0.02)
    assert delta.nbytes < delta.full_bytes / 2
    target = base.clone()
    apply(target, delta)
    assert_bitwise_equal(target, new)


def test_empty_and_scalar_tensors():
    for base, new in [(torch.zeros(0, 3), torch.zeros(0, 3)), (torch.tensor(1.0), torch.tensor(2.0))]:
        delta = encode(base, new)
        target = base.clone()
        apply(target, delta)
        assert_bitwise_equal(target, new)
