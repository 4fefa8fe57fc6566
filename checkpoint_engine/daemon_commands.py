"""The daemon's commands: what each rank runs (`execute`), the check rank 0 makes before relaying
one (`validate`), and the Driver that serialises them on rank 0.

    rank 0  Driver.run(cmd): publish ──relay──▶ every rank: run_command(ps, cmd) ──result──▶ gathered

Commands are JSON (never pickle). A command failing on any rank is reported with every rank's error.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from checkpoint_engine import engines
from checkpoint_engine.api import group_req_func, http_req_func
from checkpoint_engine.daemon_relay import EngineBoard, Relay
from checkpoint_engine.ps import ParameterServer

logger = logging.getLogger(__name__)


class CommandError(ValueError):
    """A command whose arguments are wrong: answered with HTTP 400 (422 on the compat routes)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field  # the request field at fault ("" when it is the request as a whole)


def execute(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None) -> dict:
    """Run one command on this rank's ParameterServer; return a JSON-ready result."""
    op = cmd.get("op")
    if op in Driver.ENGINE_OPS or (op == "update" and cmd.get("managed")):
        if host is None:
            raise CommandError(f"{op}: this daemon manages no engines (start it with --engine-cmd)")
        if op == "engine_start":
            return engines.engine_start(host, ps, cmd)
        if op == "engine_stop":
            return engines.engine_stop(host, cmd)
        if op == "engine_sleep":
            return engines.engine_sleep(host, cmd)
        if op == "engine_wake":
            return engines.engine_wake(host, ps, cmd)
        return engines.managed_update(host, ps, cmd["name"], cmd.get("ranks"), cmd.get("timeout_s"))
    if op == "register":
        files = cmd.get("files") or []
        owners = sorted(cmd.get("owner_ranks") or range(ps.world_size))  # validated: distinct ranks
        if not cmd.get("split_files", True):
            mine = files
        elif ps.rank in owners:  # the files split over the owners; any other rank holds none of them
            mine = [f for i, f in enumerate(sorted(files)) if i % len(owners) == owners.index(ps.rank)]
        else:
            mine = []
        ps.register_checkpoint(cmd["name"], files=mine)
        if cmd.get("gather", True):
            ps.gather_metas(cmd["name"])
        return {"registered_files": mine, **ps.checkpoints()[cmd["name"]]}
    if op == "gather_metas":
        ps.gather_metas(cmd["name"])
        return {}
    if op == "unregister":
        ps.unregister_checkpoint(cmd["name"])
        return {}
    if op == "update":
        m = ps.update(cmd["name"], _req_func(ps, cmd), timeout=cmd.get("timeout_s"), ranks=cmd.get("ranks"))
        return m.to_dict() if m is not None else {"skipped": "not a P2P receiver"}
    if op == "get_metas":
        return ps.get_metas(cmd["name"]) if ps.rank == 0 else {}
    if op == "load_metas":
        ps.load_metas(cmd["metas"])
        return {}
    if op == "inspect":
        return {"checkpoints": ps.checkpoints(), "last_update": ps.last_metrics.to_dict() if ps.last_metrics else None}
    if op == "exit":
        if host is not None:
            host.close()
        return {}
    raise CommandError(f"unknown op {op!r}")


