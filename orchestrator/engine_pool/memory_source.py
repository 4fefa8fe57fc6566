"""The RL job's versions served from the trainer's memory (``sync.source="memory"``), for the daemon.

Instead of writing each version as files into ``sync.handoff_dir`` for the daemon's ranks to read
back, the job keeps a parameter server of its own (a world of one, in this process, Mooncake at
``sync.p2p_host``) and registers each version's tensors there; the daemon takes the version's metas
(``POST /metas``: names, shapes and addresses, never the bytes) and its ranks read it from this
process's memory. With the daemon's ``--mode relay`` across hosts its first rank reads each byte
once and broadcasts it to the others; on one host the engines map the registered memory in place.

    MemorySource.publish(name, tensors) ─▶ register ─▶ gather_metas ─▶ metas
        register: the Megatron trainer's tensors are views of its SharedTensorBuffer, which becomes the
        chunk itself (no copy); other trainers' tensors are copied once into host chunks
    DaemonWeightSync: client.load_metas(metas) ─▶ client.update(name) ─▶ MemorySource.release(previous)

The version stays registered here until the next one has reached every engine: heals and late
engines read it from this process. With the daemon's --mode relay its ranks also keep the version they
relayed (--keep-relayed, the default), so heals do not need this process once a version has arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)


class MemorySource:
    """A one-rank parameter server holding the job's current version for the daemon to read."""

    def __init__(self, p2p_host: str, *, timeout_s: float, protocol: str = "tcp") -> None:
        from checkpoint_engine.config import ParameterServerConfig
        from checkpoint_engine.ps import ParameterServer
        from checkpoint_engine.transport.mooncake import P2PConfig

        cfg = ParameterServerConfig(
            transport="cpu", p2p=P2PConfig(host=p2p_host, protocol=protocol, read_timeout_s=timeout_s)
        )
        self.ps = ParameterServer(rank=0, world_size=1, config=cfg)
        self.registered: list[str] = []

    def publish(self, name: str, tensors: Mapping[str, torch.Tensor]) -> dict:
        """Register `tensors` as `name` (unless it is already) and return their metas for POST /metas."""
        if name not in self.registered:
            self.ps.register_checkpoint(name, named_tensors=dict(tensors))
            self.registered.append(name)
            self.ps.gather_metas(name)
        return self.ps.get_metas(name)

    def drop(self, name: str) -> None:
        """Unregister `name` (a delta once its update is over: the daemon forgot its metas first)."""
        if name in self.registered:
            self.ps.unregister_checkpoint(name, force=True)
            self.registered.remove(name)

    def release(self, keep: str) -> None:
        """Unregister every version but `keep` (it reached the engines; heals read it)."""
        for name in [n for n in self.registered if n != keep]:
            self.drop(name)

    def close(self) -> None:
        self.ps.close()


def memory_source(config) -> MemorySource | None:
    """The job's MemorySource for `config` (a SyncConfig), or None with ``sync.source="files"``."""
    if config.source != "memory":
        return None
    return MemorySource(config.p2p_host, timeout_s=config.timeout_s, protocol=config.p2p_protocol)
