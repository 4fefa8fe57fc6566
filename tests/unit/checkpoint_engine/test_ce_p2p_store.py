"""P2PStore (checkpoint_engine/transport/mooncake.py) on two Mooncake transfer engines in one process,
over TCP loopback: one read, a batch read, and the errors a caller sees (unreachable peer, an address the owner did not
register, a read past its deadline)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("mooncake.engine")

from checkpoint_engine.transport.mooncake import P2PConfig, P2PStore


@pytest.fixture(scope="module")
def stores():
    owner, reader = P2PStore(P2PConfig()), P2PStore(P2PConfig())
    yield owner, reader
    owner.close()
    reader.close()


def test_read_and_batch_read_copy_the_owners_bytes(stores):
    owner, reader = stores
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    owner.register(src.data_ptr(), src.numel())
    reader.register(dst.data_ptr(), dst.numel())
    try:
        reader.read(owner.addr, dst.data_ptr() + 100, src.data_ptr() + 100, 4096)
        assert torch.equal(dst[100:4196], src[100:4196]) and not dst[:100].any()
        dst.zero_()
        # three ranges, gathered out of order into one contiguous buffer
        ranges = [(5000, 65000), (0, 5000), (70000, (1 << 20) - 70000)]
        locals_, offset = [], 0
        for _, n in ranges:
            locals_.append(dst.data_ptr() + offset)
            offset += n
        reader.read_batch(owner.addr, locals_, [src.data_ptr() + s for s, _ in ranges], [n for _, n in ranges])
        expected = torch.cat([src[s : s + n] for s, n in ranges])
        assert torch.equal(dst, expected)
        reader.read_batch(owner.addr, [], [], [])  # nothing to read: no call
    finally:
        owner.unregister(src.data_ptr())
        reader.unregister(dst.data_ptr())


def test_batch_read_with_mismatched_lists_raises(stores):
    _, reader = stores
    with pytest.raises(ValueError, match="1 local, 2 remote, 1 lengths"):
        reader.read_batch("127.0.0.1:1", [1], [1, 2], [8])


def test_reads_that_fail_name_the_peer_and_why(stores):
    owner, reader = stores
    src = torch.ones(4096, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    owner.register(src.data_ptr(), src.numel())
    reader.register(dst.data_ptr(), dst.numel())
    try:
        with pytest.raises(RuntimeError, match=r"from 127\.0\.0\.1:1 failed \(not submitted\)"):
            reader.read("127.0.0.1:1", dst.data_ptr(), src.data_ptr(), 64)  # nobody listens there
        with pytest.raises(RuntimeError, match=rf"4096 bytes from {owner.addr} failed \(status -1\)"):
            reader.read(owner.addr, dst.data_ptr(), 4096, 4096)  # not an address the owner registered
        reader.read(owner.addr, dst.data_ptr(), src.data_ptr(), 4096)  # the store still reads after that
        assert bool((dst == 1).all())
    finally:
        owner.unregister(src.data_ptr())
        reader.unregister(dst.data_ptr())


def test_a_read_still_in_flight_at_its_deadline_raises_timeout(stores):
    owner, _ = stores
    reader = P2PStore(P2PConfig(read_timeout_s=0.2))

    class NeverDone:  # Mooncake's status as if the transfer never finished
        def __init__(self, engine):
            self._engine = engine

        def batch_transfer_async_read(self, *args):
            return self._engine.batch_transfer_async_read(*args)

        def transfer_check_status(self, batch):
            return 0

    src = torch.ones(64, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    owner.register(src.data_ptr(), src.numel())
    reader.register(dst.data_ptr(), dst.numel())
    real, reader._engine = reader._engine, NeverDone(reader._engine)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"64 bytes from {owner.addr} did not finish within 0.2 s"):
            reader.read(owner.addr, dst.data_ptr(), src.data_ptr(), 64)
        assert time.monotonic() - t0 < 5
    finally:
        reader._engine = real
        reader.close()
        owner.unregister(src.data_ptr())


def test_connect_reads_once_per_peer(stores, monkeypatch):
    owner, reader = stores
    src = torch.ones(64, dtype=torch.uint8)
    owner.register(src.data_ptr(), src.numel())
    reads = []
    real_read = reader.read
    monkeypatch.setattr(reader, "read", lambda *a: (reads.append(a[0]), real_read(*a)))
    try:
        reader.connect(owner.addr, src.data_ptr())
        reader.connect(owner.addr, src.data_ptr())
        assert reads == [owner.addr]
    finally:
        owner.unregister(src.data_ptr())


def test_p2p_source_connects_to_the_owners_it_reads_while_the_engine_connects():
    """`open` starts one connect per owner read over Mooncake (not our own shard, read in place);
    the first `fill` waits for them, then reads the bucket into the half."""
    import threading
    from types import SimpleNamespace

    from checkpoint_engine.buckets import Bucket
    from checkpoint_engine.protocol import BufferHandle
    from checkpoint_engine.sources import P2PSource

    gate, calls = threading.Event(), []

    class Store:
        cfg = SimpleNamespace(read_timeout_s=30.0)

        def register(self, ptr, n):
            calls.append(("register", n))

        def connect(self, addr, ptr):
            gate.wait(10)
            calls.append(("connect", addr, ptr))

        def read(self, addr, local, remote, n):
            calls.append(("read", addr, remote, n))

    shared = torch.zeros(2 * 512, dtype=torch.uint8)
    handle = BufferHandle(kind="fd", pid=1, fd=3, size_bytes=shared.numel())
    transport = SimpleNamespace(shared_buffer=lambda n: (shared, handle), engines_map_host_chunks=True)
    job = SimpleNamespace(rank=1, half_stride=512, transport=transport)
    ckpt = SimpleNamespace(chunks=[SimpleNamespace(handle=handle)])
    src = P2PSource(ckpt, Store(), {0: "peer0:1", 1: "me:2", 2: "peer2:3"}, {0: [1000], 1: [2000], 2: [3000]})
    buffers = src.open(job)
    assert buffers.reads_in_place(1) and not buffers.reads_in_place(0)
    assert sorted(t.name for t in src._connecting) == ["p2p-connect", "p2p-connect"]
    run = SimpleNamespace(job=job, metrics=SimpleNamespace(broadcast_s=0.0, copy_in_s=0.0))
    src.fill(run, Bucket(0, 1, 0, 0, 100, ()), 0)  # our own: nothing, no wait
    assert [c[0] for c in calls] == ["register"]
    gate.set()
    src.fill(run, Bucket(1, 0, 0, 64, 100, ()), 512)
    assert sorted(c for c in calls if c[0] == "connect") == [("connect", "peer0:1", 1000), ("connect", "peer2:3", 3000)]
    assert calls[-1] == ("read", "peer0:1", 1064, 100) and not src._connecting


def test_connect_in_background_opens_each_peer_once_and_close_waits_for_it():
    owner, reader = P2PStore(P2PConfig()), P2PStore(P2PConfig())
    src = torch.ones(64, dtype=torch.uint8)
    owner.register(src.data_ptr(), src.numel())
    try:
        reader.connect_in_background([(owner.addr, src.data_ptr())])
        (t,) = reader._preconnecting
        t.join(60)
        assert not t.is_alive() and reader._connected == {owner.addr}
        reader.connect_in_background([(owner.addr, src.data_ptr())])  # already open: no thread
        assert reader._preconnecting == [t]
    finally:
        reader.close()
        owner.close()
    reader.connect_in_background([("127.0.0.1:1", 8)])  # closed: nothing starts
    assert reader._preconnecting == [t]


def test_the_transfer_engines_threads_run_on_the_cpus_asked_for():
    """A store made on a thread bound to one core (as vLLM binds an engine's main thread) with
    `cpus` set: the threads Mooncake starts get that set, not the core."""
    import os
    import threading

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs")
    before = {int(t) for t in os.listdir("/proc/self/task")}
    box = []

    def make() -> None:
        os.sched_setaffinity(0, {mine[-1]})  # this thread only: the "engine's main thread"
        before.add(threading.get_native_id())  # its own task may outlive join() for a moment
        box.append(P2PStore(P2PConfig(cpus=(mine[0],))))

    t = threading.Thread(target=make)
    t.start()
    t.join(60)
    store = box[0]
    try:
        new = [int(x) for x in os.listdir("/proc/self/task") if int(x) not in before]
        placed = {tid: os.sched_getaffinity(tid) for tid in new}
        assert placed and all(s == {mine[0]} for s in placed.values()), placed
    finally:
        store.close()
