"""EngineReads: an engine reading a pull itself, against a fake transfer engine that serves two owners'
memory (the real Mooncake path runs in tests/integration/dist/test_ce_broadcast.py)."""

import ctypes
import threading
import time

import pytest
import torch

from checkpoint_engine import protocol as P
from checkpoint_engine.transport.engine_reads import EngineReads
from checkpoint_engine.worker import StartedBucket

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

    def submit(self, peer, local_ptrs, remote_ptrs, lengths) -> "FakePending":
        self.batches.append((peer, len(lengths)))
        for lp, n in zip(local_ptrs, lengths, strict=True):
            assert any(p <= lp and lp + n <= p + size for p, size in self.registered.items()), "unregistered"
        return FakePending(self, peer, local_ptrs, remote_ptrs, lengths)


class FakePending:
    """Reads in flight: the bytes land at the first look (`poll`), as a transfer engine's would later."""

    def __init__(self, store, peer, local_ptrs, remote_ptrs, lengths):
        self.store, self.peer, self.ranges = store, peer, list(zip(local_ptrs, remote_ptrs, lengths, strict=True))
        self.landed = False

    def poll(self) -> bool:
        if not self.landed:
            src = self.store.chunks[self.peer]
            for lp, rp, n in self.ranges:
                ctypes.memmove(lp, src.data_ptr() + rp - BASE[self.peer], n)
            self.landed = True
        return True

    def wait(self) -> None:
        self.poll()


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
    views = StartedBucket([own, None, None], HELLO, TENSORS, reads).views()
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
    views = dict(reads.start(HANDLES, [TENSORS[0], TENSORS[3]]).finish())
    assert torch.equal(views["w"], torch.arange(4.0)) and torch.equal(views["v"], torch.arange(100.0, 108.0))
    with pytest.raises(P.ProtocolError, match="exceeds the owner's chunk"):
        reads.start(HANDLES, [P.WireTensor("x", "float32", (8,), 2, 8)])


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


def test_begin_reports_the_wait_for_the_transfer_engine_apart_from_the_connections():
    class SlowConnect(FakeStore):
        def connect(self, peer, ptr):
            if peer not in self.connected:  # as Mooncake's: once per peer
                time.sleep(0.03)
            super().connect(peer, ptr)

    def factory(cfg):
        time.sleep(0.1)  # the transfer engine still starting when the pull begins
        return SlowConnect(owners())

    reads = EngineReads(store_factory=factory)
    reads.prestart("10.0.0.2")
    reads.begin(HANDLES, "10.0.0.2")
    s = reads.stats
    assert s.te_start_s >= 0.05 and s.connect_s >= 0.03
    assert s.te_start_s + s.connect_s <= s.start_s  # the connections open once the transfer engine is up
    reads.end()
    reads.begin(HANDLES, "10.0.0.2")  # up and connected: nothing to wait for
    assert reads.stats.te_start_s < 0.03 and reads.stats.connect_s < 0.03


def test_owners_named_at_prestart_are_connected_before_the_pull_begins():
    class Opening(FakeStore):
        opened_on: list = []  # the thread that opened each connection

        def connect(self, peer, ptr):
            if peer not in self.connected:  # as Mooncake's: once per peer
                self.opened_on.append((peer, threading.current_thread().name))
            super().connect(peer, ptr)

        def connect_in_background(self, peers):
            for peer, ptr in peers:
                self.connect(peer, ptr)

    reads = EngineReads(store_factory=lambda cfg: Opening(owners()))
    reads.prestart("10.0.0.2", peers=list(BASE.items()))
    reads.begin(HANDLES, "10.0.0.2")
    assert Opening.opened_on == [(peer, "engine-p2p-start") for peer in BASE]  # none opened by the pull


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


REMOTE_ONLY = HANDLES[1:]  # no mapped chunk: the engine reads everything
PLAN = (
    P.WireTensor("w", "float32", (4,), 0, 0),
    P.WireTensor("b", "float32", (2, 2), 0, 16),
    P.WireTensor("v", "float32", (8,), 1, 0),
)


