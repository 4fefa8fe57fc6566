"""One sandbox process seen from the service: its pipes, non-blocking I/O over them, teardown.

Popen(bwrap ... python -I -S -c RUNNER req_fd status_fd)   (as the sandbox's own host uid)
  stdin ◀── write (non-blocking)          stdout/stderr ──▶ read (byte budgets upstream)
  req_fd ◀── one request after `ready`    status_fd ──▶ ready/start/exit lines
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
from dataclasses import dataclass

from .cgroup import RunCgroup

_CHUNK_BYTES = 1 << 16


@dataclass
class Member:
    """One spawned sandbox: bwrap process, its host uid, and our ends of its control pipes."""

    proc: subprocess.Popen
    uid: int | None
    request_fd: int
    status_fd: int
    cgroup: RunCgroup | None = None


class Pipes:
    """Non-blocking I/O over one sandbox's stdin/stdout/stderr and control pipes."""

    def __init__(self, m: Member, stdin: bytes) -> None:
        self._m = m
        self._sel = selectors.DefaultSelector()
        self._pending: dict[int, memoryview] = {}
        for name, fd in (
            ("stdout", m.proc.stdout.fileno()),
            ("stderr", m.proc.stderr.fileno()),
            ("status", m.status_fd),
        ):
            os.set_blocking(fd, False)
            self._sel.register(fd, selectors.EVENT_READ, name)
        self.num_readers = 3
        self._open_writers = {m.proc.stdin.fileno(): "stdin", m.request_fd: "request"}
        self._add_writer(m.proc.stdin.fileno(), stdin)

    def send_request(self, request: bytes) -> None:
        if self._m.request_fd in self._open_writers and self._m.request_fd not in self._pending:
            self._add_writer(self._m.request_fd, request)

    def _add_writer(self, fd: int, data: bytes) -> None:
        if not data:
            self._close_writer(fd)
            return
        os.set_blocking(fd, False)
        self._pending[fd] = memoryview(data)
        self._sel.register(fd, selectors.EVENT_WRITE, "write")

    def _close_writer(self, fd: int) -> None:
        if self._open_writers.pop(fd, None) is None:
            return
        if fd in self._pending:
            del self._pending[fd]
            self._sel.unregister(fd)
        if fd == self._m.request_fd:
            os.close(fd)
        else:
            self._m.proc.stdin.close()

    def poll(self, timeout_s: float) -> list[tuple[str, bytes]]:
        """Write what can be written; return (stream name, bytes read) pairs."""
        got = []
        for key, _ in self._sel.select(timeout_s):
            fd = key.fd
            if key.data == "write":
                try:
                    written = os.write(fd, self._pending[fd][:_CHUNK_BYTES])
                except BlockingIOError:
                    continue
                except OSError:  # the reader is gone (the program exited): stop writing
                    written = len(self._pending[fd])
                self._pending[fd] = self._pending[fd][written:]
                if not self._pending[fd]:
                    self._close_writer(fd)
                continue
            try:
                chunk = os.read(fd, _CHUNK_BYTES)
            except BlockingIOError:
                continue
            if chunk:
                got.append((key.data, chunk))
            else:
                self._sel.unregister(fd)
                self.num_readers -= 1
        return got

    def close(self) -> None:
        for fd in list(self._open_writers):
            self._close_writer(fd)
        os.close(self._m.status_fd)
        self._sel.close()


def kill_sandbox(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's pid-namespace init (bwrap's child): the kernel then kills every
    process of the namespace, and bwrap reaps its child and exits. Killing bwrap itself instead
    would leave its child as a zombie of the host's init."""
    pid = proc.pid
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for child in children:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            continue
    if not children and proc.poll() is None:
        proc.kill()


def sweep_uid(uid: int) -> int:
    """SIGKILL every host process whose real uid is `uid`; return how many there were."""
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(entry), signal.SIGKILL)
                            killed += 1
                        break
        except (OSError, ValueError):
            continue
    return killed
