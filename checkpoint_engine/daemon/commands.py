"""The daemon's commands: what each rank runs, the check rank 0 makes before relaying one
(`validate`), and the Driver that runs them one at a time on rank 0.

    rank 0  Driver.run(cmd): each phase ──relay──▶ every rank: run_command(ps, {**cmd, "phase"}) ──▶ gathered

A command that changes state runs in phases, each relayed to every rank and gathered with a deadline:

    check       every rank checks what it can locally (its files exist, are regular files, their
                safetensors headers parse and fit the file, the name is free or registered, the
                metas parse, the update's checkpoint is known): no state change, no collective
    apply       only once every rank passed: the local change (register, unregister, load_metas)
    undo        a rank whose apply failed: the ranks where it took effect take it back (unregister,
                the previous metas), before any collective
    collective  every rank together (gather_metas), only once every rank has applied
    run         the rest: updates and engine operations (their check phase first makes sure that no
                rank enters the update's collectives alone), inspect, get_metas, exit

So register/unregister/load_metas/gather_metas are all-or-nothing and a rank that fails a check
fails the command within seconds on every rank. Updates and engine operations cannot be undone: the
answer names each rank's outcome, and the same request retried brings the ranks to agreement.

A rank silent past its deadline (killed, hung), or one that exited, leaves the daemon unable to run
commands (a gloo collective cannot be aborted): the Driver answers every later command at once with
status 503 naming that rank; the daemon must be restarted.

`Driver.run` answers (JSON-ready): {"ok", "op", "status": HTTP status, "ranks": [per rank: {"ok": True,
"result", "elapsed_s"} | {"ok": False, "error", "kind", "phase"}], "errors": {rank: error} (when not ok),
"error" and "kind" (when not ok)}. Kinds and statuses: `KIND_STATUS`. Commands are JSON (never pickle).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

import torch.distributed as dist

from checkpoint_engine.api import group_req_func, http_req_func
from checkpoint_engine.buckets import check_global_metas
from checkpoint_engine.daemon.relay import Relay
from checkpoint_engine.engines import host as engines
from checkpoint_engine.engines.adapters import engine_req_func
from checkpoint_engine.engines.states import SLEEP_LEVELS
from checkpoint_engine.errors import CheckpointExists, CheckpointNotFound, DaemonBusy, DaemonUnavailable
from checkpoint_engine.host_memory import read_safetensors_index
from checkpoint_engine.jobs import GlobalMetas
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.types import PAUSE_MODES, REQUESTED_ROUTES

logger = logging.getLogger(__name__)

# the HTTP status of each kind of failure; a command failing in several ways answers the first kind
# of KIND_ORDER among its ranks' failures
KIND_STATUS = {"bad_request": 400, "not_found": 404, "conflict": 409, "busy": 409, "internal": 500, "unavailable": 503}
KIND_ORDER = ("unavailable", "internal", "bad_request", "not_found", "conflict", "busy")
CHECK_TIMEOUT_S = 30.0  # the check phase's deadline (a command's own `timeout_s` shortens it)
ENGINE_OPS = ("engine_start", "engine_stop", "engine_sleep", "engine_wake")
FAULT_FIELD = "_fault"  # test-only: {"apply_fails_on": [ranks]} (a Driver with fault_injection only)


class CommandError(ValueError):
    """A command whose arguments are wrong: answered with HTTP 400 (422 on the compat routes)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field  # the request field at fault ("" when it is the request as a whole)


def error_kind(e: BaseException, phase: str | None = None) -> str:
    """The kind of a rank's failure (`KIND_STATUS`): typed errors by their type; in the check phase any
    ValueError/TypeError/OSError is the request's fault, as are ValueErrors after it (a file that
    changed, tensors that two ranks both hold); a collective that broke is `unavailable`."""
    if isinstance(e, CheckpointNotFound):
        return "not_found"
    if isinstance(e, CheckpointExists):
        return "conflict"
    if isinstance(e, DaemonBusy):
        return "busy"
    if isinstance(e, DaemonUnavailable) or _broken_collective(e):
        return "unavailable"
    if isinstance(e, (CommandError, ValueError, TypeError)):
        return "bad_request"
    if phase == "check" and isinstance(e, OSError):
        return "bad_request"
    return "internal"


