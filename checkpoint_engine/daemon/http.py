"""What every route of rank 0's HTTP API shares (aiohttp), ours (`daemon_routes`) and MoonshotAI's
`/v1` ones (`daemon_compat_routes`): the middlewares and the parsing of a JSON request body.

    request ──▶ observe (http_requests_total) ──▶ auth (401) ──▶ stopping (503) ──▶ route

`observe` counts every answer by route template and status, and turns a route's unexpected exception
into a 500 naming it; `auth` answers 401 to no or a wrong bearer token (when the daemon has one);
`stopping` answers 503 at once after POST /shutdown or a signal. The health checks (`HEALTH_PATHS`)
need no token and answer while stopping. These answers take the shape of the route asked: our JSON
object, or their error text (a JSON string) on `/v1`.

A body that is not JSON or nests deeper than `MAX_JSON_DEPTH` is refused (`parse_json`) before the
parser recurses into it; `read_body` also refuses a body that is not a JSON object, and unknown
fields, by name (400, our shape).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re

from checkpoint_engine.daemon.prometheus import DaemonMetrics

logger = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/health", "/v1/healthz"})  # answered without a token, and while stopping
MAX_JSON_DEPTH = 64  # nesting of a request body (GET /metas/NAME's answer nests 5 deep)
# a JSON string (to its closing quote, or to the end of an unterminated one) or a bracket: one linear scan
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)|[\[\]{}]', re.S)


class BodyError(ValueError):
    """A request body that is not the JSON a route takes; the message says why."""


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH):
    """`json.loads(raw)`, refusing (BodyError) a body nested deeper than `max_depth` before the parser
    recurses into it, and a body that is not JSON."""
    if raw.count(b"[") + raw.count(b"{") > max_depth:
        depth = 0
        for m in _JSON_TOKEN.finditer(raw):
            c = m.group()
            if c in (b"[", b"{"):
                depth += 1
                if depth > max_depth:
                    raise BodyError(f"body must be JSON nested at most {max_depth} levels deep")
            elif c in (b"]", b"}"):
                depth -= 1
    try:
        return json.loads(raw)
    except RecursionError:
        raise BodyError(f"body must be JSON nested at most {max_depth} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"body must be JSON: {e}") from None


async def read_body(request, fields: tuple[str, ...], route: str) -> dict:
    """The request's JSON object ({} when empty); 400 naming what is wrong, unknown fields by name."""
    from aiohttp import web

    raw = await request.read()
    try:
        data = parse_json(raw) if raw.strip() else {}
    except BodyError as e:
        raise web.HTTPBadRequest(
            text=json.dumps({"ok": False, "error": str(e)}), content_type="application/json"
        ) from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(
            text=json.dumps({"ok": False, "error": "body must be a JSON object"}), content_type="application/json"
        )
    unknown = sorted(set(data) - set(fields))
    if unknown:
        error = f"unknown field(s) {unknown}; {route} takes {list(fields)}"
        raise web.HTTPBadRequest(
            text=json.dumps({"ok": False, "error": error, "field": unknown[0]}), content_type="application/json"
        )
    return data


def _fault(request, status: int, msg: str, headers: dict | None = None):
    """An answer the middlewares give: our JSON object, or their error text (a JSON string) on /v1."""
    from aiohttp import web

    body = msg if request.path.startswith("/v1/") else {"ok": False, "error": msg}
    return web.json_response(body, status=status, headers=headers)


def _route_label(request) -> str:
    """The route's template (`/checkpoints/{name}`): bounded label values whatever the paths asked."""
    route = request.match_info.route
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "unmatched"


def middlewares(stop: asyncio.Event, *, token: str | None, metrics: DaemonMetrics) -> list:
    """The application's middlewares, in order: observe, auth, stopping. `token`: every route but the
    health checks needs `Authorization: Bearer <token>`; `metrics`: where each answer is counted."""
    from aiohttp import web

    expected = None if token is None else token.encode()

    @web.middleware
    async def observe(request, handler):
        route = _route_label(request)
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            metrics.observe_request(route, request.method, e.status)
            raise
        except Exception as e:  # a bug, not a bad request: a JSON 500 rather than aiohttp's bare one
            logger.exception("%s %s failed", request.method, request.path)
            resp = _fault(request, 500, f"daemon fault: {type(e).__name__}: {e}")
        metrics.observe_request(route, request.method, resp.status)
        return resp

    @web.middleware
    async def auth(request, handler):
        if expected is None or request.path in HEALTH_PATHS:
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            msg = (
                "this daemon needs 'Authorization: Bearer <token>' (the token of its --token-file or CKPT_ENGINE_TOKEN)"
            )
        elif not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), expected):
            msg = "wrong bearer token"
        else:
            return await handler(request)
        return _fault(request, 401, msg, headers={"WWW-Authenticate": 'Bearer realm="checkpoint-engine"'})

    @web.middleware
    async def stopping(request, handler):
        if stop.is_set() and request.path not in HEALTH_PATHS:
            return _fault(request, 503, "the daemon is stopping")
        return await handler(request)

    return [observe, auth, stopping]
