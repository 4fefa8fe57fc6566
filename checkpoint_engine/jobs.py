"""From the global view of a checkpoint to one update's job on this rank.

    GlobalMetas (gather_metas / load_metas)       what every rank knows about one checkpoint
    make_job:  all_gather budgets + can-map flags  -> bucket size -> plan -> digests agree
               choose_mode(...)                    -> "collective" | "local" | "p2p" | "p2p_engine"
               make_source(mode, ...)              -> the BucketSource of that mode (sources.py)
               -> pipeline.UpdateJob               what every mode shares, plus the source

`choose_mode` and `make_source` are pure (table-tested); `make_job` runs two small all_gathers over
the ranks taking part.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import psutil
import torch
import torch.distributed as dist
import zmq

from checkpoint_engine.buckets import (
    TensorMeta,
    check_global_metas,
    choose_bucket_size,
    pipeline_min_bytes,
    plan_buckets,
    plan_digest,
)
from checkpoint_engine.collectives import all_gather_obj
from checkpoint_engine.config import UpdateConfig
from checkpoint_engine.host_memory import RegisteredCheckpoint
from checkpoint_engine.pipeline import UpdateJob
from checkpoint_engine.protocol import BufferHandle
from checkpoint_engine.sources import (
    BucketSource,
    CollectiveSource,
    EngineP2PSource,
    LocalSource,
    P2PSource,
    RelaySource,
)
from checkpoint_engine.transport.devices import Transport
from checkpoint_engine.transport.mooncake import P2PStore
from checkpoint_engine.types import Mode, ReqFunc, RequestedMode


@dataclass(frozen=True)
class GlobalMetas:
    """What every rank knows about one checkpoint: the owners' side and this job's side.

    Owners (ranks holding tensors): `rank_metas`, `chunk_handles`, `p2p_addrs`, `chunk_ptrs`,
    `owner_pids`, `owner_hosts`. This job (every rank): `device_ids`, `pids`, `hosts` (engine
    addresses, dead-rank checks). After `gather_metas` both describe this job; `load_metas` of another
    job's metas replaces the owners' side only (the join flow), so owners may live in another job.
    """

    checkpoint: str
    rank_metas: dict[int, tuple[TensorMeta, ...]]
    device_ids: tuple[str, ...]
    pids: tuple[int, ...]
    hosts: tuple[str, ...]
    checksums: dict[str, int] | None
    chunk_handles: dict[int, list[BufferHandle]]  # per rank: memfd handles of its chunks (CPU)
    p2p_addrs: dict[int, str] = field(default_factory=dict)  # per owner rank: Mooncake address
    chunk_ptrs: dict[int, list[int]] = field(default_factory=dict)  # per owner rank: chunk addresses
    owner_pids: dict[int, int] = field(default_factory=dict)  # per owner rank: its PS process
    owner_hosts: dict[int, str] = field(default_factory=dict)  # per owner rank: its host
    job_local: bool = field(default=True, compare=False)  # device_ids/pids/hosts are this job's (not sent)

    def __post_init__(self) -> None:
        for r in self.rank_metas:  # metas of older writers: owners are ranks of the job described
            if r < len(self.pids):
                self.owner_pids.setdefault(r, self.pids[r])
                self.owner_hosts.setdefault(r, self.hosts[r])

    @property
    def owners_described(self) -> bool:
        """Every owner rank has its own process and host recorded: the metas may come from a job of
        another size (a trainer's world of one feeding a daemon of many), whose next update gathers
        this job's side (`ParameterServer._with_job_info`)."""
        return bool(self.rank_metas) and all(r in self.owner_pids and r in self.owner_hosts for r in self.rank_metas)

    @property
    def owners_in_job(self) -> bool:
        """True when every owner rank is the rank of the same number in this job (same process)."""
        return all(
            r < len(self.pids) and self.owner_pids.get(r) == self.pids[r] and self.owner_hosts.get(r) == self.hosts[r]
            for r in self.rank_metas
        )

    @classmethod
    def from_gathered(cls, everyone: list[dict], verify_checksums: bool) -> GlobalMetas:
        """The global view from every rank's `gather_metas` entry (rank order): name, metas,
        checksums, device_id, pid, host, chunks (memfd fd triples), p2p_addr, chunk_ptrs."""
        names = {r: e["name"] for r, e in enumerate(everyone)}
        if len(set(names.values())) != 1:
            raise ValueError(f"gather_metas called with different checkpoint names on different ranks: {names}")
        owners = [r for r, e in enumerate(everyone) if e["metas"]]
        rank_metas = {r: tuple(TensorMeta.from_wire(x) for x in e["metas"]) for r, e in enumerate(everyone)}
        check_global_metas(rank_metas)
        checksums = None
        if verify_checksums:
            checksums = {k: v for e in everyone for k, v in (e["checksums"] or {}).items()}
        handles = {
            r: [BufferHandle(kind="fd", pid=p, fd=f, size_bytes=n) for p, f, n in e["chunks"]]
            for r, e in enumerate(everyone)
            if e["chunks"]
        }
        return cls(
            everyone[0]["name"],
            {r: ms for r, ms in rank_metas.items() if ms},
            tuple(e["device_id"] for e in everyone),
            tuple(e["pid"] for e in everyone),
            tuple(e["host"] for e in everyone),
            checksums,
            handles,
            {r: everyone[r]["p2p_addr"] for r in owners if everyone[r]["p2p_addr"]},
            {r: everyone[r]["chunk_ptrs"] for r in owners},
            {r: everyone[r]["pid"] for r in owners},
            {r: everyone[r]["host"] for r in owners},
        )

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "device_ids": list(self.device_ids),
            "pids": list(self.pids),
            "hosts": list(self.hosts),
            "ranks": {str(r): [m.to_wire() for m in ms] for r, ms in self.rank_metas.items()},
            "chunk_handles": {
                str(r): [[h.pid, h.fd, h.size_bytes] for h in hs] for r, hs in self.chunk_handles.items()
            },
            "p2p_addrs": {str(r): a for r, a in self.p2p_addrs.items()},
            "chunk_ptrs": {str(r): ps for r, ps in self.chunk_ptrs.items()},
            "owner_pids": {str(r): p for r, p in self.owner_pids.items()},
            "owner_hosts": {str(r): h for r, h in self.owner_hosts.items()},
            "checksums": self.checksums,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> GlobalMetas:
        try:
            ranks = {int(r): tuple(TensorMeta.from_wire(x) for x in ms) for r, ms in d["ranks"].items()}
            handles = {
                int(r): [BufferHandle(kind="fd", pid=int(p), fd=int(f), size_bytes=int(n)) for p, f, n in hs]
                for r, hs in d.get("chunk_handles", {}).items()
            }
            return cls(
                str(d["checkpoint"]),
                ranks,
                tuple(str(x) for x in d["device_ids"]),
                tuple(int(x) for x in d["pids"]),
                tuple(str(x) for x in d["hosts"]),
                d.get("checksums"),
                handles,
                {int(r): str(a) for r, a in d.get("p2p_addrs", {}).items()},
                {int(r): [int(p) for p in ps] for r, ps in d.get("chunk_ptrs", {}).items()},
                {int(r): int(p) for r, p in d.get("owner_pids", {}).items()},
                {int(r): str(h) for r, h in d.get("owner_hosts", {}).items()},
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"malformed metas: {e!r}") from None

    def with_job(self, device_ids, pids, hosts) -> GlobalMetas:
        """These metas' owners, with this job's per-rank info."""
        return replace(
            self,
            device_ids=tuple(device_ids),
            pids=tuple(pids),
            hosts=tuple(hosts),
            owner_pids=dict(self.owner_pids),
            owner_hosts=dict(self.owner_hosts),
            job_local=True,
        )


def engine_can_map_owners(g: GlobalMetas, transport: Transport) -> bool:
    """Our engine (on this host) can map every owner's chunks: CPU transport, owners on this host."""
    here = socket.gethostname()
    return transport.engines_map_host_chunks and all(
        g.owner_hosts.get(r) == here and g.chunk_handles.get(r) for r in g.rank_metas
    )


def choose_mode(
    g: GlobalMetas,
    requested: RequestedMode,
    *,
    pull: bool,
    cannot_map: list[int],
    have_p2p: bool,
    backend: str,
    p2p_reader: str = "rank",
) -> Mode:
    """`local` when every taking part rank's engine can map the owners' chunks (and `requested` allows);
    otherwise a broadcast (`collective`) or, for a pull (`ranks=[...]`, owners in another job), Mooncake.

    `cannot_map`: ranks whose engine cannot map every owner's chunks; `have_p2p`: this PS has a
    Mooncake transfer engine; `backend`: the transport's, named in errors; `p2p_reader`: "engine"
    turns a Mooncake pull into "p2p_engine" (the engines read it themselves).
    """
    local_ok = not cannot_map
    # "relay" is how versions from another job arrive; a version this job's ranks own (registered here,
    # or kept after its relay: UpdateConfig.keep_relayed, for heals) moves as under "auto"
    if requested == "relay" and not local_ok and not g.owners_in_job:
        if not have_p2p:
            raise ValueError("mode='relay' reads the owners over Mooncake: start the parameter servers with p2p")
        missing = [r for r in g.rank_metas if r not in g.p2p_addrs]
        if missing:
            raise ValueError(f"owner ranks {missing} of {g.checkpoint!r} have no P2P address: start them with p2p")
        return "relay"
    if requested == "local" and not local_ok:
        raise ValueError(
            "mode='local' needs every owner on the receivers' host with CPU transport (ranks "
            f"{cannot_map} cannot map the owners' chunks; owner hosts: "
            f"{sorted(set(g.owner_hosts.values()))}, transport: {backend})"
        )
    if local_ok and requested in ("auto", "local", "relay"):
        return "local"
    if not pull:
        return "collective"
    if local_ok and not have_p2p:
        return "local"  # mode='collective' asked for moving bytes, but there is no Mooncake: read in place
    if not have_p2p:
        where = (
            "the owners are in another job: " if not g.owners_in_job else ""
        ) + f"ranks {cannot_map} cannot map the owners' chunks (owner hosts {sorted(set(g.owner_hosts.values()))})"
        raise ValueError(
            f"update of {g.checkpoint!r} from the owners' memory: {where}; across hosts (or with the "
            "CUDA transport) start every parameter server with ParameterServerConfig(p2p=P2PConfig(...))"
        )
    missing = [r for r in g.rank_metas if r not in g.p2p_addrs]
    if missing:
        raise ValueError(
            f"owner ranks {missing} of {g.checkpoint!r} have no P2P address: start every "
            "parameter server with p2p enabled"
        )
    if p2p_reader == "engine":
        if backend != "gloo":
            raise ValueError(
                f"p2p_reader='engine' reads into host memory; with the {backend} transport the ranks read the pull"
            )
        return "p2p_engine"
    return "p2p"


def make_source(mode: Mode, g: GlobalMetas, ckpt: RegisteredCheckpoint | None, p2p: P2PStore | None) -> BucketSource:
    """The bucket source of `mode`, holding only what that mode reads from the metas.

    `ckpt`: this rank's registered shard when the owners are this job's ranks, else None.
    """
    if mode == "collective":
        return CollectiveSource(ckpt)
    if mode == "local":
        return LocalSource(g.chunk_handles)
    if mode == "p2p":
        if p2p is None:
            raise ValueError("mode 'p2p' needs a Mooncake transfer engine (ParameterServerConfig(p2p=...))")
        return P2PSource(ckpt, p2p, g.p2p_addrs, g.chunk_ptrs)
    if mode == "p2p_engine":
        if p2p is None:
            raise ValueError("mode 'p2p_engine' needs a Mooncake transfer engine (ParameterServerConfig(p2p=...))")
        return EngineP2PSource(ckpt, p2p.cfg.host, g.p2p_addrs, g.chunk_ptrs, g.chunk_handles)
    if mode == "relay":
        if p2p is None:
            raise ValueError("mode 'relay' needs a Mooncake transfer engine (ParameterServerConfig(p2p=...))")
        return RelaySource(p2p, g.p2p_addrs, g.chunk_ptrs, g.owner_hosts)
    raise ValueError(f"unknown update mode {mode!r}")


def memory_budget_bytes(cfg: UpdateConfig, transport: Transport, fraction: float) -> int:
    """Bytes the double buffer may take: the config's, else `fraction` of free GPU or host memory."""
    if cfg.memory_budget_bytes is not None:
        return cfg.memory_budget_bytes
    if transport.backend == "nccl":
        return int(torch.cuda.mem_get_info()[0] * fraction)
    return int(psutil.virtual_memory().available * fraction)


def zmq_address(pid: int, rank: int, seq: int) -> str:
    """The engine link of `rank` (PS process `pid`) for update number `seq`."""
    return f"ipc://@ckpt-engine-{pid}-r{rank}-u{seq}.sock"


def make_job(
    g: GlobalMetas,
    req_func: ReqFunc,
    cfg: UpdateConfig,
    *,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
    members: list[int],
    pull: bool,
    seq: int,
    update_id: str,
    budget_bytes: int,
    transport: Transport,
    zmq_ctx: zmq.Context,
    ckpt: RegisteredCheckpoint | None,
    p2p: P2PStore | None,
) -> UpdateJob:
    """Collective over `members`: agree on the bucket plan and the mode, and build this rank's job.

    `ckpt`: this rank's registered shard of `g.checkpoint` when the owners are this job, else None.
    """
    n = len(members)
    # one small exchange: memory budgets, the update number, whether our engine can map every owner's chunks
    budgets = all_gather_obj([budget_bytes, seq, engine_can_map_owners(g, transport)], n, group)
    if len({b[1] for b in budgets}) != 1:
        raise RuntimeError(f"ranks disagree on the update sequence number: {[b[1] for b in budgets]}")
    cannot_map = [r for r, b in zip(members, budgets) if not b[2]]
    mode = choose_mode(
        g,
        cfg.mode,
        pull=pull,
        cannot_map=cannot_map,
        have_p2p=p2p is not None,
        backend=transport.backend,
        p2p_reader=cfg.p2p_reader,
    )
    bucket_size = choose_bucket_size(
        g.rank_metas,
        requested_bytes=cfg.bucket_size_bytes,
        default_bytes=cfg.default_bucket_size_bytes,
        budget_bytes=min(b[0] for b in budgets),
        pipeline_min_bytes=pipeline_min_bytes(mode),
    )
    buckets = plan_buckets(g.rank_metas, bucket_size)
    digests = all_gather_obj(plan_digest(buckets).hex(), n, group)
    if len(set(digests)) != 1:
        groups: dict[str, list[int]] = {}
        for r, d in zip(members, digests):
            groups.setdefault(d, []).append(r)
        raise ValueError(
            f"metas of {g.checkpoint!r} differ between ranks (ranks grouped by identical plans: "
            f"{sorted(groups.values())}); gather_metas/load_metas must give every rank the same view"
        )
    addresses = [(g.device_ids[r], zmq_address(g.pids[r], r, seq)) for r in range(world_size)]
    return UpdateJob(
        rank=rank,
        world_size=world_size,
        group=group,
        members=members,
        checkpoint=g.checkpoint,
        buckets=buckets,
        bucket_size_bytes=bucket_size,
        checksums=g.checksums,
        source=make_source(mode, g, ckpt, p2p),
        transport=transport,
        zmq_ctx=zmq_ctx,
        address=addresses[rank][1],
        addresses=addresses,
        req_func=req_func,
        cfg=cfg,
        update_id=update_id,
        pids=g.pids,
        hosts=g.hosts,
    )
