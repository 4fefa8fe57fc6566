"""Table tests of an update's mode and bucket source (checkpoint_engine.jobs, checkpoint_engine.sources)."""

import socket
from types import SimpleNamespace

import pytest

from checkpoint_engine.buckets import Bucket, TensorMeta
from checkpoint_engine.jobs import GlobalMetas, choose_mode, engine_can_map_owners, make_source
from checkpoint_engine.protocol import BufferHandle
from checkpoint_engine.sources import (
    CollectiveSource,
    EngineBuffers,
    EngineP2PSource,
    LocalSource,
    P2PSource,
)
from checkpoint_engine.types import MODES

HERE = socket.gethostname()


def handle(fd: int, size: int = 4096) -> BufferHandle:
    return BufferHandle(kind="fd", pid=100, fd=fd, size_bytes=size)


def metas(*, owner_host: str = HERE, p2p: bool = True, owners_in_job: bool = True) -> GlobalMetas:
    """Two ranks on this host; rank 0 owns one tensor in one chunk."""
    return GlobalMetas(
        "ck",
        {0: (TensorMeta("w", "float32", (4,), 0, 0),)},
        ("dev0", "dev1"),
        (100, 101),
        (HERE, HERE),
        None,
        {0: [handle(7)]},
        {0: "10.0.0.1:1234"} if p2p else {},
        {0: [0x1000]},
        {0: 100 if owners_in_job else 999},
        {0: owner_host},
    )


@pytest.mark.parametrize(
    "requested,pull,cannot_map,have_p2p,p2p_addrs,expected",
    [
        # every engine can map the owners' chunks
        ("auto", False, [], False, True, "local"),
        ("local", False, [], False, True, "local"),
        ("collective", False, [], False, True, "collective"),
        ("local", True, [], True, True, "local"),
        ("collective", True, [], False, True, "local"),  # a pull without Mooncake reads in place
        ("collective", True, [], True, True, "p2p"),
        # some engine cannot map them (another host, or CUDA)
        ("auto", False, [1], False, True, "collective"),
        ("collective", False, [0, 1], True, True, "collective"),
        ("auto", True, [1], True, True, "p2p"),
        ("collective", True, [0, 1], True, True, "p2p"),
        ("local", False, [1], True, True, "mode='local' needs every owner"),
        ("local", True, [1], True, True, "mode='local' needs every owner"),
        ("auto", True, [1], False, True, "ParameterServerConfig(p2p=P2PConfig"),
        ("auto", True, [1], True, False, "have no P2P address"),
    ],
)
def test_choose_mode(requested, pull, cannot_map, have_p2p, p2p_addrs, expected):
    g = metas(p2p=p2p_addrs)
    if expected in MODES:
        assert choose_mode(g, requested, pull=pull, cannot_map=cannot_map, have_p2p=have_p2p, backend="gloo") == (
            expected
        )
    else:
        with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
            choose_mode(g, requested, pull=pull, cannot_map=cannot_map, have_p2p=have_p2p, backend="gloo")


def test_choose_mode_error_names_another_job():
    g = metas(owners_in_job=False)
    with pytest.raises(ValueError, match="the owners are in another job"):
        choose_mode(g, "auto", pull=True, cannot_map=[1], have_p2p=False, backend="gloo")


@pytest.mark.parametrize(
    "maps_chunks,owner_host,handles,expected",
    [
        (True, HERE, True, True),
        (False, HERE, True, False),  # CUDA: engines read device buffers only
        (True, "elsewhere", True, False),
        (True, HERE, False, False),  # owner without memfd handles
    ],
)
def test_engine_can_map_owners(maps_chunks, owner_host, handles, expected):
    g = metas(owner_host=owner_host)
    if not handles:
        g.chunk_handles.clear()
    assert engine_can_map_owners(g, SimpleNamespace(engines_map_host_chunks=maps_chunks)) is expected


