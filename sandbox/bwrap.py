"""The bubblewrap command line of one sandbox, and a probe that says whether bubblewrap runs here.

Each sandbox gets every namespace of its own (user, pid, net, ipc, uts, cgroup), a root built
from read-only binds of the system directories only (so /root, /home, /work and /etc are not
there), a private size-capped tmpfs at /tmp as the working directory, a fresh /proc of its own
pid namespace, a minimal /dev, an empty environment, no capabilities, and no further user
namespaces. The supervisor runs as pid 1 of the new pid namespace (`--as-pid-1`): signals from
inside cannot kill it, and when it exits (or is killed from outside) the kernel kills every other
process of the sandbox. `--die-with-parent` kills the sandbox when bwrap or the service dies.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Sequence

from .config import MIB, SandboxConfig

logger = logging.getLogger(__name__)
DEFAULT_PYTHON_PACKAGES = ("cyaron", "colorful", "xeger")  # what cyaron test generators need
SANDBOX_UID = 1000
SANDBOX_LIB_DIR = "/sandbox/lib"
RUNNER_DIR = "/sandbox/runner"
WORK_DIR = "/tmp"


def system_mount_args(
    paths: Sequence[str],
    *,
    exists: Callable[[str], bool] = os.path.lexists,
    is_link: Callable[[str], bool] = os.path.islink,
    readlink: Callable[[str], str] = os.readlink,
) -> list[str]:
    """Read-only binds of host system paths; top-level symlinks (/bin -> usr/bin) stay symlinks."""
    args: list[str] = []
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"system path must be absolute, got {path!r}")
        if not exists(path):
            continue
        if is_link(path) and os.path.dirname(path) == "/":
            args += ["--symlink", readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
    return args


def sandbox_argv(
    config: SandboxConfig, mount_args: Sequence[str], runner_dir: str | None = None, lib_dir: str | None = None
) -> list[str]:
    """The bwrap command up to (not including) the program to run inside; `runner_dir` (the
    supervisor and its bytecode) appears read-only at /sandbox/runner and `lib_dir` (the staged
    copies of config.python_lib_binds, see staging.py) at /sandbox/lib."""
    argv = [
        config.bwrap_path,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--die-with-parent",
        "--as-pid-1",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        *mount_args,
    ]
    for src, dest in config.extra_ro_binds:
        argv += ["--ro-bind", src, dest]
    if lib_dir is not None:
        argv += ["--ro-bind", lib_dir, SANDBOX_LIB_DIR]
    if runner_dir is not None:
        argv += ["--ro-bind", runner_dir, RUNNER_DIR]
    argv += [
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--proc",
        "/proc",
        "--size",
        str(config.tmpfs_size_mb * MIB),
        "--perms",
        "1777",
        "--tmpfs",
        WORK_DIR,
        "--remount-ro",
        "/",
        "--chdir",
        WORK_DIR,
    ]
    return argv


def visible_inside(path: str, config: SandboxConfig) -> bool:
    """Whether a host path is reachable inside the sandbox (under a system path or extra bind)."""
    roots = [p for p in config.system_paths] + [dest for _, dest in config.extra_ro_binds]
    real = os.path.realpath(path)
    for root in roots:
        for candidate in (path, real):
            if candidate == root or candidate.startswith(root.rstrip("/") + "/"):
                return True
    return False


def python_package_binds(names: Sequence[str], *, required: bool) -> tuple[tuple[str, str], ...]:
    """(host path, name under /sandbox/lib) of each package importable by this interpreter (the
    service copies them at start into a folder the sandbox's user can read: see staging.py).

    Missing packages raise ValueError when `required`, else are skipped with a warning."""
    import importlib.util

    out = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            if required:
                raise ValueError(f"python package {name!r} is not installed in this interpreter")
            logger.warning("python package %s is not installed: sandboxed code cannot import it", name)
            continue
        if spec.submodule_search_locations:
            out.append((list(spec.submodule_search_locations)[0], name))
        else:
            out.append((spec.origin, os.path.basename(spec.origin)))
    return tuple(out)


def probe_bwrap(bwrap_path: str = "/usr/bin/bwrap", timeout_s: float = 20.0) -> str | None:
    """None when bubblewrap can build an unprivileged sandbox here, else the reason it cannot."""
    if not os.path.exists(bwrap_path):
        return f"bubblewrap not found at {bwrap_path} (apt install bubblewrap)"
    argv = [
        bwrap_path,
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        *system_mount_args(("/usr", "/bin", "/lib", "/lib64")),
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--",
        "/bin/true",
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout_s, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap failed to start: {exc}"
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        return f"bubblewrap cannot create namespaces here (exit {proc.returncode}): {err}"
    return None
