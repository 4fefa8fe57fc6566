"""The one engine process attached to each parameter-server rank (the daemon's `--engine-cmd`): the
daemon's engine commands, run on every rank, and the store the ranks agree through.

The engine is an argv template the user gives (`{port}`, `{rank}`, `{device}` are filled in), e.g.
`python -m checkpoint_engine.engines.plain --port {port}` or `python -m vllm_ext.launch --model DIR
--no-initial-push --port {port}`: this package never imports an engine.

    states          lifecycle states and their pure transition table (the diagram is there)
    config          the command template, the engine's environment, EngineConfig
    process         ManagedEngine: one process (start, health, stop) and its state; its Watchdog
    host            EngineHost, the agreement through the store, engine_start / managed_update /
                    engine_stop / engine_sleep / engine_wake
    daemon/heal     Healer (rank 0): drives the daemon's Driver, so it sits in the daemon's package,
                    above this one (daemon/server.py starts it)

How a death reaches rank 0, and the heal (the daemon wires it; see checkpoint_engine/daemon/server.py):

    rank r: Watchdog thread ── proc.poll() every poll_interval_s ── exited? ──▶ state failed(exit code)
    every state change ──publish(record)──▶ process-group store key  ckpt-engines/engines/<r>
                                        └──▶ metadata store key      engines/<r>/lifecycle (etcd if given)
    rank 0: Healer thread ── reads every rank's record from the process-group store every poll_interval_s
            ── failed (and --auto-heal) ──▶ Driver.run({"op": "engine_start", "ranks": [r], "name": current,
                                                        "heal": true})   (queued behind any running command)
    every rank runs that command: rank r restarts its engine (dummy weights) and waits for health;
    all ranks agree on the outcome (keys agree/<n>/<rank> in the process-group store, waited for with
    the start's own deadline, not a gloo collective bound by the process group's timeout), then call
    update(current, ranks=[r]): rank r's engine pulls from the owners' memory; the other ranks return
    at once and their engines keep serving.

The process-group store (torchrun's TCPStore; two extra client connections per rank, records and
agreements, so neither waits behind the relay's wait) carries the records because it is shared by
all ranks whatever the metadata store is (the in-process default is per process). Every wait has a
deadline: health (`start_timeout_s`), stop (`stop_grace_s`, then SIGKILL of the engine's process
group), the agreements (start deadline + margin), the update (its `timeout_s`).

Tensor-parallel engines (`EngineConfig.ranks_per_engine` N > 1): the ranks form groups of N consecutive
ranks, one engine each, its worker i fed by the group's rank i. The group's first rank runs the
process, publishes its record (with `ranks`: the group) and sends the update request naming every
rank's socket (`engine_update_req_func`, ranks_per_engine=N); the others take part in the agreements
and serve their worker's socket. A command's `ranks` select whole groups (`EngineHost.members`). A
heal pulls (`ps.update(ranks=group)`) even when the group is every rank: with `--p2p-reader engine`
each worker reads only its slices of the owners' memory. With `--p2p-reader engine`, every update of
such engines is a pull too (a broadcast would hand each worker the whole checkpoint).

Engines that take their first weights in their load step (`{rendezvous}` in the template, e.g.
`vllm_ext.launch --load-rendezvous {rendezvous}`): rank r starts its engine and waits until it
listens in its load step (`checkpoint_engine.transport.load_rendezvous`), the ranks agree, then the update of
`name` goes through that load step (on a heal: `update(name, ranks=[r])`, the P2P pull), and rank r
waits for health. vLLM then packs the pulled weights once, during its start, instead of packing dummy
weights and repacking after a push into the healthy engine.

Sleep instead of stop (vLLM's sleep mode, CUDA; colocated training): `engine_sleep` POSTs /sleep?level=N
to each engine (serving -> sleeping); `engine_wake` wakes them (level 1: serving the weights they had).
Engines that slept at level 2 lost their weights: they wake the weights' memory only
(/wake_up?tags=weights), take the update of `name`, then wake their KV cache (tags=kv_cache), so an
engine generates only once it holds complete weights.

Health: GET `health_path` answers 200 once the engine can take an update. For `vllm_ext.launch
--no-initial-push` that is `/version` (vLLM's own, proxied by the gate), not the gate's `/health`,
which opens only after the first update.
"""

from __future__ import annotations

import json