def _broken_collective(e: BaseException) -> bool:
    """A collective (gloo) that timed out or lost a peer: this process group cannot be used again."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "gloo" in text.lower() and ("Timed out" in text or "Connection closed by peer" in text)
    )


# -- what each rank runs ---------------------------------------------------------------------------
def _name(cmd: dict) -> str:
    return cmd["name"]


def update_name(cmd: dict) -> str | None:
    """The checkpoint a command pushes into engines (its metas must be here on every rank), or None."""
    op = cmd.get("op")
    if op == "update" or op == "engine_start" or (op == "engine_wake" and cmd.get("update_ranks")):
        return cmd.get("name") or None
    return None


def phases(cmd: dict) -> tuple[str, ...]:
    """The phases the Driver relays for `cmd`, in order (`undo` only on a failed apply or collective)."""
    op = cmd.get("op")
    if op == "register":
        return ("check", "apply", "collective") if cmd.get("gather", True) else ("check", "apply")
    if op in ("unregister", "load_metas"):
        return ("check", "apply")
    if op == "gather_metas":
        return ("check", "collective")
    if update_name(cmd) is not None or op == "update" or op in ENGINE_OPS:
        return ("check", "run")
    return ("run",)


def my_files(ps: ParameterServer, cmd: dict) -> list[str]:
    """This rank's share of a register command's files."""
    files = cmd.get("files") or []
    if not cmd.get("split_files", True):
        return list(files)
    owners = sorted(cmd.get("owner_ranks") or range(ps.world_size))  # validated: distinct ranks
    if ps.rank not in owners:  # the files split over the owners; any other rank holds none of them
        return []
    return [f for i, f in enumerate(sorted(files)) if i % len(owners) == owners.index(ps.rank)]


def check_files(files: list[str]) -> dict:
    """What registering `files` reads, checked without reading any tensor: each is an existing, readable
    regular file whose safetensors header parses and whose tensors lie inside it, and no tensor name
    comes twice. ValueError naming the file and the problem; else the files' tensor count and bytes."""
    seen: dict[str, str] = {}
    nbytes = 0
    for path in files:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ValueError(f"checkpoint file not found: {path}") from None
        except OSError as e:
            raise ValueError(f"{path}: cannot stat it: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        try:
            tensors = read_safetensors_index(path)
        except OSError as e:  # permissions, I/O
            raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
        for t in tensors:
            if t.name in seen:
                raise ValueError(f"duplicate tensor name {t.name!r} in {seen[t.name]} and {path}")
            seen[t.name] = path
            nbytes += t.nbytes
    return {"tensors": len(seen), "nbytes": nbytes}


def check_metas(ps: ParameterServer, metas) -> GlobalMetas:
    """What `ps.load_metas(metas)` checks, without taking them: ValueError/TypeError when they are
    malformed or describe another world; CheckpointExists when their checkpoint is registered here."""
    if not isinstance(metas, dict):
        raise TypeError(f"metas must be the JSON object GET /metas/NAME returned, got {type(metas).__name__}")
    g = GlobalMetas.from_dict(metas)
    if not len(g.device_ids) == len(g.pids) == len(g.hosts):
        raise ValueError(
            f"malformed metas: device_ids, pids and hosts differ in length ({len(g.device_ids)}, "
            f"{len(g.pids)}, {len(g.hosts)})"
        )
    if len(g.device_ids) != ps.world_size and not g.owners_described:
        raise ValueError(f"metas describe {len(g.device_ids)} ranks but this world has {ps.world_size}")
    check_global_metas(g.rank_metas)
    if not g.rank_metas:
        raise ValueError(f"metas of {g.checkpoint!r} name no owner rank (were they gathered where it is registered?)")
    if g.checkpoint in ps.checkpoints():
        raise CheckpointExists(
            f"checkpoint {g.checkpoint!r} is registered in this daemon: its metas come from gather_metas, "
            "not load_metas (unregister it first)"
        )
    return g


def _is_engine_op(cmd: dict) -> bool:
    """Whether `cmd` acts on the engines this daemon manages (an engine operation or a managed update)."""
    return cmd.get("op") in ENGINE_OPS or (cmd.get("op") == "update" and bool(cmd.get("managed")))


def _need_engines(op, host: engines.EngineHost | None) -> None:
    if host is None:
        raise CommandError(f"{op}: this daemon manages no engines (start it with --engine-cmd)")


def check(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None) -> dict:
    """The check phase on this rank: raises what would fail here; changes nothing, enters no collective."""
    op = cmd.get("op")
    if _is_engine_op(cmd):
        _need_engines(op, host)
    if op == "register":
        if _name(cmd) in ps.checkpoints():
            raise CheckpointExists(f"checkpoint {_name(cmd)!r} is already registered; unregister it first")
        mine = my_files(ps, cmd)
        return {"files": mine, **check_files(mine)}
    if op == "unregister":  # the Driver answers 404 when no rank has it (registered, or by loaded metas)
        return {"registered": _name(cmd) in ps.checkpoints() or ps.has_loaded_metas(_name(cmd))}
    if op == "gather_metas":
        return {"registered": _name(cmd) in ps.checkpoints()}
    if op == "load_metas":
        return {"checkpoint": check_metas(ps, cmd.get("metas")).checkpoint}
    name = update_name(cmd)
    if name is not None:
        ps.check_update(name, None if cmd.get("managed") or op != "update" else cmd.get("ranks"))
    if op == "update" and cmd.get("full_checkpoint"):  # what heals will bring a restarted engine to
        ps.check_update(cmd["full_checkpoint"], None)
    if op == "update" and not cmd.get("managed"):
        try:  # an endpoint list that has none for this rank fails here, not in the update
            _req_func(ps, cmd)
        except (IndexError, KeyError, TypeError, ValueError) as e:
            raise CommandError(
                f"update: no engine for rank {ps.rank} in this request ({type(e).__name__}: {e})"
            ) from None
    return {}


def apply(ps: ParameterServer, cmd: dict, memo: dict) -> dict:
    """The apply phase on this rank: the local change, no collective (`memo` keeps what `undo` needs)."""
    op, name = cmd.get("op"), cmd.get("name")
    fault = cmd.get(FAULT_FIELD) or {}
    if ps.rank in (fault.get("apply_fails_on") or []):
        raise MemoryError(f"fault injection: host memory allocation failed on rank {ps.rank} ({op})")
    if op == "register":
        mine = my_files(ps, cmd)
        ps.register_checkpoint(name, files=mine)
        return {"registered_files": mine, **ps.checkpoints()[name]}
    if op == "unregister":
        if ps.has_loaded_metas(name):  # another job's memory (POST /metas): forget where it was
            memo[("unregister", name)] = ps.metas_state(name)
            ps.forget_metas(name)
            return {"forgot_metas": name}
        if name not in ps.checkpoints():  # registered on other ranks only: they unregister it
            return {"skipped": "not registered on this rank"}
        ps.unregister_checkpoint(name)
        return {}
    if op == "load_metas":
        g = check_metas(ps, cmd.get("metas"))
        memo[("load_metas", g.checkpoint)] = ps.metas_state(g.checkpoint)
        ps.load_metas(cmd["metas"])
        return {}
    raise CommandError(f"{op!r} has no apply phase")


def undo(ps: ParameterServer, cmd: dict, memo: dict) -> dict:
    """Take back this rank's apply (ranks not in `undo_ranks` did not apply: nothing to do)."""
    if ps.rank not in (cmd.get("undo_ranks") or []):
        return {"skipped": "nothing to undo on this rank"}
    op, name = cmd.get("op"), cmd.get("name")
    if op == "register":
        if name in ps.checkpoints():
            ps.unregister_checkpoint(name)
        return {"undone": f"unregistered {name!r} again"}
    if op == "unregister":
        state = memo.pop(("unregister", name), None)
        if state is None:
            return {"skipped": "a registered checkpoint's freed memory cannot be taken back"}
        ps.restore_metas_state(name, state)
        return {"undone": f"the loaded metas of {name!r} as they were"}
    if op == "load_metas":
        checkpoint = str(cmd["metas"].get("checkpoint"))
        state = memo.pop(("load_metas", checkpoint), None)
        if state is not None:
            ps.restore_metas_state(checkpoint, state)
        return {"undone": f"the metas of {checkpoint!r} as they were"}
    raise CommandError(f"{op!r} has no undo phase")


def collective(ps: ParameterServer, cmd: dict) -> dict:
    """The collective phase: every rank enters it together."""
    op, name = cmd.get("op"), cmd.get("name")
    if op not in ("register", "gather_metas"):
        raise CommandError(f"{op!r} has no collective phase")
    ps.gather_metas(name)
    if op == "register":
        return {"registered_files": my_files(ps, cmd), **ps.checkpoints()[name]}
    return {}


def run(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None) -> dict:
    """The run phase: the commands that are not all-or-nothing."""
    op = cmd.get("op")
    if _is_engine_op(cmd):
        _need_engines(op, host)
        if op == "engine_start":
            return engines.engine_start(host, ps, cmd)
        if op == "engine_stop":
            return engines.engine_stop(host, cmd)
        if op == "engine_sleep":
            return engines.engine_sleep(host, cmd)
        if op == "engine_wake":
            return engines.engine_wake(host, ps, cmd)
        return engines.managed_update(
            host, ps, cmd["name"], cmd.get("ranks"), cmd.get("timeout_s"), cmd.get("full_checkpoint")
        )
    if op == "update":
        m = ps.update(cmd["name"], _req_func(ps, cmd), timeout=cmd.get("timeout_s"), ranks=cmd.get("ranks"))
        return m.to_dict() if m is not None else {"skipped": "not a P2P receiver"}
    if op == "get_metas":
        return ps.get_metas(cmd["name"]) if ps.rank == 0 else {}
    if op == "inspect":
        return {"checkpoints": ps.checkpoints(), "last_update": ps.last_metrics.to_dict() if ps.last_metrics else None}
    if op == "exit":
        if host is not None:
            host.close()
        return {}
    raise CommandError(f"unknown op {op!r}")


def run_phase(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None, memo: dict) -> dict:
    """One relayed phase of a command on this rank (`cmd["phase"]`)."""
    phase = cmd.get("phase")
    if phase == "check":
        memo.clear()  # a new command: what an earlier one kept for its undo is not needed any more
        return check(ps, cmd, host)
    if phase == "apply":
        return apply(ps, cmd, memo)
    if phase == "undo":
        return undo(ps, cmd, memo)
    if phase == "collective":
        return collective(ps, cmd)
    if phase == "run":
        return run(ps, cmd, host)
    raise CommandError(f"unknown phase {phase!r}")


def execute(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None) -> dict:
    """Run one whole command on this rank's ParameterServer (its phases in order, without the other
    ranks' checks: the Python API and tests); return a JSON-ready result. A command with a `phase`
    runs that phase only."""
    if cmd.get("phase") is not None:
        return run_phase(ps, cmd, host, {})
    op = cmd.get("op")
    if op == "unregister":
        ps.unregister_checkpoint(_name(cmd))  # CheckpointNotFound here, as before
        return {}
    if op == "gather_metas":  # a name registered nowhere is allowed here (the join flow)
        return collective(ps, cmd)
    result: dict = {}
    for phase in phases(cmd):
        result = run_phase(ps, {**cmd, "phase": phase}, host, {})
    return result


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
    # the engine's own adapter (vLLM's, registered by the daemon's entry point); auto: native where the
    # engine's launcher says it serves vLLM's routes
    return engine_req_func(
        endpoint,
        route=cmd.get("route") or "auto",
        rank=ps.rank,
        ranks_per_engine=per,
        timeout_s=timeout_s,
        weight_version=cmd.get("weight_version") or cmd["name"],
        pause_mode=cmd.get("pause_mode") or "abort",
        extension=http_req_func(endpoint, rank=ps.rank, ranks_per_engine=per, timeout_s=timeout_s),
    )


def is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in value)


