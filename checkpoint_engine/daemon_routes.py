"""Rank 0's HTTP API (aiohttp): our routes and MoonshotAI checkpoint-engine's `/v1` routes, both on
the daemon's commands (`daemon_commands`).

Every route checks its request and answers 400 (ours) or 422 naming the field (theirs) before any
rank sees it; a relayed command runs on an executor thread, never blocking the event loop. `GET
/engines` reads the engine board (no command: it answers during a long update).

Their answers: 200 with an empty body, 500 with the error text (a JSON string), 422 naming the
field of a bad request. One server for the whole job (their daemon ran one per rank), so each of
their routes is called once and acts on every rank; `files` are split across ranks as `POST
/checkpoints` does.
"""

from __future__ import annotations

import asyncio
import json

from checkpoint_engine.daemon_commands import CommandError, Driver, is_int_list, validate
from checkpoint_engine.engine_states import SLEEP_LEVELS, SLEEPABLE, STARTABLE, UPDATABLE


def make_app(driver: Driver, stop: asyncio.Event):
    from aiohttp import web

    async def call(cmd: dict) -> web.Response:
        try:
            validate(cmd)
        except CommandError as e:
            return web.json_response({"ok": False, "error": str(e)}, status=400)
        result = await asyncio.get_running_loop().run_in_executor(None, driver.run, cmd)
        return web.json_response(result, status=200 if result["ok"] else 500)

    async def body(request) -> dict:
        try:
            data = await request.json()
        except (json.JSONDecodeError, ValueError):
            raise web.HTTPBadRequest(
                text=json.dumps({"ok": False, "error": "body must be JSON"}), content_type="application/json"
            ) from None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(
                text=json.dumps({"ok": False, "error": "body must be a JSON object"}), content_type="application/json"
            )
        return data

    async def register(request):
        cmd = {"op": "register", **await body(request)}
        owners = cmd.get("owner_ranks")
        if is_int_list(owners) and not all(0 <= r < driver.ps.world_size for r in owners):
            error = f"register: 'owner_ranks' must be ranks in [0, {driver.ps.world_size}), got {owners!r}"
            return web.json_response({"ok": False, "error": error}, status=400)
        return await call(cmd)

    async def unregister(request):
        return await call({"op": "unregister", "name": request.match_info["name"]})

    async def update(request):
        cmd = {"op": "update", **await body(request)}
        if driver.host is not None and "endpoints" not in cmd and "update_url" not in cmd:
            cmd["managed"] = True  # no engine URLs: the engines this daemon manages
            refused = _engines_not_in(driver, cmd.get("ranks"), UPDATABLE, "cannot take an update")
            if refused is not None:
                return refused
        return await call(cmd)

    async def engines_start(request):
        data = await body(request)
        bad = _check_engine_request(driver, data, ("ranks", "name", "timeout_s"))
        if bad is not None:
            return bad
        busy = _engines_not_in(driver, data.get("ranks"), STARTABLE, "is running; POST /engines/stop first")
        if busy is not None:
            return busy
        name = data.get("name", driver.current)  # a started engine is brought to the current weights
        if name is None and driver.host.config.loads_from_ps:
            return web.json_response(
                {
                    "ok": False,
                    "error": "'name' is required: the engines take their first weights in their load step "
                    "({rendezvous} in --engine-cmd) and no checkpoint has been served yet",
                },
                status=400,
            )
        return await call({"op": "engine_start", "ranks": data.get("ranks"), "name": name, **_timeout(data)})

    async def engines_stop(request):
        data = await body(request)
        bad = _check_engine_request(driver, data, ("ranks",))
        if bad is not None:
            return bad
        return await call({"op": "engine_stop", "ranks": data.get("ranks")})

    async def engines_sleep(request):
        data = await body(request)
        bad = _check_engine_request(driver, data, ("ranks", "level", "timeout_s"))
        if bad is not None:
            return bad
        level = data.get("level", 1)
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            return web.json_response(
                {"ok": False, "error": f"'level' must be one of {list(SLEEP_LEVELS)} (vLLM's), got {level!r}"},
                status=400,
            )
        busy = _engines_not_in(driver, data.get("ranks"), SLEEPABLE, "is not serving; only a serving engine sleeps")
        if busy is not None:
            return busy
        return await call({"op": "engine_sleep", "ranks": data.get("ranks"), "level": level, **_timeout(data)})

    async def engines_wake(request):
        data = await body(request)
        bad = _check_engine_request(driver, data, ("ranks", "name", "timeout_s"))
        if bad is not None:
            return bad
        busy = _engines_not_in(driver, data.get("ranks"), frozenset({"sleeping"}), "is not sleeping")
        if busy is not None:
            return busy
        wanted = set(data.get("ranks") or range(driver.ps.world_size))
        records = [r for r in driver.board.records() if r["rank"] in wanted]
        name = data.get("name")
        dropped = sorted(r["rank"] for r in records if r.get("sleep_level") == 2)
        if dropped and name is None:
            name = driver.current
            if name is None:
                return web.json_response(
                    {
                        "ok": False,
                        "error": f"'name' is required: the engines of ranks {dropped} slept at level 2 and "
                        "have no weights, and no checkpoint has been served yet",
                    },
                    status=400,
                )
        update_ranks = sorted(r["rank"] for r in records if r["rank"] in dropped or (name and r["checkpoint"] != name))
        cmd = {"op": "engine_wake", "ranks": data.get("ranks"), "name": name, "update_ranks": update_ranks}
        return await call({**cmd, **_timeout(data)})

    async def engines_list(request):
        if driver.board is None:
            return web.json_response({"ok": False, "error": NO_ENGINES}, status=400)
        records = await asyncio.get_running_loop().run_in_executor(None, driver.board.records)
        auto_heal = driver.host.config.auto_heal
        return web.json_response({"ok": True, "current": driver.current, "auto_heal": auto_heal, "engines": records})

    async def inspect(request):
        return await call({"op": "inspect"})

    async def get_metas(request):
        return await call({"op": "get_metas", "name": request.match_info["name"]})

    async def load_metas(request):
        return await call({"op": "load_metas", "metas": await body(request)})

    async def health(request):
        return web.json_response({"ok": True, "world_size": driver.ps.world_size})

    async def shutdown(request):
        stop.set()
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=4 * 2**20)
    app.add_routes(compat_routes(driver))
    app.add_routes(
        [
            web.get("/health", health),
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
        if r["rank"] in wanted and (r["state"] not in allowed or (allowed is UPDATABLE and not r.get("healthy")))
    }
    if not wrong:
        return None
    detail = ", ".join(f"rank {r} is {st}" for r, st in sorted(wrong.items()))
    return web.json_response({"ok": False, "error": f"engine {why} ({detail})", "states": wrong}, status=409)


def compat_routes(driver: Driver) -> list:
    """MoonshotAI checkpoint-engine's `/v1` routes, on the same commands as ours."""
    import math

    from aiohttp import web

    def bad(field: str, msg: str) -> web.Response:  # FastAPI's answer to a request that fails validation
        return web.json_response(
            {"detail": [{"loc": ["body", field] if field else ["body"], "msg": msg, "type": "value_error"}]}, status=422
        )

    async def body(request, *, required: bool):
        raw = await request.read()
        if not raw.strip() and not required:
            return {}
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return data if isinstance(data, dict) else None

    async def call(cmd: dict) -> web.Response:
        try:
            validate(cmd)
        except CommandError as e:
            return bad("timeout" if e.field == "timeout_s" else e.field, str(e))
        result = await asyncio.get_running_loop().run_in_executor(None, driver.run, cmd)
        if result["ok"]:
            return web.Response(status=200)
        text = "; ".join(f"rank {r}: {err}" for r, err in result["errors"].items())
        return web.json_response(text, status=500)

    async def files(request):
        data = await body(request, required=True)
        if data is None:
            return bad("", 'body must be a JSON object {"files": [...]}')
        fs = data.get("files")
        if not isinstance(fs, list) or not all(isinstance(f, str) for f in fs):
            return bad("files", "'files' must be a list of safetensors paths")
        return await call({"op": "register", "name": request.match_info["name"], "files": fs, "gather": False})

    async def gather_metas(request):
        return await call({"op": "gather_metas", "name": request.match_info["name"]})

    async def update(request):
        data = await body(request, required=False)
        if data is None:
            return bad("", "body must be a JSON object")
        timeout = data.get("timeout", 300.0)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            return bad("timeout", f"'timeout' must be a number of seconds > 0, got {timeout!r}")
        for field in ("ranks", "inference_group_ranks"):
            value = data.get(field, [])
            if not is_int_list(value) or not all(0 <= r < driver.ps.world_size for r in value):
                return bad(field, f"'{field}' must be a list of ranks in [0, {driver.ps.world_size}), got {value!r}")
        ranks, group = data.get("ranks", []), data.get("inference_group_ranks", [])
        if ranks and group and not set(group) <= set(ranks):
            return bad(
                "inference_group_ranks",
                f"'inference_group_ranks' {group} must be among the P2P "
                f"receivers 'ranks' {ranks}: only they ask their engines to update",
            )
        return await call(
            {
                "op": "update",
                "name": request.match_info["name"],
                "ranks": ranks,
                "update_url": data.get("update_url"),
                "inference_group_ranks": group,
                "timeout_s": float(timeout),
                "uds": data.get("uds"),
                "world_size": driver.ps.world_size,
            }
        )

    async def unregister(request):
        return await call({"op": "unregister", "name": request.match_info["name"]})

    async def healthz(request):
        return web.Response(status=200)

    return [
        web.post("/v1/checkpoints/{name}/files", files),
        web.post("/v1/checkpoints/{name}/gather-metas", gather_metas),
        web.post("/v1/checkpoints/{name}/update", update),
        web.delete("/v1/checkpoints/{name}", unregister),
        web.get("/v1/healthz", healthz),
    ]
