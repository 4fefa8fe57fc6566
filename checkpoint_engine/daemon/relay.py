"""The daemon's two uses of the process group's store (torchrun's TCPStore, shared by every rank).

    Relay        rank 0 ──key cmd/<n>──▶ every rank runs command n ──key res/<n>/<rank>──▶ rank 0
                 a rank that exits (a signal, an error) sets gone/<rank>: rank 0 stops waiting for it;
                 one that exited or stayed silent past the deadline is reported by number, with kind
                 "unavailable" (the daemon must be restarted); answered commands' keys are deleted
    EngineBoard  every rank ──key engines/<rank>──▶ rank 0 (GET /engines, the healer)

Values are JSON (never pickle). Every wait has a deadline and is quiet (`store_wait.wait_for_keys`):
an idle rank waits for the next command in `IDLE_WAIT_S` slices without logging.

The store has no authentication: whoever reaches its port can write keys. With a bearer token (the
daemon's `--token-file`), every command and result is signed: `{"body": JSON, "mac": HMAC-SHA256}`
under a key derived from the token, over the key name (which carries the command's sequence number)
and the body. A rank runs only a command whose MAC is right for the next number it expects, so a
forged command is refused and a recorded one cannot be replayed under another number; rank 0 takes
only results signed for that command and rank. Without a token the values go unsigned, and the
daemon refuses to start a world whose store is off loopback (`relay_key_required`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import threading
import time

import torch.distributed as dist

from checkpoint_engine.daemon.store_wait import FIRST_PAUSE_S, MAX_PAUSE_S, wait_for_keys
from checkpoint_engine.engines.config import engine_group

IDLE_WAIT_S = 5.0
logger = logging.getLogger(__name__)


class ForgedMessage(RuntimeError):
    """A value in the store that was not written by a rank holding the token."""


def relay_key(token: str | None) -> bytes | None:
    """The signing key of the relay, derived from the bearer token (None: no token, unsigned)."""
    if not token:
        return None
    return hmac.new(token.encode(), b"ckpt-engine daemon relay v1", hashlib.sha256).digest()


def relay_key_required(master_addr: str | None) -> bool:
    """A store on an address other hosts may reach needs signed values (a token)."""
    if not master_addr or master_addr == "localhost":
        return False
    try:
        return not ipaddress.ip_address(master_addr).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return True


def seal(key: bytes | None, name: str, value: dict) -> str:
    body = json.dumps(value)
    if key is None:
        return body
    mac = hmac.new(key, f"{name}\n{body}".encode(), hashlib.sha256).hexdigest()
    return json.dumps({"body": body, "mac": mac})


def unseal(key: bytes | None, name: str, raw: bytes | str) -> dict:
    """The value written under `name`; ForgedMessage when it is not signed with `key` for `name`."""
    data = json.loads(raw)
    if key is None:
        return data
    if not isinstance(data, dict) or set(data) != {"body", "mac"} or not isinstance(data["body"], str):
        raise ForgedMessage(f"{name}: an unsigned value (not written by a rank holding the token)")
    want = hmac.new(key, f"{name}\n{data['body']}".encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, str(data["mac"])):
        raise ForgedMessage(f"{name}: a value whose signature is wrong (forged, or replayed from another key)")
    return json.loads(data["body"])


class Relay:
    """Moves commands from rank 0 to all ranks and results back, over the process group's store."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, result_timeout_s: float, key: bytes | None = None
    ):
        self.store = dist.PrefixStore("ckpt-daemon/", store)
        self.rank, self.world_size, self.result_timeout_s = rank, world_size, result_timeout_s
        self.key = key
        self.num_forged = 0  # values refused for their signature (logged; a forged command is skipped)
        self.seq = 0
        self._answered = False  # every rank answered the current command (its keys may go)

    def publish(self, cmd: dict) -> None:
        key = f"cmd/{self.seq}"
        self.store.set(key, seal(self.key, key, cmd))

    def next_command(self, stop: threading.Event) -> dict | None:
        key = f"cmd/{self.seq}"
        while not stop.is_set():
            if wait_for_keys(self.store, [key], IDLE_WAIT_S, stop=stop):
                try:
                    return unseal(self.key, key, self.store.get(key))
                except (ForgedMessage, ValueError) as e:
                    # not rank 0's: drop it and wait for rank 0's command under the same number
                    self.num_forged += 1
                    logger.error("rank %d: refused %s: %s", self.rank, key, e)
                    try:
                        self.store.delete_key(key)
                    except RuntimeError:
                        pass
            # idle: wait again (each wait has its own deadline)
        return None

    def put_result(self, result: dict) -> None:
        key = f"res/{self.seq}/{self.rank}"
        self.store.set(key, seal(self.key, key, result))

    def gather_results(
        self, timeout_s: float | None = None, skip: frozenset[int] | set[int] = frozenset()
    ) -> list[dict]:
        """Every rank's result of the current command. A rank that left (`leave`), one silent for
        `timeout_s` (default: the relay's) and one of `skip` (not waited for: known to be gone) get an
        error result of kind "unavailable" naming the rank: the daemon must be restarted."""
        timeout_s = self.result_timeout_s if timeout_s is None else timeout_s
        keys = [f"res/{self.seq}/{r}" for r in range(self.world_size)]
        waited = [k for r, k in enumerate(keys) if r not in skip]
        deadline = time.monotonic() + timeout_s
        pause = FIRST_PAUSE_S
        while not self.store.check(waited):  # one round trip while every rank answers in time
            pending = [r for r, k in enumerate(keys) if r not in skip and not self.store.check([k])]
            gone = {r for r in pending if self.store.check([f"gone/{r}"])}
            left = deadline - time.monotonic()
            if len(gone) == len(pending) or left <= 0:
                return [
                    self._result(r)
                    if r not in pending and r not in skip
                    else _lost(
                        r, "has exited" if r in gone else f"did not answer within {timeout_s:g} s: it may have died"
                    )
                    for r in range(self.world_size)
                ]
            time.sleep(min(pause, left))
            pause = min(2 * pause, MAX_PAUSE_S)
        self._answered = not skip
        return [
            _lost(r, "did not answer an earlier command: it may have died") if r in skip else self._result(r)
            for r in range(self.world_size)
        ]

    def _result(self, rank: int) -> dict:
        key = f"res/{self.seq}/{rank}"
        try:
            return unseal(self.key, key, self.store.get(key))
        except (ForgedMessage, ValueError) as e:
            self.num_forged += 1
            logger.error("rank 0: refused %s: %s", key, e)
            return {"ok": False, "error": f"rank {rank}'s result was refused: {e}", "kind": "unavailable"}

    def leave(self) -> None:
        """This rank exits: rank 0 no longer waits for its results."""
        try:
            self.store.set(f"gone/{self.rank}", "1")
        except RuntimeError:  # DistStoreError: the store went with rank 0's host, so nobody waits
            pass

    def done(self) -> None:
        """The current command is over on this rank. On rank 0, once every rank answered it, its keys
        go (no rank reads them again): the store does not grow with every command."""
        if self.rank == 0 and self._answered:
            for key in [f"cmd/{self.seq}", *(f"res/{self.seq}/{r}" for r in range(self.world_size))]:
                try:
                    self.store.delete_key(key)
                except RuntimeError:  # DistStoreError: the next command reports the store
                    break
        self._answered = False
        self.seq += 1


def _lost(rank: int, what: str) -> dict:
    return {
        "ok": False,
        "error": f"rank {rank} {what}; the daemon must be restarted",
        "kind": "unavailable",
    }


class EngineBoard:
    """Every engine's record in the process group's store: each engine's rank writes its own (the first
    rank of its group when `ranks_per_engine` > 1), rank 0 reads them all. Its own store connection,
    so a rank's command thread waiting on the relay never delays it."""

    def __init__(self, store: dist.Store, world_size: int, ranks_per_engine: int = 1):
        self.store = dist.PrefixStore("ckpt-engines/", store.clone())
        self.world_size, self.ranks_per_engine = world_size, ranks_per_engine
        self._lock = threading.Lock()

    def put(self, record: dict) -> None:
        with self._lock:
            self.store.set(f"engines/{record['rank']}", json.dumps(record))

    def records(self) -> list[dict]:
        out = []
        with self._lock:
            for r in range(0, self.world_size, self.ranks_per_engine):
                key = f"engines/{r}"
                known = self.store.check([key])
                unknown = {"rank": r, "ranks": engine_group(r, self.ranks_per_engine), "state": "stopped"}
                out.append(json.loads(self.store.get(key)) if known else unknown)
        return out
