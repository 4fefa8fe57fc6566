"""Several hosts on one machine, for tests and benchmarks that must see a real network link.

Each host is a Linux network namespace with its own IP stack and loopback, joined to one bridge by a
veth pair; both directions of a host's link can be shaped to a stated rate with `tc qdisc ... tbf`
(egress of each end of the pair), and a partition is the host's link set down. A host's processes
run in its namespace and, through a holder process made with `unshare --mount --uts` and entered
with `nsenter`, with its own host name and its own /dev/shm (a tmpfs, shared by the host's processes
as on one machine), so nothing can cross between two hosts but the network: a daemon cannot find a
"local" path between them. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN); `Testbed.unavailable()`
says why not, for a test's skip.

    Testbed(["trainer", "inf0", "inf1"], rate_mbit=400)   ──▶ bridge ckb<id> on the root namespace,
      │                                                       10.<a>.<b>.0/24, a host per namespace
      ├─ host.popen(cmd, ...)     a process in the host (its namespace, host name, /dev/shm)
      ├─ host.counters()          bytes sent and received on its link (interface counters)
      ├─ host.partition() / heal()  its link down / up (both ends)
      └─ close()                  processes killed, namespaces, links and the bridge removed;
                                  also at interpreter exit and on SIGTERM, whatever the exit path

Traffic stays on the bridge and the namespaces the testbed made: the bridge has no address in the
root namespace and no route leads elsewhere.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_LIVE: list[Testbed] = []
_LIVE_LOCK = threading.Lock()
_COUNTER = itertools.count()


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


def _tc(*args: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["tc", *args]
    subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)


def _close_all() -> None:
    with _LIVE_LOCK:
        beds = list(_LIVE)
    for bed in beds:
        bed.close()


atexit.register(_close_all)


@dataclass(frozen=True)
class LinkCounters:
    """Bytes and packets one host's interface sent and received (its own view of its link)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(
            self.tx_bytes - other.tx_bytes,
            self.rx_bytes - other.rx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_packets - other.rx_packets,
        )


