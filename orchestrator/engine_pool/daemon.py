"""Rollouts and weight sync through the checkpoint-engine daemon (``engine.type: "daemon"``).

The layouts of deploy/k8s: the daemon (``torchrun -m checkpoint_engine --engine-cmd ...``, one rank
per inference device) owns the vLLM engines (start, update, stop, heal); this job only talks to its
HTTP API and hands each version over as safetensors files in ``sync.handoff_dir`` (a memory-backed
volume in the colocated pod, a shared volume across nodes), or with ``sync.source="memory"`` from this
process's memory (``memory_source``: the daemon's ranks read it over Mooncake, POST /metas instead of
POST /checkpoints; across hosts the daemon's ``--mode relay`` reads each byte over this host's link once)::

    start_daemon_pool(engine config, SFT model, handoff dir)
        <handoff>/model: the SFT model (config, tokenizer, weights): what --engine-cmd's --model names
        POST /checkpoints {name: policy-v0, files}   every rank registers its share of the files
        POST /engines/start {name: policy-v0}        every engine gets v0 (in its load step with
                                                     {rendezvous} engines, else pushed into dummy
                                                     weights) before it reports serving
        GET /engines -> EnginePool: one HttpVllmEngine per rank's engine, fewest requests in flight first
    DaemonWeightSync.push(v)
        <handoff>/policy-v<v>/model-*.safetensors (one shard per rank) -> POST /checkpoints
        -> POST /update (the engines that can take it; the others are being healed)
        -> DELETE /checkpoints/policy-v<v-1> and its files
    an engine that dies: the pool requeues its requests; the daemon (--auto-heal) restarts it and
        pulls the current version into it from the ranks that hold it; the pool takes it back once
        GET /engines shows it serving that version again.

Colocated (``engine.colocated``, k1.5's hybrid deployment): the engines run only while rolling out::

    rollout ──▶ DaemonWeightSync.before_train(): pool parked (no member serves), POST /engines/stop,
                GET /engines: every engine stopped          (switch_to_train_s)
    train   ──▶ push(v+1): files -> POST /checkpoints -> POST /engines/start {name: policy-v<v+1>}
                (load step or dummy weights + the daemon's update; never serving dummy weights) -> GET /engines:
                every engine serving v+1 -> the pool takes the new URLs (switch_to_inference_s)
                -> DELETE /checkpoints/policy-v<v>
    a failed phase raises SwitchError naming it and every engine's state; the daemon keeps that state
    (GET /engines, etcd with --metadata-url: failed = the engine did not start, incomplete = the update
    into it failed); the next push stops what is left and starts every engine again.

With ``engine.sleep_level`` 1 or 2 (vLLM's sleep mode, CUDA) the engines sleep instead of stopping::

    rollout ──▶ before_train(): pool parked, POST /engines/sleep {level}, GET /engines: every engine
                sleeping                                      (switch_to_train_s)
    train   ──▶ push(v+1): files -> POST /checkpoints -> POST /engines/wake {name: policy-v<v+1>,
                timeout_s} (the daemon wakes them and updates them to v+1) -> GET /engines: every
                engine serving v+1 -> the pool takes them again (switch_to_inference_s)
    a failed sleep or wake raises SwitchError as above; the next push then finds them not all sleeping
    and stops what is left and starts every engine, as sleep_level 0 does.

With ``sync.delta`` (disaggregated only: colocated engines start or wake without the base) each version
is still registered in full, since a heal brings a restarted engine to it, and, where it pays, the
engines take only the values that changed (``checkpoint_engine.sharding.delta_sync``)::

    push(v): <handoff>/policy-v<v> registered (full: what heals pull)
        every engine the update reaches serves policy-v<v-1>, the delta is small enough?
        yes ─▶ <handoff>/policy-v<v>.delta registered (or its metas) ─▶ POST /update {name: policy-v<v>.delta,
               full_checkpoint: policy-v<v>} (the engines apply it and then serve policy-v<v>; the
               daemon's current checkpoint is policy-v<v>) ─▶ DELETE /checkpoints/policy-v<v>.delta
               an engine refused it (its weights are not the base) ─▶ POST /update {name: policy-v<v>}
        no  ─▶ POST /update {name: policy-v<v>}

A daemon engine of N ranks (vLLM at tensor parallel N, each worker pulling only its slices) takes
deltas cut along its slices (``_cut_deltas_for``). With ``sync.source="memory"`` the delta is
registered from this process's memory as the full version
is (POST /metas ``policy-v<v>.delta``, unregistered after): no file. The delta saves what the daemon
sends its engines (across nodes, the costly part); the job still registers each version in full and
the daemon's ranks can read it in full (heals).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import threading
import time
from collections.abc import Callable, Mapping

import torch

from checkpoint_engine.sharding.delta_sync import Prepared
from ckpt_common import hf_dir
from orchestrator.config import EngineConfig, SyncConfig
from orchestrator.engine_pool.base import RolloutEngine
from orchestrator.engine_pool.daemon_client import DaemonClient, SwitchError, describe_engines, num_ranks, write_version
from orchestrator.engine_pool.daemon_client import (
    shard_size_bytes as shard_size_bytes,  # its importers use it from here
)
from orchestrator.engine_pool.memory_source import MemorySource, memory_source
from orchestrator.engine_pool.pool import EnginePool
from orchestrator.engine_pool.pool_members import SERVING, Member
from orchestrator.engine_pool.pool_servers import BATCH_SIZE
from orchestrator.engine_pool.weight_sync import SyncResult, delta_sender

logger = logging.getLogger(__name__)

MODEL_DIR = "model"  # under the handoff dir: the engines' --model
# what the engines' --model folder leaves out of a model folder: its weights (they come as versions)
NOT_WEIGHTS = shutil.ignore_patterns("*.safetensors", "*.bin", "*.pt", hf_dir.INDEX_FILE)
PARKED = "stopped"  # a pool member whose engine the daemon stopped or put to sleep (colocated, while training)


def _http_engine(config: EngineConfig, url: str):
    """One daemon engine's client (kept under this name for benchmarks/bench_topology.py)."""
    from orchestrator.engine_pool.vllm_http import http_client

    return http_client(config, url, BATCH_SIZE)