from checkpoint_engine.daemon.store_wait import wait_for_keys
from checkpoint_engine.engines.config import EngineConfig, engine_group
from checkpoint_engine.engines.process import ManagedEngine, Watchdog


class EngineHost:
    """This rank's managed engine, its watchdog, and the store the ranks agree through.

    `store`: a torch.distributed Store shared by all ranks (its own client connection); None only
    with one rank. With `config.ranks_per_engine` N > 1 the ranks form groups of N consecutive ranks,
    one tensor-parallel engine each: the group's first rank (`leads`) runs and publishes it, the
    others only feed its workers in updates. A command's `ranks` select whole groups (`members`)."""

    AGREE_MARGIN_S = 30.0

    def __init__(self, rank: int, world_size: int, config: EngineConfig, *, device: str, publish, store=None):
        if store is None and world_size > 1:
            raise ValueError(f"EngineHost of {world_size} ranks needs a store shared by the ranks")
        n = config.ranks_per_engine
        if world_size % n:
            raise ValueError(
                f"ranks_per_engine={n} must divide the world size {world_size}: each engine's workers are fed "
                "by a group of that many consecutive ranks"
            )
        self.rank, self.world_size, self.config, self.store = rank, world_size, config, store
        self.ranks_per_engine = n
        self.group = engine_group(rank, n)
        self.leads = rank == self.group[0]
        quiet = lambda record: None  # a group's other ranks run no engine: nothing to publish
        self.engine = ManagedEngine(
            rank, config, device=device, publish=publish if self.leads else quiet, ranks=self.group
        )
        self.watchdog = Watchdog(self.engine, config.poll_interval_s)
        self._num_agreements = 0  # every rank runs the same commands, so the counts match

    def members(self, ranks: list[int] | None) -> list[int]:
        """`ranks` (None or empty: all) widened to whole engine groups: a rank selects its group's engine."""
        if not ranks:
            return list(range(self.world_size))
        return sorted({g for r in ranks for g in engine_group(r, self.ranks_per_engine)})

    def runs(self, members: list[int]) -> bool:
        """This rank runs one of the engines of `members` (it leads a group among them)."""
        return self.leads and self.rank in members

    @property
    def start_agreement_timeout_s(self) -> float:
        """Longer than any rank's own start deadline (health wait, then a stop), so no rank is late."""
        return self.config.start_timeout_s + 2 * self.config.stop_grace_s + self.AGREE_MARGIN_S

    def close(self) -> None:
        self.watchdog.close()
        self.engine.stop()


def _agree(host: EngineHost, error: str | None, timeout_s: float) -> dict[int, str]:
    """Every rank's error of a step, {rank: error} of the failed ones, agreed through the store.

    Not a gloo collective: a rank whose engine takes minutes to start would otherwise run the others
    into the process group's timeout; here the deadline is the step's own."""
    if host.world_size == 1:
        return {host.rank: error} if error else {}
    n = host._num_agreements
    host._num_agreements += 1
    keys = [f"agree/{n}/{r}" for r in range(host.world_size)]
    host.store.set(keys[host.rank], json.dumps(error))
    wait_for_keys(host.store, keys, timeout_s)  # quiet; on timeout the missing ranks are named below
    failed = {}
    for r, key in enumerate(keys):
        if not host.store.check([key]):
            failed[r] = f"rank {r} did not report within {timeout_s:g} s"
        elif (e := json.loads(host.store.get(key))) is not None:
            failed[r] = e
    return failed


def _start_and_agree(host: EngineHost, ranks: list[int], wait, what: str, *, abandon: bool) -> dict | None:
    """Start this rank's engine when it is among `ranks`, `wait()` for it, and agree with every rank.

    None when every engine got there; else this rank's result (raises on a rank whose engine failed),
    and with `abandon` an engine of this rank that got there is stopped and marked failed."""
    error = None
    if host.runs(ranks):
        try:
            host.engine.start()
            wait()
        except RuntimeError as e:
            error = str(e)
    failed = _agree(host, error, host.start_agreement_timeout_s)
    if not failed:
        return None
    why = f"engines of ranks {sorted(failed)} {what}"
    if abandon and error is None and host.runs(ranks):
        host.engine.abandon(f"start abandoned: {why}")
    if host.rank in failed:
        raise RuntimeError(failed[host.rank])
    return {"engine": host.engine.record(), "update": f"skipped: {why}"}