class Host:
    """One host of a testbed: a namespace, an address on the bridge, a link (see the module doc)."""

    def __init__(self, bed: Testbed, name: str, index: int):
        self.bed = bed
        self.name = name
        self.netns = f"{bed.prefix}-{name}"
        self.ip = f"{bed.subnet}.{index + 2}"
        self.inner_if = "eth0"  # inside the namespace
        self.outer_if = f"{bed.prefix}v{index}"  # its peer, on the bridge
        self.procs: list[subprocess.Popen] = []
        self._holder: subprocess.Popen | None = None

    def command(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` as it runs inside this host: its network, mount (own /dev/shm) and UTS namespaces,
        entered through the host's holder process (every process of a host shares one /dev/shm, as
        processes of one machine do)."""
        return ["nsenter", "-t", str(self._holder.pid), "-n", "-m", "-u", "--", *cmd]

    def _start_holder(self) -> None:
        """The process that keeps this host's mount and UTS namespaces (a tmpfs on /dev/shm, its name)."""
        inner = f"mount -t tmpfs -o size=8g tmpfs /dev/shm && hostname {shlex.quote(self.name)} && exec sleep 1000000"
        self._holder = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--propagation", "private"]
            + ["sh", "-c", inner],
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while True:
            out = subprocess.run(self.command(["hostname"]), capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip() == self.name:
                return
            if self._holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name}: its namespaces did not come up ({out.stderr.strip()})")
            time.sleep(0.05)

    def popen(self, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` in this host (its own process group, ended by `Testbed.close`)."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(cmd), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], timeout_s: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(cmd), timeout=timeout_s, **kwargs)

    def counters(self) -> LinkCounters:
        """This host's interface counters (bytes on its link, as the host itself counts them)."""
        values = []
        for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
            path = f"/sys/class/net/{self.inner_if}/statistics/{key}"
            out = subprocess.run(
                ["ip", "netns", "exec", self.netns, "cat", path], capture_output=True, text=True, timeout=10, check=True
            )
            values.append(int(out.stdout.strip()))
        return LinkCounters(*values)

    def partition(self) -> None:
        """Cut this host off the network (both ends of its link down): packets are lost, not refused."""
        _ip("link", "set", self.outer_if, "down")
        _ip("link", "set", self.inner_if, "down", netns=self.netns)

    def heal(self) -> None:
        """Its link back up, shaped as before."""
        _ip("link", "set", self.inner_if, "up", netns=self.netns)
        _ip("link", "set", self.outer_if, "up")

    def kill_processes(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                logger.warning("host %s: process %d did not end after SIGKILL", self.name, proc.pid)
        self.procs.clear()
        if self._holder is not None and self._holder.poll() is None:
            os.killpg(self._holder.pid, signal.SIGKILL)
            self._holder.wait(10)


class Testbed:
    """N hosts joined by a bridge, each link shaped to `rate_mbit` (None: not shaped) both ways."""

    __test__ = False  # not a pytest class, whatever its name

    def __init__(self, names: Sequence[str], *, rate_mbit: float | None = None, burst_kbit: int | None = None):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct and at least one, got {list(names)}")
        if len(names) > 200:
            raise ValueError(f"at most 200 hosts, got {len(names)}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit!r}")
        why = self.unavailable()
        if why:
            raise RuntimeError(f"the multi-host testbed cannot run here: {why}")
        n = next(_COUNTER)
        self.prefix = f"ck{os.getpid() % 10000}{n}"[:9]
        self.bridge = f"{self.prefix}br"
        tag = uuid.uuid4().int
        self.subnet = f"10.{200 + tag % 50}.{(tag >> 8) % 250 + 1}"
        self.rate_mbit = rate_mbit
        # the token bucket holds 10 ms at the rate (at least 256 kbit): what a kernel timer tick needs
        self.burst_kbit = burst_kbit or max(256, int((rate_mbit or 0) * 10))
        self.hosts: dict[str, Host] = {}
        self._closed = False
        with _LIVE_LOCK:
            _LIVE.append(self)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for index, name in enumerate(names):
                self._add_host(name, index)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def unavailable() -> str | None:
        """Why hosts cannot be made here (None: they can)."""
        if os.geteuid() != 0:
            return "it needs root (network namespaces, veth pairs, tc)"
        for tool in ("ip", "tc", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                return f"{tool!r} is not installed (iproute2, util-linux)"
        probe = f"ckprobe{os.getpid() % 100000}"
        out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            return f"'ip netns add' failed: {out.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        return None

    def _add_host(self, name: str, index: int) -> None:
        host = Host(self, name, index)
        self.hosts[name] = host
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.outer_if, "type", "veth", "peer", "name", f"{self.prefix}i{index}")
        _ip("link", "set", f"{self.prefix}i{index}", "netns", host.netns)
        _ip("link", "set", f"{self.prefix}i{index}", "name", host.inner_if, netns=host.netns)
        _ip("addr", "add", f"{host.ip}/24", "dev", host.inner_if, netns=host.netns)
        _ip("link", "set", "lo", "up", netns=host.netns)
        _ip("link", "set", host.inner_if, "up", netns=host.netns)
        _ip("link", "set", host.outer_if, "master", self.bridge)
        _ip("link", "set", host.outer_if, "up")
        if self.rate_mbit is not None:
            shape = ["root", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", f"{self.burst_kbit}kbit"]
            shape += ["latency", "100ms"]
            _tc("qdisc", "add", "dev", host.inner_if, *shape, netns=host.netns)  # what the host sends
            _tc("qdisc", "add", "dev", host.outer_if, *shape)  # what it receives
        host._start_holder()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process a host started, remove the namespaces, links and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            host.kill_processes()
        for host in self.hosts.values():
            _ip("link", "del", host.outer_if, check=False)  # its peer goes with it
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)

    def leftovers(self) -> list[str]:
        """What of this testbed still exists (namespaces, links): empty once closed."""
        out = _ip("netns", "list", check=False).stdout
        left = [line.split()[0] for line in out.splitlines() if line.startswith(self.prefix + "-")]
        links = _ip("-o", "link", "show", check=False).stdout
        left += [part.split(":")[1].strip().split("@")[0] for part in links.splitlines() if f" {self.prefix}" in part]
        return left


def wait_port(host: Host, port: int, timeout_s: float = 30.0) -> None:
    """Until something listens on `port` in `host` (a TCP connect from inside it succeeds)."""
    deadline = time.monotonic() + timeout_s
    probe = ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 1).close()"]
    while True:
        if host.run(probe, timeout_s=10).returncode == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port} of host {host.name} after {timeout_s:g} s")
        time.sleep(0.2)
