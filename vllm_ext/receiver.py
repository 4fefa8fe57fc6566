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
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import zmq

from checkpoint_engine.sharding.delta_sync import RankSlices
from checkpoint_engine.state import EngineWeightState
from checkpoint_engine.transport.engine_reads import EngineReads
from checkpoint_engine.transport.shm import MappingCache
from checkpoint_engine.worker import UpdateAborted, update_weights_from_ipc
from ckpt_common.dtypes import dtype_from_name
from vllm_ext.placement import SlotProbe
from vllm_ext.receive.caching import CacheUse
from vllm_ext.receive.delta import DeltaIntake
from vllm_ext.receive.faults import BucketFault, FaultSlot, FaultSpec
from vllm_ext.receive.modes import BucketLoad, NamedTensors, ReloadFn, ReloadStream, reload_failed, reload_for
from vllm_ext.receive.reads import ReadTally
from vllm_ext.settings import ReceiverConfig
from vllm_ext.weight_cache import WeightCache

# the names other modules and tests import from here, now defined in vllm_ext.receive
__all__ = ["FaultSpec", "NamedTensors", "ReloadFn", "ReloadStream", "WeightReceiver", "reload_failed"]

logger = logging.getLogger(__name__)


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
        partial_reload_fn: Callable[[], bool] | None = None,
    ):
        """`initial_weights`: what the engine started with, "checkpoint" or "dummy" (random).
        `cache_slots_fn`: engine memory the weight cache may keep named tensors in (asked after each
        complete update; see `WeightCache.adopt`). `load_per_bucket`: call `reload_fn` once per
        bucket, before its Ack, on views of the PS's buffers (see the module docstring); only for
        a reload that may be called once per bucket and keeps no tensor after it returns.
        `partial_reload_fn`: whether `reload_fn` keeps the layers it is not given as they are (vLLM's
        direct reload does, its layerwise reload does not): a delta then reloads only the tensors
        whose values it changed, so the engine's work falls with the changed share."""
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
        self._partial_reload_fn = partial_reload_fn
        self.num_cache_adopted = 0
        self._zmq_ctx = zmq.Context()
        self._faults = FaultSlot()  # test-only (`arm_fault`)
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
        partial_reload_fn: Callable[[], bool] | None = None,
    ) -> None:
        """Route later updates to another reload, under `config` if given (the receiver that did an
        engine's initial load, inside vLLM's load step, carries on as the worker's receiver)."""
        with self._busy:
            self._reload_fn = reload_fn
            self._recover_fn = recover_fn
            self._cache_slots_fn = cache_slots_fn
            self._partial_reload_fn = partial_reload_fn
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
        fault = self._faults.arm(spec)
        logger.warning("fault armed for the next weight update: %s", fault)
        return {"armed": True, "fault": dict(fault.__dict__)}

    def take_fault(self, at: str) -> FaultSpec | None:
        """The armed fault if it is one `at` this point, disarmed and fired now (its marker written):
        for the start and finish points; else None."""
        fault = self._faults.take(at)
        if fault is not None:
            fault.fire()
        return fault

    def receive(self, zmq_handle: str, device_id: int | None) -> dict:
        """Run one update from the PS rank at `zmq_handle`; return `report()`; raise UpdateAborted."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a weight update is already in progress on this engine")
        try:
            self.finish_error = None
            fault = self._faults.take("bucket")  # fires in its bucket (`receive.faults.BucketFault`)
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
    """One update: the names received in order, their bytes, the timings and the summary. Each
    other job is a piece of `vllm_ext.receive` it composes: the reload mode (`modes`), the weight
    cache's use (`caching`), the engine's own reads (`reads`), a delta (`delta`), a fault (`faults`)."""

    def __init__(self, receiver: WeightReceiver, fault: FaultSpec | None):
        self.r = receiver
        self.mode = "bucket" if receiver.load_per_bucket else receiver.config.reload_mode
        self.fault = BucketFault(fault)
        self.caching = CacheUse(receiver.cache, weight_cache=receiver.config.weight_cache, mode=self.mode)
        self.reads = ReadTally(receiver.remote_reads, receiver._slot_probe, len(receiver._owed))
        self.reload = reload_for(self.mode, receiver._reload_fn, receiver.config.reload_timeout_s, self.reads.unread)
        self.delta = DeltaIntake(
            receiver.rank_slices, receiver.state.report()["checkpoint"], whole_only=self.mode == "bucket"
        )
        self.order: list[str] = []
        self.received: set[str] = set()
        self.num_buckets = 0
        self.nbytes = 0
        self.t_first: float | None = None
        self.t_done: float | None = None
        self.t_end: float | None = None

    def on_hello(self, hello, buffers: list[torch.Tensor | None]) -> None:
        self.reads.on_hello(hello)
        self.caching.on_hello(hello, buffers)

    def on_bucket(self, views: NamedTensors) -> None:
        index = self.num_buckets
        self.num_buckets += 1
        self.t_first = self.t_first or time.perf_counter()
        self.fault.check(index)
        views = self.delta.take(views)
        self.caching.stale()
        if self.reload.keeps:
            views = [(name, self.caching.keep(name, view)) for name, view in views]
        else:  # loaded now, before the Ack frees the buffer half: no copy
            self.caching.num_zero_copy += len(views)
        self._note(views)
        self.reload.on_bucket(views)

    def _note(self, pairs: NamedTensors) -> None:
        for name, t in pairs:
            if name not in self.received:
                self.received.add(name)
                self.order.append(name)
            self.nbytes += t.numel() * t.element_size()

    def _delta_report(self) -> dict:
        d = self.delta
        return {"base": d.held_checkpoint, "nbytes": d.nbytes, "reloaded_tensors": d.reloaded}

    def finish(self) -> None:
        """post_hook: every bucket arrived; complete the reload."""
        r = self.r
        self.t_done = time.perf_counter()
        owed, r._owed = r._owed - self.received, set()
        if owed:  # their loaders ran in the probe ahead: the engine would count them as loaded
            raise RuntimeError(
                f"the update left out {len(owed)} tensor(s) of the version the engine was told to expect "
                f"and probed ahead, e.g. {sorted(owed)[:5]}"
            )
        delta = self.delta.is_delta
        if delta:  # the delta onto the cache, then the whole model through the reload
            refusal = r.delta_refusal(self.caching.fallback_ok)
            pairs = self.delta.apply(self.caching, refusal, self.received, r.state, sliced=r.cache_sliced)
            self._note(pairs)  # the cache holds every tensor of the version still
            if not r.cache_sliced and r._partial_reload_fn is not None and r._partial_reload_fn():
                changed = self.delta.changed  # the other layers keep what they hold: the base's values
                pairs = [(name, t) for name, t in pairs if name in changed]
            self.delta.reloaded = len(pairs)
            self.reload.start(pairs)
        else:
            self.reload.on_done(lambda: self.caching.kept(self.order))
        self.reload.join(r)
        adopted = self.caching.commit(self.received, r._cache_slots_fn)
        if adopted is not None:
            r.num_cache_adopted = adopted
        r.reload_error = None
        if not delta:  # a full update decides what the cache holds; a delta keeps it as it was
            r.cache_sliced = self.reads.sliced()
        self.t_end = time.perf_counter()

    def abort(self) -> None:
        """The update failed: end the reload so the engine keeps serving (status: incomplete)."""
        filled = self.reload.abort(self.received, self.caching.previous(self.received), self.r)
        if filled is not None and (why := self.caching.after_abort(filled)) is not None:
            self.r.reload_error = why

    def summary(self) -> dict:
        def span(a, b):
            return None if a is None or b is None else round(b - a, 4)

        return {
            "num_buckets": self.num_buckets,
            "num_tensors": len(self.received),
            "nbytes": self.nbytes,
            "mode": self.mode,
            "num_zero_copy": self.caching.num_zero_copy,
            "transfer_s": span(self.t_first, self.t_done),
            "reload_tail_s": span(self.t_done, self.t_end),
            "total_s": span(self.t_first, self.t_end),
            "engine_reads": self.reads.report(),
            "delta": self._delta_report() if self.delta.nbytes else None,
            **(
                {
                    "loaders_s": round(self.reload.loaders_s, 4),
                    "num_loaded_by_read": self.reads.num_loaded_by_read,
                    "probed_ahead": self.reads.probed_ahead,
                    "probed_in_update": self.reads.probed_in_update(),
                }
                if isinstance(self.reload, BucketLoad)
                else {}
            ),
        }
