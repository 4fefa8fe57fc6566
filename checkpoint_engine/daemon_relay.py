"""The daemon's two uses of the process group's store (torchrun's TCPStore, shared by every rank).

    Relay        rank 0 ──key cmd/<n>──▶ every rank runs command n ──key res/<n>/<rank>──▶ rank 0
    EngineBoard  every rank ──key engines/<rank>──▶ rank 0 (GET /engines, the healer)

Values are JSON (never pickle). Every wait has a deadline and is quiet (`store_wait.wait_for_keys`):
an idle rank waits for the next command in `IDLE_WAIT_S` slices without logging.
"""

from __future__ import annotations

import json
import threading

import torch.distributed as dist

from checkpoint_engine.store_wait import wait_for_keys

IDLE_WAIT_S = 5.0


class Relay:
    """Moves commands from rank 0 to all ranks and results back, over the process group's store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, result_timeout_s: float):
        self.store = dist.PrefixStore("ckpt-daemon/", store)
        self.rank, self.world_size, self.result_timeout_s = rank, world_size, result_timeout_s
        self.seq = 0

    def publish(self, cmd: dict) -> None:
        self.store.set(f"cmd/{self.seq}", json.dumps(cmd))

    def next_command(self, stop: threading.Event) -> dict | None:
        key = f"cmd/{self.seq}"
        while not stop.is_set():
            if wait_for_keys(self.store, [key], IDLE_WAIT_S, stop=stop):
                return json.loads(self.store.get(key))
            # idle: wait again (each wait has its own deadline)
        return None

    def put_result(self, result: dict) -> None:
        self.store.set(f"res/{self.seq}/{self.rank}", json.dumps(result))

    def gather_results(self) -> list[dict]:
        keys = [f"res/{self.seq}/{r}" for r in range(self.world_size)]
        if not wait_for_keys(self.store, keys, self.result_timeout_s):
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            return [
                {"ok": False, "error": f"rank {r} did not answer within {self.result_timeout_s:.0f} s"}
                if r in missing
                else json.loads(self.store.get(keys[r]))
                for r in range(self.world_size)
            ]
        return [json.loads(self.store.get(k)) for k in keys]

    def done(self) -> None:
        self.seq += 1


class EngineBoard:
    """Every rank's engine record in the process group's store: each rank writes its own, rank 0 reads
    them all. Its own store connection, so a rank's command thread waiting on the relay never delays it."""

    def __init__(self, store: dist.Store, world_size: int):
        self.store = dist.PrefixStore("ckpt-engines/", store.clone())
        self.world_size = world_size
        self._lock = threading.Lock()

    def put(self, record: dict) -> None:
        with self._lock:
            self.store.set(f"engines/{record['rank']}", json.dumps(record))

    def records(self) -> list[dict]:
        out = []
        with self._lock:
            for r in range(self.world_size):
                key = f"engines/{r}"
                known = self.store.check([key])
                out.append(json.loads(self.store.get(key)) if known else {"rank": r, "state": "stopped"})
        return out
