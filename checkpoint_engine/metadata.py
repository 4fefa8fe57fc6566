"""Global metadata: which checkpoints exist and where their shards live, engine status, updates in flight.

A small key-value interface with two backends: an in-process store (the single-machine default) and
etcd (`etcd://host:port/prefix`, through the `pyetcd` client: `pip install etcd-sdk-python`). Values
are JSON strings. Keys under the prefix:

    checkpoints/<name>/metas      global metas (what `ParameterServer.load_metas` takes)
    checkpoints/<name>/last_update  metrics of the last completed update
    engines/<rank>                engine weight state after the last update (version, status)
    ops/<update_id>               an update in flight (deleted when it ends; has a TTL)
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from typing import Protocol


class MetadataStore(Protocol):
    def put(self, key: str, value: str, ttl_s: float | None = None) -> None: ...
    def get(self, key: str) -> str | None: ...
    def get_prefix(self, prefix: str) -> dict[str, str]: ...
    def delete(self, key: str) -> None: ...
    def close(self) -> None: ...


class InMemoryStore:
    """Process-local store with TTLs (the default when no etcd is configured)."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[str, float | None]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, value: str, ttl_s: float | None = None) -> None:
        with self._lock:
            self._data[key] = (value, None if ttl_s is None else time.monotonic() + ttl_s)

    def _live(self, key: str) -> str | None:
        value, expires = self._data.get(key, (None, None))
        if expires is not None and time.monotonic() > expires:
            self._data.pop(key, None)
            return None
        return value

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._live(key)

    def get_prefix(self, prefix: str) -> dict[str, str]:
        with self._lock:
            out = {k: self._live(k) for k in list(self._data) if k.startswith(prefix)}
            return {k: v for k, v in out.items() if v is not None}

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def close(self) -> None:
        pass


class EtcdStore:
    """etcd v3 through `pyetcd` (etcd3's API); every call has a deadline (`timeout_s`)."""

    def __init__(self, host: str, port: int, prefix: str = "/ckpt-engine", timeout_s: float = 10.0):
        try:
            import pyetcd
        except ImportError as e:
            raise RuntimeError(f"etcd metadata needs the etcd-sdk-python package (import pyetcd): {e}") from None
        self.prefix = prefix.rstrip("/")
        self._client = pyetcd.client(host=host, port=port, timeout=timeout_s)
        try:
            self._client.status()
        except Exception as e:  # noqa: BLE001 - grpc raises its own types
            raise RuntimeError(f"etcd at {host}:{port} is not reachable: {type(e).__name__}: {e}") from None

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def put(self, key: str, value: str, ttl_s: float | None = None) -> None:
        lease = self._client.lease(max(1, int(ttl_s))) if ttl_s is not None else None
        self._client.put(self._k(key), value, lease=lease)

    def get(self, key: str) -> str | None:
        value, _ = self._client.get(self._k(key))
        return None if value is None else value.decode()

    def get_prefix(self, prefix: str) -> dict[str, str]:
        n = len(self.prefix) + 1
        return {meta.key.decode()[n:]: value.decode() for value, meta in self._client.get_prefix(self._k(prefix))}

    def delete(self, key: str) -> None:
        self._client.delete(self._k(key))

    def close(self) -> None:
        self._client.close()


def make_store(url: str | None) -> MetadataStore:
    """`None` or `memory://`: in-process; `etcd://host:port[/prefix]`: etcd."""
    if url is None or url == "memory://":
        return InMemoryStore()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "etcd" or not parts.hostname:
        raise ValueError(f"metadata url must be memory:// or etcd://host:port[/prefix], got {url!r}")
    return EtcdStore(parts.hostname, parts.port or 2379, parts.path or "/ckpt-engine")


class CheckpointRegistry:
    """What the parameter server publishes, in the store's key layout."""

    OP_TTL_S = 3600.0

    def __init__(self, store: MetadataStore):
        self.store = store

    def publish_metas(self, name: str, metas: dict) -> None:
        self.store.put(f"checkpoints/{name}/metas", json.dumps(metas))

    def metas(self, name: str) -> dict | None:
        raw = self.store.get(f"checkpoints/{name}/metas")
        return None if raw is None else json.loads(raw)

    def checkpoints(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.store.get_prefix("checkpoints/")})

    def forget(self, name: str) -> None:
        for key in self.store.get_prefix(f"checkpoints/{name}/"):
            self.store.delete(key)

    def begin_update(self, update_id: str, info: dict) -> None:
        self.store.put(f"ops/{update_id}", json.dumps(info), ttl_s=self.OP_TTL_S)

    def end_update(self, update_id: str, name: str, metrics: dict) -> None:
        self.store.delete(f"ops/{update_id}")
        if metrics.get("ok"):
            self.store.put(f"checkpoints/{name}/last_update", json.dumps(metrics))

    def in_flight(self) -> dict[str, dict]:
        return {k.split("/", 1)[1]: json.loads(v) for k, v in self.store.get_prefix("ops/").items()}

    def engine_status(self, rank: int, status: dict) -> None:
        self.store.put(f"engines/{rank}", json.dumps(status))