def engine_start(host: EngineHost, ps, cmd: dict) -> dict:
    """Start the engines of `ranks` (dummy weights), wait until healthy; with `name`, push it to them.
    Engines that load from the PS (`{rendezvous}`) get `name` in their load step instead."""
    ranks = host.members(cmd.get("ranks"))
    if host.config.loads_from_ps:  # one rank per engine (EngineConfig refuses groups there)
        return _start_loading(host, ps, cmd, ranks)
    # a heal's engine that started while another did not: failed again, the healer retries (bounded)
    skipped = _start_and_agree(host, ranks, host.engine.wait_healthy, "did not start", abandon=bool(cmd.get("heal")))
    if skipped is not None:
        return skipped
    result = {"engine": host.engine.record()}
    if cmd.get("name"):
        # a heal pulls from the owners' memory (P2P where the daemon has Mooncake) even when the
        # restarted engine is the only one: a tensor-parallel engine's workers then read only their slices
        heal = bool(cmd.get("heal"))
        result["update"] = managed_update(host, ps, cmd["name"], ranks, cmd.get("timeout_s"), pull=heal)
        result["engine"] = host.engine.record()
    return result


def _start_loading(host: EngineHost, ps, cmd: dict, ranks: list[int]) -> dict:
    """Start the engines of `ranks`, wait until each sits in its load step, update `name` through it
    (a P2P pull when only some ranks start), then wait until healthy: the engine never holds dummy
    weights and packs its weights once. An engine whose load did not happen is stopped (failed)."""
    from checkpoint_engine.transport.load_rendezvous import PullHint, loader_req_func

    name = cmd.get("name")
    if not name:
        raise RuntimeError("engine_start: these engines load their first weights from the PS: 'name' is required")
    mine = host.rank in ranks
    pull_ranks = None if len(set(ranks)) == host.world_size else sorted(set(ranks))
    if mine:  # a pull: what it will read, for an engine that reads the owners itself to prepare ahead
        host.engine.load_hint = ps.pull_hint(name) if pull_ranks is not None else PullHint()
    # an engine in its load step whose peers failed waits for a load that will not come: stopped
    skipped = _start_and_agree(host, ranks, host.engine.wait_load_step, "did not reach their load step", abandon=True)
    if skipped is not None:
        return skipped
    timeout_s = float(cmd.get("timeout_s") or host.config.update_timeout_s)
    req_func = lambda paths: None  # a rank without a starting engine only serves the pull
    if mine:
        host.engine.begin_load(name)
        alive = lambda: host.engine.poll() is None
        req_func = loader_req_func(host.engine.rendezvous, timeout_s=timeout_s, is_alive=alive, rank=host.rank)
    try:
        metrics = ps.update(name, req_func, timeout=timeout_s, ranks=pull_ranks)
    except Exception as e:
        if mine:
            host.engine.abandon(f"loading {name!r} into the engine failed: {type(e).__name__}: {e}")
        raise
    if mine:
        host.engine.wait_healthy(state="updating")  # vLLM packs, compiles and allocates its cache
        host.engine.end_update(name, None)
    return {
        "engine": host.engine.record(),
        "update": metrics.to_dict() if metrics is not None else {"skipped": "not a receiver"},
    }


def engine_update_req_func(host: EngineHost, name: str, timeout_s: float):
    """The update request into this rank's serving engine, by `config.update_route`, through the engine
    adapter registered in this process (`adapters.engine_req_func`; the daemon's entry point registers
    vLLM's). With vLLM's: auto is the route the engine offers, asked at the update; native: vLLM's
    weight-transfer routes, with `name` as the version vLLM reports; extension: /collective_rpc."""
    from checkpoint_engine.api import http_req_func
    from checkpoint_engine.engines.adapters import engine_req_func

    url, per = host.engine.url, host.ranks_per_engine
    return engine_req_func(
        url,
        route=host.config.update_route,
        rank=host.rank,
        ranks_per_engine=per,
        timeout_s=timeout_s,
        weight_version=name,
        extension=http_req_func(url, rank=host.rank, ranks_per_engine=per, timeout_s=timeout_s),
    )


