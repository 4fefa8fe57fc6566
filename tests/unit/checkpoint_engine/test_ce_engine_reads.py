"""EngineReads: an engine reading a pull itself, against a fake transfer engine that serves two owners'
memory (the real Mooncake path runs in tests/integration/dist/test_ce_broadcast.py)."""

import ctypes

import pytest
import torch

from checkpoint_engine import protocol as P
from checkpoint_engine.engine_reads import EngineReads
from checkpoint_engine.worker import bucket_views

BASE = {"10.0.0.1:1": 0x10000, "10.0.0.3:3": 0x90000}  # where each owner's chunk "is" on its host


class FakeStore:
    """Reads from each peer's chunk (a local tensor standing in for remote memory); checks that every
    local address lies inside registered memory, as Mooncake requires."""

    def __init__(self, chunks: dict[str, torch.Tensor]):
        self.chunks = chunks
        self.registered: dict[int, int] = {}
        self.connected: list[str] = []
        self.batches: list[tuple[str, int]] = []

    def connect(self, peer: str, ptr: int) -> None:
        assert ptr == BASE[peer]
        self.connected.append(peer)

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered.setdefault(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self.registered.pop(ptr, None)

    def unregister_all(self) -> None:
        self.registered.clear()

    def read_batch(self, peer, local_ptrs, remote_ptrs, lengths) -> None:
        self.batches.append((peer, len(lengths)))
        src = self.chunks[peer]
        for lp, rp, n in zip(local_ptrs, remote_ptrs, lengths, strict=True):
            assert any(p <= lp and lp + n <= p + size for p, size in self.registered.items()), "unregistered"
            off = rp - BASE[peer]
            ctypes.memmove(lp, src.data_ptr() + off, n)


def owners():
    a = torch.arange(16, dtype=torch.float32)  # owner 0: w (4,) at 0, b (2, 2) at 16
    c = torch.arange(100, 108, dtype=torch.float32)  # owner 2: v (8,) at 0
    return {"10.0.0.1:1": a.view(torch.uint8), "10.0.0.3:3": c.view(torch.uint8)}


HANDLES = (
    P.BufferHandle(kind="fd", size_bytes=64, pid=1, fd=3),  # the rank's own chunk, mapped
    P.BufferHandle(kind="remote", size_bytes=64, peer="10.0.0.1:1", ptr=BASE["10.0.0.1:1"]),
    P.BufferHandle(kind="remote", size_bytes=32, peer="10.0.0.3:3", ptr=BASE["10.0.0.3:3"]),
)
HELLO = P.Hello(update_id="u", checkpoint="ck", num_buckets=1, buffers=HANDLES, p2p_host="10.0.0.2")
TENSORS = (
    P.WireTensor("w", "float32", (4,), 1, 0),
    P.WireTensor("own", "float32", (2,), 0, 8),
    P.WireTensor("b", "float32", (2, 2), 1, 16),
    P.WireTensor("v", "float32", (8,), 2, 0),
)


def test_reads_land_in_place_or_in_scratch_in_bucket_order():
    store = FakeStore(owners())
    held = {"w": torch.zeros(4), "v": torch.zeros(8), "b": torch.zeros(2, 2, dtype=torch.float64)}  # b: wrong dtype
    asked = []

    def destination(items):
        asked.append([n for n, _, _ in items])
        return [held.get(n) for n, _, _ in items]

    reads = EngineReads(destination, store_factory=lambda cfg: store)
    reads.begin(HANDLES, "10.0.0.2")
    assert sorted(store.connected) == sorted(BASE)
    own = torch.tensor([0, 0, 7.0, 8.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).view(torch.uint8)
    views = bucket_views([own, None, None], HELLO, TENSORS, reads)
    assert asked == [["w", "b", "v"]]  # once per bucket, the remote tensors only
    assert [n for n, _ in views] == ["w", "own", "b", "v"]
    got = dict(views)
    assert got["w"] is held["w"] and got["v"] is held["v"]  # read into the tensors the engine holds
    assert torch.equal(held["w"], torch.arange(4.0)) and torch.equal(held["v"], torch.arange(100.0, 108.0))
    assert torch.equal(got["b"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))  # the wrong dtype went to scratch
    assert got["b"].dtype == torch.float32 and got["b"] is not held["b"]
    assert torch.equal(got["own"], torch.tensor([7.0, 8.0]))  # mapped, not read
    assert sorted(store.batches) == [("10.0.0.1:1", 2), ("10.0.0.3:3", 1)]  # one batch per owner
    s = reads.stats
    assert (s.placed_tensors, s.placed_bytes, s.scratch_tensors, s.scratch_bytes) == (2, 48, 1, 16)
    reads.end()
    assert store.registered == {}  # nothing stays registered: the engine may free or repack its tensors


def test_reads_without_a_destination_all_go_to_scratch_and_past_the_chunk_is_refused():
    store = FakeStore(owners())
    reads = EngineReads(store_factory=lambda cfg: store)
    reads.begin(HANDLES, "")
    views = dict(reads.read(HANDLES, [TENSORS[0], TENSORS[3]]))
    assert torch.equal(views["w"], torch.arange(4.0)) and torch.equal(views["v"], torch.arange(100.0, 108.0))
    with pytest.raises(P.ProtocolError, match="exceeds the owner's chunk"):
        reads.read(HANDLES, [P.WireTensor("x", "float32", (8,), 2, 8)])


def test_a_transfer_engine_started_ahead_is_the_one_the_pull_uses():
    made = []

    def factory(cfg):
        made.append((cfg.host, cfg.cpus))
        return FakeStore(owners())

    reads = EngineReads(store_factory=factory)
    reads.prestart("10.0.0.2", (0, 1))
    reads.prestart("10.0.0.2", (0, 1))  # once
    reads.begin(HANDLES, "10.0.0.2")
    reads.end()
    reads.begin(HANDLES, "10.0.0.2")  # kept across updates
    assert made == [("10.0.0.2", (0, 1))]  # its threads placed on the CPUs asked for


def test_an_engine_without_a_transfer_engine_names_why():
    from checkpoint_engine.worker import UpdateAborted, update_weights_from_ipc

    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    ps = ctx.socket(zmq.DEALER)  # the PS rank's end of the link
    port = ps.bind_to_random_port("tcp://127.0.0.1")
    try:
        import threading

        def hello():  # a DEALER sends only once a peer is connected
            if ps.poll(5000, zmq.POLLOUT):
                ps.send(P.encode(HELLO))

        t = threading.Thread(target=hello, daemon=True)
        t.start()
        with pytest.raises(UpdateAborted, match="read the weights itself"):
            update_weights_from_ipc(ctx, f"tcp://127.0.0.1:{port}", None, run=lambda v: None, timeout_s=5.0)
        t.join(5)
    finally:
        ps.close(0)
        ctx.term()