def validate(cmd: dict) -> dict:
    """Check a command on rank 0 before it goes to every rank (HTTP 400 on failure)."""
    op = cmd.get("op")
    if op in ENGINE_OPS and cmd.get("ranks") is not None and not is_int_list(cmd["ranks"]):
        raise CommandError(f"{op}: 'ranks' must be a list of ranks or null (all)", "ranks")
    if op == "engine_sleep" and cmd.get("level", 1) not in SLEEP_LEVELS:
        raise CommandError(f"engine_sleep: 'level' must be one of {list(SLEEP_LEVELS)}", "level")
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
    if op == "update" and cmd.get("full_checkpoint") is not None:
        full = cmd["full_checkpoint"]
        if not (isinstance(full, str) and full):
            raise CommandError("update: 'full_checkpoint' must be a checkpoint name", "full_checkpoint")
        if not cmd.get("managed"):
            raise CommandError(
                "update: 'full_checkpoint' applies to the engines the daemon manages (no 'endpoints' or 'update_url')",
                "full_checkpoint",
            )
        if full == cmd.get("name"):
            raise CommandError("update: 'full_checkpoint' must name another checkpoint than 'name'", "full_checkpoint")
    if op == "update" and cmd.get("ranks") is not None and not is_int_list(cmd["ranks"]):
        raise CommandError("update: 'ranks' must be a list of ints (P2P receivers) or null", "ranks")
    timeout_s = cmd.get("timeout_s")
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        raise CommandError(f"{op}: 'timeout_s' must be a number > 0, got {timeout_s!r}", "timeout_s")
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
    if op == "update":
        _check_route_fields(cmd)
    if op == "update" and not cmd.get("managed") and "update_url" not in cmd:
        eps = cmd.get("endpoints")
        if not (isinstance(eps, str) or (isinstance(eps, list) and eps and all(isinstance(e, str) for e in eps))):
            raise CommandError(
                "update: 'endpoints' must be an engine URL or a list of URLs (one per engine); leave it out "
                "to update the engines the daemon manages (--engine-cmd)",
                "endpoints",
            )
    return cmd