def managed_update(
    host: EngineHost,
    ps,
    name: str,
    ranks: list[int] | None,
    timeout_s: float | None,
    full_checkpoint: str | None = None,
    *,
    pull: bool = False,
) -> dict:
    """`ps.update(name)` into the managed engines of `ranks` (all by default): updating -> serving/incomplete.

    Every rank calls it. The receivers first agree that each of their engines can take an update, so
    a stopped engine refuses the update on all ranks instead of leaving the others in a collective.
    `full_checkpoint`: `name` is a delta (`checkpoint_engine.sharding.delta_sync`) whose result is that
    registered checkpoint's weights: the engines then serve it by that name (and vLLM reports it).
    `pull`: read from the owners' memory (`ps.update(ranks=...)`) even when every engine takes part."""
    serves = full_checkpoint or name
    members = host.members(ranks)  # every rank of a selected engine's group feeds one of its workers
    mine = host.runs(members)  # this rank runs one of the engines: it asks it, and keeps its state
    refused = _agree(host, host.engine.update_refusal() if mine else None, host.AGREE_MARGIN_S)
    if refused:
        raise RuntimeError(
            refused.get(host.rank) or f"update refused: the engines of ranks {sorted(refused)} cannot take updates"
        )
    if mine:
        try:
            host.engine.begin_update(serves)
        except RuntimeError:
            pass  # it died since the agreement: the update below fails on every rank through its engine
    timeout_s = float(timeout_s or host.config.update_timeout_s)
    # the group's other ranks answer their workers' sockets; the first rank's request names them all
    req_func = engine_update_req_func(host, serves, timeout_s) if mine else (lambda paths: None)
    # tensor-parallel engines whose workers read pulls themselves take every update as a pull: each
    # worker reads only its slices, where a broadcast would give each the whole checkpoint
    pull = pull or (host.ranks_per_engine > 1 and ps.config.update.p2p_reader == "engine")
    pull_ranks = None if len(members) == host.world_size and not pull else members
    try:
        metrics = ps.update(name, req_func, timeout=timeout_s, ranks=pull_ranks)
    except Exception as e:
        if mine:  # a ValueError is a request the PS refused before contacting any engine
            host.engine.end_update(serves, f"{type(e).__name__}: {e}", engine_untouched=isinstance(e, ValueError))
        raise
    if mine:
        host.engine.end_update(serves, None)
    return metrics.to_dict() if metrics is not None else {"skipped": "not a receiver"}


def engine_stop(host: EngineHost, cmd: dict) -> dict:
    if host.runs(host.members(cmd.get("ranks"))):
        host.engine.stop()
    return {"engine": host.engine.record()}


def engine_sleep(host: EngineHost, cmd: dict) -> dict:
    """Put the serving engines of `ranks` to sleep at `level` (1: weights to host memory; 2: dropped)."""
    if host.runs(host.members(cmd.get("ranks"))):
        host.engine.sleep(
            int(cmd.get("level") or 1), timeout_s=float(cmd.get("timeout_s") or host.config.update_timeout_s)
        )
    return {"engine": host.engine.record()}


def engine_wake(host: EngineHost, ps, cmd: dict) -> dict:
    """Wake the sleeping engines of `ranks`; those of `update_ranks` then take `name` (every rank calls
    this: the update is collective). Rank 0 picks `update_ranks` from the records: engines that slept at
    level 2 and those whose weights are not `name`."""
    update_ranks = host.members(cmd["update_ranks"]) if cmd.get("update_ranks") else []
    timeout_s = float(cmd.get("timeout_s") or host.config.update_timeout_s)
    mine = host.runs(host.members(cmd.get("ranks")))
    weights_only = mine and host.rank in update_ranks and host.engine.sleep_level == 2
    error = None
    if mine:
        try:
            host.engine.wake(timeout_s, weights_only=weights_only)
        except RuntimeError as e:
            error = str(e)
    failed = _agree(host, error, timeout_s + host.AGREE_MARGIN_S)
    if failed:
        if host.rank in failed:
            raise RuntimeError(failed[host.rank])
        return {"engine": host.engine.record(), "update": f"skipped: engines of ranks {sorted(failed)} did not wake"}
    result = {"engine": host.engine.record()}
    try:
        if update_ranks:
            result["update"] = managed_update(host, ps, cmd["name"], update_ranks, timeout_s)
    finally:
        if weights_only:  # also after a failed update: the engine stays incomplete, not half asleep
            host.engine.finish_wake(timeout_s)
    result["engine"] = host.engine.record()
    return result
