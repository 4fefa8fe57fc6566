"""The checkpoint-engine daemon: every torchrun rank runs a ParameterServer; rank 0 also serves an
HTTP API (127.0.0.1 or a unix socket by default) and relays each command to all ranks.

    HTTP client ──POST /checkpoints, /update, ...──▶ rank 0 aiohttp handler (never blocks the loop)
                                                       │ asyncio future, executor thread
                                                       ▼
                            command n ──TCPStore key cmd/n──▶ every rank: run on its ParameterServer
                            result    ◀──key res/n/<rank>─── (JSON; rank 0 gathers with a deadline)

Commands are JSON (never pickle). A command failing on any rank is reported with every rank's error.

Beside its own routes, rank 0 serves MoonshotAI checkpoint-engine's HTTP API (`compat_routes`) on the
same commands: one server for the whole job (their daemon ran one per rank), so each of those
routes is called once and acts on every rank; `files` are split across ranks as `POST /checkpoints`
does. Their answers: 200 with an empty body, 500 with the error text (a JSON string), 422 naming the
field of a bad request.

Managed engines (`--engine-cmd`, see engines.py): each rank runs the one engine process of its
device. `POST /engines/start`, `POST /engines/stop` and `POST /update` without engine URLs are
relayed commands like the others; `GET /engines` reads every rank's engine record from the process
group's store (no command: it answers during a long update). With `--auto-heal`, a `Healer` thread
on rank 0 notices a failed engine there and relays a restart + `update(current, ranks=[its rank])`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from checkpoint_engine import engines
from checkpoint_engine.api import group_req_func, http_req_func
from checkpoint_engine.ps import ParameterServer

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 5.0


class CommandError(ValueError):
    """A command whose arguments are wrong: answered with HTTP 400 (422 on the compat routes)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field  # the request field at fault ("" when it is the request as a whole)


class Relay:
    """Moves commands from rank 0 to all ranks and results back, over the process group's store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, result_timeout_s: float):
        self.store = dist.PrefixStore("ckpt-daemon/", store)
        self.rank, self.world_size, self.result_timeout_s = rank, world_size, result_timeout_s
        self.seq = 0

    def publish(self, cmd: dict) -> None:
        self.store.set(f"cmd/{self.seq}", json.dumps(cmd))

    def next_command(self, stop: threading.Event) -> dict | None:
        key = f"cmd/{self.seq}"
        while not stop.is_set():
            try:
                self.store.wait([key], timedelta(seconds=IDLE_WAIT_S))
                return json.loads(self.store.get(key))
            except dist.DistStoreError:
                continue  # idle: wait again (each wait has its own deadline)
        return None

    def put_result(self, result: dict) -> None:
        self.store.set(f"res/{self.seq}/{self.rank}", json.dumps(result))

    def gather_results(self) -> list[dict]:
        keys = [f"res/{self.seq}/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.result_timeout_s))
        except dist.DistStoreError:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            return [
                {"ok": False, "error": f"rank {r} did not answer within {self.result_timeout_s:.0f} s"}
                if r in missing
                else json.loads(self.store.get(keys[r]))
                for r in range(self.world_size)
            ]
        return [json.loads(self.store.get(k)) for k in keys]

    def done(self) -> None:
        self.seq += 1


class EngineBoard:
    """Every rank's engine record in the process group's store: each rank writes its own, rank 0 reads
    them all. Its own store connection, so a rank's command thread waiting on the relay never delays it."""

    def __init__(self, store: dist.Store, world_size: int):
        self.store = dist.PrefixStore("ckpt-engines/", store.clone())
        self.world_size = world_size
        self._lock = threading.Lock()

    def put(self, record: dict) -> None:
        with self._lock:
            self.store.set(f"engines/{record['rank']}", json.dumps(record))

    def records(self) -> list[dict]:
        out = []
        with self._lock:
            for r in range(self.world_size):
                key = f"engines/{r}"
                known = self.store.check([key])
                out.append(json.loads(self.store.get(key)) if known else {"rank": r, "state": "stopped"})
        return out


