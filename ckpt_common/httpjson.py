"""JSON over HTTP, both sides, stdlib only: the one client of the project and a quiet handler base.

    call_json(method, url, body)   ──▶ the decoded answer; HTTPError(.status, .text) for status >= 400,
                                       RuntimeError when unreachable or not JSON
    status_json(method, url, body) ──▶ (status, decoded answer) for any status (probes, tests);
                                       an unreachable server raises OSError
    post_json(url, body)           ──▶ call_json("POST", ...)
    post_sse(url, body)            ──▶ the decoded ``data:`` events of a server-sent-event stream, as
                                       they arrive, up to ``data: [DONE]``; HTTPError before the first
                                       event, ConnectionError when the stream breaks off
    JsonRequestHandler             ──   server side: reply(status, body), read_json()

URLs are ``http://host:port/path`` or ``https://...`` (verified against the system's CAs, or only the
CA in ``ca_file=PATH``: a daemon serving ``--tls-cert-file``); ``uds=PATH`` sends the request over a
Unix socket instead; ``token=TOKEN`` sends ``Authorization: Bearer TOKEN`` (the checkpoint-engine
daemon's credential).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

__all__ = ["HTTPError", "JsonRequestHandler", "call_json", "post_json", "post_sse", "status_json"]

logger = logging.getLogger(__name__)


class HTTPError(RuntimeError):
    """An HTTP server answered with a status >= 400 (this module's client).

    `status` is the HTTP status code and `text` the answer's body, so callers branch on the code.
    """

    def __init__(self, method: str, url: str, status: int, text: str):
        self.method, self.url, self.status, self.text = method, url, status, text
        super().__init__(f"{method} {url} answered HTTP {status}: {text[:2000]}")


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, uds: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._uds = uds

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._uds)


def _connection(
    url: str, timeout_s: float, uds: str | None, ca_file: str | None = None
) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if uds:
        conn: http.client.HTTPConnection = _UnixHTTPConnection(uds, timeout_s)
    elif parts.scheme == "http":
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    elif parts.scheme == "https":
        import ssl

        ctx = ssl.create_default_context(cafile=ca_file)
        conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=timeout_s, context=ctx)
    else:
        raise ValueError(f"only http:// and https:// URLs are supported, got {url!r}")
    return conn, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _request(
    method: str,
    url: str,
    body: Any,
    timeout_s: float,
    uds: str | None,
    token: str | None = None,
    ca_file: str | None = None,
) -> tuple[int, str]:
    """(status, body text) of one request; OSError (ConnectionError for protocol failures; ssl.SSLError,
    an OSError, for a certificate that does not verify) when it fails."""
    conn, path = _connection(url, timeout_s, uds, ca_file)
    data = None if body is None else json.dumps(body)
    headers = {} if body is None else {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    except http.client.HTTPException as e:
        raise ConnectionError(f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()


def status_json(
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout_s: float,
    uds: str | None = None,
    token: str | None = None,
    ca_file: str | None = None,
) -> tuple[int, dict]:
    """(HTTP status, decoded JSON answer) whatever the status: {} for an empty answer, {"raw": text}
    for one that is not JSON. An unreachable server raises OSError."""
    status, text = _request(method, url, body, timeout_s, uds, token, ca_file)
    try:
        return status, json.loads(text) if text else {}
    except json.JSONDecodeError:
        return status, {"raw": text}


def call_json(
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout_s: float,
    uds: str | None = None,
    token: str | None = None,
    ca_file: str | None = None,
) -> Any:
    """The decoded JSON answer ({} when empty). HTTPError (with `.status`) for status >= 400;
    RuntimeError naming the URL when the server cannot be reached or answers non-JSON."""
    try:
        status, text = _request(method, url, body, timeout_s, uds, token, ca_file)
    except OSError as e:
        raise RuntimeError(f"{method} {url} failed: {type(e).__name__}: {e}") from None
    if status >= 400:
        raise HTTPError(method, url, status, text)
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        raise RuntimeError(f"{method} {url} answered non-JSON: {text[:500]!r}") from None


def post_json(
    url: str,
    body: Any,
    *,
    timeout_s: float,
    uds: str | None = None,
    token: str | None = None,
    ca_file: str | None = None,
) -> Any:
    """POST JSON, return the decoded JSON answer (see `call_json` for the errors)."""
    return call_json("POST", url, body, timeout_s=timeout_s, uds=uds, token=token, ca_file=ca_file)


def post_sse(url: str, body: Any, *, timeout_s: float, uds: str | None = None) -> Iterator[Any]:
    """POST JSON and yield each decoded ``data:`` event of the server-sent-event answer.

    ``timeout_s`` bounds each socket operation (a stalled stream raises). HTTPError for a status
    >= 400; ConnectionError when the stream ends before ``data: [DONE]`` or the connection breaks;
    RuntimeError for an event that is not JSON. Closing the generator early closes the connection
    (a vLLM server then aborts the request)."""
    conn, path = _connection(url, timeout_s, uds)
    try:
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
        except http.client.HTTPException as e:
            raise ConnectionError(f"POST {url}: {type(e).__name__}: {e}") from None
        if resp.status >= 400:
            raise HTTPError("POST", url, resp.status, resp.read().decode(errors="replace"))
        while True:
            try:
                line = resp.readline()
            except http.client.HTTPException as e:
                raise ConnectionError(f"POST {url}: the stream broke off: {type(e).__name__}: {e}") from None
            if not line:
                raise ConnectionError(f"POST {url}: the stream ended before its [DONE] event")
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, other fields
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                yield json.loads(data)
            except json.JSONDecodeError:
                raise RuntimeError(f"POST {url}: an event that is not JSON: {data[:300]!r}") from None
    finally:
        conn.close()


class JsonRequestHandler(BaseHTTPRequestHandler):
    """``reply(status, body)`` sends ``body`` as JSON; ``read_json()`` parses the request body."""

    def log_message(self, fmt, *args):  # requests go to the debug log, not stderr
        logger.debug(fmt, *args)

    def reply(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_json(self):
        """The request's JSON body ({} when empty); ValueError names a body that is not JSON."""
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            return json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"request body is not JSON: {e}") from None
