"""Start the code sandbox service: `python -m sandbox --host 127.0.0.1 --port PORT`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(
        prog="python -m sandbox", description="HTTP service that runs untrusted code in bubblewrap."
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--workers", type=int, default=cores, help=f"runs at once (default: the {cores} usable cores)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait (then 503)")
    p.add_argument("--queue-timeout-s", type=float, default=60.0)
    p.add_argument(
        "--pool-size", type=int, default=None, help="pre-started sandboxes kept warm (default: 2 x workers; 0 disables)"
    )
    p.add_argument("--python", default="/usr/bin/python3", help="interpreter run inside")
    p.add_argument(
        "--python-package",
        action="append",
        default=None,
        metavar="NAME",
        help="host package made importable inside (repeatable; default: cyaron, colorful, xeger when installed)",
    )
    p.add_argument("--bwrap", default="/usr/bin/bwrap")
    p.add_argument("--max-timeout-s", type=float, default=30.0)
    p.add_argument("--max-memory-mb", type=int, default=4096)
    p.add_argument("--max-processes", type=int, default=32)
    p.add_argument("--uid-base", type=int, default=100_000, help="first host uid for sandboxes (when running as root)")
    p.add_argument("--no-cgroup", action="store_true", help="never use cgroup v2 limits")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ckpt_common.logs import setup_logging

    setup_logging(args.log_level)
    import uvicorn

    from .bwrap import DEFAULT_PYTHON_PACKAGES, probe_bwrap, python_package_binds
    from .config import SandboxConfig, ServiceConfig
    from .executor import Sandbox
    from .models import RunRequest
    from .service import create_app

    reason = probe_bwrap(args.bwrap)
    if reason is not None:
        logger.error("cannot start the sandbox service: %s", reason)
        return 2
    packages = python_package_binds(
        args.python_package or DEFAULT_PYTHON_PACKAGES, required=args.python_package is not None
    )
    sandbox_cfg = SandboxConfig(
        bwrap_path=args.bwrap,
        python_executable=args.python,
        python_lib_binds=packages,
        max_timeout_s=args.max_timeout_s,
        max_memory_mb=args.max_memory_mb,
        max_processes=args.max_processes,
        uid_base=args.uid_base,
        pool_size=2 * args.workers if args.pool_size is None else args.pool_size,
        use_cgroup="off" if args.no_cgroup else "auto",
    )
    service_cfg = ServiceConfig(
        host=args.host,
        port=args.port,
        num_workers=args.workers,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout_s,
        sandbox=sandbox_cfg,
    )
    try:
        sandbox = Sandbox(sandbox_cfg)
    except ValueError as exc:
        logger.error("cannot start the sandbox service: %s", exc)
        return 2
    try:
        # the first program also proves the bound python packages are importable inside
        imports = "".join(f"import {name.split('.')[0]}\n" for _, name in packages)
        try:
            check = sandbox.run(RunRequest(language="python", code=imports + "print(6 * 7)"))
        except RuntimeError as exc:
            logger.error("sandbox self-check failed: %s", exc)
            return 3
        if check.status != "ok" or check.stdout != "42\n":
            logger.error("sandbox self-check failed: %s", check)
            return 3
        health = sandbox.health()
        logger.info(
            "sandbox ready: languages=%s uid_isolation=%s cgroup=%s",
            health["languages"],
            health["uid_isolation"],
            health["cgroup"]["reason"],
        )
        # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the
        # handler that was there before it: make that a no-op so `finally` runs and we exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: logger.info("signal %d: stopped", signum))
        uvicorn.run(
            create_app(sandbox, service_cfg),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=False,
        )
    finally:
        sandbox.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
