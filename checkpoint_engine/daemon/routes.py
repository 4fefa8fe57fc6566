"""Rank 0's HTTP API (aiohttp): our routes, on the daemon's commands (`daemon_commands`), and
`GET /metrics` (`daemon_metrics`); `make_app` mounts them with MoonshotAI checkpoint-engine's `/v1`
routes (`daemon_compat_routes`) behind the shared middlewares (`daemon_http`).

Every route checks its request before any rank sees it; a relayed command runs on an executor
thread, never blocking the event loop. `GET /engines` and `GET /metrics` read the engine board (no
command: they answer during a long update). docs/daemon.md is the user's guide to all of it.

Our answers: 200 done; 400 a malformed request (a body that is not a JSON object or nests deeper
than `daemon_http.MAX_JSON_DEPTH`, an unknown field, named, a bad value, named); 401 no or a wrong
bearer token (when the daemon has one); 404 an unknown checkpoint, 409 a name already registered,
an engine in the wrong state or the daemon busy with another command, 500 a fault of the daemon or
its engines, 503 a daemon that must be restarted, or is stopping (after POST /shutdown or a signal
every route but the health checks answers 503 at once). The relayed codes come from the driver
(`status`).
"""

from __future__ import annotations

import asyncio
import logging

from checkpoint_engine.daemon.commands import FAULT_FIELD, CommandError, is_int_list, validate
from checkpoint_engine.daemon.compat_routes import compat_routes
from checkpoint_engine.daemon.driver import Driver
from checkpoint_engine.daemon.http import middlewares, read_body
from checkpoint_engine.daemon.prometheus import CONTENT_TYPE, DaemonMetrics, ObservedDriver
from checkpoint_engine.engines.states import SLEEP_LEVELS, SLEEPABLE, STARTABLE, UPDATABLE

logger = logging.getLogger(__name__)

# what each route's JSON body may hold (anything else is refused, by name)
REGISTER_FIELDS = ("name", "files", "owner_ranks", "split_files", "gather", "timeout_s")
UPDATE_FIELDS = (
    "name",
    "endpoints",
    "ranks_per_engine",
    "ranks",
    "timeout_s",
    "update_url",
    "inference_group_ranks",
    "uds",
    "route",
    "pause_mode",
    "weight_version",
    "full_checkpoint",
)
# POST /metas takes what GET /metas/NAME answered as its rank 0 result (jobs.GlobalMetas.to_dict)
METAS_REQUIRED = ("checkpoint", "ranks", "device_ids", "pids", "hosts")
METAS_FIELDS = (*METAS_REQUIRED, "chunk_handles", "p2p_addrs", "chunk_ptrs", "owner_pids", "owner_hosts", "checksums")


def _bad(msg: str, field: str | None = None, status: int = 400):
    from aiohttp import web

    return web.json_response({"ok": False, "error": msg, **({"field": field} if field else {})}, status=status)