def test_hello_s_plan_places_every_tensor_once_while_the_owners_connect():
    store = FakeStore(owners())
    held = {"w": torch.zeros(4), "v": torch.zeros(8)}
    asked = []

    def destination(items):
        asked.append([n for n, _, _ in items])
        return [held.get(n) for n, _, _ in items]

    reads = EngineReads(destination, store_factory=lambda cfg: store)
    reads.begin(REMOTE_ONLY, "10.0.0.2", PLAN)
    assert asked == [["w", "b", "v"]] and reads.knows(PLAN)
    assert not reads.knows([P.WireTensor("x", "float32", (1,), 0, 0)])
    first = reads.start(REMOTE_ONLY, list(PLAN[:2]))  # two buckets in flight at once
    second = reads.start(REMOTE_ONLY, [PLAN[2], P.WireTensor("x", "float32", (2,), 0, 48)])
    assert asked == [["w", "b", "v"], ["x"]]  # only the name the plan lacked is asked for
    got1, got2 = dict(first.finish()), dict(second.finish())
    assert got1["w"] is held["w"] and got2["v"] is held["v"]
    assert torch.equal(got1["b"], torch.tensor([[4.0, 5.0], [6.0, 7.0]])) and torch.equal(
        got2["x"], torch.tensor([12.0, 13.0])
    )
    assert got1["b"].data_ptr() != got2["x"].data_ptr()  # two scratch buffers: both buckets' bytes kept
    s = reads.stats
    assert (s.placed_tensors, s.scratch_tensors) == (2, 2)


def test_end_lets_reads_in_flight_land_before_it_unregisters():
    store = FakeStore(owners())
    reads = EngineReads(store_factory=lambda cfg: store)
    reads.begin(REMOTE_ONLY, "10.0.0.2", PLAN)
    bucket = reads.start(REMOTE_ONLY, list(PLAN))
    assert bucket.pending
    reads.end()  # the update failed with these reads in flight
    assert not bucket.pending and store.registered == {}


class SlowFirstStore(FakeStore):
    """The first bucket's reads land only once a second bucket's reads were submitted (or fail after
    2 s): the engine must begin bucket 1 while bucket 0 is still being read."""

    def submit(self, peer, local_ptrs, remote_ptrs, lengths):
        pending = super().submit(peer, local_ptrs, remote_ptrs, lengths)
        first = len(self.batches) == 1
        deadline = time.monotonic() + 2.0
        poll = pending.poll

        def gated() -> bool:
            if first and len(self.batches) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("bucket 1's reads were not begun while bucket 0's were in flight")
                return False
            return poll()

        pending.poll = gated
        pending.wait = lambda: _spin(gated)
        return pending


def _spin(poll) -> None:
    while not poll():
        time.sleep(0.001)


def test_the_worker_begins_the_next_bucket_while_this_one_is_read():
    from checkpoint_engine.worker import update_weights_from_ipc

    zmq = pytest.importorskip("zmq")
    store = SlowFirstStore(owners())
    reads = EngineReads(lambda items: [None] * len(items), store_factory=lambda cfg: store)  # all to scratch
    hello = P.Hello(update_id="u", checkpoint="ck", num_buckets=2, buffers=REMOTE_ONLY, p2p_host="h", tensors=PLAN)
    ctx = zmq.Context()
    ps = ctx.socket(zmq.DEALER)  # the PS rank's end of the link
    port = ps.bind_to_random_port("tcp://127.0.0.1")
    got: list = []

    def ps_side():
        def recv():
            assert ps.poll(10_000, zmq.POLLIN), "no answer from the engine"
            return P.decode(ps.recv())

        if ps.poll(5000, zmq.POLLOUT):
            ps.send(P.encode(hello))
            got.append(recv())  # Ready
            ps.send(P.encode(P.Bucket(index=0, tensors=PLAN[:2])))  # buckets 0 and 1 go out at once,
            ps.send(P.encode(P.Bucket(index=1, tensors=PLAN[2:])))  # as the pipeline sends them
            got.extend([recv(), recv()])
            ps.send(P.encode(P.Done(update_id="u")))
            got.append(recv())

    import threading

    t = threading.Thread(target=ps_side, daemon=True)
    t.start()
    loaded: list[dict] = []
    try:
        update_weights_from_ipc(
            ctx,
            f"tcp://127.0.0.1:{port}",
            None,
            run=lambda views: loaded.append({n: v.clone() for n, v in views}),
            remote_reads=reads,
            timeout_s=10.0,
        )
        t.join(10)
    finally:
        ps.close(0)
        ctx.term()
    assert [type(m).__name__ for m in got] == ["Ready", "Ack", "Ack", "Ack"]
    assert [m.index for m in got[1:]] == [0, 1, P.DONE_ACK]
    assert [list(b) for b in loaded] == [["w", "b"], ["v"]]  # run in bucket order
    assert torch.equal(loaded[0]["w"], torch.arange(4.0)) and torch.equal(loaded[1]["v"], torch.arange(100.0, 108.0))
    assert torch.equal(loaded[0]["b"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))


