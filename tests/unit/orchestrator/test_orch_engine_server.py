"""EngineServer (one launcher child of the engine pool) with a stand-in launcher: a real process that
answers /launcher/status and whose child maps a named shared-memory segment it never removes."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from orchestrator.engine_pool.pool_servers import EngineServer
from tests.leaky_shm import LEAKY_ENGINE, remove_segment, wait_for_segment

# the "launcher": serves /launcher/status on the given port; its child (tests.leaky_shm) plays vLLM,
# which maps a segment and (killed with SIGKILL) never removes it
LAUNCHER = r"""
import json, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port, name_file, child = int(sys.argv[1]), sys.argv[2], sys.argv[3]
subprocess.Popen([sys.executable, "-c", child, name_file])

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        import os
        ready = os.path.exists(name_file) and open(name_file).read()
        body = json.dumps({"phase": "ready" if ready else "starting"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _server(tmp_path: Path, name_file: Path) -> EngineServer:
    return EngineServer(
        lambda port: [sys.executable, "-c", LAUNCHER, str(port), str(name_file), LEAKY_ENGINE],
        dict(os.environ),
        tmp_path / "server.log",
    )


def test_a_stop_removes_the_shared_memory_a_killed_engine_left(tmp_path):
    name_file = tmp_path / "seg"
    server = _server(tmp_path, name_file)
    try:
        server.wait_ready(30.0, threading.Event())
        seg = Path("/dev/shm") / name_file.read_text()
        assert seg.exists() and server.processes()  # the engine (and its resource tracker)
        os.killpg(server.proc.pid, signal.SIGKILL)  # launcher and engine killed, as a lost machine would
        server.proc.wait(10)
        t0 = time.monotonic()
        while any(p.is_running() and p.status() != "zombie" for p in server.processes()):
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        assert seg.exists()  # nobody removed it
        assert server.stop(grace_s=5.0) == -signal.SIGKILL
        assert not seg.exists()
    finally:
        server.stop(grace_s=1.0)
        remove_segment(name_file)


def test_a_stop_during_the_start_removes_the_shared_memory_the_engine_left(tmp_path):
    """The pool stops a server that never became ready (the job ends, a start deadline passes): the
    stop notes the tree's segments itself, since wait_ready() never did."""
    name_file = tmp_path / "seg"
    server = _server(tmp_path, name_file)
    try:
        seg = wait_for_segment(name_file, lambda: not server.exited())
        assert seg.exists() and not server.processes()  # not ready yet: nothing noted
        server.stop(grace_s=5.0)
        assert server.exited() and not seg.exists()
    finally:
        server.stop(grace_s=1.0)
        remove_segment(name_file)