def make_app(driver: Driver, stop: asyncio.Event, *, token: str | None = None, metrics: DaemonMetrics | None = None):
    """Rank 0's aiohttp application. `token`: every route but the health checks needs `Authorization:
    Bearer <token>`; `metrics`: the daemon's (one made here when None; the healer's commands reach it
    through `ObservedDriver` in `serve_http`)."""
    from aiohttp import web

    metrics = metrics if metrics is not None else DaemonMetrics(driver.ps.world_size)
    observed = ObservedDriver(driver, metrics)

    async def run(cmd: dict) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, observed.run, cmd)

    async def call(cmd: dict) -> web.Response:
        try:
            validate(cmd)
        except CommandError as e:
            return _bad(str(e), e.field or None)
        result = await run(cmd)
        return web.json_response(result, status=result.get("status", 200 if result["ok"] else 500))

    def bad_ranks(value, field: str, *, empty_ok: bool):
        """A 400 naming `field` unless it is null or a list of distinct ranks of this world."""
        n = driver.ps.world_size
        if value is None or (
            is_int_list(value)
            and (value or empty_ok)
            and len(set(value)) == len(value)
            and all(0 <= r < n for r in value)
        ):
            return None
        return _bad(
            f"'{field}' must be a {'' if empty_ok else 'non-empty '}list of distinct ranks in [0, {n}) "
            f"or null, got {value!r}",
            field,
        )

    async def register(request):
        fields = REGISTER_FIELDS + ((FAULT_FIELD,) if driver.fault_injection else ())  # tests only
        data = await read_body(request, fields, "POST /checkpoints")
        owners = data.get("owner_ranks")
        if is_int_list(owners) and not all(0 <= r < driver.ps.world_size for r in owners):
            error = f"register: 'owner_ranks' must be ranks in [0, {driver.ps.world_size}), got {owners!r}"
            return _bad(error, "owner_ranks")
        for flag in ("split_files", "gather"):
            if flag in data and not isinstance(data[flag], bool):
                return _bad(f"'{flag}' must be true or false, got {data[flag]!r}", flag)
        return await call({"op": "register", **data})

    async def unregister(request):
        return await call({"op": "unregister", "name": request.match_info["name"]})

    async def update(request):
        data = await read_body(request, UPDATE_FIELDS, "POST /update")
        n = driver.ps.world_size
        bad = bad_ranks(data.get("ranks"), "ranks", empty_ok=True)
        if bad is not None:
            return bad
        per = data.get("ranks_per_engine", 1)
        if isinstance(per, bool) or not isinstance(per, int) or per < 1 or n % per:
            return _bad(
                f"'ranks_per_engine' must be an int >= 1 dividing the world size {n}, got {per!r}", "ranks_per_engine"
            )
        eps = data.get("endpoints")
        if isinstance(eps, list) and eps and len(eps) < n // per:
            return _bad(
                f"'endpoints' must hold one URL per engine: {n // per} for {n} ranks at {per} per engine, "
                f"got {len(eps)}",
                "endpoints",
            )
        cmd = {"op": "update", **data}
        if "update_url" in cmd:
            cmd["world_size"] = n  # validate() checks a list of URLs against it
        if driver.host is not None and "endpoints" not in cmd and "update_url" not in cmd:
            cmd["managed"] = True  # no engine URLs: the engines this daemon manages
            refused = _engines_not_in(driver, cmd.get("ranks"), UPDATABLE, "cannot take an update")
            if refused is not None:
                return refused
        return await call(cmd)

    async def engines_start(request):
        data = await read_body(request, ("ranks", "name", "timeout_s"), "POST /engines/start")
        bad = _check_engine_request(driver, data, ("ranks", "name", "timeout_s"))
        if bad is not None:
            return bad
        busy = _engines_not_in(driver, data.get("ranks"), STARTABLE, "is running; POST /engines/stop first")
        if busy is not None:
            return busy
        name = data.get("name", driver.current)  # a started engine is brought to the current weights
        if name is None and driver.host.config.loads_from_ps:
            return _bad(
                "'name' is required: the engines take their first weights in their load step "
                "({rendezvous} in --engine-cmd) and no checkpoint has been served yet",
                "name",
            )
        return await call({"op": "engine_start", "ranks": data.get("ranks"), "name": name, **_timeout(data)})

    async def engines_stop(request):
        data = await read_body(request, ("ranks",), "POST /engines/stop")
        bad = _check_engine_request(driver, data, ("ranks",))
        if bad is not None:
            return bad
        return await call({"op": "engine_stop", "ranks": data.get("ranks")})

    async def engines_sleep(request):
        data = await read_body(request, ("ranks", "level", "timeout_s"), "POST /engines/sleep")
        bad = _check_engine_request(driver, data, ("ranks", "level", "timeout_s"))
        if bad is not None:
            return bad
        level = data.get("level", 1)
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            return _bad(f"'level' must be one of {list(SLEEP_LEVELS)} (vLLM's), got {level!r}", "level")
        busy = _engines_not_in(driver, data.get("ranks"), SLEEPABLE, "is not serving; only a serving engine sleeps")
        if busy is not None:
            return busy
        return await call({"op": "engine_sleep", "ranks": data.get("ranks"), "level": level, **_timeout(data)})

    async def engines_wake(request):
        data = await read_body(request, ("ranks", "name", "timeout_s"), "POST /engines/wake")
        bad = _check_engine_request(driver, data, ("ranks", "name", "timeout_s"))
        if bad is not None:
            return bad
        busy = _engines_not_in(driver, data.get("ranks"), frozenset({"sleeping"}), "is not sleeping")
        if busy is not None:
            return busy
        wanted = set(data.get("ranks") or range(driver.ps.world_size))
        records = [r for r in driver.board.records() if _selected(r, wanted)]
        name = data.get("name")
        dropped = sorted(r["rank"] for r in records if r.get("sleep_level") == 2)
        if dropped and name is None:
            name = driver.current
            if name is None:
                return _bad(
                    f"'name' is required: the engines of ranks {dropped} slept at level 2 and "
                    "have no weights, and no checkpoint has been served yet",
                    "name",
                )
        update_ranks = sorted(r["rank"] for r in records if r["rank"] in dropped or (name and r["checkpoint"] != name))
        cmd = {"op": "engine_wake", "ranks": data.get("ranks"), "name": name, "update_ranks": update_ranks}
        return await call({**cmd, **_timeout(data)})

    async def engines_list(request):
        if driver.board is None:
            return _bad(NO_ENGINES)
        records = await asyncio.get_running_loop().run_in_executor(None, driver.board.records)
        auto_heal = driver.host.config.auto_heal
        return web.json_response({"ok": True, "current": driver.current, "auto_heal": auto_heal, "engines": records})

    async def inspect(request):
        return await call({"op": "inspect"})

    async def get_metas(request):
        return await call({"op": "get_metas", "name": request.match_info["name"]})

    async def load_metas(request):
        data = await read_body(request, METAS_FIELDS, "POST /metas (the metas GET /metas/NAME answered)")
        missing = [f for f in METAS_REQUIRED if f not in data]
        if missing:
            return _bad(
                f"missing field(s) {missing}: POST /metas takes the metas GET /metas/NAME answered "
                "(its ranks[0].result)",
                missing[0],
            )
        return await call({"op": "load_metas", "metas": data})

    async def health(request):
        return web.json_response({"ok": True, "world_size": driver.ps.world_size, "stopping": stop.is_set()})

    async def shutdown(request):
        stop.set()
        return web.json_response({"ok": True})

    async def prometheus(request):
        records = None
        if driver.board is not None:
            try:
                records = await asyncio.get_running_loop().run_in_executor(None, driver.board.records)
            except Exception as e:  # noqa: BLE001 - the store unreachable: the other metrics still answer
                logger.warning("GET /metrics: engine records unreadable: %s: %s", type(e).__name__, e)
        return web.Response(body=metrics.render(records).encode(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(client_max_size=4 * 2**20, middlewares=middlewares(stop, token=token, metrics=metrics))
    app.add_routes(compat_routes(driver, run))
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/metrics", prometheus),
            web.get("/checkpoints", inspect),
            web.post("/checkpoints", register),
            web.delete("/checkpoints/{name}", unregister),
            web.post("/update", update),
            web.get("/engines", engines_list),
            web.post("/engines/start", engines_start),
            web.post("/engines/stop", engines_stop),
            web.post("/engines/sleep", engines_sleep),
            web.post("/engines/wake", engines_wake),
            web.get("/metas/{name}", get_metas),
            web.post("/metas", load_metas),
            web.post("/shutdown", shutdown),
        ]
    )
    return app