def _req_func(ps: ParameterServer, cmd: dict):
    timeout_s = float(cmd.get("timeout_s") or 300)
    if "update_url" in cmd:  # MoonshotAI's route: one engine, the devices of inference_group_ranks
        url = cmd["update_url"]
        if isinstance(url, list):  # our extension: one URL per engine, each serving world/len ranks
            per = ps.world_size // len(url)
            first = ps.rank // per * per
            return group_req_func(
                url[ps.rank // per],
                rank=ps.rank,
                group_ranks=list(range(first, first + per)),
                timeout_s=timeout_s,
                uds=cmd.get("uds"),
            )
        group = cmd.get("inference_group_ranks") or cmd.get("ranks") or list(range(ps.world_size))
        return group_req_func(url, rank=ps.rank, group_ranks=group, timeout_s=timeout_s, uds=cmd.get("uds"))
    endpoints = cmd["endpoints"]
    per = int(cmd.get("ranks_per_engine", 1))
    endpoint = endpoints[ps.rank // per] if isinstance(endpoints, list) else endpoints
    return http_req_func(endpoint, rank=ps.rank, ranks_per_engine=per, timeout_s=timeout_s)


def is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in value)


def validate(cmd: dict) -> dict:
    """Check a command on rank 0 before it goes to every rank (HTTP 400 on failure)."""
    op = cmd.get("op")
    if op in Driver.ENGINE_OPS and cmd.get("ranks") is not None and not is_int_list(cmd["ranks"]):
        raise CommandError(f"{op}: 'ranks' must be a list of ranks or null (all)", "ranks")
    if op == "engine_sleep" and cmd.get("level", 1) not in engines.SLEEP_LEVELS:
        raise CommandError(f"engine_sleep: 'level' must be one of {list(engines.SLEEP_LEVELS)}", "level")
    if op == "engine_wake" and cmd.get("update_ranks"):
        if not is_int_list(cmd["update_ranks"]):
            raise CommandError("engine_wake: 'update_ranks' must be a list of ranks", "update_ranks")
        if not (isinstance(cmd.get("name"), str) and cmd["name"]):
            raise CommandError("engine_wake: engines to update need a checkpoint 'name'", "name")
    if op == "engine_start" and cmd.get("name") is not None and not (isinstance(cmd["name"], str) and cmd["name"]):
        raise CommandError("engine_start: 'name' must be a checkpoint name or null", "name")
    if op in ("register", "unregister", "update", "gather_metas") and not (
        isinstance(cmd.get("name"), str) and cmd["name"]
    ):
        raise CommandError(f"{op}: 'name' must be a non-empty string", "name")
    if op == "register":
        files = cmd.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise CommandError("register: 'files' must be a non-empty list of safetensors paths", "files")
        owners = cmd.get("owner_ranks")
        if owners is not None and not (is_int_list(owners) and owners and len(set(owners)) == len(owners)):
            raise CommandError(
                f"register: 'owner_ranks' must be a non-empty list of distinct ranks or null (all), got {owners!r}",
                "owner_ranks",
            )
    if op == "load_metas" and not isinstance(cmd.get("metas"), dict):
        raise CommandError("load_metas: 'metas' must be the JSON object GET /metas/NAME returned", "metas")
    if op == "update" and cmd.get("ranks") is not None and not is_int_list(cmd["ranks"]):
        raise CommandError("update: 'ranks' must be a list of ints (P2P receivers) or null", "ranks")
    timeout_s = cmd.get("timeout_s")
    if (
        op == "update"
        and timeout_s is not None
        and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0)
    ):
        raise CommandError(f"update: 'timeout_s' must be a number > 0, got {timeout_s!r}", "timeout_s")
    if op == "update" and "update_url" in cmd:
        url = cmd["update_url"]
        if isinstance(url, list):
            if not url or not all(isinstance(u, str) for u in url) or cmd.get("world_size", len(url)) % len(url):
                raise CommandError(
                    "update: a list 'update_url' must hold one URL per engine, the engines "
                    f"serving equal numbers of ranks (world size {cmd.get('world_size')})",
                    "update_url",
                )
            if cmd.get("inference_group_ranks"):
                raise CommandError(
                    "update: 'inference_group_ranks' applies to a single 'update_url' only", "inference_group_ranks"
                )
        elif url is not None and not isinstance(url, str):
            raise CommandError(
                "update: 'update_url' must be a URL string, a list of them (one per engine) or null", "update_url"
            )
        if cmd.get("uds") is not None and not isinstance(cmd["uds"], str):
            raise CommandError("update: 'uds' must be a unix socket path or null", "uds")
        if not is_int_list(cmd.get("inference_group_ranks", [])):
            raise CommandError("update: 'inference_group_ranks' must be a list of ints", "inference_group_ranks")
    elif op == "update" and not cmd.get("managed"):
        eps = cmd.get("endpoints")
        if not (isinstance(eps, str) or (isinstance(eps, list) and eps and all(isinstance(e, str) for e in eps))):
            raise CommandError(
                "update: 'endpoints' must be an engine URL or a list of URLs (one per engine); leave it out "
                "to update the engines the daemon manages (--engine-cmd)",
                "endpoints",
            )
    return cmd


def serve_rank(
    ps: ParameterServer, relay: Relay, stop: threading.Event, host: engines.EngineHost | None = None
) -> None:
    """Non-zero ranks: execute commands until 'exit'."""
    while (cmd := relay.next_command(stop)) is not None:
        relay.put_result(run_command(ps, cmd, host))
        relay.done()
        if cmd.get("op") == "exit":
            return


def run_command(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        return {"ok": True, "result": execute(ps, cmd, host), "elapsed_s": round(time.perf_counter() - t0, 4)}
    except Exception as e:
        logger.exception("command %s failed", cmd.get("op"))
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


class Driver:
    """Rank 0: serialises commands (one at a time) on a worker thread.

    With managed engines it also keeps `current`: the checkpoint the engines serve (the last managed
    update or start with a name that succeeded), which heals bring a restarted engine to."""

    def __init__(
        self,
        ps: ParameterServer,
        relay: Relay,
        host: engines.EngineHost | None = None,
        board: EngineBoard | None = None,
    ):
        self.ps, self.relay, self.host, self.board = ps, relay, host, board
        self.lock = threading.Lock()
        self.current: str | None = None

    ENGINE_OPS = ("engine_start", "engine_stop", "engine_sleep", "engine_wake")

    def run(self, cmd: dict, result_timeout_s: float | None = None) -> dict:
        """Run `cmd` on every rank; ranks silent for `result_timeout_s` (default: the relay's) fail it."""
        with self.lock:
            op_key = self._begin_engine_op(cmd)
            self.relay.publish(cmd)
            mine = run_command(self.ps, cmd, self.host)
            self.relay.put_result(mine)
            results = self.relay.gather_results(result_timeout_s)
            self.relay.done()
            ok = all(r.get("ok") for r in results)
            if op_key is not None:
                self.ps.registry.store.delete(op_key)
            op, name = cmd.get("op"), cmd.get("name")
            updated = op == "engine_start" or (op == "update" and cmd.get("managed"))
            if ok and name and (updated or (op == "engine_wake" and cmd.get("update_ranks"))):
                self.current = name
            elif ok and op == "unregister" and name == self.current:
                self.current = None  # heals now start engines without weights until the next update
        errors = {str(r): res["error"] for r, res in enumerate(results) if not res.get("ok")}
        return {"ok": ok, "op": cmd.get("op"), "ranks": results, **({"errors": errors} if errors else {})}

    def _begin_engine_op(self, cmd: dict) -> str | None:
        """An engine operation in flight goes to the metadata store (`ops/engines-<n>`, with a TTL) until it
        ends; updates publish their own (`ps.update`)."""
        if cmd.get("op") not in self.ENGINE_OPS:
            return None
        key = f"ops/engines-{self.relay.seq}"
        info = {k: cmd.get(k) for k in ("op", "ranks", "name", "heal", "level")}
        self.ps.registry.store.put(key, json.dumps({**info, "started_at_s": time.time()}), ttl_s=3600.0)
        return key
