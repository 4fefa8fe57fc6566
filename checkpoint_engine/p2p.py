"""P2P reads through Mooncake's transfer engine (RDMA on clusters, TCP elsewhere).

Owners register their host chunks once; a receiving rank reads bucket byte ranges straight from
the owners' memory (one-sided: the owners' engines and PS ranks do no work), so a restarted or new
engine recovers its weights without disturbing engines that are serving.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class P2PConfig:
    host: str = "127.0.0.1"  # address the transfer engine announces to peers
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""  # RDMA device(s), e.g. "mlx5_0"; empty for tcp
    read_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"p2p protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not self.host:
            raise ValueError("p2p host must be a non-empty address")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")


class P2PStore:
    """One Mooncake TransferEngine per PS rank."""

    def __init__(self, cfg: P2PConfig):
        os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog is chatty at INFO
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "P2P updates need Mooncake's transfer engine: pip install mooncake-transfer-engine-non-cuda "
                f"(CPU machines) or mooncake-transfer-engine (CUDA) ({e})"
            ) from None
        self.cfg = cfg
        self._engine = TransferEngine()
        rc = self._engine.initialize(cfg.host, "P2PHANDSHAKE", cfg.protocol, cfg.device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to initialize on {cfg.host} ({cfg.protocol}): rc={rc}")
        self.addr = f"{cfg.host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if ptr in self._registered:
                return
            rc = self._engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory({nbytes} bytes) failed: rc={rc}")
            self._registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            if self._registered.pop(ptr, None) is not None:
                self._engine.unregister_memory(ptr)

    def read(self, remote_addr: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        """Copy `nbytes` from `remote_ptr` at peer `remote_addr` into `local_ptr`, within the deadline."""
        result: list[int] = []
        t = threading.Thread(
            target=lambda: result.append(self._engine.transfer_sync_read(remote_addr, local_ptr, remote_ptr, nbytes)),
            daemon=True,
        )
        t.start()
        t.join(self.cfg.read_timeout_s)
        if t.is_alive():
            raise TimeoutError(
                f"P2P read of {nbytes} bytes from {remote_addr} did not finish within {self.cfg.read_timeout_s:.0f} s"
            )
        if result[0] != 0:
            raise RuntimeError(
                f"P2P read of {nbytes} bytes from {remote_addr} failed (rc={result[0]}): "
                "is the owner's parameter server alive and its checkpoint still registered?"
            )

    def close(self) -> None:
        for ptr in list(self._registered):
            self.unregister(ptr)
