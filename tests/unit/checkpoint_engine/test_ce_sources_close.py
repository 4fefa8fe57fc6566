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
import time
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
    assert len(sources._PARKED) == 1 and sources._PARKED[0].staging is staging
    release.set()
    # once its reader is done and its grace is over, the next update's close frees it
    sources._PARKED[0].threads[0].join(5)
    assert sources._sweep_parked(now_s=sources._PARKED[0].until_s - 1) == 0  # within its grace: kept
    assert sources._sweep_parked(now_s=sources._PARKED[0].until_s) == 1
    assert store.registered == {} and not sources._PARKED


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
    parked = sources._PARKED[0]
    assert parked.until_s >= time.monotonic() + 9  # two read timeouts of 5 s, less what passed

    # a later update's close sweeps it once its grace is over (the clock moved on here)
    parked.until_s = time.monotonic() - 1
    src = RelaySource(store=store, owner_addrs={1: "peer"}, chunk_ptrs={1: [1 << 20]})
    store.read_fn = lambda *a: None
    src.open(job([bucket(0)]))
    src._ahead[0][0].join(5)
    src.close()
    assert store.registered == {} and not sources._PARKED


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


def test_a_relays_kept_share_is_copied_once_into_the_chunk_it_registers():
    """keep_relayed: each kept bucket's tensors are written, as the bucket passes, into one shared
    buffer that `register_checkpoint` then adopts as the checkpoint's chunk (no second copy); the
    buffer is freed when that checkpoint is unregistered, and at once when nothing adopted it."""
    import ctypes

    import torch

    from checkpoint_engine.buckets import align_up, layout_tensors, plan_buckets
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.host_memory import find_shared_buffer
    from checkpoint_engine.ps import ParameterServer

    gen = torch.Generator().manual_seed(0)
    owned = {f"w{i}": torch.randn(33 + i, 7, generator=gen) for i in range(6)}
    owned["step"] = torch.tensor(3, dtype=torch.int64)
    layout = layout_tensors(
        [(n, "float32" if t.is_floating_point() else "int64", tuple(t.shape)) for n, t in owned.items()]
    )
    owner = torch.zeros(layout.chunk_sizes_bytes[0], dtype=torch.uint8)  # the trainer's memory
    for m in layout.metas:
        owner[m.offset_bytes : m.offset_bytes + m.nbytes].copy_(owned[m.name].reshape(-1).view(torch.uint8))
    buckets = plan_buckets({1: layout.metas}, 2048)
    assert len(buckets) >= 3
    store = FakeStore(read=lambda addr, local, remote, n: ctypes.memmove(local, remote, n))
    cfg = UpdateConfig(engine_timeout_s=5.0)
    stride = align_up(max(b.size_bytes for b in buckets), 256)
    j = SimpleNamespace(
        half_stride=stride, transport=CpuTransport(), rank=0, world_size=1, members=[0], buckets=buckets, cfg=cfg
    )
    run = SimpleNamespace(job=j, metrics=SimpleNamespace(broadcast_s=0.0, copy_in_s=0.0), link=None)
    src = RelaySource(store=store, owner_addrs={1: "trainer"}, chunk_ptrs={1: [owner.data_ptr()]})
    src.open(j)
    assert src.keeps  # one rank, every rank in the relay: it keeps every bucket
    for k, b in enumerate(buckets):
        src.fill(run, b, (k % 2) * stride)
    src.close()
    kept = src.kept_tensors()
    assert kept.keys() == owned.keys()
    assert all(torch.equal(kept[n], owned[n]) for n in owned)
    buffer = find_shared_buffer(kept, 256)
    assert buffer is not None and buffer is src._kept_buffer

    ps = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu"))
    try:
        ps.register_checkpoint("v1", named_tensors=kept)
        assert ps._checkpoints["v1"].adopted and buffer.adopted_by == "v1"  # its chunk is the buffer: no copy
        src.discard_kept()
        assert buffer._segment is not None  # the checkpoint still holds it
        ps.unregister_checkpoint("v1")
        assert buffer._segment is None  # freed with the checkpoint
    finally:
        ps.close()

    src.open(j)  # an update that fails before it is kept: the buffer goes at once
    kept_buffer = src._kept_buffer
    src.discard_kept()
    assert kept_buffer._segment is None and src.kept_tensors() == {}
