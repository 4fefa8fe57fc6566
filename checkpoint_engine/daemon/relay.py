"""The daemon's uses of the process group's store (torchrun's TCPStore, shared by every rank).

    Relay        rank 0 ──key cmd/<n>──▶ every rank runs command n ──key res/<n>/<rank>──▶ rank 0
                 a rank that exits (a signal, an error) sets gone/<rank>: rank 0 stops waiting for it;
                 one that exited or stayed silent past the deadline is reported by number, with kind
                 "unavailable" (the daemon must be restarted); answered commands' keys are deleted
    EngineBoard  every rank ──key engines/<rank>──▶ rank 0 (GET /engines, the healer)
    SealedStore  a store wrapper that seals what it sets and checks what it gets, for the engine
                 host's agreement keys (agree/<n>/<rank>, checkpoint_engine.engines.host)

Values are JSON (never pickle). Every wait has a deadline and is quiet (`store_wait.wait_for_keys`):
an idle rank waits for the next command in `IDLE_WAIT_S` slices without logging.

The store has no authentication: whoever reaches its port can write (and delete) keys. With a bearer
token (the daemon's `--token-file`), every value one rank writes and another acts on is sealed:
`{"body": JSON, "mac": HMAC-SHA256}` under a key derived from the token, over the key name and the
body, so a value copied to another key fails too. That covers the commands (`cmd/<n>`: the number in
the name, so a recorded command cannot be replayed under another), the results (`res/<n>/<rank>`),
the exits (`gone/<rank>`), the engine records (`engines/<rank>`) and, through `SealedStore`, the
agreements (once `__main__` hands the engine host its store wrapped in it: until then those go
plain). An engine record is overwritten in place at every state change, so its body also carries
the writer's count of records (`n`): rank 0 refuses one older than the newest it took (a genuine old
record written back). A refused value is logged once per key and value ("rank R: refused KEY: ...")
and ignored, never acted on: a rank keeps waiting for the genuine command or result, which the
writing rank's own `set` puts over the forgery (no rank deletes a refused value: the genuine one may
be landing at that moment); a refused engine record leaves rank 0's view of that engine unchanged.
What the seals cannot stop: deleting or overwriting a genuine value (a denial of service) and, since
the key is the token's, a value recorded from an earlier daemon with the same token.
Without a token the values go as plain JSON, and the daemon refuses to start a world whose store is
off loopback (`relay_key_required`).
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
REFUSED_PAUSE_S = 0.05  # how often a rank reads again a key whose value it refused
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


def _mac(key: bytes, name: str, body: str) -> str:
    return hmac.new(key, f"{name}\n{body}".encode(), hashlib.sha256).hexdigest()


def seal_text(key: bytes | None, name: str, body: str) -> str:
    """`body` (JSON text) as it goes to the store under `name`: signed for `name` with `key`, or as is."""
    if key is None:
        return body
    return json.dumps({"body": body, "mac": _mac(key, name, body)})


def unseal_text(key: bytes | None, name: str, raw: bytes | str) -> str:
    """The JSON text written under `name`; ForgedMessage when it is not signed with `key` for `name`."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    if key is None:
        return text
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or set(data) != {"body", "mac"} or not isinstance(data["body"], str):
        raise ForgedMessage(f"{name}: an unsigned value (not written by a rank holding the token)")
    if not hmac.compare_digest(_mac(key, name, data["body"]), str(data["mac"])):
        raise ForgedMessage(f"{name}: a value whose signature is wrong (forged, or replayed from another key)")
    return data["body"]


def seal(key: bytes | None, name: str, value) -> str:
    return seal_text(key, name, json.dumps(value))


def unseal(key: bytes | None, name: str, raw: bytes | str):
    """The value written under `name`; ForgedMessage when it is not signed with `key` for `name` (or is
    not JSON)."""
    text = unseal_text(key, name, raw)
    try:
        return json.loads(text)
    except ValueError as e:  # only without a key: a signed body is the JSON its writer made
        raise ForgedMessage(f"{name}: a value that is not JSON ({e})") from None


class Refusals:
    """Logs each refused value once per key and value (a rank reads a refused key again and again
    while it waits for the genuine value) and counts them."""

    def __init__(self, who: str):
        self.who = who
        self.count = 0
        self._last: dict[str, bytes] = {}  # key name -> the last value refused there
        self._lock = threading.Lock()

    def refuse(self, name: str, raw: bytes | str, why: object) -> None:
        raw = raw.encode() if isinstance(raw, str) else raw
        with self._lock:
            if self._last.get(name) == raw:
                return
            self._last[name] = raw
            self.count += 1
        logger.error("%s: refused %s: %s", self.who, name, why)

    def seen(self, name: str) -> bool:
        """A value at `name` was refused (since the last `forget`)."""
        with self._lock:
            return name in self._last

    def forget(self) -> None:
        """The keys read so far are done with (a command's): their memory goes."""
        with self._lock:
            self._last.clear()


