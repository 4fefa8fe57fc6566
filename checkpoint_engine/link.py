"""The PS rank's ZMQ link to its engine worker: bind, send typed messages, receive with deadlines.

A DEALER socket bound on an abstract unix socket (local to the host); a monitor socket reports the
engine's disconnect at once, so a killed engine fails the update without waiting for a timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from checkpoint_engine import protocol as P


class EngineFailure(RuntimeError):
    """The engine did not answer, answered wrongly, or went away."""

    def describe(self) -> str:
        return f"engine: {self}"


class CheckFailed(EngineFailure):
    """A wait was cut short by the caller's check (e.g. req_func raised)."""

    def describe(self) -> str:
        return str(self)


class EngineLink:
    POLL_SLICE_MS = 50

    def __init__(self, ctx: zmq.Context, address: str):
        self.address = address
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)  # an Abort sent just before close still goes out
        self._sock.bind(address)
        # HANDSHAKE_SUCCEEDED: the moment a message can be queued for the engine (wakes `send`).
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.connected = False
        self._gone = False
        self.failure: str | None = None  # set by the pipeline when the engine reported an error

    def send(
        self, msg: P.Message, deadline_s: float | None = None, check: Callable[[], str | None] | None = None
    ) -> None:
        """Queue `msg`; with a deadline, wait (until then) for the engine to connect first."""
        data = P.encode(msg)
        while True:
            try:
                self._sock.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                while self._monitor.poll(0, zmq.POLLIN):  # a disconnect may be waiting to be read
                    self._on_monitor_event()
                if self._gone:
                    raise EngineFailure(
                        f"engine disconnected before {type(msg).__name__} could be sent "
                        "(its process exited or was killed)"
                    ) from None
                if deadline_s is None or time.monotonic() > deadline_s:
                    raise EngineFailure(
                        f"timed out waiting for the engine to connect (could not send {type(msg).__name__})"
                    ) from None
            # Once the engine is accepted the pipe is usable within a handshake (well under a ms), and
            # its HANDSHAKE_SUCCEEDED event may already have been drained above, before the send that
            # failed: retry in short slices then, or every update's set-up would sleep a full slice.
            if self._monitor.poll(1 if self.connected else self.POLL_SLICE_MS, zmq.POLLIN):
                self._on_monitor_event()
            if check is not None and (problem := check()):
                raise CheckFailed(problem)

    def recv(self, deadline_s: float, *, what: str, check: Callable[[], str | None] | None = None) -> P.Message:
        """Next message from the engine before `deadline_s` (time.monotonic); `check` may abort early."""
        while True:
            remaining = deadline_s - time.monotonic()
            if remaining <= 0:
                raise EngineFailure(f"timed out waiting for {what}")
            events = dict(self._poller.poll(min(self.POLL_SLICE_MS, max(1, int(remaining * 1000)))))
            if self._sock in events:
                data = self._sock.recv()
                try:
                    return P.decode(data)
                except P.ProtocolError as e:
                    raise EngineFailure(f"bad message from engine while waiting for {what}: {e}") from None
            if self._monitor in events:
                self._on_monitor_event()
            if self._gone and not (self._sock.poll(0) & zmq.POLLIN):
                raise EngineFailure(
                    f"engine disconnected while we waited for {what} (its process exited or was killed)"
                )
            if check is not None:
                problem = check()
                if problem:
                    raise CheckFailed(problem)

    def _on_monitor_event(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        evt = recv_monitor_message(self._monitor)
        if evt["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            self.connected = True
        elif evt["event"] == zmq.EVENT_DISCONNECTED and self.connected:
            self._gone = True  # raised by recv once what the engine sent before is read

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close()
