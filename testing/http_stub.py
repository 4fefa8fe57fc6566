"""A stub HTTP server for tests: a `BaseHTTPRequestHandler` class served on a free loopback port.

    with serve_stub(Handler) as url:   # "http://127.0.0.1:<port>"
        ...

Stdlib only: importing this module is instant.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serve_stub(handler: type[BaseHTTPRequestHandler], join_timeout_s: float = 10.0) -> Iterator[str]:
    """Serve `handler` on 127.0.0.1 on a thread; yield its base URL; shut it down on exit."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True, name="http-stub")
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(join_timeout_s)