class DaemonEnginePool(EnginePool):
    """An EnginePool over the daemon's engines: the daemon heals them, the pool waits for it."""

    def __init__(
        self, members, *, client: DaemonClient, handoff: pathlib.Path, records: list[dict], probe_path: str, **kw
    ) -> None:
        super().__init__(members, **kw)
        self.daemon, self.handoff, self.probe_path = client, handoff, probe_path
        self.records = {i: r for i, r in enumerate(records)}  # each member's engine as the daemon last said
        self.current = "policy-v0"
        self.source: MemorySource | None = None  # start_daemon_pool's, for DaemonWeightSync

    def url_answers(self, url: str) -> bool:
        from ckpt_common.httpjson import status_json

        try:
            code, _ = status_json("GET", url + self.probe_path, timeout_s=5.0)
        except Exception:  # noqa: BLE001 - no answer at all
            return False
        return code == 200

    def _answers(self, member: Member) -> bool:  # the engine's own server, not the daemon
        return self.url_answers(self.records[member.index]["url"])

    def endpoints(self) -> dict[str, str]:
        with self._cond:
            return {m.name: self.records[m.index]["url"] for m in self.members}

    def park(self) -> None:
        """Colocated: the daemon is about to stop every engine; no member takes requests until ``take``."""
        with self._cond:
            engines = [m.engine for m in self.members]
            for m in self.members:
                m.state, m.engine = PARKED, None
            self._cond.notify_all()
        for engine in engines:
            if engine is not None and hasattr(engine, "close"):
                engine.close()

    def take(self, records: list[dict], version: int) -> None:
        """Colocated: the daemon started every engine again (new processes, new URLs) serving ``version``."""
        with self._cond:
            for m in self.members:
                self.records[m.index] = records[m.index]
                m.epoch += 1  # a failure seen by the previous process is ignored
        engines = [self._connect(m) for m in self.members]
        with self._cond:
            for m, engine in zip(self.members, engines):
                m.engine, m.version, m.state = engine, version, SERVING
            self._cond.notify_all()


