"""A pull's staging memory leaves the transfer engine with its update (sources.P2PSource, RelaySource).

Each update allocates its staging anew. Left registered after the memory was freed, a region makes a
later registration that overlaps it fail ("Transfer Engine does not support overlapped memory
region"): the relay's root failed so at its third update in benchmarks/bench_hosts_rl.py. So `close()`
(the pipeline's, after every update) unregisters what `open()` registered, and keeps it registered
and alive only while a read may still write into it (a read that failed past its deadline, or a
read-ahead thread still running).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from checkpoint_engine import sources
from checkpoint_engine.buckets import Bucket
from checkpoint_engine.sources import P2PSource, RelaySource
from checkpoint_engine.transport.devices import CpuTransport

HALF = 4096


class FakeStore:
    """What a source uses of a P2PStore: registrations by pointer, reads that succeed, fail or block."""

    def __init__(self, read=None):
        self.cfg = SimpleNamespace(read_timeout_s=5.0)
        self.registered: dict[int, int] = {}
        self.read_fn = read or (lambda *a: None)

    def register(self, ptr: int, nbytes: int) -> None:
        assert ptr not in self.registered
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]

    def read(self, addr, local_ptr, remote_ptr, nbytes) -> None:
        self.read_fn(addr, local_ptr, remote_ptr, nbytes)

    def connect(self, addr, ptr) -> None:
        pass


def job(buckets=()):
    return SimpleNamespace(half_stride=HALF, transport=CpuTransport(), rank=0, members=[0], buckets=list(buckets))


def bucket(i: int) -> Bucket:
    return Bucket(index=i, owner_rank=1, chunk=0, start_bytes=i * 64, size_bytes=64, tensors=())


@pytest.fixture(autouse=True)
def no_parked():
    sources._PARKED.clear()
    yield
    sources._PARKED.clear()


def test_the_relays_staging_is_unregistered_after_each_update():
    store = FakeStore()
    for _ in range(3):  # each update registers its own staging and gives it back
        src = RelaySource(store=store, owner_addrs={1: "peer"}, chunk_ptrs={1: [1 << 20]})
        src.open(job([bucket(0), bucket(1)]))
        assert len(store.registered) == 1 and list(store.registered.values()) == [2 * HALF]
        src._ahead[0][0].join(5)  # the read-ahead of bucket 0 (started by open) is done
        src.close()
        assert store.registered == {} and not sources._PARKED


def test_a_relay_read_still_in_flight_keeps_its_staging_registered_and_alive():
    release = threading.Event()
    store = FakeStore(read=lambda *a: release.wait(10))
    src = RelaySource(store=store, owner_addrs={1: "peer"}, chunk_ptrs={1: [1 << 20]})
    src.open(job([bucket(0)]))
    staging = src._staging
    src.close()  # the update failed with bucket 0's read still running
    assert list(store.registered) == [staging.data_ptr()]
    assert len(sources._PARKED) == 1 and sources._PARKED[0] is staging
    release.set()


def test_a_failed_relay_read_parks_its_staging():
    def fail(*a):
        raise TimeoutError("read past its deadline")

    store = FakeStore(read=fail)
    src = RelaySource(store=store, owner_addrs={1: "peer"}, chunk_ptrs={1: [1 << 20]})
    src.open(job([bucket(0)]))
    src._ahead[0][0].join(5)
    assert src._ahead[0][1] and "read past its deadline" in src._ahead[0][1][0]
    src.close()
    assert len(store.registered) == 1 and len(sources._PARKED) == 1


def test_a_p2p_pull_unregisters_its_staging_unless_a_read_failed():
    store = FakeStore()
    src = P2PSource(ckpt=None, store=store, owner_addrs={1: "peer"}, chunk_ptrs={1: [1 << 20]})
    src.open(job())
    assert len(store.registered) == 1
    src.close()
    assert store.registered == {}

    def fail(*a):
        raise TimeoutError("read past its deadline")

    store = FakeStore(read=fail)
    src = P2PSource(ckpt=None, store=store, owner_addrs={1: "peer"}, chunk_ptrs={1: [1 << 20]})
    j = job()
    src.open(j)
    run = SimpleNamespace(job=j, metrics=SimpleNamespace(broadcast_s=0.0, copy_in_s=0.0))
    with pytest.raises(TimeoutError):
        src.fill(run, bucket(0), 0)
    src.close()
    assert len(store.registered) == 1 and len(sources._PARKED) == 1
