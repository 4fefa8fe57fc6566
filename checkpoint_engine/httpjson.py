"""A quiet stdlib HTTP handler base that answers JSON (the plain engine's server, test doubles)."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler

logger = logging.getLogger(__name__)


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