def execute(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None) -> dict:
    """Run one command on this rank's ParameterServer; return a JSON-ready result."""
    op = cmd.get("op")
    if op in ("engine_start", "engine_stop") or (op == "update" and cmd.get("managed")):
        if host is None:
            raise CommandError(f"{op}: this daemon manages no engines (start it with --engine-cmd)")
        if op == "engine_start":
            return engines.engine_start(host, ps, cmd)
        if op == "engine_stop":
            return engines.engine_stop(host, cmd)
        return engines.managed_update(host, ps, cmd["name"], cmd.get("ranks"), cmd.get("timeout_s"))
    if op == "register":
        files = cmd.get("files") or []
        mine = (
            [f for i, f in enumerate(sorted(files)) if i % ps.world_size == ps.rank]
            if cmd.get("split_files", True)
            else files
        )
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


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in value)


def validate(cmd: dict) -> dict:
    """Check a command on rank 0 before it goes to every rank (HTTP 400 on failure)."""
    op = cmd.get("op")
    if op in ("engine_start", "engine_stop") and cmd.get("ranks") is not None and not _int_list(cmd["ranks"]):
        raise CommandError(f"{op}: 'ranks' must be a list of ranks or null (all)", "ranks")
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
    if op == "load_metas" and not isinstance(cmd.get("metas"), dict):
        raise CommandError("load_metas: 'metas' must be the JSON object GET /metas/NAME returned", "metas")
    if op == "update" and cmd.get("ranks") is not None and not _int_list(cmd["ranks"]):
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
        if not _int_list(cmd.get("inference_group_ranks", [])):
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
        relay.put_result(_run(ps, cmd, host))
        relay.done()
        if cmd.get("op") == "exit":
            return


def _run(ps: ParameterServer, cmd: dict, host: engines.EngineHost | None = None) -> dict:
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

    ENGINE_OPS = ("engine_start", "engine_stop")

    def run(self, cmd: dict) -> dict:
        with self.lock:
            op_key = self._begin_engine_op(cmd)
            self.relay.publish(cmd)
            mine = _run(self.ps, cmd, self.host)
            self.relay.put_result(mine)
            results = self.relay.gather_results()
            self.relay.done()
            ok = all(r.get("ok") for r in results)
            if op_key is not None:
                self.ps.registry.store.delete(op_key)
            op, name = cmd.get("op"), cmd.get("name")
            if ok and name and (op == "engine_start" or (op == "update" and cmd.get("managed"))):
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
        info = {k: cmd.get(k) for k in ("op", "ranks", "name", "heal")}
        self.ps.registry.store.put(key, json.dumps({**info, "started_at_s": time.time()}), ttl_s=3600.0)
        return key


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
        return await call({"op": "register", **await body(request)})

    async def unregister(request):
        return await call({"op": "unregister", "name": request.match_info["name"]})

    async def update(request):
        cmd = {"op": "update", **await body(request)}
        if driver.host is not None and "endpoints" not in cmd and "update_url" not in cmd:
            cmd["managed"] = True  # no engine URLs: the engines this daemon manages
            refused = _engines_not_in(driver, cmd.get("ranks"), engines.UPDATABLE, "cannot take an update")
            if refused is not None:
                return refused
        return await call(cmd)

    async def engines_start(request):
        data = await body(request)
        bad = _check_engine_request(driver, data, ("ranks", "name", "timeout_s"))
        if bad is not None:
            return bad
        busy = _engines_not_in(driver, data.get("ranks"), engines.STARTABLE, "is running; POST /engines/stop first")
        if busy is not None:
            return busy
        name = data.get("name", driver.current)  # a started engine is brought to the current weights
        return await call({"op": "engine_start", "ranks": data.get("ranks"), "name": name, **_timeout(data)})

    async def engines_stop(request):
        data = await body(request)
        bad = _check_engine_request(driver, data, ("ranks",))
        if bad is not None:
            return bad
        return await call({"op": "engine_stop", "ranks": data.get("ranks")})

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
        not _int_list(ranks) or not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < n for r in ranks)
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

    if not (ranks is None or _int_list(ranks)):
        return None  # validate() answers 400 for it
    records = driver.board.records()
    wanted = set(ranks) if ranks else set(range(driver.ps.world_size))
    wrong = {
        r["rank"]: r["state"]
        for r in records
        if r["rank"] in wanted
        and (r["state"] not in allowed or (allowed is engines.UPDATABLE and not r.get("healthy")))
    }
    if not wrong:
        return None
    detail = ", ".join(f"rank {r} is {st}" for r, st in sorted(wrong.items()))
    return web.json_response({"ok": False, "error": f"engine {why} ({detail})", "states": wrong}, status=409)


