import pytest

from checkpoint_engine.buckets import (
    TensorMeta,
    align_up,
    check_global_metas,
    choose_bucket_size,
    double_buffer_schedule,
    layout_tensors,
    plan_buckets,
    plan_digest,
)


def metas(*sizes, dtype="uint8", align=16, chunk=None):
    layout = layout_tensors(
        [(f"t{i}", dtype, (n,)) for i, n in enumerate(sizes)], align_bytes=align, max_chunk_bytes=chunk
    )
    return list(layout.metas)


@pytest.mark.parametrize(
    "specs,align,offsets",
    [
        ([("a", "int8", (3,)), ("b", "float32", (2,))], 16, [0, 16]),  # odd int8 before a float
        ([("a", "float32", ()), ("b", "float16", (0, 4)), ("c", "bfloat16", (5,))], 16, [0, 16, 16]),  # 0-d, empty
        ([("a", "float32", (64,)), ("b", "float32", (1,))], 256, [0, 256]),
        ([], 16, []),
    ],
)
def test_layout_offsets_are_aligned(specs, align, offsets):
    layout = layout_tensors(specs, align_bytes=align)
    assert [m.offset_bytes for m in layout.metas] == offsets
    assert all(m.offset_bytes % align == 0 for m in layout.metas)
    if specs:
        last = layout.metas[-1]
        assert layout.chunk_sizes_bytes[-1] >= last.offset_bytes + last.nbytes


def test_layout_splits_chunks_and_gives_big_tensor_its_own():
    layout = layout_tensors(
        [("a", "uint8", (40,)), ("b", "uint8", (40,)), ("c", "uint8", (500,)), ("d", "uint8", (8,))],
        align_bytes=16,
        max_chunk_bytes=100,
    )
    assert [(m.chunk, m.offset_bytes) for m in layout.metas] == [(0, 0), (0, 48), (1, 0), (2, 0)]
    assert layout.chunk_sizes_bytes == (96, 512, 16)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(specs=[("a", "uint8", (1,)), ("a", "uint8", (1,))]), "duplicate tensor name 'a'"),
        (dict(specs=[("a", "complex64", (1,))]), "unsupported dtype name 'complex64'"),
        (dict(specs=[], align_bytes=24), "power of two"),
        (dict(specs=[], max_chunk_bytes=0), "max_chunk_bytes"),
    ],
)
def test_layout_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        layout_tensors(**bad)


@pytest.mark.parametrize(
    "sizes,bucket,expected",
    [
        ((1,) * 10, 64, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),  # many tiny tensors (16-byte slots)
        ((64,), 64, [[0]]),  # exactly one bucket
        ((64, 64), 64, [[0], [1]]),
        ((10, 0, 10), 32, [[0, 1, 2]]),  # empty tensor rides along
        ((), 64, []),
    ],
)
def test_plan_buckets_single_owner(sizes, bucket, expected):
    buckets = plan_buckets({0: metas(*sizes)}, bucket)
    assert [[int(t.name[1:]) for t in b.tensors] for b in buckets] == expected
    for b in buckets:
        assert b.size_bytes <= bucket
        assert b.start_bytes == b.tensors[0].offset_bytes


def test_plan_buckets_refuses_tensor_larger_than_bucket_and_names_it():
    with pytest.raises(ValueError, match=r"tensor 't1' \(rank 0\) needs 65 bytes.*at least 65"):
        plan_buckets({0: metas(10, 65)}, 64)


def test_plan_buckets_interleaves_owners_and_respects_chunks():
    a = metas(40, 40, 40, chunk=96)  # chunks: [t0, t1], [t2]
    b = [TensorMeta(f"b{i}", m.dtype, m.shape, m.offset_bytes, m.chunk) for i, m in enumerate(metas(40))]
    buckets = plan_buckets({0: a, 1: b}, 1000)
    assert [(x.owner_rank, x.chunk, [t.name for t in x.tensors]) for x in buckets] == [
        (0, 0, ["t0", "t1"]),
        (1, 0, ["b0"]),
        (0, 1, ["t2"]),
    ]
    assert [x.index for x in buckets] == [0, 1, 2]


def test_check_global_metas_names_both_ranks():
    with pytest.raises(ValueError, match="'t0' is registered on rank 0 and on rank 2"):
        check_global_metas({0: metas(4), 1: [], 2: metas(4)})
    assert check_global_metas({0: metas(4, 4), 1: []}) == 2


@pytest.mark.parametrize(
    "requested,default,budget,largest,total,expected",
    [
        (1000, 64, None, 10, 100, 1000),  # explicit wins
        (None, 64, None, 10, 1000, 64),  # default
        (None, 64, None, 100, 1000, 112),  # raised to the largest tensor (aligned to 16)
        (None, 4096, None, 10, 100, 112),  # never more than the whole checkpoint
        (None, 1024, 600, 10, 5000, 288),  # capped by half the budget (aligned down)
    ],
)
def test_choose_bucket_size(requested, default, budget, largest, total, expected):
    rest = [TensorMeta(f"x{i}", "uint8", (1,), 16 * i) for i in range(total - largest)]
    rank_metas = {0: metas(largest), 1: rest}
    got = choose_bucket_size(rank_metas, requested_bytes=requested, default_bytes=default, budget_bytes=budget)
    assert got == expected