def test_make_source_holds_only_its_modes_fields():
    g, ckpt, store = metas(), object(), object()
    src = make_source("collective", g, ckpt, None)
    assert isinstance(src, CollectiveSource) and src.ckpt is ckpt and src.mode == "collective"
    src = make_source("local", g, ckpt, store)
    assert isinstance(src, LocalSource) and src.chunk_handles == {0: [handle(7)]} and src.mode == "local"
    src = make_source("p2p", g, None, store)
    assert isinstance(src, P2PSource) and src.mode == "p2p"
    assert (src.ckpt, src.store, src.owner_addrs, src.chunk_ptrs) == (None, store, g.p2p_addrs, g.chunk_ptrs)
    with pytest.raises(ValueError, match="needs a Mooncake transfer engine"):
        make_source("p2p", g, None, None)
    with_host = SimpleNamespace(cfg=SimpleNamespace(host="10.0.0.2"))
    src = make_source("p2p_engine", g, None, with_host)
    assert isinstance(src, EngineP2PSource) and src.mode == "p2p_engine" and src.p2p_host == "10.0.0.2"
    assert (src.owner_addrs, src.chunk_ptrs, src.chunk_handles) == (g.p2p_addrs, g.chunk_ptrs, g.chunk_handles)
    with pytest.raises(ValueError, match="needs a Mooncake transfer engine"):
        make_source("p2p_engine", g, None, None)
    with pytest.raises(ValueError, match="unknown update mode"):
        make_source("broadcast", g, None, None)
    assert {make_source(m, g, ckpt, with_host).mode for m in MODES} == set(MODES)


def test_choose_mode_engine_reader():
    g = metas()
    pull = dict(pull=True, cannot_map=[1], have_p2p=True)
    assert choose_mode(g, "auto", **pull, backend="gloo", p2p_reader="engine") == "p2p_engine"
    assert choose_mode(g, "auto", **pull, backend="gloo", p2p_reader="rank") == "p2p"
    # not a Mooncake pull: the reader does not matter
    assert choose_mode(g, "auto", pull=False, cannot_map=[], have_p2p=True, backend="gloo", p2p_reader="engine") == (
        "local"
    )
    with pytest.raises(ValueError, match="reads into host memory"):
        choose_mode(g, "auto", **pull, backend="nccl", p2p_reader="engine")


def test_engine_p2p_source_sends_the_owners_chunks_as_remote_buffers():
    """Rank 1 pulls; owners 0 (two chunks) and 2 (one) are read by the engine, rank 1's own chunk is mapped."""
    own = SimpleNamespace(chunks=[SimpleNamespace(handle=handle(5))])
    src = EngineP2PSource(
        own,
        "10.0.0.2",
        {0: "10.0.0.1:1", 2: "10.0.0.3:3"},
        {0: [0x1000, 0x9000], 1: [0x5000], 2: [0x7000]},
        {0: [handle(7, 100), handle(8, 200)], 1: [handle(5)], 2: [handle(9, 300)]},
    )
    job = SimpleNamespace(rank=1, transport=SimpleNamespace(engines_map_host_chunks=True))
    buffers = src.open(job)
    assert buffers.handles[0] == handle(5)
    remote = [(h.kind, h.peer, h.ptr, h.size_bytes) for h in buffers.handles[1:]]
    assert remote == [
        ("remote", "10.0.0.1:1", 0x1000, 100),
        ("remote", "10.0.0.1:1", 0x9000, 200),
        ("remote", "10.0.0.3:3", 0x7000, 300),
    ]
    assert buffers.base == {1: 0, 0: 1, 2: 3} and not buffers.double_buffer and buffers.p2p_host == "10.0.0.2"
    assert buffers.stable_buffers() == (0,)  # remote chunks are never mapped
    # owner 0's chunk 1 at byte 16: buffer 2 of the Hello, offset 16
    bucket = Bucket(0, 0, 1, 16, 8, (TensorMeta("w", "uint8", (8,), 16, 1),))
    assert [(w.buffer, w.offset_bytes) for w in buffers.wire(bucket, 0, None)] == [(2, 16)]
    with pytest.raises(ValueError, match="CUDA engines pull through their rank"):
        src.open(SimpleNamespace(rank=1, transport=SimpleNamespace(engines_map_host_chunks=False)))
    src.chunk_handles = {0: [handle(7, 100)], 1: [handle(5)], 2: [handle(9, 300)]}
    with pytest.raises(ValueError, match="owner rank 0: its chunk sizes"):
        src.open(job)


