"""Engine side of a pull that the engine reads itself: Mooncake reads from the owners straight into
the engine's parameters.

A P2P pull through the PS rank moves every byte twice on the receiving host: the rank's transfer
engine reads the owner's chunk into the shared double buffer, then the engine's loaders copy it into
the parameters. Here the engine runs its own transfer engine and the PS rank only sends the plan
(`protocol.BufferHandle(kind="remote")`: each owner chunk's peer and address; Hello lists every
tensor). At `begin` the engine asks `destination` where each tensor lives in its memory, while the
connections to the owners open (a heal's load step asked already, while vLLM started, about the
tensors the daemon left beside its rendezvous, so the answers are at hand); a contiguous tensor of
that dtype and shape (a parameter, or a slice of a fused one) is read into in place, and the
loaders then find the bytes already there. Tensors without a destination land in a registered
scratch buffer and go through the loaders as usual.

    Hello(remote buffers, p2p_host, tensors) ─▶ start a transfer engine on p2p_host (first update
                                                only), connect to every owner, place every tensor,
                                                then submit the reads of every placed tensor of the
                                                whole update at once, in the plan's order
    Bucket ─▶ its placed tensors' reads are already in flight; the rest land in scratch: registered,
          every owner's reads submitted at once
          ─▶ (name, tensor)s once they have landed (`BucketReads`; the worker starts the next
             bucket's scratch reads while it waits for these)
    end of the update ─▶ wait for reads still in flight, unregister everything (the parameters may
                         be repacked or freed next)

Reading every placed tensor at Hello keeps the transfer engine busy across bucket boundaries: on
few cores the bucket-by-bucket reads left it idle while each Ack and the next Bucket went round.
It is safe because a destination is memory that only this tensor's bytes go to (the slot probe
refuses any other op that touches it), so when its bytes land relative to other tensors' loads does
not matter; an update that fails midway leaves the engine incomplete, as it would anyway.

Sharded reads (`set_slices`, an engine rank under tensor or expert parallelism): a tensor read into
scratch is read only in the byte ranges of the slices this rank's loaders consume
(`vllm_ext.shard_probe.ShardProbe`, `checkpoint_engine.sharding`); the scratch keeps the whole
tensor's shape, so the loaders narrow it as usual and find their rows there; the rest of it is never
read, and its pages never touched. A tensor the rank consumes none of is not read at all. The stats
count the bytes read (`scratch_bytes`) and those left out (`sliced_out_bytes`).

CPU memory only: a CUDA destination would need GPUDirect registration (RDMA), not written yet.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from checkpoint_engine import protocol as P
from checkpoint_engine.sharding.shard_plan import byte_ranges
from checkpoint_engine.sharding.slices import SourceSlice
from checkpoint_engine.transport.mooncake import P2PConfig, P2PStore, PendingReads
from ckpt_common.dtypes import dtype_from_name

logger = logging.getLogger(__name__)

# [(name, dtype, shape)] of one bucket -> for each, a contiguous tensor of exactly that dtype and shape
# to read into, or None
Destination = Callable[[list[tuple[str, torch.dtype, tuple[int, ...]]]], "list[torch.Tensor | None]"]
# [(name, dtype, shape)] -> for each name, the slices this rank's loaders read (() for none)
Slices = Callable[[list[tuple[str, torch.dtype, tuple[int, ...]]]], "dict[str, tuple[SourceSlice, ...]]"]
SCRATCH_ALIGN_BYTES = 64


@dataclass
class EngineReadStats:
    start_s: float = 0.0  # transfer engine start and the connections to the owners (all of `begin`)
    te_start_s: float = 0.0  # of it: waiting for the transfer engine to be up (started ahead, or now)
    connect_s: float = 0.0  # the slowest connection to an owner (opened in parallel with `destination`)
    read_s: float = 0.0  # time this engine spent submitting reads and waiting for them (not overlapped)
    destination_s: float = 0.0  # asking `destination` where each tensor goes (at `begin`, during the connects)
    ahead_s: float = 0.0  # of read_s: registering the destinations and submitting their reads at `begin`
    placed_tensors: int = 0  # read straight into their destination
    placed_bytes: int = 0
    scratch_tensors: int = 0  # read into scratch, then loaded
    scratch_bytes: int = 0  # bytes read into scratch (only the rank's slices when sharded)
    sliced_tensors: int = 0  # scratch tensors read in part (sharded), or not at all
    sliced_out_bytes: int = 0  # bytes of those tensors not read: the other ranks' slices
    # tensors of a buffer the engine maps (its own PS rank's shard, on its host): the loaders read them
    # in place, taking only this rank's slices of them (`mapped_slice_bytes`; the whole when not sharded)
    mapped_tensors: int = 0
    mapped_bytes: int = 0
    mapped_slice_bytes: int = 0

    def received_bytes(self) -> int:
        """What this rank took of the update: read from the owners, plus its slices of the mapped tensors."""
        return self.placed_bytes + self.scratch_bytes + self.mapped_slice_bytes

    def report(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _landing(dst: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`dst` when the bytes can land there as they are (CPU, that dtype and shape, contiguous)."""
    if dst is not None and dst.device.type == "cpu" and dst.dtype == dtype and tuple(dst.shape) == shape:
        return dst if dst.is_contiguous() else None
    return None