def write_engine_model(job, out_dir: str | pathlib.Path) -> pathlib.Path:
    """The engines' --model folder for `job` (a JobConfig): its model's config, generation config and
    tokenizer, no weights. `init_model_dir` (your model): its files but the weights; else the demo's
    warm-up model's shape (trainer.sft.write_warmup_model_files). What start_daemon_pool writes beside the
    handoff dir, for a host that does not mount it."""
    if job.init_model_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copytree(
            job.init_model_dir,
            out,
            ignore=NOT_WEIGHTS,
            dirs_exist_ok=True,
        )
        return out
    from trainer.sft import write_warmup_model_files

    return write_warmup_model_files(job.sft, out_dir)


def start_daemon_pool(
    config: EngineConfig,
    model_dir: str,
    handoff_dir: str,
    timeout_s: float,
    *,
    engine_for_url: Callable[[str], RolloutEngine] | None = None,
    probe_path: str = "/v1/models",
    source: MemorySource | None = None,
) -> DaemonEnginePool:
    """The SFT model into the handoff dir, the daemon's engines started on it, a pool over them.

    ``engine_for_url(url)``: the rollout client of one engine (default: vLLM's OpenAI API over HTTP);
    ``probe_path``: what answers 200 while an engine is alive; ``source``: the job's memory source
    (``sync.source="memory"``): the first version goes from this process's memory, not as files."""
    engine_for_url = engine_for_url or (lambda url: _http_engine(config, url))
    client = DaemonClient(config.endpoint, timeout_s)
    records = client.engines()["engines"]
    handoff = pathlib.Path(handoff_dir)
    model = handoff / MODEL_DIR
    if model.exists():
        shutil.rmtree(model)
    # config and tokenizer for vLLM; the weights come from the daemon (--no-initial-push: the load step
    # waits for the first update), so the SFT weights travel once, as the first version's files
    shutil.copytree(model_dir, model, ignore=NOT_WEIGHTS)
    name = "policy-v0"
    if source is not None:  # the daemon's ranks read it from this process (POST /metas)
        client.load_metas(source.publish(name, hf_dir.read_tensors(model_dir)))
    else:
        client.register(name, write_version(handoff, name, hf_dir.read_tensors(model_dir), num_ranks(records)))
    started = time.monotonic()
    client.start_engines(name, timeout_s=config.start_timeout_s)
    records = client.engines()["engines"]
    not_serving = [r for r in records if r.get("state") != "serving"]
    if not_serving:
        raise RuntimeError(f"the daemon's engines did not all start: {not_serving}")
    logger.info("%d daemon engines serving %s in %.1f s", len(records), name, time.monotonic() - started)
    members = [Member(i, engine=engine_for_url(r["url"]), state=SERVING, version=0) for i, r in enumerate(records)]

    def restart(member: Member) -> None:  # the daemon heals; wait until it serves the current version
        current = client.engines().get("current") or name
        pool.records[member.index] = client.wait_serving(
            member.index,
            current,
            config.start_timeout_s,
            replaced_pid=pool.records[member.index].get("pid"),
            still_answers=pool.url_answers,
            stop=pool._closing,
        )

    def connect(member: Member) -> RolloutEngine:
        return engine_for_url(pool.records[member.index]["url"])

    pool = DaemonEnginePool(
        members,
        client=client,
        handoff=handoff,
        records=records,
        probe_path=probe_path,
        max_inflight_per_engine=min(config.max_num_seqs, 256),
        batch_size=BATCH_SIZE,
        restart=restart,
        connect=connect,
    )
    pool.source = source
    return pool


def _update_s(answer: dict) -> float | None:
    """The longest rank's update seconds in the daemon's answer to /engines/start or /engines/wake, if it said."""
    updates = [r.get("result", {}).get("update") for r in answer.get("ranks", []) if isinstance(r.get("result"), dict)]
    return max((u["total_s"] for u in updates if isinstance(u, dict) and "total_s" in u), default=None)