def _check_route_fields(cmd: dict) -> None:
    """POST /update's "route", "pause_mode" and "weight_version": for 'endpoints' only (the managed engines
    take the daemon's --engine-update-route; MoonshotAI's 'update_url' keeps its /collective_rpc)."""
    given = [k for k in ("route", "pause_mode", "weight_version") if cmd.get(k) is not None]
    if given and "endpoints" not in cmd:
        raise CommandError(
            f"update: {given} apply to 'endpoints' only (the managed engines take --engine-update-route; "
            "'update_url' is MoonshotAI's /collective_rpc route)",
            given[0],
        )
    if cmd.get("route") is not None and cmd["route"] not in REQUESTED_ROUTES:
        raise CommandError(f"update: 'route' must be one of {list(REQUESTED_ROUTES)}, got {cmd['route']!r}", "route")
    if cmd.get("pause_mode") is not None and cmd["pause_mode"] not in PAUSE_MODES:
        raise CommandError(
            f"update: 'pause_mode' must be one of {list(PAUSE_MODES)}, got {cmd['pause_mode']!r}", "pause_mode"
        )
    if cmd.get("route") == "extension" and cmd.get("pause_mode") is not None:
        raise CommandError("update: 'pause_mode' applies to the native route only (vLLM's /pause)", "pause_mode")
    if cmd.get("weight_version") is not None and not (isinstance(cmd["weight_version"], str) and cmd["weight_version"]):
        raise CommandError("update: 'weight_version' must be a non-empty string", "weight_version")


