"""Engine side of one weight update for an engine with a "reload path" (vLLM), engine-agnostic.

`WeightReceiver.receive` drives `checkpoint_engine.worker.update_weights_from_ipc` and feeds what
arrives to `reload_fn(iterator of (name, tensor))`, which the engine adapter binds to its reload
(for vLLM: `worker.reload_weights(weights_iterator=...)`, which redoes repacking/quantization).
The reload runs once per update, in a thread, over an iterator that yields tensors as buckets
arrive, so layer processing overlaps the transfer of later buckets ("streaming" mode):

    PS ─bucket i─▶ on_bucket: copy views into WeightCache ─▶ queue ─▶ reload thread: reload_fn(iter)
    PS ─Done─────▶ finish: end the iterator, join the reload (deadline) ─▶ Ack, version v+1
    any failure ─▶ abort: feed the previous values of the names not received (when the cache
                   still describes the model), end the iterator, join ─▶ state `incomplete`

"end" mode only caches during the transfer and runs the reload after Done: slower, but an aborted
update leaves the model's weights exactly as they were.

`load_per_bucket` (vLLM's load step, where loading is only the loaders' copies into the parameters,
with no repacking until the load returns): each bucket is loaded by `reload_fn` before it is acked,
so tensors in the PS's double buffer go to the loaders as views too (no copy into a cache, whose
fresh pages a new engine process would fault in one by one); the PS fills the other half meanwhile.
When the engine reads the pull itself (remote buffers), each tensor is read into the slot its loader
would copy it to (`placement.SlotProbe`, which runs the loaders once with the copies left out), and
only the tensors without a slot go through `reload_fn` afterwards.

With `weight_cache=False` (streaming), tensors in buffers the PS marks stable until Done (its
registered chunks, when engine and PS share a host) go to the reload as views, without a copy:
the update then does no work beyond vLLM's own reload, and no host copy of the model is kept.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch
import zmq

from checkpoint_engine.sharding.delta import DeltaMismatch
from checkpoint_engine.sharding.delta_sync import DeltaReceiver, RankSlices
from checkpoint_engine.state import EngineWeightState
from checkpoint_engine.transport.engine_reads import EngineReads
from checkpoint_engine.transport.shm import MappingCache
from checkpoint_engine.worker import UpdateAborted, update_weights_from_ipc
from ckpt_common.dtypes import dtype_from_name
from vllm_ext.placement import SlotProbe
from vllm_ext.settings import ReceiverConfig
from vllm_ext.weight_cache import WeightCache

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
ReloadFn = Callable[[Iterator[tuple[str, torch.Tensor]]], None]


@dataclass(frozen=True)
class FaultSpec:
    """Test-only fault for the next update: `raise` in bucket `bucket`, or `stall` there for `stall_s`.

    `at` "start" or "finish": vLLM's weight-transfer backend (`vllm_ext.weight_transfer.engine`) raises
    in its `start_weight_update` or `finish_weight_update` instead (kind "raise" only); the bucket
    receive does not take such a fault. `marker_path`, if given, is created when the fault fires
    (lets a test act at that moment).
    """

    kind: Literal["raise", "stall"]
    bucket: int = 0
    stall_s: float = 5.0
    marker_path: str | None = None
    at: Literal["bucket", "start", "finish"] = "bucket"

    def __post_init__(self) -> None:
        if self.kind not in ("raise", "stall"):
            raise ValueError(f"kind must be 'raise' or 'stall', got {self.kind!r}")
        if self.at not in ("bucket", "start", "finish"):
            raise ValueError(f"at must be 'bucket', 'start' or 'finish', got {self.at!r}")
        if self.at != "bucket" and self.kind != "raise":
            raise ValueError(f"a fault at {self.at!r} can only raise, got kind {self.kind!r}")
        if isinstance(self.bucket, bool) or not isinstance(self.bucket, int) or self.bucket < 0:
            raise ValueError(f"bucket must be an int >= 0, got {self.bucket!r}")
        if not 0 < self.stall_s <= 600:
            raise ValueError(f"stall_s must be in (0, 600], got {self.stall_s!r}")

    def fire(self) -> None:
        """Write the marker (this process's pid), if any: the fault fires now."""
        if self.marker_path:
            with open(self.marker_path, "w") as fh:
                fh.write(f"{os.getpid()}\n")

    @classmethod
    def from_dict(cls, d: Mapping) -> FaultSpec:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown fault field(s) {unknown}")
        return cls(**d)


def reload_failed(e: BaseException) -> RuntimeError:
    """The error an update reports when the engine's reload raised `e`."""
    return RuntimeError(f"the engine's reload path failed: {type(e).__name__}: {e}")


class ReloadStream:
    """Runs `reload_fn` in a thread over an iterator fed batch by batch; `finish` joins it."""

    _END = None

    def __init__(self, reload_fn: ReloadFn):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.num_fed = 0
        self._thread = threading.Thread(target=self._run, args=(reload_fn,), daemon=True, name="ckpt-engine-reload")
        self._thread.start()

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (batch := self._queue.get()) is not self._END:
            yield from batch

    def _run(self, reload_fn: ReloadFn) -> None:
        try:
            with torch.no_grad():
                reload_fn(self._pairs())
        except BaseException as e:
            logger.exception("the reload path failed")
            self.error = e

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise reload_failed(self.error) from self.error

    def feed(self, pairs: NamedTensors) -> None:
        self.raise_if_failed()
        self.num_fed += len(pairs)
        self._queue.put(pairs)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def finish(self, timeout_s: float) -> None:
        self._queue.put(self._END)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine's reload path did not finish within {timeout_s:.0f} s")
        self.raise_if_failed()


class WeightReceiver:
    """Receives updates into one engine device; keeps state and cache across updates."""

    def __init__(
        self,
        reload_fn: ReloadFn,
        *,
        recover_fn: Callable[[], None] | None = None,
        config: ReceiverConfig | None = None,
        initial_weights: str = "checkpoint",
        cache_slots_fn: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        load_per_bucket: bool = False,
    ):
        """`initial_weights`: what the engine started with, "checkpoint" or "dummy" (random).
        `cache_slots_fn`: engine memory the weight cache may keep named tensors in (asked after each
        complete update; see `WeightCache.adopt`). `load_per_bucket`: call `reload_fn` once per
        bucket, before its Ack, on views of the PS's buffers (see the module docstring); only for
        a reload that may be called once per bucket and keeps no tensor after it returns."""
        if initial_weights not in ("checkpoint", "dummy"):
            raise ValueError(f"initial_weights must be 'checkpoint' or 'dummy', got {initial_weights!r}")
        self.initial_weights = initial_weights
        self.config = config or ReceiverConfig()
        self.state = EngineWeightState()
        self.cache = WeightCache()
        self.mappings = MappingCache() if self.config.keep_mappings else None
        self.last_update: dict | None = None
        self.reload_error: str | None = None  # set when the model may be unusable after a failed reload
        # why the last finish of vLLM's weight-transfer API failed on this worker (the backend's
        # `finish_weight_update`, which must not raise); cleared when the next update starts
        self.finish_error: str | None = None
        self._reload_fn = reload_fn
        self._recover_fn = recover_fn
        self._cache_slots_fn = cache_slots_fn
        self.num_cache_adopted = 0
        self._zmq_ctx = zmq.Context()
        self._fault: FaultSpec | None = None
        self._busy = threading.Lock()
        self.load_per_bucket = load_per_bucket
        # A pull the engine reads itself (PS `p2p_reader="engine"`): its transfer engine, started by
        # the first such update; in the load step each tensor is read straight into its parameter slot.
        self.remote_reads = EngineReads(read_timeout_s=self.config.timeout_s)
        self._slot_probe: SlotProbe | None = None
        self._owed: set[str] = set()  # names probed ahead: the next update must bring every one
        # a tensor-parallel worker's slices (`read_slices`), and whether the weight cache holds only
        # those (the last full update was a sharded pull): a delta is then applied slice by slice
        self.rank_slices: RankSlices | None = None
        self.cache_sliced = False

    def read_slices(self, probe, max_ranges_per_tensor: int = 0) -> None:
        """Pulls this engine reads itself take only the slices `probe` says its loaders consume
        (`vllm_ext.shard_probe`), and deltas only those slices' entries
        (`checkpoint_engine.sharding.delta_sync.RankSlices`)."""
        self.rank_slices = RankSlices(probe)
        self.remote_reads.set_slices(self.rank_slices, max_ranges_per_tensor=max_ranges_per_tensor)

    def rebind(
        self,
        reload_fn: ReloadFn,
        *,
        recover_fn: Callable[[], None] | None = None,
        cache_slots_fn: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        config: ReceiverConfig | None = None,
    ) -> None:
        """Route later updates to another reload, under `config` if given (the receiver that did an
        engine's initial load, inside vLLM's load step, carries on as the worker's receiver)."""
        with self._busy:
            self._reload_fn = reload_fn
            self._recover_fn = recover_fn
            self._cache_slots_fn = cache_slots_fn
            if config is not None:
                self.config = config

    def probe_ahead(self, tensors: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        """Find now, before the first update, where each of `tensors` ((name, dtype name, shape): the
        version the daemon expects the load step to pull) lands in the parameters, so that the pull
        does not probe. The probe is their loaders' run (`placement`), so the next update must bring
        every one of these names: its end refuses an update that left one out. Load step only; a
        hint that cannot be read is logged and ignored."""
        if not self.load_per_bucket:
            raise RuntimeError("probe_ahead: only an engine's load step probes ahead")
        try:
            items = [(str(n), dtype_from_name(d), tuple(int(x) for x in shape)) for n, d, shape in tensors]
        except (TypeError, ValueError) as e:
            logger.warning("ignoring the pull hint's tensors: %s", e)
            return
        t0 = time.perf_counter()
        self._slot_probe = self._slot_probe or SlotProbe(lambda weights: self._reload_fn(weights))
        slots = self._slot_probe(items)
        self._owed = {n for n, _, _ in items}
        logger.info(
            "probed %d tensors ahead of the pull in %.3f s (%d with a slot)",
            len(items),
            time.perf_counter() - t0,
            sum(s is not None for s in slots),
        )

    def arm_fault(self, spec: FaultSpec | Mapping) -> dict:
        self._fault = spec if isinstance(spec, FaultSpec) else FaultSpec.from_dict(spec)
        logger.warning("fault armed for the next weight update: %s", self._fault)
        return {"armed": True, "fault": dict(self._fault.__dict__)}

    def _disarm(self, at: str) -> FaultSpec | None:
        """The armed fault if it is one `at` this point ("bucket", "start", "finish"), disarmed; else None."""
        fault = self._fault
        if fault is None or fault.at != at:
            return None
        self._fault = None
        return fault

    def take_fault(self, at: str) -> FaultSpec | None:
        """`_disarm`, firing the fault now (its marker written): for the start and finish points."""
        fault = self._disarm(at)
        if fault is not None:
            fault.fire()
        return fault

    def receive(self, zmq_handle: str, device_id: int | None) -> dict:
        """Run one update from the PS rank at `zmq_handle`; return `report()`; raise UpdateAborted."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a weight update is already in progress on this engine")
        try:
            self.finish_error = None
            fault = self._disarm("bucket")  # fires in its bucket (`_UpdateSession._maybe_fault`)
            if self.load_per_bucket:  # plain parameters, loaded bucket by bucket: reads land in place
                self._slot_probe = self._slot_probe or SlotProbe(lambda weights: self._reload_fn(weights))
                self.remote_reads.set_destination(self._slot_probe)
            else:  # later updates go through the reload's own staging: reads land in scratch
                self.remote_reads.set_destination(None)
            session = _UpdateSession(self, fault)
            maps = self.mappings
            before = (maps.hits, maps.misses) if maps is not None else (0, 0)
            try:
                update_weights_from_ipc(
                    self._zmq_ctx,
                    zmq_handle,
                    device_id,
                    run=session.on_bucket,
                    post_hook=session.finish,
                    state=self.state,
                    timeout_s=self.config.timeout_s,
                    mapping_cache=self.mappings,
                    on_hello=session.on_hello,
                    remote_reads=self.remote_reads,
                )
            except UpdateAborted:
                session.abort()
                raise
            finally:
                self.last_update = session.summary()
                if maps is not None:  # segments mapped afresh vs reused from earlier updates
                    self.last_update.update(
                        segments_mapped=maps.misses - before[1], segments_reused=maps.hits - before[0]
                    )
            return self.report()
        finally:
            self._busy.release()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no update is running here (the PS may return before the engine finished aborting)."""
        if not self._busy.acquire(timeout=timeout_s):
            return False
        self._busy.release()
        return True

    def report(self) -> dict:
        s = self._state_report()
        return {
            **s,
            "initial_weights": self.initial_weights,
            "reload_mode": self.config.reload_mode,
            "reload_error": self.reload_error,
            "finish_error": self.finish_error,
            "cache_bytes": self.cache.nbytes,
            "last_update": self.last_update,
            "cache_tensors_in_engine_memory": self.num_cache_adopted,
            "pid": os.getpid(),
        }

    def _state_report(self) -> dict:
        s = self.state.report()
        if s["status"] == "initial" and self.initial_weights == "dummy":
            s["weights_complete"] = False  # started with random weights: nothing real is loaded yet
        return s

    def checksum_report(self) -> dict:
        s = self._state_report()
        checksum, num_tensors = None, len(self.cache)
        definition = "sha256 over (name, dtype, shape, crc32) of the checkpoint-format tensors loaded"
        if not self.config.weight_cache:
            definition, num_tensors = "unavailable: the engine runs with weight_cache off (no copy of the weights)", 0
        elif self.cache_sliced:  # a tensor-parallel worker's sharded pull: the cache holds this rank's slices only
            definition = (
                "unavailable: this rank's weights came by a sharded pull (only its tensor-parallel slices "
                "were read); the weight cache holds those slices only"
            )
        else:
            checksum = self.cache.checksum()
        return {
            "checksum": checksum,
            "version": s["version"],
            "status": s["status"],
            "weights_complete": s["weights_complete"],
            "num_tensors": num_tensors,
            "definition": definition,
        }

    def delta_refusal(self, cache_matches_model: bool | None = None) -> str | None:
        """Why this engine cannot apply a delta update now (None: it can, given the right base).
        `cache_matches_model`: the cache's state before the update in progress (default: now)."""
        matches = self.cache.matches_model if cache_matches_model is None else cache_matches_model
        if not self.config.weight_cache:
            return "it runs with weight_cache off: it keeps no copy of the weights to apply a delta to"
        if self.cache_sliced and self.rank_slices is None:
            return "its last update read only this rank's tensor-parallel slices, and it knows no slice plan"
        if not matches:
            return "its weight cache does not hold the weights it serves (no complete update yet, or an aborted one)"
        return None

    def recover(self, why: str) -> None:
        """Put the model back in a servable state after its reload failed half-way."""
        self.reload_error = why
        if self._recover_fn is None:
            return
        try:
            self._recover_fn()
        except Exception as e:
            logger.exception("recovering the model after a failed reload failed")
            self.reload_error = f"{why}; recovery failed: {type(e).__name__}: {e}"


class _UpdateSession:
    """What one update needs: received names in order, the reload stream, a fault, timings."""

    def __init__(self, receiver: WeightReceiver, fault: FaultSpec | None):
        self.r = receiver
        self.mode = "bucket" if receiver.load_per_bucket else receiver.config.reload_mode
        self.fault = fault
        self.fallback_ok = receiver.cache.matches_model  # untouched names still hold the model's values
        self.order: list[str] = []
        self.received: set[str] = set()
        self.num_buckets = 0
        self.nbytes = 0
        self.stream: ReloadStream | None = None
        self.stable_ranges: list[tuple[int, int]] = []  # address ranges of buffers valid until Done
        self.num_zero_copy = 0
        self.t_first: float | None = None
        self.t_done: float | None = None
        self.t_end: float | None = None
        self.remote = False  # the engine reads this update itself (remote buffers)
        self.num_loaded_by_read = 0  # bucket mode: tensors read into their slots, no loader run after
        probe = receiver._slot_probe
        self.probed_ahead = len(receiver._owed)  # bucket mode: names whose slots were found before the update
        self._probed_before = probe.num_probed if probe is not None else 0
        self.loaders_s = 0.0  # bucket mode: time in the load function, per bucket, summed
        # a delta update (checkpoint_engine.sharding.delta_sync): its tensors are kept as they arrive
        # and applied at the end onto the weight cache, which holds the version the engine serves
        self.delta = DeltaReceiver(receiver.rank_slices)
        self.held_checkpoint = receiver.state.report()["checkpoint"]
        self.delta_bytes = 0

    def on_hello(self, hello, buffers: list[torch.Tensor | None]) -> None:
        self.remote = any(h.kind == "remote" for h in hello.buffers)
        if not self.r.config.weight_cache and self.mode == "streaming":
            self.stable_ranges = [
                (b.data_ptr(), b.data_ptr() + b.numel())
                for i, b in enumerate(buffers)
                if i in set(hello.stable_buffers)
            ]

    def _is_stable(self, view: torch.Tensor) -> bool:
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        return any(lo <= start and end <= hi for lo, hi in self.stable_ranges)

    def _keep(self, name: str, view: torch.Tensor) -> torch.Tensor:
        """The tensor to hand to the reload: the view itself when it stays valid until Done and no
        cache is kept, else the cached copy."""
        if self.stable_ranges and self._is_stable(view):
            self.num_zero_copy += 1
            return view
        return self.r.cache.store(name, view)

    def on_bucket(self, views: NamedTensors) -> None:
        index = self.num_buckets
        self.num_buckets += 1
        self.t_first = self.t_first or time.perf_counter()
        self._maybe_fault(index)
        views = self._take_delta(views)
        cache = self.r.cache
        cache.matches_model = False
        if self.mode == "bucket":  # loaded now, before the Ack frees the buffer half: no copy
            self._note(views)
            self.num_zero_copy += len(views)
            probe = self.r._slot_probe if self.remote else None
            # a tensor read straight into its slot is loaded: its loader ran (copy left out) in the probe
            rest = views if probe is None else [(n, t) for n, t in views if not probe.holds(n, t)]
            self.num_loaded_by_read += len(views) - len(rest)
            if rest:
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        self.r._reload_fn(iter(rest))
                except Exception as e:
                    raise reload_failed(e) from e
                self.loaders_s += time.perf_counter() - t0
            return
        pairs = [(name, self._keep(name, view)) for name, view in views]
        self._note(pairs)
        if self.mode == "streaming" and pairs:
            if self.stream is None:
                self.stream = ReloadStream(self.r._reload_fn)
            self.stream.feed(pairs)

    def _take_delta(self, views: NamedTensors) -> NamedTensors:
        """Keep a delta's tensors aside (copied: the buffer is reused after the Ack); the rest."""
        rest = []
        for name, t in views:
            if self.delta.take(name, t):
                self.delta_bytes += t.numel() * t.element_size()
            else:
                rest.append((name, t))
        if len(rest) < len(views) and self.mode == "bucket":
            raise DeltaMismatch("vLLM's load step takes whole weights: a delta needs a version loaded before it")
        return rest

    def _apply_delta(self) -> None:
        """The delta onto the cache's copy of the version held (every base checksum checked before
        anything is written), then the whole model through the reload: the network carries only the
        changes, but vLLM's layer-wise reload wants every tensor of a layer it reloads."""
        cache = self.r.cache
        why = self.r.delta_refusal(self.fallback_ok)
        if why is None and self.received:
            why = f"the update mixes whole tensors ({len(self.received)}) with a delta"
        if why is not None:
            # nothing of the delta was written; whole tensors of a mixed update were (cached, reloaded)
            cache.matches_model = self.fallback_ok and not self.received
            raise DeltaMismatch(f"this engine cannot apply a delta update: {why}")
        weights = dict(cache.items_except(set()))
        try:
            # the engine then holds its version; a sharded cache: this rank's slices only
            self.delta.finish(weights, self.held_checkpoint, self.r.state, sliced=self.r.cache_sliced)
        except DeltaMismatch:
            cache.matches_model = True  # every base checksum is checked first: nothing was written
            raise
        pairs = list(weights.items())
        self._note(pairs)
        self.stream = ReloadStream(self.r._reload_fn)
        self.stream.feed(pairs)

    def _note(self, pairs: NamedTensors) -> None:
        for name, t in pairs:
            if name not in self.received:
                self.received.add(name)
                self.order.append(name)
            self.nbytes += t.numel() * t.element_size()

    def finish(self) -> None:
        """post_hook: every bucket arrived; complete the reload."""
        self.t_done = time.perf_counter()
        owed, self.r._owed = self.r._owed - self.received, set()
        if owed:  # their loaders ran in the probe ahead: the engine would count them as loaded
            raise RuntimeError(
                f"the update left out {len(owed)} tensor(s) of the version the engine was told to expect "
                f"and probed ahead, e.g. {sorted(owed)[:5]}"
            )
        cache = self.r.cache
        delta = self.delta.is_delta
        if delta:
            self._apply_delta()
        elif self.stream is None and self.order and self.mode == "end":  # the whole reload happens now
            self.stream = ReloadStream(self.r._reload_fn)
            self.stream.feed([(n, cache.get(n)) for n in self.order])
        try:
            if self.stream is not None:
                self.stream.finish(self.r.config.reload_timeout_s)
        except Exception as e:
            self.stream = None  # nothing left for abort() to end
            self.r.recover(f"reload failed: {type(e).__name__}: {e}")
            raise
        if self.r.config.weight_cache and self.mode != "bucket":  # per bucket: nothing was cached
            cache.retain_only(self.received)
            cache.matches_model = True
            if self.r._cache_slots_fn is not None:
                self.r.num_cache_adopted = cache.adopt(self.r._cache_slots_fn())
        self.r.reload_error = None
        if not delta:  # a full update decides what the cache holds; a delta keeps it as it was
            reads = self.r.remote_reads.stats if self.remote else None
            self.r.cache_sliced = reads is not None and reads.sliced_tensors > 0
        self.t_end = time.perf_counter()

    def abort(self) -> None:
        """The update failed: end the reload so the engine keeps serving (status: incomplete)."""
        stream, self.stream = self.stream, None
        if self.mode == "bucket" and self.received:
            self.r.reload_error = "aborted load: only some buckets reached the parameters"
            return
        if stream is None:  # no reload started ("end" mode, or failed before the first bucket)
            return
        if stream.error is not None or not stream.running:
            self.r.recover(f"reload failed: {type(stream.error).__name__}: {stream.error}")
            return
        filled = False
        try:
            if self.fallback_ok:
                stream.feed(self.r.cache.items_except(self.received))
                filled = True
            stream.finish(self.r.config.reload_timeout_s)
        except Exception as e:  # noqa: BLE001 - the update is already failing; keep the first error
            self.r.recover(f"reload failed while aborting: {type(e).__name__}: {e}")
            return
        # With the previous values filled in, the cache again mirrors the (mixed) model exactly.
        self.r.cache.matches_model = filled
        if not filled:
            why = (
                "weight_cache is off"
                if not self.r.config.weight_cache
                else "no copy of the previous weights: the cache is filled by a completed update"
            )
            self.r.reload_error = (
                f"aborted update without previous values to fill in ({why}): layers "
                "that were only partly received hold undefined values until the next update"
            )

    def _maybe_fault(self, index: int) -> None:
        f = self.fault
        if f is None or f.bucket != index:
            return
        self.fault = None
        f.fire()
        if f.kind == "raise":
            raise RuntimeError(f"injected fault in bucket {index}")
        logger.warning("injected stall of %.1f s in bucket %d", f.stall_s, index)
        time.sleep(f.stall_s)

    def _probed_in_update(self) -> int:
        """Names whose slots this update had to find (0 when all were found ahead, or no probe ran)."""
        probe = self.r._slot_probe
        return probe.num_probed - self._probed_before if probe is not None else 0

    def summary(self) -> dict:
        def span(a, b):
            return None if a is None or b is None else round(b - a, 4)

        return {
            "num_buckets": self.num_buckets,
            "num_tensors": len(self.received),
            "nbytes": self.nbytes,
            "mode": self.mode,
            "num_zero_copy": self.num_zero_copy,
            "transfer_s": span(self.t_first, self.t_done),
            "reload_tail_s": span(self.t_done, self.t_end),
            "total_s": span(self.t_first, self.t_end),
            "engine_reads": self.r.remote_reads.stats.report() if self.remote else None,
            "delta": {"base": self.held_checkpoint, "nbytes": self.delta_bytes} if self.delta_bytes else None,
            **(
                {
                    "loaders_s": round(self.loaders_s, 4),
                    "num_loaded_by_read": self.num_loaded_by_read,
                    "probed_ahead": self.probed_ahead,
                    "probed_in_update": self._probed_in_update(),
                }
                if self.mode == "bucket"
                else {}
            ),
        }