class Healer:
    """Rank 0: restarts failed engines and brings them to the current checkpoint (see engines.py)."""

    def __init__(self, driver: Driver, interval_s: float, max_attempts: int):
        self.driver, self.interval_s, self.max_attempts = driver, interval_s, max_attempts
        self._stop = threading.Event()
        self._attempts: dict[int, int] = {}  # per rank: heals since it last served
        self._thread = threading.Thread(target=self._loop, name="engine-healer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.heal_once()
            except Exception:  # the healer must outlive one bad round (a store hiccup): logged, next round
                logger.exception("engine healer round failed")

    def heal_once(self) -> None:
        failed = []
        for rec in self.driver.board.records():
            r, state = rec["rank"], rec["state"]
            if state == "serving":
                self._attempts.pop(r, None)
            elif state == "failed":
                n = self._attempts.get(r, 0)
                if n < self.max_attempts:
                    failed.append(r)
                elif n == self.max_attempts:
                    self._attempts[r] = n + 1  # say it once
                    logger.error("rank %d: engine still failed after %d heals; giving up: %s", r, n, rec["last_error"])
        if not failed or self._stop.is_set():
            return
        for r in failed:
            self._attempts[r] = self._attempts.get(r, 0) + 1
        logger.warning("healing the engines of ranks %s (checkpoint %r)", failed, self.driver.current)
        result = self.driver.run({"op": "engine_start", "ranks": failed, "name": self.driver.current, "heal": True})
        if result["ok"]:
            logger.info("healed the engines of ranks %s", failed)
        else:
            logger.error("heal of ranks %s failed: %s", failed, result.get("errors"))

    def stop(self) -> None:
        self._stop.set()

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


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
            if not _int_list(value) or not all(0 <= r < driver.ps.world_size for r in value):
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


def _clear_stale_socket(path: str) -> None:
    """Remove a unix socket file left by a dead server; refuse to take over a live one."""
    import os
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise RuntimeError(f"--uds {path} exists and is not a socket")
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:  # nobody listens: a leftover
            os.unlink(path)
            return
    raise RuntimeError(f"--uds {path}: another server is listening there")


async def serve_http(driver: Driver, host: str, port: int, uds: str | None) -> None:
    from aiohttp import web

    stop = asyncio.Event()
    runner = web.AppRunner(make_app(driver, stop))
    await runner.setup()
    if uds:
        _clear_stale_socket(uds)
    site = web.UnixSite(runner, uds) if uds else web.TCPSite(runner, host, port)
    await site.start()
    where = uds or f"http://{host}:{port}"
    logger.info("checkpoint-engine daemon serving on %s (world size %d)", where, driver.ps.world_size)
    print(f"checkpoint-engine daemon ready on {where}", flush=True)
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    healer = None
    if driver.host is not None and driver.host.config.auto_heal:
        cfg = driver.host.config
        healer = Healer(driver, cfg.poll_interval_s, cfg.max_heal_attempts)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        if healer is not None:
            healer.stop()  # no new heals; one in progress finishes first (bounded by its own deadlines)
        # exit stops every engine; then the healer thread ends (a rank-0 engine it restarted has
        # PR_SET_PDEATHSIG on that thread: stopping it first keeps that engine from dying unasked)
        await loop.run_in_executor(None, driver.run, {"op": "exit"})
        if healer is not None:
            await loop.run_in_executor(None, healer.close, driver.host.config.start_timeout_s)
        if uds:
            import contextlib
            import os

            with contextlib.suppress(FileNotFoundError):
                os.unlink(uds)