def serve_rank(
    ps: ParameterServer, relay: Relay, stop: threading.Event, host: engines.EngineHost | None = None
) -> None:
    """Non-zero ranks: run the relayed commands' phases until 'exit'."""
    memo: dict = {}  # what this rank's last apply needs for its undo
    while (cmd := relay.next_command(stop)) is not None:
        relay.put_result(run_command(ps, cmd, host, memo))
        relay.done()
        if cmd.get("op") == "exit":
            return


def run_command(
    ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None, memo: dict | None = None
) -> dict:
    """`cmd` (one phase of it when it names one, else all of it) on this rank, as a JSON-ready result:
    {"ok": True, "result", "elapsed_s"} or {"ok": False, "error", "kind", "phase", "elapsed_s"}."""
    t0 = time.perf_counter()
    phase = cmd.get("phase")
    try:
        result = run_phase(ps, cmd, host, {} if memo is None else memo) if phase else execute(ps, cmd, host)
        return {"ok": True, "result": result, "elapsed_s": round(time.perf_counter() - t0, 4)}
    except Exception as e:
        kind = error_kind(e, phase)
        if kind in ("internal", "unavailable"):
            logger.exception("rank %d: command %s (%s) failed", ps.rank, cmd.get("op"), phase or "whole")
        else:
            logger.warning(
                "rank %d: command %s (%s) refused: %s: %s", ps.rank, cmd.get("op"), phase, type(e).__name__, e
            )
        failure = {"ok": False, "error": f"{type(e).__name__}: {e}", "kind": kind}
        return {**failure, **({"phase": phase} if phase else {}), "elapsed_s": round(time.perf_counter() - t0, 4)}