def test_every_placed_tensor_is_read_at_hello_and_each_bucket_collects_its_own():
    store = FakeStore(owners())
    held = {"w": torch.zeros(4), "v": torch.zeros(8)}
    reads = EngineReads(lambda items: [held.get(n) for n, _, _ in items], store_factory=lambda cfg: store)
    reads.begin(REMOTE_ONLY, "10.0.0.2", PLAN)
    assert store.batches == [("10.0.0.1:1", 1), ("10.0.0.3:3", 1)]  # w and v, in the plan's order; b: scratch
    assert reads.stats.placed_tensors == 2 and reads.stats.placed_bytes == 48
    second = dict(reads.start(REMOTE_ONLY, [PLAN[2]]).finish())  # bucket 1's read was in flight already
    assert second["v"] is held["v"] and torch.equal(held["v"], torch.arange(100.0, 108.0))
    assert len(store.batches) == 2  # nothing more submitted for it
    first = dict(reads.start(REMOTE_ONLY, list(PLAN[:2])).finish())
    assert first["w"] is held["w"] and torch.equal(held["w"], torch.arange(4.0))
    assert torch.equal(first["b"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))  # b's read: submitted with its bucket
    assert store.batches[2:] == [("10.0.0.1:1", 1)]
    assert reads.stats.placed_tensors == 2 and reads.stats.scratch_tensors == 1  # counted once
    reads.end()
    assert store.registered == {}


def test_a_bucket_that_contradicts_hello_s_plan_is_refused_and_its_read_still_ends():
    store = FakeStore(owners())
    held = {"w": torch.zeros(4)}
    reads = EngineReads(lambda items: [held.get(n) for n, _, _ in items], store_factory=lambda cfg: store)
    reads.begin(REMOTE_ONLY, "10.0.0.2", PLAN)
    moved = P.WireTensor("w", "float32", (4,), 0, 32)  # another offset than Hello's
    with pytest.raises(P.ProtocolError, match="differs from Hello's plan"):
        reads.start(REMOTE_ONLY, [moved])
    reads.end()  # waits for w's read, submitted at Hello, before it unregisters
    assert torch.equal(held["w"], torch.arange(4.0)) and store.registered == {}


class FailingStore(FakeStore):
    """The first submitted read fails; the others land only when waited for."""

    def submit(self, peer, local_ptrs, remote_ptrs, lengths):
        pending = super().submit(peer, local_ptrs, remote_ptrs, lengths)
        if len(self.batches) == 1:

            def fail():
                raise RuntimeError("P2P read failed")

            pending.poll = pending.wait = fail
        return pending


def test_a_failed_read_is_raised_once_every_other_read_of_the_bucket_ended():
    store = FailingStore(owners())
    reads = EngineReads(store_factory=lambda cfg: store)
    reads.begin(REMOTE_ONLY, "10.0.0.2")
    bucket = reads.start(REMOTE_ONLY, list(PLAN))  # two owners: two reads in flight
    with pytest.raises(RuntimeError, match="P2P read failed"):
        bucket.finish()
    assert not bucket.pending
    views = bucket._out
    assert torch.equal(dict(views)["v"], torch.arange(100.0, 108.0))  # the other owner's read landed first
    reads.end()
    assert store.registered == {}


class RefusingScratchStore(FakeStore):
    """Registering more memory fails once the reads begun at Hello are in flight (the scratch)."""

    def __init__(self, chunks):
        super().__init__(chunks)
        self.refuse = False

    def register(self, ptr, nbytes):
        if self.refuse:
            raise RuntimeError("Mooncake register_memory failed")
        super().register(ptr, nbytes)


def test_a_bucket_that_fails_to_start_leaves_hello_s_reads_to_end():
    store = RefusingScratchStore(owners())
    held = {"w": torch.zeros(4)}
    reads = EngineReads(lambda items: [held.get(n) for n, _, _ in items], store_factory=lambda cfg: store)
    reads.begin(REMOTE_ONLY, "10.0.0.2", PLAN)
    store.refuse = True
    with pytest.raises(RuntimeError, match="register_memory failed"):
        reads.start(REMOTE_ONLY, list(PLAN[:2]))  # w read since Hello; b needs scratch, refused
    reads.end()  # still waits for w's read before it unregisters
    assert torch.equal(held["w"], torch.arange(4.0)) and store.registered == {}


