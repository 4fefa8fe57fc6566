"""The checkpoint-engine daemon's HTTP API as the RL job uses it, and versions handed over as files.

::

    DaemonClient: GET /engines, POST /checkpoints, DELETE /checkpoints/<name>, POST /engines/start,
        POST /engines/stop, POST /engines/sleep, POST /engines/wake, POST /update;
        wait_serving(rank, name): until that rank's engine serves it
    write_version: a version's tensors as safetensors shards in the handoff dir, one per daemon rank
    SwitchError, describe_engines: a failed colocated switch, naming every engine's state
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import threading
import time
from collections.abc import Callable, Mapping

import torch

from ckpt_common import hf_dir
from ckpt_common.httpjson import HTTPError, call_json

POLL_INTERVAL_S = 0.5


class SwitchError(RuntimeError):
    """A colocated switch that failed; the message names the phase and every engine's state."""


def _is_busy(text: str) -> bool:
    """Whether a 409 answer of the daemon says it was busy (not a conflict such as a taken name)."""
    try:
        answer = json.loads(text)
    except ValueError:
        return False
    return isinstance(answer, dict) and answer.get("kind") == "busy"


def describe_engines(records: list[dict]) -> str:
    """'rank 0: serving policy-v2; rank 1: failed (engine exited with code 3 ...)' for error messages."""
    parts = []
    for r in records:
        what = r.get("state", "?") + (f" {r['checkpoint']}" if r.get("checkpoint") else "")
        if r.get("state") in ("failed", "incomplete") and r.get("last_error"):
            what += f" ({str(r['last_error'])[:300]})"
        parts.append(f"rank {r.get('rank', '?')}: {what}")
    return "; ".join(parts)


TOKEN_ENV = "CKPT_ENGINE_TOKEN"  # the daemon's bearer token (its --token-file or the same variable)


