"""MoonshotAI checkpoint-engine's HTTP API (the `/v1` routes) on rank 0, on the daemon's commands
(`daemon_commands`) as our routes (`daemon_routes`) are; `daemon_routes.make_app` mounts them beside
ours, behind the same middlewares (`daemon_http`).

Their answers keep their contract: 200 with an empty body, 500 with the error text (a JSON string),
422 naming the field of a bad request (FastAPI's shape). One server for the whole job (their daemon
ran one per rank), so each of their routes is called once and acts on every rank; `files` are
split across ranks as `POST /checkpoints` does.
"""

from __future__ import annotations

import asyncio

from checkpoint_engine.daemon.commands import CommandError, is_int_list, validate
from checkpoint_engine.daemon.driver import Driver
from checkpoint_engine.daemon.http import BodyError, parse_json


def compat_routes(driver: Driver, run=None) -> list:
    """MoonshotAI checkpoint-engine's `/v1` routes, on the same commands as ours. `run(cmd)`: an
    awaitable of the driver's result (default: `driver.run` on an executor thread)."""
    import math

    from aiohttp import web

    if run is None:

        async def run(cmd: dict) -> dict:
            return await asyncio.get_running_loop().run_in_executor(None, driver.run, cmd)

    def bad(field: str, msg: str) -> web.Response:  # FastAPI's answer to a request that fails validation
        return web.json_response(
            {"detail": [{"loc": ["body", field] if field else ["body"], "msg": msg, "type": "value_error"}]}, status=422
        )

    async def body(request, *, required: bool):
        raw = await request.read()
        if not raw.strip() and not required:
            return {}
        try:
            data = parse_json(raw)
        except BodyError:
            return None
        return data if isinstance(data, dict) else None

    async def call(cmd: dict) -> web.Response:
        try:
            validate(cmd)
        except CommandError as e:
            return bad("timeout" if e.field == "timeout_s" else e.field, str(e))
        result = await run(cmd)
        if result["ok"]:
            return web.Response(status=200)
        errors = result.get("errors") or {"0": result.get("error", "failed")}
        text = "; ".join(f"rank {r}: {err}" for r, err in errors.items())
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