def test_sharded_reads_take_only_this_ranks_slices_into_whole_shaped_scratch():
    """A TP rank's slices: rows 1 of b (2, 2) (its dim-0 shard), column 1 of a (4, 2) view of v (two
    4-byte ranges), nothing of w; the bytes read are counted by the reader, the rest never read."""
    from checkpoint_engine.sharding.slices import SourceSlice

    store = FakeStore(owners())
    v_as_matrix = P.WireTensor("m", "float32", (4, 2), 2, 0)  # owner 2's 8 floats as a 4x2 matrix
    asked = []

    def slices(items):
        asked.append([n for n, _, _ in items])
        return {"w": (), "b": (SourceSlice("b", 0, 1, 2),), "m": (SourceSlice("m", 1, 1, 2),)}

    reads = EngineReads(store_factory=lambda cfg: store)
    reads.set_slices(slices)
    reads.begin(HANDLES, "")
    got = dict(reads.start(HANDLES, [TENSORS[0], TENSORS[2], v_as_matrix]).finish())
    assert asked == [["w", "b", "m"]]
    assert got["b"].shape == (2, 2) and torch.equal(got["b"][1], torch.tensor([6.0, 7.0]))
    assert got["m"].shape == (4, 2) and torch.equal(got["m"][:, 1], torch.tensor([101.0, 103.0, 105.0, 107.0]))
    s = reads.stats
    assert (s.scratch_tensors, s.scratch_bytes, s.sliced_tensors, s.sliced_out_bytes) == (3, 8 + 16, 3, 16 + 8 + 16)
    assert sorted(store.batches) == [("10.0.0.1:1", 1), ("10.0.0.3:3", 4)]  # w: no read at all
    # asked once per name: the next update reuses the answers
    reads.start(HANDLES, [TENSORS[2]]).finish()
    assert asked == [["w", "b", "m"]]
    reads.set_slices(None)  # whole tensors again
    got = dict(reads.start(HANDLES, [TENSORS[2]]).finish())
    assert torch.equal(got["b"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    reads.end()


def test_a_slice_of_many_ranges_is_read_as_their_covering_range_past_the_limit():
    """Column 1 of m (4, 2): 4 ranges of 4 bytes; with at most 2 ranges per tensor it is read from
    its first to its last byte in one read (the rows' other column comes along)."""
    from checkpoint_engine.sharding.slices import SourceSlice

    store = FakeStore(owners())
    m = P.WireTensor("m", "float32", (4, 2), 2, 0)
    reads = EngineReads(store_factory=lambda cfg: store)
    reads.set_slices(lambda items: {"m": (SourceSlice("m", 1, 1, 2),)}, max_ranges_per_tensor=2)
    reads.begin(HANDLES, "")
    got = dict(reads.start(HANDLES, [m]).finish())
    assert torch.equal(got["m"][:, 1], torch.tensor([101.0, 103.0, 105.0, 107.0]))
    assert store.batches == [("10.0.0.3:3", 1)]  # one read, bytes 4..32
    s = reads.stats
    assert (s.scratch_bytes, s.sliced_tensors, s.sliced_out_bytes) == (28, 1, 4)
    reads.end()


def test_mapped_tensors_are_counted_whole_and_by_this_ranks_slices():
    """Tensors of a buffer the engine maps are read by the loaders in place: counted (no read
    submitted), whole and as the slices this rank takes; without slices the two counts agree."""
    from checkpoint_engine.sharding.slices import SourceSlice

    m = P.WireTensor("m", "float32", (4, 2), 0, 0)  # 32 bytes
    n = P.WireTensor("n", "bfloat16", (3,), 0, 32)  # 6 bytes, replicated: taken whole
    w = P.WireTensor("w", "float32", (2,), 0, 40)  # 8 bytes this rank takes none of
    asked = []

    def slices(items):
        asked.append([name for name, _, _ in items])
        return {"m": (SourceSlice("m", 0, 2, 4),), "w": ()}

    reads = EngineReads(store_factory=lambda cfg: FakeStore(owners()))
    reads.set_slices(slices)
    reads.note_mapped([m, n, w])
    reads.note_mapped([m])  # the next bucket or update: counted again, the slices asked once
    s = reads.stats
    assert asked == [["m", "n", "w"]]
    assert (s.mapped_tensors, s.mapped_bytes, s.mapped_slice_bytes) == (4, 32 + 6 + 8 + 32, 16 + 6 + 0 + 16)
    assert s.received_bytes() == 16 + 6 + 16 and s.report()["mapped_slice_bytes"] == 38
    reads.set_slices(None)
    reads.note_mapped([m])
    assert (reads.stats.mapped_bytes, reads.stats.mapped_slice_bytes) == (32 + 6 + 8 + 64, 38 + 32)