@dataclasses.dataclass(frozen=True)
class DaemonSyncResult(SyncResult):
    switch: dict[str, float] = dataclasses.field(default_factory=dict)  # colocated: switch_to_inference_s


class DaemonWeightSync:
    """Each version as files in the handoff dir, registered with the daemon and pushed into its engines."""

    def __init__(
        self,
        config: SyncConfig,
        pool: DaemonEnginePool,
        *,
        colocated: bool = False,
        start_timeout_s: float = 900.0,
        sleep_level: int = 0,
    ) -> None:
        self.pool = pool
        self.client: DaemonClient = pool.daemon
        self.handoff: pathlib.Path = pool.handoff
        self._current: str | None = pool.current
        self._version = 0
        self._lock = threading.Lock()
        self.colocated, self.start_timeout_s = colocated, start_timeout_s
        self.sleep_level = sleep_level  # colocated: 0 stop/start the engines, 1 or 2 sleep/wake them
        # colocated: the engines are stopped or asleep (training); the next push starts or wakes them
        self._parked = False
        self._registered: str | None = None  # the last version registered with the daemon
        if config.delta and colocated:
            raise ValueError(
                "sync.delta=true needs engines that keep the version they serve between updates; colocated "
                "engines start (or wake) for each version: set sync.delta=false or engine.colocated=false"
            )
        self.delta = delta_sender(config)
        self._delta_tp_size = 1  # the engines' tensor-parallel size the delta sender cuts deltas for
        # sync.source="memory": versions served from this process (memory_source); the pool's when
        # it started the engines from memory
        self.source = pool.source if pool.source is not None else memory_source(config)
        pool.set_bring_up(self.bring_up)

    def before_train(self) -> dict[str, float]:
        """Colocated: stop every engine, or put it to sleep with ``sleep_level`` (inference -> train);
        {"switch_to_train_s": s}. Disaggregated: {}."""
        if not self.colocated:
            return {}
        with self._lock:
            start = time.monotonic()
            self._parked = True  # whatever happens below, the next push starts the engines again
            self.pool.park()
            if self.sleep_level:
                self._sleep()
                return {"switch_to_train_s": time.monotonic() - start}
            try:
                self.client.stop_engines()
                records = self.client.engines()["engines"]
            except Exception as e:
                raise SwitchError(f"colocated switch inference->train: POST /engines/stop failed: {e}") from e
            running = [r for r in records if r.get("state") != "stopped"]
            if running:
                raise SwitchError(
                    f"colocated switch inference->train: engines still running after POST /engines/stop "
                    f"({describe_engines(running)})"
                )
            return {"switch_to_train_s": time.monotonic() - start}

    def _sleep(self) -> None:
        """Colocated inference -> train with ``sleep_level``: every engine asleep (lock held)."""
        route = f"POST /engines/sleep {{level: {self.sleep_level}}}"
        try:
            self.client.sleep_engines(self.sleep_level)
            records = self.client.engines()["engines"]
        except Exception as e:
            # 500: an engine refused to sleep (vLLM without sleep mode); say how to run without it
            hint = (
                ". vLLM sleeps only on CUDA and when started with --enable-sleep-mode; else set "
                "engine.sleep_level=0 (stop and start the engines)"
                if getattr(e, "status", None) == 500
                else ""
            )
            raise SwitchError(f"colocated switch inference->train: {route} failed: {str(e)[:1500]}{hint}") from e
        awake = [r for r in records if r.get("state") != "sleeping"]
        if awake:
            raise SwitchError(
                f"colocated switch inference->train: engines not sleeping after {route} ({describe_engines(records)})"
            )

    def _wake(self, name: str, version: int) -> tuple[float, float | None]:
        """Colocated train -> inference with ``sleep_level``: every engine woken and brought to ``name`` by
        the daemon, then taken by the pool. (seconds, the daemon's update seconds if it said). Engines
        that are not all asleep (a failed switch) are stopped and started instead (``_start``)."""
        start = time.monotonic()
        records = self.client.engines()["engines"]
        if any(r.get("state") != "sleeping" for r in records):
            logger.warning(
                "colocated switch train->inference: not every engine sleeps (%s); stopping them and starting "
                "every engine with %s",
                describe_engines(records),
                name,
            )
            return self._start(name, version)
        route = f"POST /engines/wake {{name: {name}}}"
        try:
            answer = self.client.wake_engines(name, timeout_s=self.start_timeout_s)
        except Exception as e:
            phases = ("engine wake", ("sleeping", "failed"), "engine wake + update")
            next_push = "The next push wakes them if all still sleep, else stops them and starts every engine"
            raise self._failed_switch(route, e, name, phases, next_push) from e
        return self._take(route, name, version, start, answer)

    def _failed_switch(self, route: str, error: Exception, name: str, phases: tuple, next_push: str) -> SwitchError:
        """The error of a failed train -> inference switch, naming the phase the engines' states point to.
        `phases`: (phase when any engine is in one of the states that follow, those states, phase otherwise);
        an engine left incomplete means the update failed."""
        try:
            records = self.client.engines()["engines"]
        except Exception as e2:  # noqa: BLE001 - the daemon itself may be gone: say so instead
            return SwitchError(
                f"colocated switch train->inference: {route} failed: {error}; GET /engines failed too: {e2}"
            )
        states = {r.get("state") for r in records}
        early, early_states, otherwise = phases
        phase = (
            early if states & set(early_states) else f"weight update to {name}" if "incomplete" in states else otherwise
        )
        return SwitchError(
            f"colocated switch train->inference failed in phase '{phase}' ({route}): {str(error)[:1500]}; "
            f"engines now: {describe_engines(records)}. {next_push}"
        )

    def _take(self, route: str, name: str, version: int, start: float, answer: dict) -> tuple[float, float | None]:
        """Every engine serves ``name`` after ``route``: the pool takes them. (seconds, update seconds)."""
        records = self.client.engines()["engines"]
        wrong = [r for r in records if r.get("state") != "serving" or r.get("checkpoint") != name]
        if wrong:
            raise SwitchError(
                f"colocated switch train->inference: after {route} the engines do not all serve {name} "
                f"({describe_engines(wrong)})"
            )
        self.pool.take(records, version)
        return time.monotonic() - start, _update_s(answer)

    def _start(self, name: str, version: int) -> tuple[float, float | None]:
        """Colocated train -> inference: every engine started with dummy weights and brought to ``name`` by
        the daemon, then taken by the pool. (seconds, the daemon's update seconds if it said)."""
        start = time.monotonic()
        records = self.client.engines()["engines"]
        if any(r.get("state") not in ("stopped", "failed") for r in records):
            self.client.stop_engines()  # what a failed switch left (an engine started, an incomplete update)
        try:
            answer = self.client.start_engines(name, timeout_s=self.start_timeout_s + 60.0)
        except Exception as e:
            route = f"POST /engines/start {{name: {name}}}"
            phases = ("engine start (dummy weights)", ("failed", "starting"), "engine start + update")
            raise self._failed_switch(
                route, e, name, phases, "The next push stops them and starts every engine again"
            ) from e
        return self._take("POST /engines/start", name, version, start, answer)

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> SyncResult:
        name = f"policy-v{version}"
        with self._lock:
            start = time.monotonic()
            records = self.client.engines()["engines"]
            if name not in (self._current, self._registered):  # a retried push has its files registered
                if self.source is not None:  # the daemon reads it from this process's memory
                    self.client.load_metas(self.source.publish(name, named_tensors))
                else:
                    files = write_version(self.handoff, name, named_tensors, num_ranks(records))
                    self.client.register(name, files)
                self._registered = name
            if self._parked:
                return self._push_by_start(name, version, named_tensors, start)
            held_here = self.source is None or name in self.source.registered  # heals can read it
            if (
                name == self._current
                and held_here
                and records
                and all(r.get("state") == "serving" and r.get("checkpoint") == name for r in records)
            ):
                return self._already_served(name, version, named_tensors, start)
            # An engine being healed cannot take the update; it is brought to this version by its heal.
            ready = [i for i, r in enumerate(records) if r.get("state") in ("serving", "incomplete")]
            if not ready:
                raise RuntimeError(f"no daemon engine can take weights v{version}: {records}")
            # the daemon selects engines by rank: a tensor-parallel engine's record has its first rank
            ranks = None if len(ready) == len(records) else [records[i].get("rank", i) for i in ready]
            t0 = time.monotonic()
            kind, reason, nbytes = "full", "", None
            if self.delta is not None:
                # a delta only if every engine it reaches serves the base (an incomplete one holds no version)
                held = {records[i].get("checkpoint") if records[i].get("state") == "serving" else None for i in ready}
                self._cut_deltas_for(records, named_tensors)
                prepared = self.delta.prepare(name, named_tensors, held.pop() if len(held) == 1 else None)
                kind, reason = prepared.choice.kind, prepared.choice.reason
                if kind == "delta":
                    kind, reason = self._update_by_delta(name, prepared, ranks, num_ranks(records))
                    nbytes = prepared.nbytes if kind == "delta" else None
                else:
                    self.client.update(name, ranks)
                self.delta.commit(prepared)  # the next delta's base: every engine reached serves this version
                logger.info("weights v%d: %s update (%s)", version, kind, reason)
            else:
                self.client.update(name, ranks)
            update_s = time.monotonic() - t0
            if self._current is not None and self._current != name:
                # the daemon forgets the previous version (its files, or the metas of this process's
                # memory, so that nothing reads that memory once it is released), then it goes here
                self.client.unregister(self._current)
                if self.source is None or self._current not in self.source.registered:  # its files
                    shutil.rmtree(self.handoff / self._current, ignore_errors=True)
                if self.source is not None:  # every earlier version in this process's memory
                    self.source.release(keep=name)
            self._current, self._version = name, version
            for member, epoch in self.pool.sync_targets():
                if member.index in ready:
                    self.pool.weights_in(member, version, epoch)
            total_s = time.monotonic() - start
        if nbytes is None:
            nbytes = sum(t.numel() * t.element_size() for t in named_tensors.values())
        return SyncResult(
            version=version,
            total_s=total_s,
            update_s=update_s,
            total_bytes=nbytes,
            num_buckets=0,
            kind=kind,
            reason=reason,
        )

    def _cut_deltas_for(self, records: list[dict], names) -> None:
        """Deltas cut along the engines' tensor-parallel slices: a daemon engine of N ranks
        (``--ranks-per-engine N``, vLLM at tensor parallel N) has each worker pull only its slices,
        and its cache then holds only those, so it takes a delta only as entries of them (a delta of
        whole tensors it refuses, and the full version follows). The slices come from the engines'
        config.json (``<handoff>/model``) for the job's tensor names."""
        tp_size = max((len(r.get("ranks") or ()) for r in records), default=1) or 1
        if tp_size == self._delta_tp_size:
            return
        import json

        from checkpoint_engine.sharding.delta_slices import tp_delta_slices

        try:
            hf_config = json.loads((self.handoff / MODEL_DIR / "config.json").read_text())
            self.delta.slices = tp_delta_slices(hf_config, tp_size, names)
        except (OSError, ValueError) as e:  # whole-tensor deltas: a sliced engine refuses them, the full goes
            logger.warning("deltas not cut for tensor parallel %d (%s): sent whole", tp_size, e)
            self.delta.slices = None
        else:
            logger.info("deltas cut along the slices of tensor parallel %d engines", tp_size)
        self._delta_tp_size = tp_size

    def _already_served(self, name: str, version: int, named_tensors, start: float) -> SyncResult:
        """Every engine serves ``name``, this sync's current version, already: the job's initial push
        of the version the engines started with (``policy-v0``, or a resumed run's). ``name`` is
        registered once, so an update would send the same bytes again (a full version over every
        link); none is sent. With deltas these tensors become the base."""
        if self.delta is not None:
            prepared = self.delta.prepare(name, named_tensors, name)
            if prepared.choice.kind == "full":
                self.delta.commit(prepared)
        logger.info("weights v%d: every engine serves %s already; no update sent", version, name)
        self._version = version
        return SyncResult(
            version=version,
            total_s=time.monotonic() - start,
            update_s=0.0,
            total_bytes=0,
            num_buckets=0,
            kind="full",
            reason=f"every engine serves {name} already",
        )

    def _update_by_delta(
        self, name: str, prepared: Prepared, ranks: list[int] | None, num_ranks: int
    ) -> tuple[str, str]:
        """The engines of ``ranks`` to ``name`` by its delta (registered beside it, dropped after);
        the full version where an engine refused it. (kind the engines took, why)."""
        delta_name = f"{name}.delta"
        try:
            if self.source is not None:  # from this process's memory, as the full versions: no file
                self.client.load_metas(self.source.publish(delta_name, prepared.tensors))
            else:
                files = write_version(self.handoff, delta_name, prepared.tensors, num_ranks)
                self.client.register(delta_name, files)
            try:
                self.client.update(delta_name, ranks, full_checkpoint=name)
                return "delta", prepared.choice.reason
            except Exception as e:  # noqa: BLE001 - a refused delta: the full version goes (its failure raises)
                reason = f"the engines refused the delta ({str(e)[:500]}); sent the full version"
                logger.warning("%s: %s", name, reason)
                self.client.update(name, ranks)
                return "full", reason
            finally:
                try:
                    self.client.unregister(delta_name)
                except Exception as e:  # noqa: BLE001 - only host memory stays taken: the update's outcome stands
                    # the daemon may still hold its metas: this process keeps the memory they name
                    # until the next push releases every version but the current one
                    logger.warning("could not unregister %s: %s", delta_name, e)
                else:
                    if self.source is not None:
                        self.source.drop(delta_name)
        finally:
            shutil.rmtree(self.handoff / delta_name, ignore_errors=True)

    def _push_by_start(self, name: str, version: int, named_tensors, start: float) -> SyncResult:
        """Colocated: the version reaches the engines as they start or wake (lock held)."""
        switch_s, update_s = self._wake(name, version) if self.sleep_level else self._start(name, version)
        self._parked = False
        if self._current is not None and self._current != name:
            self.client.unregister(self._current)
            shutil.rmtree(self.handoff / self._current, ignore_errors=True)
        self._current, self._version = name, version
        nbytes = sum(t.numel() * t.element_size() for t in named_tensors.values())
        return DaemonSyncResult(
            version=version,
            total_s=time.monotonic() - start,
            update_s=update_s if update_s is not None else switch_s,
            total_bytes=nbytes,
            num_buckets=0,
            switch={"switch_to_inference_s": switch_s},
        )

    def bring_up(self, member: Member) -> None:
        """Healer: the daemon pulled the version that was current when the heal began into the
        restarted engine; if a newer one was pushed meanwhile (to the other engines only), pull that
        one into it too, under the push lock, before it takes rollouts again."""
        with self._lock:
            healed_to = self.pool.records[member.index].get("checkpoint")
            if self._current is not None and healed_to != self._current:
                logger.info("%s was healed to %s; bringing it to %s", member.name, healed_to, self._current)
                self.client.update(self._current, [member.index])
                self.pool.records[member.index] = dict(self.pool.records[member.index], checkpoint=self._current)
            self.pool.weights_in(member, self._version, member.epoch)

    def close(self) -> None:
        self.pool.stop_healing()
        with self._lock:
            if self._current is not None:
                try:
                    self.client.unregister(self._current)
                except Exception as e:  # noqa: BLE001 - the daemon may be gone already
                    logger.warning("could not unregister %s: %s", self._current, e)
                shutil.rmtree(self.handoff / self._current, ignore_errors=True)
            if self.source is not None:
                self.source.close()
