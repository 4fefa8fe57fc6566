"""The `checkpoint_engine` load format's rendezvous: an update into an engine that waits in its load
step (vLLM's loader: `vllm_ext.loader`; the plain engine: `plain_engine --load-rendezvous`).

    wait_for_loader(address)        {"op": "hello"}                    ──▶  {"ok": true, "waiting": true}
    ps.update(name, loader_req_func(address)):
        req_func(socket_paths)      {"op": "load", "zmq_handles": {...}} ──▶ {"ok": true, "report": {...}}

The engine binds a REP socket (`serve_initial_load`); the PS sends JSON over one REQ socket per
message (nothing is unpickled). Every wait has a deadline; the PS's waits stop early when
`is_alive()` says the engine exited. No vLLM import: the daemon starts engines
that load from its ranks (`{rendezvous}` in `--engine-cmd`) without importing any engine.

Beside an ipc:// socket, in the daemon's private folder, the daemon may leave `pull_hint.json`
before it starts the engine (`PullHint`): the owners of the version it will pull and that version's
tensors, so that an engine reading the owners itself opens those connections, and finds where each
tensor lands in its parameters, while vLLM starts rather than in its pull.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20
POLL_S = 0.5  # how often a wait re-checks that the engine is alive


HINT_FILE = "pull_hint.json"  # PullHint.to_json()


@dataclass(frozen=True)
class PullHint:
    """What the daemon expects an engine's load step to pull: `peers`, (Mooncake address, registered
    chunk address) of each owner to connect to; `tensors`, (name, dtype name, shape) of every tensor
    of the version (each name once). A hint only saves set-up time: the pull itself decides what
    moves, but an engine that probed the tensors ahead refuses an update that leaves one out
    (`vllm_ext.receiver.WeightReceiver.probe_ahead`)."""

    peers: tuple[tuple[str, int], ...] = ()
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.peers or self.tensors)

    def to_json(self) -> dict:
        return {"peers": [[a, p] for a, p in self.peers], "tensors": [[n, d, list(s)] for n, d, s in self.tensors]}

    @classmethod
    def from_json(cls, raw) -> PullHint:
        """Raises ValueError naming what is malformed."""
        if not isinstance(raw, dict) or set(raw) - {"peers", "tensors"}:
            raise ValueError(f"expected {{'peers': [...], 'tensors': [...]}}, got {str(raw)[:200]}")
        peers, tensors = raw.get("peers", []), raw.get("tensors", [])
        if not isinstance(peers, list) or not all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and type(x[1]) is int for x in peers
        ):
            raise ValueError(f"peers: expected [[address, pointer], ...], got {str(peers)[:200]}")
        if not isinstance(tensors, list) or not all(
            isinstance(x, list)
            and len(x) == 3
            and isinstance(x[0], str)
            and isinstance(x[1], str)
            and isinstance(x[2], list)
            and all(type(d) is int and d >= 0 for d in x[2])
            for x in tensors
        ):
            raise ValueError(f"tensors: expected [[name, dtype, [dims]], ...], got {str(tensors)[:200]}")
        if len({x[0] for x in tensors}) != len(tensors):
            raise ValueError("tensors: a name is listed twice")
        return cls(tuple((a, p) for a, p in peers), tuple((n, d, tuple(s)) for n, d, s in tensors))


def hint_path(address: str) -> str | None:
    """Where the pull hint of the load step at `address` lies (beside its ipc:// socket), or None."""
    if not address.startswith("ipc://"):
        return None
    return os.path.join(os.path.dirname(address[len("ipc://") :]), HINT_FILE)


def write_pull_hint(address: str, hint: PullHint) -> None:
    """Daemon side, before the engine starts: leave `hint` for its load step (an empty one: remove the file)."""
    path = hint_path(address)
    if path is None:
        return
    if not hint:
        if os.path.exists(path):
            os.unlink(path)
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(hint.to_json(), f)
    os.replace(tmp, path)


def read_pull_hint(address: str) -> PullHint:
    """Engine side: the hint the daemon left for this load step; an empty one when none, or when the
    file is malformed (logged: it only saves set-up time)."""
    path = hint_path(address)
    if path is None or not os.path.exists(path):
        return PullHint()
    try:
        with open(path) as f:
            return PullHint.from_json(json.load(f))
    except (OSError, ValueError) as e:
        logger.warning("ignoring the load step's pull hint %s: %s", path, e)
        return PullHint()


def parse_request(raw: bytes) -> dict:
    """A rendezvous request: {"op": "hello"} or {"op": "load", "zmq_handles": {device_id: address}}."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ValueError(f"request of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"request is not JSON: {e}") from None
    if not isinstance(msg, dict) or msg.get("op") not in ("hello", "load"):
        raise ValueError(f"request must be a JSON object with op 'hello' or 'load', got {str(msg)[:200]}")
    if msg["op"] == "load":
        handles = msg.get("zmq_handles")
        if (
            not isinstance(handles, dict)
            or not handles
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in handles.items())
        ):
            raise ValueError(f"'load' needs zmq_handles, a non-empty {{device_id: address}} object, got {handles!r}")
    return msg


def serve_initial_load(address: str, receive: Callable[[dict[str, str]], dict], *, timeout_s: float, ctx=None) -> dict:
    """Engine side: answer hellos, run `receive(zmq_handles)` for the first valid load request, reply.

    Returns receive's report. Raises TimeoutError when no load request came within `timeout_s`
    (and no message arrived for `timeout_s` since the last one), or the load's own error.
    """
    import zmq

    own_ctx = ctx is None
    ctx = ctx or zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.bind(address)
        logger.info("waiting for the parameter server at %s (up to %.0f s)", address, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                raise TimeoutError(f"no parameter server sent the weights to {address} within {timeout_s:.0f} s")
            raw = sock.recv()
            deadline = time.monotonic() + timeout_s  # a peer is there: each message gets the full deadline
            try:
                msg = parse_request(raw)
            except ValueError as e:
                logger.warning("rejected a rendezvous request: %s", e)
                sock.send(json.dumps({"ok": False, "error": str(e)}).encode())
                continue
            if msg["op"] == "hello":
                sock.send(json.dumps({"ok": True, "waiting": True}).encode())
                continue
            try:
                report = receive(msg["zmq_handles"])
            except BaseException as e:
                sock.send(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode())
                raise
            sock.send(json.dumps({"ok": True, "report": report}, default=str).encode())
            return report
    finally:
        sock.close()
        if own_ctx:
            ctx.term()


class LoaderRendezvousError(RuntimeError):
    """The engine's load step answered with an error, or could not be reached in time."""


def _request(address: str, msg: dict, *, timeout_s: float, is_alive: Callable[[], bool] | None) -> dict:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    # The engine binds when it reaches its load step; until then zmq retries the connection every
    # RECONNECT_IVL (100 ms by default), which the load would wait on: retry every 10 ms instead.
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 10)
    try:
        sock.connect(address)  # the engine may bind later: zmq connects when it does
        sock.send(json.dumps(msg).encode())
        deadline = time.monotonic() + timeout_s
        while not sock.poll(int(POLL_S * 1000)):
            if is_alive is not None and not is_alive():
                raise LoaderRendezvousError(f"the engine exited before its load step answered {msg['op']!r}")
            if time.monotonic() > deadline:
                raise LoaderRendezvousError(
                    f"the engine's load step at {address} did not answer {msg['op']!r} within {timeout_s:.0f} s"
                )
        raw = sock.recv()
    finally:
        sock.close()
    try:
        answer = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoaderRendezvousError(f"the engine's load step answered non-JSON: {raw[:200]!r}") from None
    if not isinstance(answer, dict) or not answer.get("ok"):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise LoaderRendezvousError(f"the engine's load step failed: {error}")
    return answer


def wait_for_loader(address: str, *, timeout_s: float, is_alive: Callable[[], bool] | None = None) -> None:
    """PS side: return once the engine sits in its load step, listening at `address`."""
    _request(address, {"op": "hello"}, timeout_s=timeout_s, is_alive=is_alive)


def loader_req_func(
    address: str,
    *,
    timeout_s: float,
    is_alive: Callable[[], bool] | None = None,
    result: dict | None = None,
    rank: int | None = None,
) -> Callable[[Sequence[tuple[str, str]]], None]:
    """req_func for `ps.update` that hands the PS's sockets to an engine waiting in its load step.

    One PS rank per engine (TP = 1): `rank` (the PS rank feeding this engine) sends only its own
    socket; None sends every rank's (a one-rank PS). `result`, if given, receives the engine's report.
    """

    def req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
        handles = dict(socket_paths if rank is None else socket_paths[rank : rank + 1])
        answer = _request(address, {"op": "load", "zmq_handles": handles}, timeout_s=timeout_s, is_alive=is_alive)
        if result is not None:
            result.update(answer.get("report") or {})

    return req_func
