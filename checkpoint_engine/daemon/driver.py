"""Rank 0's Driver: runs the daemon's commands one at a time, each as its phases
(`daemon_commands.phases`), relayed to every rank and gathered with a deadline.

    HTTP route ──Driver.run(cmd)──▶ for each phase: relay {**cmd, "phase"} ──▶ every rank's run_command
                                    ◀── per-rank results ── status (KIND_STATUS), undo where needed

What each rank runs, the phases and the kinds of failure live in `daemon_commands`.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from checkpoint_engine.daemon.commands import (
    CHECK_TIMEOUT_S,
    ENGINE_OPS,
    FAULT_FIELD,
    KIND_ORDER,
    KIND_STATUS,
    error_kind,
    phases,
    run_command,
)
from checkpoint_engine.daemon.relay import EngineBoard, Relay
from checkpoint_engine.engines import host as engines
from checkpoint_engine.ps import ParameterServer

logger = logging.getLogger(__name__)


class Driver:
    """Rank 0: runs commands one at a time, each as its phases (`phases`), relayed to every rank.

    A command that comes while another runs is refused at once (`busy`, HTTP 409), except the
    shutdown's `exit` and a heal (`heal: True`), which wait for the lock (bounded). Once a rank died or
    stayed silent past a deadline, every command but `exit` is refused at once (`unavailable`, 503).

    With managed engines it also keeps `current`: the checkpoint the engines serve (the last managed
    update or start with a name that succeeded), which heals bring a restarted engine to.

    `fault_injection` (tests only, never from the environment): commands may carry `_fault`
    ({"apply_fails_on": [ranks]}: their apply phase fails there as an allocation would); without it
    such a command is refused (400)."""

    ENGINE_OPS = ENGINE_OPS
    fault_injection = False

    def __init__(
        self,
        ps: ParameterServer,
        relay: Relay,
        host: engines.EngineHost | None = None,
        board: EngineBoard | None = None,
        *,
        fault_injection: bool | None = None,
    ):
        self.ps, self.relay, self.host, self.board = ps, relay, host, board
        self.lock = threading.Lock()
        self.current: str | None = None
        self.in_flight: str | None = None  # the op running now (for the busy answer)
        self.broken: dict[str, str] = {}  # rank -> why the daemon must be restarted (empty: it need not)
        self.stopping = False  # set by `exit`: later commands answer 503
        self._memo: dict = {}
        if fault_injection is not None:
            self.fault_injection = fault_injection

    def run(self, cmd: dict, result_timeout_s: float | None = None, wait_s: float | None = None) -> dict:
        """Run `cmd` on every rank; return the answer (module docstring: "ok", "op", "status", "ranks",
        "errors"...). `result_timeout_s`: the deadline of its phases after the check (default: the
        relay's); `wait_s`: how long to wait for a command in flight (default: 0, busy at once; `exit`
        and heals: that deadline)."""
        op = cmd.get("op")
        if FAULT_FIELD in cmd and not self.fault_injection:
            return self._refused(
                op, "bad_request", {"0": f"'{FAULT_FIELD}' needs a daemon started for fault injection"}
            )
        refusal = self._refusal(op)
        if refusal is not None:
            return refusal
        if wait_s is None:
            waits = op == "exit" or bool(cmd.get("heal"))
            wait_s = (self.relay.result_timeout_s if result_timeout_s is None else result_timeout_s) if waits else 0.0
        if not (self.lock.acquire(timeout=wait_s) if wait_s > 0 else self.lock.acquire(blocking=False)):
            why = f"the daemon is busy with another command ({self.in_flight}); try again when it is done"
            return self._refused(op, "busy", {"0": why})
        try:
            refusal = self._refusal(op)  # the command this one waited for may have found a dead rank
            if refusal is not None:
                return refusal
            self.in_flight = op
            if op == "exit":
                self.stopping = True
            op_key = self._begin_engine_op(cmd)
            try:
                answer = self._run_phases(cmd, result_timeout_s)
            except Exception as e:  # the store, or a bug of ours: this daemon's fault, on rank 0
                logger.exception("command %s failed on rank 0", op)
                kind = error_kind(e)
                why = f"{type(e).__name__}: {e}"
                if kind == "unavailable":
                    self.broken = {"0": f"the process group's store failed ({why}); the daemon must be restarted"}
                answer = self._refused(op, "unavailable" if kind == "unavailable" else "internal", {"0": why})
            finally:
                if op_key is not None:
                    self._end_engine_op(op_key)
            name = cmd.get("name")
            updated = op == "engine_start" or (op == "update" and cmd.get("managed"))
            if answer["ok"] and name and (updated or (op == "engine_wake" and cmd.get("update_ranks"))):
                self.current = cmd.get("full_checkpoint") or name  # a delta's engines serve its full version
            elif answer["ok"] and op == "unregister" and name == self.current:
                self.current = None  # heals now start engines without weights until the next update
            return answer
        finally:
            self.in_flight = None
            self.lock.release()

    def _refusal(self, op) -> dict | None:
        if op == "exit":
            return None  # the shutdown always tells the ranks that can still hear it
        if self.broken:
            return self._refused(op, "unavailable", dict(self.broken))
        if self.stopping:
            return self._refused(op, "unavailable", {"0": "the daemon is stopping"})
        return None

    @staticmethod
    def _refused(op, kind: str, errors: dict[str, str]) -> dict:
        """The answer to a command no rank ran (or that rank 0 could not relay)."""
        error = "; ".join(f"rank {r}: {e}" for r, e in errors.items())
        return {
            "ok": False,
            "op": op,
            "status": KIND_STATUS[kind],
            "ranks": [],
            "errors": errors,
            "error": error,
            "kind": kind,
        }

    def _relay(self, cmd: dict, phase: str, timeout_s: float | None, extra: dict | None = None) -> list[dict]:
        """One phase of `cmd` on every rank (rank 0's own part here); a rank lost marks the daemon broken."""
        step = {**cmd, "phase": phase, **(extra or {})}
        self.relay.publish(step)
        self.relay.put_result(run_command(self.ps, step, self.host, self._memo))
        skip = {int(r) for r in self.broken}  # exit after a rank was lost: not waited for again
        results = self.relay.gather_results(timeout_s, skip=skip)
        self.relay.done()
        for r, res in enumerate(results):
            if not res.get("ok"):
                res.setdefault("phase", phase)
                if res.get("kind") == "unavailable":
                    self.broken.setdefault(str(r), res["error"])
        return results

    def _run_phases(self, cmd: dict, result_timeout_s: float | None) -> dict:
        op, n = cmd.get("op"), self.ps.world_size
        elapsed = [0.0] * n
        results: list[dict] = []
        failed: dict[int, dict] = {}
        instead: dict | None = None  # what the ranks that did not fail report when the command was not applied
        for phase in phases(cmd):
            timeout_s = result_timeout_s
            if phase == "check":
                bound = min(CHECK_TIMEOUT_S, float(cmd.get("timeout_s") or CHECK_TIMEOUT_S))
                timeout_s = bound if timeout_s is None else min(timeout_s, bound)
            results = self._relay(cmd, phase, timeout_s)
            for r, res in enumerate(results):
                elapsed[r] += res.get("elapsed_s", 0.0)
            failed = {r: res for r, res in enumerate(results) if not res.get("ok")}
            if phase == "check" and not failed and op in ("unregister", "gather_metas"):
                if not any(res["result"].get("registered") for res in results):
                    why = f"CheckpointNotFound: checkpoint {cmd.get('name')!r} is registered on no rank"
                    failed = {r: {"ok": False, "error": why, "kind": "not_found", "phase": "check"} for r in range(n)}
            if not failed:
                continue
            culprits = sorted(failed)
            if phase in ("check", "apply"):
                instead = {"skipped": f"not applied: ranks {culprits} failed the {phase} phase"}
            applied = []
            if phase == "apply" and op in ("register", "load_metas", "unregister"):  # unregister: loaded metas back
                applied = [r for r in range(n) if r not in failed]
            elif phase == "collective" and op == "register":
                applied = list(range(n))  # every rank had registered it
            if applied and not self.broken:  # a lost rank: no undo, the daemon must be restarted anyway
                self._undo(cmd, applied, failed, result_timeout_s)
                instead = {"undone": f"ranks {culprits} failed the {phase} phase", "undo_ranks": applied}
            break
        ranks = [
            failed[r]
            if r in failed
            else {
                "ok": True,
                "result": results[r].get("result") if instead is None else instead,
                "elapsed_s": round(elapsed[r], 4),
            }
            for r in range(n)
        ]
        if not failed:
            return {"ok": True, "op": op, "status": 200, "ranks": ranks}
        errors = {str(r): res["error"] for r, res in sorted(failed.items())}
        kinds = {res.get("kind", "internal") for res in failed.values()}
        kind = next(k for k in KIND_ORDER if k in kinds)
        error = "; ".join(f"rank {r}: {e}" for r, e in errors.items())
        return {
            "ok": False,
            "op": op,
            "status": KIND_STATUS[kind],
            "ranks": ranks,
            "errors": errors,
            "error": error,
            "kind": kind,
        }

    def _undo(self, cmd: dict, applied: list[int], failed: dict[int, dict], timeout_s: float | None) -> None:
        """Take the apply back on `applied`; a rank whose undo fails joins `failed` (the ranks then disagree)."""
        results = self._relay(cmd, "undo", timeout_s, {"undo_ranks": applied})
        for r, res in enumerate(results):
            if not res.get("ok") and r not in failed:
                failed[r] = {**res, "error": f"undo failed, this rank keeps the change: {res['error']}"}

    def _begin_engine_op(self, cmd: dict) -> str | None:
        """An engine operation in flight goes to the metadata store (`ops/engines-<n>`, with a TTL) until it
        ends; updates publish their own (`ps.update`)."""
        if cmd.get("op") not in self.ENGINE_OPS:
            return None
        key = f"ops/engines-{self.relay.seq}"
        info = {k: cmd.get(k) for k in ("op", "ranks", "name", "heal", "level")}
        self.ps.registry.store.put(key, json.dumps({**info, "started_at_s": time.time()}), ttl_s=3600.0)
        return key

    def _end_engine_op(self, key: str) -> None:
        try:
            self.ps.registry.store.delete(key)
        except Exception as e:  # noqa: BLE001 - etcd down: the key's TTL removes it
            logger.warning("engine operation %s not removed from the metadata store: %s: %s", key, type(e).__name__, e)