NO_ENGINES = "this daemon manages no engines: start it with --engine-cmd 'python -m ENGINE ... --port {port}'"


def _timeout(data: dict) -> dict:
    return {"timeout_s": data["timeout_s"]} if data.get("timeout_s") is not None else {}


def _check_engine_request(driver: Driver, data: dict, fields: tuple[str, ...]):
    """A 400 answer naming the bad field of an /engines request, or None when it is good."""
    from aiohttp import web

    def bad(msg: str):
        return web.json_response({"ok": False, "error": msg}, status=400)

    if driver.host is None:
        return bad(NO_ENGINES)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        return bad(f"unknown field(s) {unknown}; this route takes {list(fields)}")
    ranks, n = data.get("ranks"), driver.ps.world_size
    if ranks is not None and (
        not is_int_list(ranks) or not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < n for r in ranks)
    ):
        return bad(f"'ranks' must be a non-empty list of distinct ranks in [0, {n}) or null (all), got {ranks!r}")
    if data.get("name") is not None and not (isinstance(data["name"], str) and data["name"]):
        return bad(f"'name' must be a registered checkpoint's name or null, got {data['name']!r}")
    t = data.get("timeout_s")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
        return bad(f"'timeout_s' must be a number > 0, got {t!r}")
    return None


def _selected(record: dict, wanted: set[int]) -> bool:
    """An engine record that `wanted` ranks select: any rank of its group (a tensor-parallel engine
    serves several ranks, named in its record's `ranks`)."""
    return bool(wanted.intersection(record.get("ranks") or [record["rank"]]))


def _engines_not_in(driver: Driver, ranks, allowed: frozenset, why: str):
    """A 409 answer when an engine of `ranks` (all when None) is not in an `allowed` state, else None."""
    from aiohttp import web

    if not (ranks is None or is_int_list(ranks)):
        return None  # validate() answers 400 for it
    records = driver.board.records()
    wanted = set(ranks) if ranks else set(range(driver.ps.world_size))
    wrong = {
        r["rank"]: r["state"]
        for r in records
        if _selected(r, wanted) and (r["state"] not in allowed or (allowed is UPDATABLE and not r.get("healthy")))
    }
    if not wrong:
        return None
    detail = ", ".join(f"rank {r} is {st}" for r, st in sorted(wrong.items()))
    return web.json_response({"ok": False, "error": f"engine {why} ({detail})", "states": wrong}, status=409)
