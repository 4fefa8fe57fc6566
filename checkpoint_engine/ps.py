"""ParameterServer: one rank per inference device; holds the newest weights in host memory and
pushes them into the engines (call-compatible with MoonshotAI's checkpoint-engine).

    register_checkpoint(name, files | named_tensors)   host chunks (this rank's shard)
    gather_metas(name)                                  all_gather of metas -> global view, per name
    update(name, req_func)                              jobs.make_job -> pipeline.run_update
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from checkpoint_engine.buckets import check_global_metas
from checkpoint_engine.collectives import all_gather_obj
from checkpoint_engine.config import ParameterServerConfig
from checkpoint_engine.errors import CheckpointExists, CheckpointNotFound, UpdateFailed
from checkpoint_engine.host_memory import (
    HostMemoryPool,
    RegisteredCheckpoint,
    adopt_shared_buffer,
    find_shared_buffer,
    register_tensors,
)
from checkpoint_engine.jobs import GlobalMetas, make_job, memory_budget_bytes
from checkpoint_engine.metadata import CheckpointRegistry, MetadataStore, make_store
from checkpoint_engine.pipeline import run_update
from checkpoint_engine.transport.devices import make_transport
from checkpoint_engine.transport.load_rendezvous import PullHint
from checkpoint_engine.transport.mooncake import P2PStore
from checkpoint_engine.update_metrics import UpdateMetrics, append_jsonl

logger = logging.getLogger(__name__)


def _env_int(value: int | None, var: str) -> int:
    if value is not None:
        return value
    if var not in os.environ:
        raise ValueError(f"{var.lower()} not given and ${var} is not set (launch with torchrun or pass it)")
    return int(os.environ[var])


class ParameterServer:
    def __init__(
        self,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        auto_pg: bool = True,
        gpu_count: int | None = None,
        mem_fraction: float | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        config: ParameterServerConfig | None = None,
        metadata_store: MetadataStore | None = None,
    ):
        """`rank`/`world_size`/`master_*` default to torchrun's environment (RANK, WORLD_SIZE, ...)."""
        self._rank = _env_int(rank, "RANK")
        self._world_size = _env_int(world_size, "WORLD_SIZE")
        if not 0 <= self._rank < self._world_size:
            raise ValueError(f"rank must be in [0, world_size={self._world_size}), got {self._rank}")
        if mem_fraction is not None and not 0 < mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
        self.config = config or ParameterServerConfig()
        self._mem_fraction = 0.9 if mem_fraction is None else mem_fraction
        count = gpu_count if gpu_count is not None else max(torch.cuda.device_count(), 1)
        self._local_rank = int(os.environ.get("LOCAL_RANK", self._rank % count))
        self._transport = make_transport(self.config.transport, self._local_rank)
        self._host_pool = HostMemoryPool(self._transport.alloc_host, enabled=self.config.reuse_host_memory)
        self._shared_pool = HostMemoryPool(self._transport.alloc_host, enabled=True)  # use_shared_memory_pool
        self._shared_pool_user: str | None = None
        self._auto_pg = auto_pg
        self._master_addr = master_addr
        self._master_port = master_port
        self._zmq_ctx = zmq.Context()
        self._checkpoints: dict[str, RegisteredCheckpoint] = {}
        self._global: dict[str, GlobalMetas] = {}
        self._last_gathered: str | None = None
        self._update_seq = 0
        self._owns_pg = False
        self._run_id = uuid.uuid4().hex[:8]
        self.last_metrics: UpdateMetrics | None = None
        self._broken: str | None = None  # why no update can run any more (see _note_if_broken)
        self._failed_updates: list[BaseException] = []
        self._p2p = P2PStore(self.config.p2p) if self.config.p2p is not None else None
        self.registry = CheckpointRegistry(
            metadata_store if metadata_store is not None else make_store(self.config.metadata_url)
        )

    # -- properties -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device_id(self) -> str:
        """This rank's device id: the key of its engine's entry in the list req_func receives."""
        return self._transport.device_id(self._rank)

    def checkpoints(self) -> dict[str, dict]:
        return {
            n: {"num_tensors": len(c.layout.metas), "nbytes": c.nbytes, "gathered": n in self._global}
            for n, c in self._checkpoints.items()
        }

    # -- process group ----------------------------------------------------------------------
    def init_process_group(self, *, timeout: timedelta | None = None) -> None:
        if dist.is_initialized():
            return
        timeout = timeout or timedelta(seconds=self.config.collective_timeout_s)
        if self._master_port is not None:
            addr = self._master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            init = f"tcp://{addr}:{self._master_port}"
        else:
            init = "env://"
        dist.init_process_group(
            self._transport.backend, init_method=init, rank=self._rank, world_size=self._world_size, timeout=timeout
        )
        self._owns_pg = True
        logger.info(
            "rank %d: process group ready (%s, world %d)", self._rank, self._transport.backend, self._world_size
        )

    def _ensure_pg(self) -> None:
        if self._world_size == 1:
            return
        if not dist.is_initialized():
            if not self._auto_pg:
                raise RuntimeError("no process group: call init_process_group() or create one (auto_pg=False)")
            self.init_process_group()
        if dist.get_world_size() != self._world_size or dist.get_rank() != self._rank:
            raise RuntimeError(
                f"process group is rank {dist.get_rank()}/{dist.get_world_size()} but this "
                f"ParameterServer is rank {self._rank}/{self._world_size}"
            )

    # -- registration -----------------------------------------------------------------------
    def register_checkpoint(
        self,
        checkpoint_name: str,
        *,
        files: Sequence[str] | None = None,
        named_tensors: Mapping[str, torch.Tensor] | None = None,
        use_shared_memory_pool: bool = False,
        use_inplace_pin_memory: bool = True,
        **unknown,
    ) -> None:
        """Copy this rank's shard of `checkpoint_name` into host memory (both sources may be given).

        MoonshotAI's options, accepted with this meaning here:
        `use_shared_memory_pool`: the chunks come from one shared pool kept across checkpoints: when
        the checkpoint is unregistered its chunks stay allocated (and mapped by the engines) for the
        next shared-pool registration of the same sizes, whatever `reuse_host_memory` says. One
        registered checkpoint may use the pool at a time.
        `use_inplace_pin_memory`: accepted and ignored. Files are always copied into the PS's own
        chunks (memfd on CPU, pinned on CUDA) and never removed (MoonshotAI pins /dev/shm files in
        place on CUDA and deletes them).

        Zero copy (ours): with the CPU transport, `named_tensors` that are the views of a
        `host_memory.SharedTensorBuffer` made in this process (and no `files`, no shared pool) are
        adopted: that buffer's memfd segment becomes the checkpoint's chunk, nothing is copied, and
        the buffer is released for writing again by `unregister_checkpoint` (see its docstring).
        """
        if unknown:
            raise TypeError(
                f"register_checkpoint() got unexpected keyword argument(s) {sorted(unknown)}; it accepts "
                "files, named_tensors, use_shared_memory_pool, use_inplace_pin_memory"
            )
        for flag, v in (
            ("use_shared_memory_pool", use_shared_memory_pool),
            ("use_inplace_pin_memory", use_inplace_pin_memory),
        ):
            if not isinstance(v, bool):
                raise TypeError(f"{flag} must be a bool, got {v!r}")
        if not checkpoint_name or not isinstance(checkpoint_name, str):
            raise ValueError(f"checkpoint name must be a non-empty string, got {checkpoint_name!r}")
        if checkpoint_name in self._checkpoints:
            raise CheckpointExists(f"checkpoint {checkpoint_name!r} is already registered; unregister it first")
        pool = self._host_pool
        if use_shared_memory_pool:
            if self._shared_pool_user is not None:
                raise ValueError(
                    f"the shared memory pool is used by checkpoint {self._shared_pool_user!r}; "
                    "unregister it before registering another one with use_shared_memory_pool=True"
                )
            pool = self._shared_pool
        shared = None
        if named_tensors and not files and not use_shared_memory_pool and self._transport.engines_map_host_chunks:
            shared = find_shared_buffer(named_tensors, self.config.align_bytes)
        if shared is not None:
            ckpt = adopt_shared_buffer(checkpoint_name, named_tensors, shared)
        else:
            try:
                ckpt = register_tensors(
                    checkpoint_name,
                    files=files,
                    named_tensors=named_tensors,
                    alloc_host=pool.alloc,
                    align_bytes=self.config.align_bytes,
                    max_chunk_bytes=self.config.max_chunk_bytes,
                )
            finally:
                pool.trim()  # what this registration did not reuse
        if use_shared_memory_pool:
            self._shared_pool_user = checkpoint_name
        if self._p2p is not None:
            for c in ckpt.chunks:
                self._p2p.register(c.tensor.data_ptr(), c.tensor.numel())
        self._checkpoints[checkpoint_name] = ckpt

    def unregister_checkpoint(self, checkpoint_name: str, force: bool = False) -> None:
        """Free the checkpoint's host memory (with ``reuse_host_memory``: at the next registration)."""
        if checkpoint_name not in self._checkpoints:
            raise CheckpointNotFound(
                f"checkpoint {checkpoint_name!r} is not registered (have: {sorted(self._checkpoints)})"
            )
        ckpt = self._checkpoints.pop(checkpoint_name)
        if self._shared_pool_user == checkpoint_name:
            self._shared_pool_user = None
        if self._p2p is not None:
            for c in ckpt.chunks:
                self._p2p.unregister(c.tensor.data_ptr())
        ckpt.close()
        if self._global.pop(checkpoint_name, None) is not None and self._rank == 0:
            self.registry.forget(checkpoint_name)

    # -- metas ------------------------------------------------------------------------------
    def gather_metas(self, checkpoint_name: str) -> None:
        """Collective: every rank learns every rank's tensor metas for `checkpoint_name`.

        A name no rank registered is allowed (the join flow): the ranks then only learn each other's
        device ids, pids and hosts, and `load_metas` adds the owners (another job) before `update`.
        """
        self._ensure_pg()
        ckpt = self._checkpoints.get(checkpoint_name)
        mine = {
            "name": checkpoint_name,
            "metas": [m.to_wire() for m in ckpt.layout.metas] if ckpt else [],
            "checksums": ckpt.checksums() if ckpt and self.config.verify_checksums else None,
            "device_id": self._transport.device_id(self._rank),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "registered": ckpt is not None,
            "chunks": [[c.handle.pid, c.handle.fd, c.handle.size_bytes] for c in ckpt.chunks if c.handle is not None]
            if ckpt
            else [],
            "p2p_addr": self._p2p.addr if self._p2p is not None else None,
            "chunk_ptrs": [c.tensor.data_ptr() for c in ckpt.chunks] if ckpt else [],
        }
        g = GlobalMetas.from_gathered(all_gather_obj(mine, self._world_size), self.config.verify_checksums)
        self._global[checkpoint_name] = g
        self._last_gathered = checkpoint_name
        if not g.rank_metas:  # the join flow: a new job learns its own ranks' info, then load_metas(owners' metas)
            logger.info(
                "rank %d: %r is registered on no rank of this job; load_metas() must name its owners",
                self._rank,
                checkpoint_name,
            )
            return
        if self._rank == 0:
            self.registry.publish_metas(checkpoint_name, g.to_dict())
        self._preconnect(g)
        n = sum(len(ms) for ms in g.rank_metas.values())
        logger.info(
            "rank %d: gathered metas of %r: %d tensors on %d ranks", self._rank, checkpoint_name, n, len(g.rank_metas)
        )

    def _preconnect(self, g: GlobalMetas) -> None:
        """Open the P2P connections to the other owners now, in the background: a pull's first read from
        a peer otherwise pays the transfer engine's handshake (0.1-0.2 s on loaded CPUs, more than
        reading 8 MB once connected), and a heal comes long after the metas were gathered."""
        if self._p2p is not None:
            self._p2p.connect_in_background(_owner_peers(g, exclude=self._p2p.addr))

    def pull_hint(self, checkpoint_name: str) -> PullHint:
        """What a pull of `checkpoint_name` into this rank's engine will read, for an engine that reads
        the owners itself to prepare while it starts (`load_rendezvous.PullHint`): the (Mooncake
        address, a registered chunk address) of every owner but this rank, and, with
        `p2p_reader="engine"`, every tensor of the checkpoint. Empty when its metas are not gathered
        here; no peers when its owners have no transfer engine."""
        g = self._global.get(checkpoint_name)
        if g is None:
            return PullHint()
        peers = _owner_peers(g, exclude=self._p2p.addr if self._p2p is not None else None)
        tensors: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        if self.config.update.p2p_reader == "engine":
            for _, metas in sorted(g.rank_metas.items()):
                for m in metas:
                    tensors.setdefault(m.name, (m.name, m.dtype, tuple(m.shape)))
        return PullHint(tuple(peers), tuple(tensors.values()))

    def get_metas(self, checkpoint_name: str | None = None) -> dict:
        """The global metas (JSON-ready) of `checkpoint_name` or of the last gathered checkpoint."""
        name = checkpoint_name or self._last_gathered
        if name is None or name not in self._global:
            raise CheckpointNotFound(f"no gathered metas for {name!r}; call gather_metas first")
        return self._global[name].to_dict()

    def load_metas_from_store(self, checkpoint_name: str) -> None:
        """Load the metas another instance published (etcd) for `checkpoint_name`."""
        metas = self.registry.metas(checkpoint_name)
        if metas is None:
            raise ValueError(
                f"no metas for {checkpoint_name!r} in the metadata store (it has: {self.registry.checkpoints()})"
            )
        self.load_metas(metas)

    def load_metas(self, metas: Mapping) -> None:
        """Take the owners' side of `metas` (what `get_metas()` returned, here or in another job).

        When `gather_metas` of the same name ran in this job before, this job's device ids, pids and
        hosts are kept (engine addresses, dead-rank checks) and only the owners' tensor metas, chunk
        handles, P2P addresses and chunk pointers are taken. Otherwise the next `update` first
        gathers this job's rank info (every rank calls `update`). Local: no collective here.
        """
        if not isinstance(metas, Mapping):
            raise TypeError(f"metas must be the dict get_metas() returned, got {type(metas).__name__}")
        g = GlobalMetas.from_dict(metas)
        if len(g.device_ids) != self._world_size and not g.owners_described:
            raise ValueError(f"metas describe {len(g.device_ids)} ranks but this world has {self._world_size}")
        if not len(g.device_ids) == len(g.pids) == len(g.hosts):
            raise ValueError(
                f"malformed metas: device_ids, pids and hosts differ in length ({len(g.device_ids)}, "
                f"{len(g.pids)}, {len(g.hosts)})"
            )
        check_global_metas(g.rank_metas)
        if not g.rank_metas:
            raise ValueError(
                f"metas of {g.checkpoint!r} name no owner rank (were they gathered where it is registered?)"
            )
        mine = self._global.get(g.checkpoint)
        if mine is not None and mine.job_local:
            g = g.with_job(mine.device_ids, mine.pids, mine.hosts)
        else:
            g = replace(g, job_local=False)
        self._global[g.checkpoint] = g
        self._last_gathered = g.checkpoint
        self._preconnect(g)

    def _with_job_info(self, g: GlobalMetas) -> GlobalMetas:
        """Collective over every rank: this job's device ids, pids and hosts in place of the loaded ones."""
        mine = [self._transport.device_id(self._rank), os.getpid(), socket.gethostname()]
        everyone = all_gather_obj(mine, self._world_size)
        g = g.with_job(*zip(*everyone))
        self._global[g.checkpoint] = g
        return g

    # -- update -----------------------------------------------------------------------------
    def update(
        self,
        checkpoint_name: str,
        req_func: Callable[[list[tuple[str, str]]], None],
        *,
        timeout: timedelta | float | None = None,
        ranks: list[int] | None = None,
    ) -> UpdateMetrics | None:
        """Collective: push `checkpoint_name` into the engines. Every rank must call it.

        `ranks=None` or `[]`: every rank's engine (broadcast, or local mode on one CPU host).
        `ranks=[...]`: only those ranks' engines pull the weights from the owners' registered memory;
        the other ranks return None at once and their engines keep serving. Owners on this host with
        the CPU transport: the engines read the owners' chunks directly (local mode, nothing to
        configure); else through Mooncake (`ParameterServerConfig(p2p=P2PConfig(...))` on owners and
        receivers). Owners must keep the checkpoint registered until the receivers are done.
        Owners in another job (`load_metas`) are always pulled from, also with `ranks=None`.
        """
        if req_func is None or not callable(req_func):
            raise ValueError("req_func must be a callable taking the list of (device_id, zmq_address) pairs")
        if self._broken is not None:
            raise RuntimeError(
                f"rank {self._rank}: this parameter server cannot update any more ({self._broken}): restart it"
            )
        members = self.check_update(checkpoint_name, ranks)
        g = self._global[checkpoint_name]
        self._ensure_pg()
        if not g.job_local:
            g = self._with_job_info(g)
        cfg = self.config.update
        if timeout is not None:
            secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            cfg = replace(cfg, engine_connect_timeout_s=secs, engine_timeout_s=secs, req_func_timeout_s=secs)
        seq = self._update_seq
        self._update_seq += 1
        pull = bool(ranks) or not g.owners_in_job
        group = None
        if pull:
            group = dist.new_group(members) if self._world_size > 1 else None  # collective over every rank
            if self._rank not in members:
                return None  # not a receiver: our engine keeps serving, undisturbed
        publish, job, metrics = False, None, None
        try:
            job = make_job(
                g,
                req_func,
                cfg,
                rank=self._rank,
                world_size=self._world_size,
                group=group,
                members=members,
                pull=pull,
                seq=seq,
                update_id=f"{self._run_id}-{seq}",
                budget_bytes=memory_budget_bytes(cfg, self._transport, self._mem_fraction),
                transport=self._transport,
                zmq_ctx=self._zmq_ctx,
                ckpt=self._checkpoints.get(g.checkpoint) if g.owners_in_job else None,
                p2p=self._p2p,
            )
            publish = self._rank == members[0]
            if publish:
                self.registry.begin_update(
                    job.update_id,
                    {"checkpoint": checkpoint_name, "ranks": members, "mode": job.mode, "started_at_s": time.time()},
                )
            metrics = run_update(job)
        except UpdateFailed as e:
            logger.error("rank %d: %s", self._rank, e)
            self._note_if_broken(e)
            raise
        except BaseException as e:
            self._note_if_broken(e)
            raise
        finally:
            if group is not None:
                dist.destroy_process_group(group)
            if metrics is None and job is not None and hasattr(job.source, "discard_kept"):
                job.source.discard_kept()  # a failed relay keeps nothing
            if publish:
                self.registry.end_update(
                    job.update_id, checkpoint_name, metrics.to_dict() if metrics else {"ok": False}
                )
        if getattr(job.source, "keeps", False):  # a relay every rank took part in, with keep_relayed
            self._keep_relayed(checkpoint_name, job.source)
        self.last_metrics = metrics
        if self._rank == members[0]:
            logger.info(metrics.summary())
        if cfg.metrics_path:
            append_jsonl(cfg.metrics_path, metrics.to_dict())
        return metrics

    def _keep_relayed(self, name: str, source) -> None:
        """Collective, after a relay update every rank took part in (`UpdateConfig.keep_relayed`): each
        rank registers the share of `name` it kept and the ranks gather its metas, so that this job
        owns the version from now on (a heal pulls it from the ranks, not from the trainer). If any rank
        cannot register its share, none keeps it and the owners' metas stay."""
        state = self.metas_state(name)
        kept, error = source.kept_tensors(), None
        try:
            if kept:
                self.register_checkpoint(name, named_tensors=kept)
        except Exception as e:  # noqa: BLE001 - agreed below: every rank keeps the owners' metas then
            error = f"rank {self._rank}: {type(e).__name__}: {e}"
        finally:
            source.discard_kept()  # adopted: freed with the checkpoint; else now
        errors = [x for x in all_gather_obj(error, self._world_size) if x]
        if errors:
            if name in self._checkpoints:
                self.unregister_checkpoint(name, force=True)
            self.restore_metas_state(name, state)
            logger.warning("rank %d: %r not kept by the ranks (heals read its owners): %s", self._rank, name, errors)
            return
        self.gather_metas(name)
        logger.info(
            "rank %d: kept its share of %r (%d tensors, %.3f GiB); heals pull it from the ranks",
            self._rank,
            name,
            len(kept),
            sum(t.nbytes for t in kept.values()) / 2**30,
        )

    def _note_if_broken(self, e: BaseException) -> None:
        """A broadcast given up on (a peer's host cut off) leaves operations pending in the process
        group: no later collective can be trusted, and freeing the failed update's objects would wait
        on them. Keep the exception (and what its frames hold) and refuse further updates by name."""
        from checkpoint_engine.transport.devices import BroadcastTimeout

        seen, x = set(), e
        while x is not None and id(x) not in seen:
            seen.add(id(x))
            if isinstance(x, BroadcastTimeout) or "BroadcastTimeout" in str(x):
                self._broken = f"a broadcast timed out: {x}"
                self._failed_updates.append(e)
                return
            x = x.__cause__ or x.__context__

    def check_update(self, checkpoint_name: str, ranks: list[int] | None = None) -> list[int]:
        """What `update` checks on this rank before its first collective (local, no state change):
        CheckpointNotFound for a name neither registered nor with metas here, ValueError when its
        metas are not gathered or name no owner, or for bad `ranks`. Returns the update's members."""
        members = self._check_ranks(ranks)
        if checkpoint_name not in self._global:
            known = sorted(self._checkpoints)
            if checkpoint_name not in self._checkpoints and not known:
                raise CheckpointNotFound(f"unknown checkpoint {checkpoint_name!r}: nothing is registered")
            error = CheckpointNotFound if checkpoint_name not in self._checkpoints else ValueError
            raise error(
                f"no metas for checkpoint {checkpoint_name!r}: call gather_metas({checkpoint_name!r}) "
                f"on every rank before update (registered here: {known})"
            )
        if not self._global[checkpoint_name].rank_metas:
            raise ValueError(
                f"no rank owns {checkpoint_name!r}: it is registered nowhere in this job; load the "
                "owners' metas (load_metas(metas from get_metas() where it is registered)) first"
            )
        return members

    def metas_state(self, checkpoint_name: str) -> tuple[GlobalMetas | None, str | None]:
        """This rank's metas of `checkpoint_name` and the last gathered name, for `restore_metas_state`
        (the daemon undoes a `load_metas` that failed on another rank)."""
        return self._global.get(checkpoint_name), self._last_gathered

    def has_loaded_metas(self, checkpoint_name: str) -> bool:
        """Whether `checkpoint_name` is known here only by metas another job owns (``load_metas``)."""
        return checkpoint_name in self._global and checkpoint_name not in self._checkpoints

    def forget_metas(self, checkpoint_name: str) -> None:
        """Drop the loaded metas of a checkpoint another job owns (it is about to free that memory): an
        update or heal to it is then refused by name instead of reading memory that is gone."""
        if not self.has_loaded_metas(checkpoint_name):
            raise CheckpointNotFound(f"no loaded metas for {checkpoint_name!r} (loaded: {self.loaded_metas()})")
        self._global.pop(checkpoint_name)
        if self._last_gathered == checkpoint_name:
            self._last_gathered = None

    def loaded_metas(self) -> list[str]:
        """The checkpoints known here only by loaded metas (another job owns their memory)."""
        return sorted(n for n in self._global if n not in self._checkpoints)

    def restore_metas_state(self, checkpoint_name: str, state: tuple[GlobalMetas | None, str | None]) -> None:
        g, self._last_gathered = state
        if g is None:
            self._global.pop(checkpoint_name, None)
        else:
            self._global[checkpoint_name] = g

    def _check_ranks(self, ranks: list[int] | None) -> list[int]:
        if not ranks:
            return list(range(self._world_size))
        members = sorted(set(ranks))
        if len(members) != len(ranks) or not all(isinstance(r, int) and 0 <= r < self._world_size for r in ranks):
            raise ValueError(f"ranks must be distinct ints in [0, {self._world_size}), got {ranks!r}")
        return members

    def close(self) -> None:
        self.registry.store.close()
        if self._p2p is not None:
            self._p2p.close()
        for ckpt in self._checkpoints.values():
            ckpt.close()
        self._checkpoints.clear()
        self._host_pool.trim()
        self._shared_pool.trim()
        self._shared_pool_user = None
        self._global.clear()
        self._transport.release_shared()
        self._zmq_ctx.term()
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_pg = False

    def __repr__(self) -> str:
        names = sorted(self._checkpoints)
        return f"ParameterServer(rank={self._rank}, world_size={self._world_size}, checkpoints={names})"


def _owner_peers(g: GlobalMetas, exclude: str | None) -> list[tuple[str, int]]:
    """(P2P address, first chunk address) per owner rank of `g` with an address other than `exclude`."""
    return [
        (g.p2p_addrs[r], ptrs[0])
        for r, ptrs in sorted(g.chunk_ptrs.items())
        if ptrs and g.p2p_addrs.get(r) not in (None, exclude)
    ]