def _read(store, name: str, key: bytes | None, refusals: Refusals, *, there: bool = False):
    """The value at `name` when it is there (`there`: known to be) and sealed for it; None when absent
    or refused (logged)."""
    if not there and not store.check([name]):
        return None
    raw = store.get(name)
    try:
        return unseal(key, name, raw)
    except ForgedMessage as e:
        refusals.refuse(name, raw, e)
        return None


# The key of the Relay made on each store object, for an EngineBoard made later on the same store
# without a key of its own: the daemon makes its Relay first, so its engine records are sealed with
# the relay's key (the one token) without a second path for it. The store is kept with its key, so its
# id is not reused while it is listed.
_RELAY_KEYS: dict[int, tuple[object, bytes | None]] = {}
_RELAYS_KEY = object()  # EngineBoard's default: the key of the Relay on the same store


class Relay:
    """Moves commands from rank 0 to all ranks and results back, over the process group's store."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, result_timeout_s: float, key: bytes | None = None
    ):
        _RELAY_KEYS[id(store)] = (store, key)
        self.store = dist.PrefixStore("ckpt-daemon/", store)
        self.rank, self.world_size, self.result_timeout_s = rank, world_size, result_timeout_s
        self.key = key
        self.refusals = Refusals(f"rank {rank}")
        self.seq = 0
        self._answered = False  # every rank answered the current command (its keys may go)

    @property
    def num_forged(self) -> int:
        """Values refused for their seal (each logged once; none acted on)."""
        return self.refusals.count

    def publish(self, cmd: dict) -> None:
        key = f"cmd/{self.seq}"
        self.store.set(key, seal(self.key, key, cmd))  # over any forgery already there

    def next_command(self, stop: threading.Event) -> dict | None:
        """The command numbered `seq` once rank 0 published it (None: `stop` set first). A value there
        that is not rank 0's is refused and left alone: rank 0's `set` replaces it (deleting it could
        delete rank 0's command landing at that moment), so this rank reads the key again until then."""
        key = f"cmd/{self.seq}"
        while not stop.is_set():
            if wait_for_keys(self.store, [key], IDLE_WAIT_S, stop=stop):
                cmd = _read(self.store, key, self.key, self.refusals, there=True)
                if cmd is not None:
                    return cmd
                stop.wait(REFUSED_PAUSE_S)
            # idle: wait again (each wait has its own deadline)
        return None

    def put_result(self, result: dict) -> None:
        key = f"res/{self.seq}/{self.rank}"
        self.store.set(key, seal(self.key, key, result))  # over any forgery already there

    def gather_results(
        self, timeout_s: float | None = None, skip: frozenset[int] | set[int] = frozenset()
    ) -> list[dict]:
        """Every rank's result of the current command. A rank that left (`leave`), one silent for
        `timeout_s` (default: the relay's) and one of `skip` (not waited for: known to be gone) get an
        error result of kind "unavailable" naming the rank: the daemon must be restarted. A result or
        exit that is not the rank's own (refused: logged) counts as not there yet."""
        timeout_s = self.result_timeout_s if timeout_s is None else timeout_s
        keys = {r: f"res/{self.seq}/{r}" for r in range(self.world_size) if r not in skip}
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        pause = FIRST_PAUSE_S
        while True:
            pending = [r for r in keys if r not in got]
            # one round trip while every rank answers in time; else the ranks whose key is there
            there = pending if self.store.check([keys[r] for r in pending]) else None
            if there is None:
                there = [r for r in pending if self.store.check([keys[r]])]
            for r in there:
                value = _read(self.store, keys[r], self.key, self.refusals, there=True)
                if value is not None:
                    got[r] = value
            pending = [r for r in pending if r not in got]
            if not pending:
                break
            gone = {r for r in pending if self._gone(r)}
            left = deadline - time.monotonic()
            if len(gone) == len(pending) or left <= 0:
                # a rank of `skip` here is named as one that did not answer (it was not waited for)
                return [
                    got[r] if r in got else _lost(r, self._why_lost(r, r in gone, timeout_s))
                    for r in range(self.world_size)
                ]
            time.sleep(min(pause, left))
            pause = min(2 * pause, MAX_PAUSE_S)
        self._answered = not skip
        return [
            _lost(r, "did not answer an earlier command: it may have died") if r in skip else got[r]
            for r in range(self.world_size)
        ]

    def _why_lost(self, rank: int, gone: bool, timeout_s: float) -> str:
        if gone:
            return "has exited"
        if self.refusals.seen(f"res/{self.seq}/{rank}"):
            return f"did not answer within {timeout_s:g} s (a result in its name was refused: forged)"
        return f"did not answer within {timeout_s:g} s: it may have died"

    def _gone(self, rank: int) -> bool:
        """Rank `rank` said it exited (`leave`), in a value sealed for its key."""
        return _read(self.store, f"gone/{rank}", self.key, self.refusals) is not None

    def leave(self) -> None:
        """This rank exits: rank 0 no longer waits for its results."""
        key = f"gone/{self.rank}"
        try:
            self.store.set(key, seal(self.key, key, {"gone": True}))
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
        self.refusals.forget()
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
    so a rank's command thread waiting on the relay never delays it.

    `key`: the seal of the records (module docstring); by default that of the `Relay` made on the same
    `store` object (None when there is none: plain records). A sealed record is `{"n": count, "record":
    record}`, `n` counting this writer's records; the reader takes a record only when it is sealed for
    its key and not older than the newest it took from that rank. A refused one (logged) leaves the
    reader's view unchanged: the last record it took, or one in state "unknown" when it took none, so
    nothing (the healer, GET /engines) acts on a record that is not the rank's own."""

    def __init__(self, store: dist.Store, world_size: int, ranks_per_engine: int = 1, key=_RELAYS_KEY):
        self.key = _RELAY_KEYS.get(id(store), (None, None))[1] if key is _RELAYS_KEY else key
        self.store = dist.PrefixStore("ckpt-engines/", store.clone())
        self.world_size, self.ranks_per_engine = world_size, ranks_per_engine
        self.refusals = Refusals("rank 0")  # only rank 0 reads the board
        self._lock = threading.Lock()
        self._written = 0  # records this rank wrote: the `n` of its next one is one more
        self._taken: dict[int, tuple[int, dict]] = {}  # rank -> (n, record) of the newest record taken

    def put(self, record: dict) -> None:
        key = f"engines/{record['rank']}"
        with self._lock:
            if self.key is None:
                self.store.set(key, json.dumps(record))
                return
            self._written += 1
            self.store.set(key, seal(self.key, key, {"n": self._written, "record": record}))

    def records(self) -> list[dict]:
        with self._lock:
            return [self._record(r) for r in range(0, self.world_size, self.ranks_per_engine)]

    def _record(self, rank: int) -> dict:
        key = f"engines/{rank}"
        if not self.store.check([key]):
            return {"rank": rank, "ranks": engine_group(rank, self.ranks_per_engine), "state": "stopped"}
        raw = self.store.get(key)
        try:
            value = unseal(self.key, key, raw)
            if self.key is None:
                return value
            n, record = value["n"], value["record"]  # a sealed value is one of `put`'s
            last = self._taken.get(rank)
            if last is not None and n < last[0]:
                raise ForgedMessage(
                    f"{key}: an older record (number {n}; the newest taken is number {last[0]}): a genuine "
                    "record written back"
                )
            self._taken[rank] = (n, record)
            return record
        except ForgedMessage as e:
            self.refusals.refuse(key, raw, e)
            last = self._taken.get(rank)
            if last is not None:
                return last[1]
            return {
                "rank": rank,
                "ranks": engine_group(rank, self.ranks_per_engine),
                "state": "unknown",
                "checkpoint": None,
                "last_error": f"the record in the store was refused: {e}",
            }


class SealedStore:
    """A store that seals every value it sets for its key name, and whose `check` sees only values
    sealed so (a refused one is logged and reads as absent, so a wait goes on until the writer's own
    `set` replaces it); `get` answers the value's JSON text, or the last genuine one read at that key
    when the value was replaced since. For the engine host's agreements (`agree/<n>/<rank>`): the
    ranks agree through `set`, `check` (`wait_for_keys`) and `get` only. `key` None: the store as is."""

    def __init__(self, store, key: bytes | None, who: str):
        self.store, self.key = store, key
        self.refusals = Refusals(who)
        self._genuine: dict[str, str] = {}  # key name -> the last value read there that was sealed for it
        self._lock = threading.Lock()

    def set(self, name: str, value: str | bytes) -> None:
        text = value.decode() if isinstance(value, bytes) else value
        self.store.set(name, seal_text(self.key, name, text))

    def check(self, names: list[str]) -> bool:
        if self.key is None:
            return self.store.check(names)
        return all(self._verified(name) is not None for name in names)

    def get(self, name: str) -> bytes:
        if self.key is None:
            return self.store.get(name)
        text = self._verified(name)
        if text is None:
            with self._lock:
                text = self._genuine.get(name)
        if text is None:
            raise ForgedMessage(f"{name}: no value sealed for it (refused: see the log)")
        return text.encode()

    def delete_key(self, name: str) -> bool:
        with self._lock:
            self._genuine.pop(name, None)
        return self.store.delete_key(name)

    def _verified(self, name: str) -> str | None:
        if not self.store.check([name]):
            return None
        raw = self.store.get(name)
        try:
            text = unseal_text(self.key, name, raw)
        except ForgedMessage as e:
            self.refusals.refuse(name, raw, e)
            return None
        with self._lock:
            self._genuine[name] = text
        return text
