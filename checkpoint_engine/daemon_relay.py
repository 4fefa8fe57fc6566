"""The daemon's two uses of the process group's store (torchrun's TCPStore, shared by every rank).

    Relay        rank 0 ──key cmd/<n>──▶ every rank runs command n ──key res/<n>/<rank>──▶ rank 0
                 a rank that exits (a signal, an error) sets gone/<rank>: rank 0 stops waiting for it
    EngineBoard  every rank ──key engines/<rank>──▶ rank 0 (GET /engines, the healer)

Values are JSON (never pickle). Every wait has a deadline and is quiet (`store_wait.wait_for_keys`):
an idle rank waits for the next command in `IDLE_WAIT_S` slices without logging.
"""

from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

from checkpoint_engine.store_wait import FIRST_PAUSE_S, MAX_PAUSE_S, wait_for_keys

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

    def gather_results(self, timeout_s: float | None = None) -> list[dict]:
        """Every rank's result of the current command; a rank that left (`leave`) or stayed silent for
        `timeout_s` (default: the relay's) gets an error result."""
        timeout_s = self.result_timeout_s if timeout_s is None else timeout_s
        keys = [f"res/{self.seq}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        pause = FIRST_PAUSE_S
        while not self.store.check(keys):  # one round trip while every rank answers in time
            pending = [r for r, k in enumerate(keys) if not self.store.check([k])]
            gone = [r for r in pending if self.store.check([f"gone/{r}"])]
            left = deadline - time.monotonic()
            if len(gone) == len(pending) or left <= 0:
                return [
                    json.loads(self.store.get(keys[r]))
                    if r not in pending
                    else {"ok": False, "error": f"rank {r} has exited"}
                    if r in gone
                    else {"ok": False, "error": f"rank {r} did not answer within {timeout_s:.0f} s"}
                    for r in range(self.world_size)
                ]
            time.sleep(min(pause, left))
            pause = min(2 * pause, MAX_PAUSE_S)
        return [json.loads(self.store.get(k)) for k in keys]

    def leave(self) -> None:
        """This rank exits: rank 0 no longer waits for its results."""
        try:
            self.store.set(f"gone/{self.rank}", "1")
        except RuntimeError:  # DistStoreError: the store went with rank 0's host, so nobody waits
            pass

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