@pytest.mark.parametrize(
    "default,min_bytes,largest,total,expected",
    [
        (1024, 0, 10, 4000, 512),  # 4000 / 8 buckets = 500, aligned up
        (1024, 0, 10, 800, 112),  # 100, aligned up: 8 buckets of the checkpoint
        (1024, 600, 10, 4000, 608),  # not below the pipelined minimum (aligned up)
        (256, 0, 10, 4000, 256),  # a default below total / 8 stays
        (1024, 0, 700, 4000, 704),  # raised to the largest tensor
    ],
)
def test_choose_bucket_size_cuts_a_checkpoint_into_enough_buckets_to_pipeline(
    default, min_bytes, largest, total, expected
):
    rest = [TensorMeta(f"x{i}", "uint8", (1,), 16 * i) for i in range(total - largest)]
    rank_metas = {0: metas(largest), 1: rest}
    got = choose_bucket_size(
        rank_metas, requested_bytes=None, default_bytes=default, budget_bytes=None, pipeline_min_bytes=min_bytes
    )
    assert got == expected


def test_across_hosts_the_pipelined_minimum_is_smaller():
    from checkpoint_engine.buckets import PIPELINE_MIN_BUCKET_BYTES, PIPELINE_MIN_BUCKET_BYTES_RELAY, pipeline_min_bytes

    assert pipeline_min_bytes("relay") == PIPELINE_MIN_BUCKET_BYTES_RELAY < PIPELINE_MIN_BUCKET_BYTES
    assert {pipeline_min_bytes(m) for m in ("local", "collective", "p2p", "p2p_engine")} == {PIPELINE_MIN_BUCKET_BYTES}
    # a 17 MiB delta: two buckets at the default floor, eight across hosts
    rank_metas = {0: [TensorMeta(f"x{i}", "uint8", (2**20,), i * 2**20) for i in range(17)]}
    sizes = [
        choose_bucket_size(
            rank_metas,
            requested_bytes=None,
            default_bytes=64 * 2**20,
            budget_bytes=None,
            pipeline_min_bytes=pipeline_min_bytes(m),
        )
        for m in ("collective", "relay")
    ]
    assert [len(plan_buckets(rank_metas, size)) for size in sizes] == [2, 9]


def test_choose_bucket_size_fails_when_budget_too_small():
    with pytest.raises(ValueError, match="largest tensor needs 500 bytes"):
        choose_bucket_size({0: metas(500)}, requested_bytes=None, default_bytes=64, budget_bytes=600)


def test_plan_digest_changes_with_plan():
    m = {0: metas(4, 8)}
    assert plan_digest(plan_buckets(m, 64)) == plan_digest(plan_buckets(m, 64))
    assert plan_digest(plan_buckets(m, 64)) != plan_digest(plan_buckets(m, 16))
    assert align_up(17, 16) == 32


def test_tensor_meta_wire_roundtrip_and_validation():
    m = TensorMeta("w", "bfloat16", (3, 4), 256, 1)
    assert TensorMeta.from_wire(m.to_wire()) == m
    for bad in (["w", "bfloat16", [-1], 0, 0], ["w", "nope", [1], 0, 0], ["w"], "x"):
        with pytest.raises(ValueError):
            TensorMeta.from_wire(bad)


@pytest.mark.parametrize(
    "in_place, expected",
    [
        ([], []),
        # every bucket in a half: the usual "Ack(i-2) before bucket i"
        ([False] * 5, [(0, 0), (1, 0), (0, 1), (1, 2), (0, 3)]),
        # every bucket read in place (local mode): the engine stays at most two buckets behind
        ([True] * 4, [(None, 0), (None, 0), (None, 1), (None, 2)]),
        # a pull whose rank owns every other bucket: each read waits only for the half it reuses
        (
            [False, True, False, True, False, True, False],
            [(0, 0), (None, 0), (1, 0), (None, 2), (0, 1), (None, 4), (1, 3)],
        ),
        # own buckets first, then reads: the reads alternate halves from the start
        ([True, True, False, False, False], [(None, 0), (None, 0), (0, 0), (1, 0), (0, 3)]),
    ],
)
def test_double_buffer_schedule(in_place, expected):
    assert double_buffer_schedule(in_place) == expected


@pytest.mark.parametrize(
    "in_place, lag, expected",
    [
        # the engine reads every bucket itself, all begun at Hello: Buckets go out without waiting
        ([True] * 4, 4, [(None, 0)] * 4),
        ([True] * 5, 3, [(None, 0), (None, 0), (None, 0), (None, 1), (None, 2)]),
        # halves keep their own rule whatever the lag
        ([False, True, False, True], 4, [(0, 0), (None, 0), (1, 0), (None, 0)]),
    ],
)
def test_double_buffer_schedule_with_a_longer_lag_for_buckets_read_in_place(in_place, lag, expected):
    assert double_buffer_schedule(in_place, lag) == expected


def test_double_buffer_schedule_refuses_a_lag_below_one():
    with pytest.raises(ValueError, match="in_place_lag"):
        double_buffer_schedule([True], 0)