def _where(t: P.WireTensor) -> tuple:
    return t.buffer, t.offset_bytes, t.dtype, tuple(t.shape)


def _check_range(t: P.WireTensor, h: P.BufferHandle, dtype: torch.dtype) -> int:
    """The tensor's size in bytes, once it is known to lie inside its owner's chunk."""
    nbytes = _nbytes(dtype, t.shape)
    if t.offset_bytes + nbytes > h.size_bytes:
        raise P.ProtocolError(f"tensor {t.name!r} [{t.offset_bytes}, +{nbytes}) exceeds the owner's chunk")
    return nbytes


class EngineReads:
    """An engine's reads from the owners (see the module docstring). Kept by the engine across
    updates (one transfer engine per process); `begin` .. `end` is one update."""

    def __init__(
        self,
        destination: Destination | None = None,
        read_timeout_s: float = 300.0,
        store_factory: Callable[[P2PConfig], P2PStore] = P2PStore,
    ):
        self._destination = destination
        self._store_factory = store_factory
        self._read_timeout_s = read_timeout_s
        self._store: P2PStore | None = None
        self._starting: threading.Thread | None = None
        self._scratches: list[torch.Tensor | None] = [None, None]  # two: two buckets may be in flight
        self._next_scratch = 0
        self._planned: dict[str, torch.Tensor | None] = {}  # name -> where it lands (None: scratch)
        self._in_flight: list[BucketReads] = []
        self._ahead: dict[str, tuple[P.WireTensor, torch.Tensor, PendingReads]] = {}  # submitted at begin
        self._cpus: tuple[int, ...] | None = None
        self._slices: Slices | None = None
        self._max_ranges = 0
        # (name, dtype, shape) -> the byte ranges to read: asked of `_slices` and computed once while set
        self._ranges: dict[tuple[str, str, tuple[int, ...]], list[tuple[int, int]]] = {}
        self._taken: dict[tuple[str, str, tuple[int, ...]], int] = {}  # the same key -> bytes of its slices
        self.stats = EngineReadStats()

    def _config(self, p2p_host: str) -> P2PConfig:
        return P2PConfig(host=p2p_host, read_timeout_s=self._read_timeout_s, cpus=self._cpus)

    def prestart(
        self, p2p_host: str, cpus: tuple[int, ...] | None = None, peers: Sequence[tuple[str, int]] = ()
    ) -> None:
        """Start the transfer engine on a thread now (an engine waiting for its first pull); `begin`
        waits for it. `cpus`: where its threads run (`P2PConfig.cpus`), for this and later starts.
        `peers` ((address, registered pointer) of the owners the pull will likely read): connect to
        them too, in the background; `begin` waits for a connection still opening rather than open
        it twice, and a peer that cannot be reached is only logged (the pull's own connect reports it)."""
        self._cpus = cpus
        if self._store is not None or self._starting is not None:
            return

        def start() -> None:
            try:
                self._store = self._store_factory(self._config(p2p_host))
            except Exception as e:  # noqa: BLE001 - begin() starts one itself and reports its error
                logger.warning("could not start the transfer engine ahead of the pull: %s", e)
                return
            if peers:
                self._store.connect_in_background(list(peers))

        self._starting = threading.Thread(target=start, daemon=True, name="engine-p2p-start")
        self._starting.start()

    def set_destination(self, destination: Destination | None) -> None:
        self._destination = destination

    def set_slices(self, slices: Slices | None, max_ranges_per_tensor: int = 0) -> None:
        """Read only these slices of each scratch tensor (see the module docstring); None: whole tensors.
        `max_ranges_per_tensor` (0: no limit): a tensor whose slices need more byte ranges (a
        row-parallel slice is one per row) is read as the one range that covers them."""
        if slices is not self._slices or max_ranges_per_tensor != self._max_ranges:
            self._ranges = {}
        self._taken = {}
        self._slices = slices
        self._max_ranges = max_ranges_per_tensor

    def _read_ranges(self, tensors: list[tuple[P.WireTensor, torch.dtype, int]]) -> list[list[tuple[int, int]]]:
        """For each (tensor, dtype, nbytes) going to scratch: the byte ranges to read from it."""
        if self._slices is None:
            return [[(0, nbytes)] if nbytes else [] for _, _, nbytes in tensors]
        key = {id(t): (t.name, t.dtype, tuple(t.shape)) for t, _, _ in tensors}
        todo = [(t, d, nbytes) for t, d, nbytes in tensors if key[id(t)] not in self._ranges]
        if todo:
            found = self._slices([(t.name, d, tuple(t.shape)) for t, d, _ in todo])
            for t, _, nbytes in todo:
                self._ranges[key[id(t)]] = self._ranges_of(t, found.get(t.name, (SourceSlice(t.name),)), nbytes)
        out = []
        for t, _, nbytes in tensors:
            ranges = self._ranges[key[id(t)]]
            read = sum(hi - lo for lo, hi in ranges)
            if read < nbytes:
                self.stats.sliced_tensors += 1
                self.stats.sliced_out_bytes += nbytes - read
            out.append(ranges)
        return out

    def note_mapped(self, tensors: Sequence[P.WireTensor]) -> None:
        """Count `tensors` (a bucket's, in buffers this engine maps): the loaders read them in place,
        only this rank's slices when sharded; no read is submitted for them."""
        keys = [(t.name, t.dtype, tuple(t.shape)) for t in tensors]
        todo = [(t, key) for t, key in zip(tensors, keys, strict=True) if key not in self._taken]
        if todo:
            items = [(t.name, dtype_from_name(t.dtype), key[2]) for t, key in todo]
            found = self._slices(items) if self._slices is not None else {}
            for (t, key), (_, dtype, shape) in zip(todo, items, strict=True):
                nbytes = _nbytes(dtype, shape)
                if self._slices is None:
                    self._taken[key] = nbytes
                    continue
                spans = {r for s in found.get(t.name, (SourceSlice(t.name),)) for r in byte_ranges(s, shape, t.dtype)}
                self._taken[key] = min(nbytes, sum(hi - lo for lo, hi in spans))
        for key in keys:
            self.stats.mapped_tensors += 1
            self.stats.mapped_bytes += _nbytes(dtype_from_name(key[1]), key[2])
            self.stats.mapped_slice_bytes += self._taken[key]

    def _ranges_of(self, t: P.WireTensor, slices: tuple[SourceSlice, ...], nbytes: int) -> list[tuple[int, int]]:
        """The byte ranges of `t` that `slices` cover, within `max_ranges_per_tensor`."""
        ranges = sorted({r for s in slices for r in byte_ranges(s, t.shape, t.dtype)})
        if self._max_ranges and len(ranges) > self._max_ranges:
            ranges = [(ranges[0][0], max(hi for _, hi in ranges))]  # one read covering them all
        if sum(hi - lo for lo, hi in ranges) > nbytes:  # overlapping slices: read the whole tensor once
            ranges = [(0, nbytes)]
        return ranges

    def begin(self, handles: tuple[P.BufferHandle, ...], p2p_host: str, tensors: tuple[P.WireTensor, ...] = ()) -> None:
        """Start the transfer engine (once) and open a connection to every owner (in parallel).
        `tensors` (Hello's: every remote tensor of the update): ask `destination` where each lands
        now, while the connections open, so that the buckets need not ask."""
        t0 = time.perf_counter()
        self.stats = EngineReadStats()
        self._planned = {}
        if self._starting is not None:
            self._starting.join(self._read_timeout_s)
            self._starting = None
        if self._store is None:
            self._store = self._store_factory(self._config(p2p_host or "127.0.0.1"))
        self.stats.te_start_s = time.perf_counter() - t0
        peers = {h.peer: h.ptr for h in handles if h.kind == "remote"}
        errors: list[str] = []
        connect_s: list[float] = []  # one per owner (list.append is atomic)

        def connect(peer: str, ptr: int) -> None:
            t1 = time.perf_counter()
            try:
                self._store.connect(peer, ptr)
            except Exception as e:  # noqa: BLE001 - reported below, naming the peer
                errors.append(f"{peer}: {type(e).__name__}: {e}")
            connect_s.append(time.perf_counter() - t1)

        threads = [
            threading.Thread(target=connect, args=kv, daemon=True, name="engine-p2p-connect") for kv in peers.items()
        ]
        for t in threads:
            t.start()
        remote = [t for t in tensors if t.buffer < len(handles) and handles[t.buffer].kind == "remote"]
        if remote and self._destination is not None:
            t1 = time.perf_counter()
            items = [(t.name, dtype_from_name(t.dtype), t.shape) for t in remote]
            self._planned = dict(zip((t.name for t in remote), self._destination(items), strict=True))
            self.stats.destination_s += time.perf_counter() - t1
        for t in threads:
            t.join(self._read_timeout_s)
        if errors or any(t.is_alive() for t in threads):
            raise RuntimeError(f"the engine could not reach the owners of the weights: {errors or 'timed out'}")
        self.stats.connect_s = max(connect_s, default=0.0)
        self.stats.start_s = time.perf_counter() - t0
        self._read_placed_ahead(handles, remote)

    def _read_placed_ahead(self, handles: tuple[P.BufferHandle, ...], tensors: list[P.WireTensor]) -> None:
        """Submit the reads of every tensor of `tensors` that has a destination now (see the module
        docstring); each bucket then collects its own (`start`)."""
        t0 = time.perf_counter()
        for t in tensors:
            dtype = dtype_from_name(t.dtype)
            dst = _landing(self._planned.get(t.name), dtype, t.shape)
            if dst is None or t.name in self._ahead:
                continue
            h = handles[t.buffer]
            nbytes = _check_range(t, h, dtype)
            storage = dst.untyped_storage()
            self._store.register(storage.data_ptr(), storage.nbytes())
            read = self._store.submit(h.peer, [dst.data_ptr()], [h.ptr + t.offset_bytes], [nbytes])
            self._ahead[t.name] = (t, dst, read)
            self.stats.placed_tensors += 1
            self.stats.placed_bytes += nbytes
        self.stats.ahead_s = time.perf_counter() - t0
        self.stats.read_s += self.stats.ahead_s

    def knows(self, tensors) -> bool:
        """Every one of `tensors` (WireTensors) was placed at `begin`: starting its reads runs no loader."""
        return self._destination is None or all(t.name in self._planned for t in tensors)

    def start(self, handles: tuple[P.BufferHandle, ...], tensors: list[P.WireTensor]) -> BucketReads:
        """Submit the reads of one bucket's `tensors` (all in remote buffers) and return at once.

        At most two buckets may be in flight, and a bucket's tensors must be loaded before the bucket
        after next starts: the scratch memory alternates between two buffers."""
        if self._store is None:
            raise RuntimeError("EngineReads.start before begin")
        t0 = time.perf_counter()
        out: list[tuple[str, torch.Tensor | None]] = []
        pending: list[tuple[int, int, int]] = []  # (index in out, scratch offset, nbytes)
        by_peer: dict[str, tuple[list[int], list[int], list[int]]] = {}
        scratch_bytes = 0
        dtypes = [dtype_from_name(t.dtype) for t in tensors]
        todo = [(t.name, d, t.shape) for t, d in zip(tensors, dtypes, strict=True) if t.name not in self._planned]
        if todo and self._destination is not None:
            self._planned.update(zip((n for n, _, _ in todo), self._destination(todo), strict=True))
            self.stats.destination_s += time.perf_counter() - t0
        sizes = []  # checked before anything is taken from the reads begun at Hello (end() waits for those)
        for t, dtype in zip(tensors, dtypes, strict=True):
            planned = self._ahead[t.name][0] if t.name in self._ahead else None
            if planned is not None and _where(planned) != _where(t):
                raise P.ProtocolError(f"tensor {t.name!r} of a bucket differs from Hello's plan: {t} vs {planned}")
            sizes.append(None if planned is not None else _check_range(t, handles[t.buffer], dtype))
        ahead: list[PendingReads] = []
        to_scratch = [
            (t, dtype, nbytes)
            for t, dtype, nbytes in zip(tensors, dtypes, sizes, strict=True)
            if nbytes is not None and _landing(self._planned.get(t.name), dtype, t.shape) is None
        ]
        ranges_of = dict(zip((id(t) for t, _, _ in to_scratch), self._read_ranges(to_scratch), strict=True))
        targets: list[int] = []  # scratch offset of each placeholder local address (-1 - index)
        for t, dtype, nbytes in zip(tensors, dtypes, sizes, strict=True):
            if nbytes is None:  # read since Hello; taken from `_ahead` once this bucket is in flight
                _, dst, pending_read = self._ahead[t.name]
                out.append((t.name, dst))
                ahead.append(pending_read)
                continue
            h = handles[t.buffer]
            dst = _landing(self._planned.get(t.name), dtype, t.shape)
            locals_, remotes, lengths = by_peer.setdefault(h.peer, ([], [], []))
            if dst is not None:
                remotes.append(h.ptr + t.offset_bytes)
                lengths.append(nbytes)
                storage = dst.untyped_storage()
                self._store.register(storage.data_ptr(), storage.nbytes())
                locals_.append(dst.data_ptr())
                out.append((t.name, dst))
                self.stats.placed_tensors += 1
                self.stats.placed_bytes += nbytes
            else:
                offset = -(-scratch_bytes // SCRATCH_ALIGN_BYTES) * SCRATCH_ALIGN_BYTES
                scratch_bytes = offset + nbytes
                for lo, hi in ranges_of[id(t)]:  # the whole tensor, or this rank's slices of it
                    remotes.append(h.ptr + t.offset_bytes + lo)
                    lengths.append(hi - lo)
                    locals_.append(-1 - len(targets))  # patched once the scratch is sized
                    targets.append(offset + lo)
                    self.stats.scratch_bytes += hi - lo
                pending.append((len(out), offset, nbytes))
                out.append((t.name, None))
                self.stats.scratch_tensors += 1
        scratch = None
        if pending:
            scratch = self._scratch_of(self._next_scratch, scratch_bytes)
            self._next_scratch ^= 1
        for locals_, _, _ in by_peer.values():
            for i, ptr in enumerate(locals_):
                if ptr < 0:
                    locals_[i] = scratch.data_ptr() + targets[-1 - ptr]
        # every owner's reads in flight together
        reads = [self._store.submit(peer, *lists) for peer, lists in by_peer.items() if lists[2]]
        for t, nbytes in zip(tensors, sizes, strict=True):
            if nbytes is None:
                self._ahead.pop(t.name, None)
        reads = list({id(r): r for r in ahead}.values()) + reads
        for index, offset, nbytes in pending:
            t = tensors[index]
            out[index] = (t.name, scratch[offset : offset + nbytes].view(dtype_from_name(t.dtype)).view(t.shape))
        self.stats.read_s += time.perf_counter() - t0
        bucket = BucketReads(out, reads, self.stats)  # type: ignore[arg-type] - every None was replaced above
        self._in_flight = [b for b in self._in_flight if b.pending] + [bucket]
        return bucket

    def _scratch_of(self, which: int, nbytes: int) -> torch.Tensor:
        """Registered scratch buffer `which` (0 or 1) of at least `nbytes`, reused by later buckets."""
        old = self._scratches[which]
        if old is None or old.numel() < nbytes:
            if old is not None:
                self._store.unregister(old.data_ptr())
            self._scratches[which] = torch.empty(nbytes, dtype=torch.uint8)
            self._store.register(self._scratches[which].data_ptr(), nbytes)
        return self._scratches[which]

    def end(self) -> None:
        """Unregister every destination and the scratch (the parameters may be freed or repacked next),
        once the reads still in flight (a bucket begun early, then the update failed) have ended."""
        left = [b.finish for b in self._in_flight] + [r.wait for _, _, r in self._ahead.values()]
        for wait in left:
            try:
                wait()
            except Exception as e:  # noqa: BLE001 - the update already failed; its memory is what matters
                logger.debug("a read in flight at the end of the update failed: %s", e)
        self._in_flight = []
        self._ahead = {}
        if self._store is not None:
            self._store.unregister_all()
        self._scratches = [None, None]
        self._planned = {}


class BucketReads:
    """One bucket's reads in flight (`EngineReads.start`)."""

    def __init__(self, out: list[tuple[str, torch.Tensor]], reads: list[PendingReads], stats: EngineReadStats):
        self._out = out
        self._reads = reads
        self._stats = stats

    @property
    def pending(self) -> bool:
        return bool(self._reads)

    def done(self) -> bool:
        """Whether every read has landed (looks once, does not wait); raises if one failed."""
        self._reads = [r for r in self._reads if not r.poll()]
        return not self._reads

    def finish(self) -> list[tuple[str, torch.Tensor]]:
        """Wait for every read (each within its deadline); the bucket's (name, tensor)s in order."""
        t0 = time.perf_counter()
        first_error: BaseException | None = None
        for r in self._reads:  # every read ends before this returns or raises: none may land later
            try:
                r.wait()
            except Exception as e:  # noqa: BLE001 - raised once the others have ended
                first_error = first_error or e
        self._reads = []
        self._stats.read_s += time.perf_counter() - t0
        if first_error is not None:
            raise first_error
        return self._out
