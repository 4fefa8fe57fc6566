"""DaemonClient against a scripted HTTP server: a busy daemon (409, kind "busy") is asked again until
the call's deadline; any other 4xx (a conflict such as a taken name) raises at once."""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from ckpt_common.httpjson import HTTPError, JsonRequestHandler
from orchestrator.engine_pool.daemon_client import DaemonClient

BUSY = (409, {"ok": False, "kind": "busy", "error": "the daemon is busy with another command (update)"})
TAKEN = (409, {"ok": False, "kind": "conflict", "error": "checkpoint 'v1' is already registered"})
OK = (200, {"ok": True, "current": None, "engines": []})


@pytest.fixture
def scripted():
    """A server answering each request with the next (status, body) of `answers` (the last repeats)."""
    answers: list[tuple[int, dict]] = []
    asked: list[float] = []

    class Handler(JsonRequestHandler):
        def do_GET(self):
            asked.append(time.monotonic())
            status, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self.reply(status, body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answers, asked
    finally:
        server.shutdown()
        server.server_close()


def test_busy_is_asked_again_until_it_answers(scripted):
    url, answers, asked = scripted
    answers += [BUSY, BUSY, OK]
    assert DaemonClient(url, timeout_s=10.0).engines() == OK[1]
    assert len(asked) == 3


def test_a_conflict_raises_at_once(scripted):
    url, answers, asked = scripted
    answers += [TAKEN]
    with pytest.raises(HTTPError, match="already registered") as info:
        DaemonClient(url, timeout_s=10.0).engines()
    assert info.value.status == 409 and len(asked) == 1


def test_busy_past_the_deadline_raises_the_busy_answer(scripted):
    url, answers, asked = scripted
    answers += [BUSY]
    t0 = time.monotonic()
    with pytest.raises(HTTPError, match="busy"):
        DaemonClient(url, timeout_s=1.2).engines()
    assert time.monotonic() - t0 < 3.0 and len(asked) >= 2