class DaemonClient:
    """The daemon's HTTP API (its rank 0); every call has a deadline and raises naming the route.

    ``token``: the daemon's bearer token, sent as ``Authorization: Bearer`` (a daemon bound beyond
    loopback requires one); None takes ``$CKPT_ENGINE_TOKEN`` when set (the RL job's process
    environment, e.g. from a Kubernetes Secret), else sends none."""

    def __init__(self, endpoint: str, timeout_s: float, token: str | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        if token is None:
            token = os.environ.get(TOKEN_ENV, "").strip() or None
        self.token = token

    def _call(self, method: str, route: str, body=None, timeout_s: float | None = None):
        """One request; while the daemon is busy with another command (HTTP 409, kind "busy": a heal
        its healer runs, say) it is asked again until the call's deadline, as the daemon no longer
        queues commands."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return call_json(method, self.endpoint + route, body, timeout_s=timeout_s, token=self.token)
            except HTTPError as e:
                if not (e.status == 409 and _is_busy(e.text)) or time.monotonic() + POLL_INTERVAL_S > deadline:
                    raise
            time.sleep(POLL_INTERVAL_S)  # the command in flight runs on; bounded by the deadline

    def engines(self) -> dict:
        """``{"current": name | None, "engines": [per-rank record]}``."""
        return self._call("GET", "/engines")

    def register(self, name: str, files: list[str], owner_ranks: list[int] | None = None) -> None:
        """Every rank registers its share of ``files``; with ``owner_ranks`` only those ranks hold them."""
        body = (
            {"name": name, "files": files}
            if owner_ranks is None
            else {"name": name, "files": files, "owner_ranks": owner_ranks}
        )
        self._call("POST", "/checkpoints", body)

    def load_metas(self, metas: dict) -> None:
        """Every rank takes the owners' side of `metas` (another job's: the RL job's memory source)."""
        self._call("POST", "/metas", metas)

    def unregister(self, name: str) -> None:
        self._call("DELETE", f"/checkpoints/{name}")

    def start_engines(self, name: str, timeout_s: float, ranks: list[int] | None = None) -> dict:
        """Start the engines of ``ranks`` (all: None) with ``name``: through their load step, or dummy
        weights and a push; they report serving only with it."""
        body = {"name": name} if ranks is None else {"name": name, "ranks": ranks}
        return self._call("POST", "/engines/start", body, timeout_s=timeout_s)

    def stop_engines(self, ranks: list[int] | None = None) -> dict:
        return self._call("POST", "/engines/stop", {} if ranks is None else {"ranks": ranks})

    def sleep_engines(self, level: int, ranks: list[int] | None = None) -> dict:
        """Put the serving engines of ``ranks`` (all: None) to sleep at vLLM sleep ``level`` (1: weights
        kept in host memory, 2: dropped); they report "sleeping"."""
        body = {"level": level} if ranks is None else {"level": level, "ranks": ranks}
        return self._call("POST", "/engines/sleep", body)

    def wake_engines(self, name: str | None, timeout_s: float, ranks: list[int] | None = None) -> dict:
        """Wake the sleeping engines of ``ranks`` (all: None), serving ``name`` (the daemon updates them
        to it; None: level 1 keeps what they slept with, level 2 gets the current checkpoint)."""
        body: dict = {"name": name, "timeout_s": timeout_s}
        if ranks is not None:
            body["ranks"] = ranks
        return self._call("POST", "/engines/wake", body, timeout_s=timeout_s + 60.0)

    def update(self, name: str, ranks: list[int] | None, full_checkpoint: str | None = None) -> dict:
        """The engines of ``ranks`` (all: None) to ``name``; ``full_checkpoint``: ``name`` is a delta whose
        engines then serve that registered checkpoint (what heals bring a restarted engine to)."""
        body: dict = {"name": name}
        if ranks is not None:
            body["ranks"] = ranks
        if full_checkpoint is not None:
            body["full_checkpoint"] = full_checkpoint
        return self._call("POST", "/update", body)

    def wait_serving(
        self,
        rank: int,
        name: str,
        timeout_s: float,
        *,
        replaced_pid: int | None = None,
        still_answers: Callable[[str], bool] | None = None,
        stop: threading.Event | None = None,
    ) -> dict:
        """Wait until rank ``rank``'s engine serves checkpoint ``name``; its record.

        ``replaced_pid``: the engine process that failed. Until the daemon notices (its watchdog
        polls), its record still says serving with that pid: such a record counts only if
        ``still_answers(url)`` (the failure was not the engine's death)."""
        deadline = time.monotonic() + timeout_s
        last: dict = {}
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            try:
                last = self.engines()["engines"][rank]
            except Exception as e:  # noqa: BLE001 - the daemon may be busy with the heal's update: ask again
                last = {"error": str(e)}
            if last.get("state") == "serving" and last.get("checkpoint") == name and last.get("url"):
                if replaced_pid is None or last.get("pid") != replaced_pid:
                    return last
                if still_answers is not None and still_answers(last["url"]):
                    return last
            time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"rank {rank}'s engine did not serve {name} within {timeout_s:.0f} s (last: {last})")


def shard_size_bytes(sizes_bytes: Mapping[str, int], num_ranks: int) -> int:
    """Largest shard so that the files split over ``num_ranks`` ranks about evenly (the daemon gives
    file i to rank i % world) and no tensor is cut."""
    total = sum(sizes_bytes.values())
    return max(max(sizes_bytes.values(), default=1), math.ceil(total / max(num_ranks, 1)))


def num_ranks(records: list[dict]) -> int:
    """The daemon's ranks behind its engine records (a tensor-parallel engine's record names its group)."""
    return sum(len(r.get("ranks") or [0]) for r in records)


def write_version(handoff: pathlib.Path, name: str, tensors: Mapping[str, torch.Tensor], num_ranks: int) -> list[str]:
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    files = hf_dir.write_safetensors(handoff / name, tensors, max_shard_size_bytes=shard_size_bytes(sizes, num_ranks))
    return [str(f) for f in files]
