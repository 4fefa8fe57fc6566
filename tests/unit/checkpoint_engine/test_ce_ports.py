"""ckpt_common.ports: free ports outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from ckpt_common import ports


@pytest.mark.parametrize(
    "ephemeral,span",
    [
        ((32768, 60999), (20000, 32767)),  # Linux's default: below the range
        ((49152, 65535), (20000, 49151)),  # IANA's range
        ((20500, 60999), (61000, 65535)),  # no room below: above
        ((1024, 65535), None),  # the whole space is ephemeral: the kernel's choice
        ((21000, 64535), (20000, 20999)),  # exactly MIN_SPAN_PORTS below
        ((20999, 64536), None),  # one short on both sides
    ],
)
def test_pick_span(ephemeral, span):
    assert ports.pick_span(ephemeral) == span


def test_ephemeral_range_reads_the_kernel_file_or_falls_back(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(path)) == (40000, 50000)
    path.write_text("garbage\n")
    assert ports.ephemeral_range(str(path)) == ports.DEFAULT_EPHEMERAL_RANGE
    assert ports.ephemeral_range(str(tmp_path / "missing")) == ports.DEFAULT_EPHEMERAL_RANGE


def test_free_ports_bind_lie_outside_the_ephemeral_range_and_do_not_repeat():
    span = ports.pick_span(ports.ephemeral_range())
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    if span is not None:
        assert all(span[0] <= p <= span[1] for p in picked), picked
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))  # free: a server can take it


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        draws = iter([busy, busy, free])
        monkeypatch.setattr(ports, "pick_span", lambda _range: (20000, 65535))
        monkeypatch.setattr(ports._random, "randint", lambda _a, _b: next(draws))
        monkeypatch.setattr(ports, "_given", set())
        assert ports.free_port() == free


def test_no_free_port_is_an_error_naming_the_host(monkeypatch):
    monkeypatch.setattr(ports, "_binds", lambda _host, _port: False)
    with pytest.raises(OSError, match="no free TCP port on 127.0.0.1 in 5 tries"):
        ports.free_port(attempts=5)
