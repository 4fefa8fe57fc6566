"""Optional cgroup v2 limits (memory.max, pids.max) per sandbox, used only where they work.

The configured root must be a cgroup2 directory we may write, with the `memory` and `pids`
controllers available to its children. Each run gets `<root>/sbx-<id>`; the sandbox's processes
are moved in while it waits for its request (its process tree is then still), and the cgroup is
killed and removed after the run. Where the probe fails (cgroup v1 hosts, read-only /sys/fs/cgroup
in containers) the sandbox relies on rlimits alone and /health says why.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)
_counter = itertools.count()


@dataclass(frozen=True)
class CgroupSupport:
    usable: bool
    reason: str


def is_cgroup2_mount(path: str, mounts_text: str) -> bool:
    """Whether `path` is at or under a cgroup2 mount listed in /proc/self/mounts text."""
    real = os.path.realpath(path)
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            mount_point = parts[1]
            if real == mount_point or real.startswith(mount_point.rstrip("/") + "/"):
                return True
    return False


def probe_cgroup_v2(root: str) -> CgroupSupport:
    """Try to prepare `root` for per-run child cgroups; say why not when it cannot be used."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = f.read()
    except OSError as exc:
        return CgroupSupport(False, f"cannot read /proc/self/mounts: {exc}")
    if not is_cgroup2_mount(root, mounts):
        return CgroupSupport(False, f"{root} is not a cgroup v2 mount (cgroup v1 or hybrid host)")
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            controllers = set(f.read().split())
        missing = {"memory", "pids"} - controllers
        if missing:
            return CgroupSupport(False, f"{root} lacks cgroup v2 controllers {sorted(missing)}")
        with open(os.path.join(root, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        if not {"memory", "pids"} <= enabled:
            with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
        test_dir = os.path.join(root, f"sbx-probe-{os.getpid()}")
        os.mkdir(test_dir)
        os.rmdir(test_dir)
    except OSError as exc:
        return CgroupSupport(False, f"cannot use cgroup v2 at {root}: {exc}")
    return CgroupSupport(True, f"cgroup v2 memory.max and pids.max under {root}")


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (via /proc/<pid>/task/<tid>/children)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            for tid in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue  # the process is gone
    return out


class RunCgroup:
    """One sandbox's cgroup: create with limits, attach its process tree, read OOM kills, remove."""

    def __init__(self, root: str, memory_bytes: int, max_processes: int) -> None:
        self.path = os.path.join(root, f"sbx-{os.getpid()}-{next(_counter)}")
        os.mkdir(self.path)
        self._write("memory.max", str(memory_bytes))
        if os.path.exists(os.path.join(self.path, "memory.swap.max")):
            self._write("memory.swap.max", "0")
        self._write("pids.max", str(max_processes))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def attach_tree(self, pid: int) -> None:
        for member in process_tree(pid):
            try:
                self._write("cgroup.procs", str(member))
            except ProcessLookupError:
                continue

    def oom_killed(self) -> bool:
        try:
            with open(os.path.join(self.path, "memory.events")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        except OSError:
            return False
        return False

    def remove(self, timeout_s: float = 3.0) -> None:
        """Kill whatever is left in the cgroup and remove it, within a deadline."""
        if os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                self._write("cgroup.kill", "1")
            except OSError as exc:
                logger.warning("cgroup.kill failed for %s: %s", self.path, exc)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    logger.warning("could not remove cgroup %s: %s", self.path, exc)
                    return
                time.sleep(0.01)  # polling for the kernel to empty the cgroup, bounded above
