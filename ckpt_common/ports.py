"""Free TCP ports for the servers this project starts: engines, daemons, launchers, process-group stores.

A port found by binding port 0 comes from the kernel's ephemeral range, the range outgoing connections
take their local ports from. Between the pick and the server's own bind, one of the host's many
connections (gloo's, HTTP clients', vLLM's) can take it, and the server then fails with "address
already in use". So ``free_port`` picks a random port outside that range (below it, else above it),
checks that it binds, and never hands out one port twice in a process: two picks in a row, before
either server binds, could otherwise return the same port. Only where the range leaves too little
room does it fall back to the kernel's choice.

    picks ──random port outside the ephemeral range──▶ bind check ──▶ not handed out before ──▶ port
"""

from __future__ import annotations

import random
import socket
import threading

EPHEMERAL_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default
LOWEST_PORT = 20000  # below: the registered ports of common services
MIN_SPAN_PORTS = 1000  # a narrower span than this falls back to the kernel's choice

_random = random.SystemRandom()  # a forked child must not repeat its parent's picks
_given: set[int] = set()
_lock = threading.Lock()


def ephemeral_range(path: str = EPHEMERAL_RANGE_PATH) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive); Linux's default where it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def pick_span(ephemeral: tuple[int, int], lowest: int = LOWEST_PORT) -> tuple[int, int] | None:
    """The ports (inclusive) to pick from: [lowest, ephemeral start), else (ephemeral end, 65535], the
    first with at least MIN_SPAN_PORTS ports; None if neither has them."""
    low, high = ephemeral
    if low - lowest >= MIN_SPAN_PORTS:
        return lowest, low - 1
    if 65535 - high >= MIN_SPAN_PORTS:
        return high + 1, 65535
    return None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _binds(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port on `host` that binds now, outside the ephemeral range where it has room, and not
    returned before by this process. OSError if `attempts` tries find none."""
    span = pick_span(ephemeral_range())
    with _lock:
        for _ in range(attempts):
            port = _random.randint(*span) if span is not None else _kernel_port(host)
            if port not in _given and (span is None or _binds(host, port)):
                _given.add(port)
                return port
    raise OSError(f"no free TCP port on {host} in {attempts} tries")


def is_loopback(host: str | None) -> bool:
    """Whether `host` (a bind address, or a peer's address) is loopback: localhost, 127.0.0.0/8, ::1, or
    127.x mapped into IPv6 (::ffff:127.0.0.1). Other names are not: they may resolve anywhere."""
    import ipaddress

    name = (host or "").strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)