def test_local_source_maps_every_owners_chunks_in_rank_order():
    src = LocalSource({2: [handle(9)], 0: [handle(7), handle(8)]})
    buffers = src.open(None)  # the local source needs nothing from the job
    assert buffers.handles == (handle(7), handle(8), handle(9))
    assert buffers.base == {0: 0, 2: 2}
    assert buffers.stable_buffers() == (0, 1, 2)  # no double buffer: every buffer is a registered chunk


@pytest.mark.parametrize(
    "base,double_buffer,half,expected_bufs,expected_offs",
    [
        ({}, True, 0, [0, 0], [0, 64]),  # through the double buffer, half 0
        ({}, True, 1024, [0, 0], [1024, 1088]),  # half 1
        ({1: 1}, True, 1024, [2, 2], [448, 512]),  # our own chunks after the double buffer: in place
        ({1: 0}, False, 0, [1, 1], [448, 512]),  # local mode: owner 1's chunks from index 0
    ],
)
def test_engine_buffers_wire(base, double_buffer, half, expected_bufs, expected_offs):
    # a bucket of owner 1: bytes [448, 520) of its chunk 1, tensors at 448 and 512
    tensors = (TensorMeta("a", "uint8", (8,), 448, 1), TensorMeta("b", "uint8", (8,), 512, 1))
    bucket = Bucket(0, 1, 1, 448, 72, tensors)
    buffers = EngineBuffers(tuple(handle(i) for i in range(3)), base, double_buffer)
    wire = buffers.wire(bucket, half, {"a": 1, "b": 2})
    assert [w.buffer for w in wire] == expected_bufs
    assert [w.offset_bytes for w in wire] == expected_offs
    assert [w.checksum for w in wire] == [1, 2]
    assert buffers.stable_buffers() == ((1, 2) if double_buffer else (0, 1, 2))
    assert all(w.checksum is None for w in buffers.wire(bucket, half, None))


@pytest.mark.parametrize(
    "owners_in_job,pull,cannot_map,have_p2p,p2p_addrs,expected",
    [
        (False, True, [0, 1], True, True, "relay"),  # the trainer's memory on another host: read once, relayed
        (False, True, [], True, True, "local"),  # every engine maps the owners' chunks: nothing to relay
        # a version the ranks own (kept after its relay, for heals): as under "auto"
        (True, True, [1], True, True, "p2p"),  # a heal's pull from the other ranks
        (True, False, [1], True, True, "collective"),  # every engine: broadcast from the owner ranks
        (False, True, [0, 1], False, True, "reads the owners over Mooncake"),
        (False, True, [0, 1], True, False, "have no P2P address"),
    ],
)
def test_choose_mode_relay(owners_in_job, pull, cannot_map, have_p2p, p2p_addrs, expected):
    g = metas(owners_in_job=owners_in_job, p2p=p2p_addrs)
    if expected in MODES:
        assert choose_mode(g, "relay", pull=pull, cannot_map=cannot_map, have_p2p=have_p2p, backend="gloo") == expected
    else:
        with pytest.raises(ValueError, match=expected):
            choose_mode(g, "relay", pull=pull, cannot_map=cannot_map, have_p2p=have_p2p, backend="gloo")


def test_metas_of_a_world_of_another_size_describe_their_owners():
    g = metas(owners_in_job=False)
    assert g.owners_described and not g.owners_in_job
    legacy = GlobalMetas("ck", {3: (TensorMeta("w", "float32", (4,), 0, 0),)}, ("d",), (1,), ("h",), None, {})
    assert not legacy.owners_described  # rank 3 of a one-rank world, no pid or host of its own
