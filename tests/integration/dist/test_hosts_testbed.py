"""The multi-host testbed (testing/hosts.py): real links between network namespaces, shaped, counted,
partitioned, and nothing left behind.

Three hosts on a bridge, every link shaped to 200 Mbit/s both ways. One host sends 16 MiB to another
over TCP: the transfer takes about 16 MiB / 200 Mbit/s (0.85-1.1 of it: the rate is a real limit),
each end's interface counters show the bytes (sent by one, received by the other, the third sees
none of them), /dev/shm and the host name are each host's own, and a partitioned host cannot be
reached until its link is back.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from testing.hosts import Testbed, wait_port

RATE_MBIT = 200
PAYLOAD_BYTES = 16 << 20

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(4)
while True:
    c, _ = s.accept(); n = 0
    while (b := c.recv(1 << 20)):
        n += len(b)
    c.sendall(str(n).encode()); c.close()
"""
CLIENT = """
import socket, sys, time
n = int(sys.argv[3]); buf = b"x" * (1 << 20)
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
t0 = time.perf_counter(); sent = 0
while sent < n:
    sent += c.send(buf[: min(len(buf), n - sent)])
c.shutdown(socket.SHUT_WR); got = int(c.recv(64)); print(got, time.perf_counter() - t0)
"""

pytestmark = pytest.mark.skipif(bool(Testbed.unavailable()), reason=f"no testbed here: {Testbed.unavailable()}")


def test_hosts_are_separate_and_their_links_shaped_counted_and_partitioned():
    with Testbed(["a", "b", "c"], rate_mbit=RATE_MBIT) as bed:
        a, b, c = bed["a"], bed["b"], bed["c"]
        # each host its own name and /dev/shm: a file one writes there, the other cannot see
        assert a.run(["hostname"]).stdout.strip() == "a"
        assert a.run(["sh", "-c", "echo 1 > /dev/shm/ckpt-testbed-probe && ls /dev/shm"]).stdout.split() == [
            "ckpt-testbed-probe"
        ]
        assert b.run(["ls", "/dev/shm"]).stdout.split() == []

        server = b.popen([sys.executable, "-c", SERVER, "7100"])
        wait_port(b, 7100)
        before = {h.name: h.counters() for h in (a, b, c)}
        out = a.run([sys.executable, "-c", CLIENT, b.ip, "7100", str(PAYLOAD_BYTES), "30"], timeout_s=60)
        assert out.returncode == 0, out.stderr
        got, seconds = out.stdout.split()
        assert int(got) == PAYLOAD_BYTES
        limit_s = PAYLOAD_BYTES * 8 / (RATE_MBIT * 1e6)
        ratio = float(seconds) / limit_s
        print(f"16 MiB over a {RATE_MBIT} Mbit/s link: {float(seconds):.3f} s, {ratio:.2f}x the link's limit")
        assert 0.85 <= ratio <= 1.6, ratio  # the shaper is a limit: never much faster, not far slower
        delta = {h.name: h.counters() - before[h.name] for h in (a, b, c)}
        assert PAYLOAD_BYTES <= delta["a"].tx_bytes <= 1.1 * PAYLOAD_BYTES, delta
        assert PAYLOAD_BYTES <= delta["b"].rx_bytes <= 1.1 * PAYLOAD_BYTES, delta
        assert delta["c"].rx_bytes < 0.01 * PAYLOAD_BYTES, delta  # a bridge learns: nothing floods to c

        b.partition()
        t0 = time.monotonic()
        out = a.run([sys.executable, "-c", CLIENT, b.ip, "7100", "1000", "2"], timeout_s=30)
        assert out.returncode != 0 and "timed out" in out.stderr, out  # lost, not refused
        assert time.monotonic() - t0 < 20
        b.heal()
        out = a.run([sys.executable, "-c", CLIENT, b.ip, "7100", "1000", "10"], timeout_s=30)
        assert out.returncode == 0 and out.stdout.split()[0] == "1000", out
        prefix = bed.prefix
        assert server.poll() is None
    assert server.poll() is not None  # the host's processes end with the testbed
    assert not bed.leftovers(), bed.leftovers()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in names


def test_a_failed_set_up_removes_what_it_made():
    with pytest.raises(ValueError, match="distinct"):
        Testbed(["x", "x"])
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    bed = Testbed(["p", "q"])
    bed["p"].popen(["sleep", "600"])
    bed.close()
    bed.close()  # idempotent
    assert not bed.leftovers()
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before
