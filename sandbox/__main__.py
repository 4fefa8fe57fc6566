"""Start the code sandbox service: `python -m sandbox --host 127.0.0.1 --port PORT` (`ckpt-sandbox`).

The flags are ServiceConfig's fields and a few of SandboxConfig's (sandbox/config.py: defaults and
help live there); this command's own defaults: --workers is the usable cores, --pool-size 2 x
--workers. --python-package and --no-cgroup are not config fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from ckpt_common.cli_config import ConfigArgs, add_config_args

from .config import ServiceConfig

logger = logging.getLogger(__name__)

# the SandboxConfig fields a command line sets (the others keep the dataclass's defaults)
SANDBOX_FLAGS = (
    "python_executable",
    "bwrap_path",
    "max_timeout_s",
    "max_memory_mb",
    "max_processes",
    "uid_base",
    "pool_size",
    "use_cgroup",
)


def _parser() -> tuple[argparse.ArgumentParser, ConfigArgs]:
    from .bwrap import DEFAULT_PYTHON_PACKAGES

    p = argparse.ArgumentParser(
        prog="python -m sandbox",
        description="HTTP service that runs untrusted code in bubblewrap.",
        epilog=__doc__.split("\n", 2)[2],
    )
    own = [f.name for f in dataclasses.fields(ServiceConfig) if f.name != "sandbox"]
    spec = add_config_args(
        p,
        ServiceConfig,
        only=(*own, *(f"sandbox.{name}" for name in SANDBOX_FLAGS)),
        flatten=("sandbox",),
        rename={
            "num_workers": "workers",
            "sandbox.python_executable": "python",
            "sandbox.bwrap_path": "bwrap",
            "sandbox.use_cgroup": "cgroup",
        },
        # computed when the command runs: None becomes 2 x --workers in parse_config()
        defaults={"num_workers": len(os.sched_getaffinity(0)), "sandbox.pool_size": None},
    )
    p.add_argument("--no-cgroup", action="store_true", help="never use cgroup v2 limits (the same as --cgroup off)")
    p.add_argument(
        "--python-package",
        action="append",
        metavar="NAME",
        help="host package made importable inside (repeatable; default: "
        f"{', '.join(DEFAULT_PYTHON_PACKAGES)} when installed)",
    )
    return p, spec


def _dest(spec: ConfigArgs, field_path: str) -> str:
    """The argparse dest of a config field's flag."""
    return spec.flag_for(field_path).removeprefix("--").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    return _parser()[0]


def parse_config(argv: list[str] | None = None) -> tuple[ServiceConfig, argparse.Namespace]:
    """The service's config from the command line (python_lib_binds still empty: main() resolves
    --python-package), and the parsed arguments. A bad value exits 2 naming the flag."""
    parser, spec = _parser()
    args = parser.parse_args(argv)
    if args.no_cgroup:
        setattr(args, _dest(spec, "sandbox.use_cgroup"), "off")
    pool_size = _dest(spec, "sandbox.pool_size")
    if getattr(args, pool_size) is None:
        setattr(args, pool_size, 2 * getattr(args, _dest(spec, "num_workers")))
    return spec.build(args, parser), args


def main(argv: list[str] | None = None) -> int:
    config, args = parse_config(argv)
    from ckpt_common.logs import setup_logging

    setup_logging(config.log_level)
    from .bwrap import DEFAULT_PYTHON_PACKAGES, probe_bwrap, python_package_binds
    from .executor import Sandbox
    from .models import RunRequest
    from .service import serve

    reason = probe_bwrap(config.sandbox.bwrap_path)
    if reason is not None:
        logger.error("cannot start the sandbox service: %s", reason)
        return 2
    try:
        packages = python_package_binds(
            args.python_package or DEFAULT_PYTHON_PACKAGES, required=args.python_package is not None
        )
        config = dataclasses.replace(config, sandbox=dataclasses.replace(config.sandbox, python_lib_binds=packages))
        sandbox = Sandbox(config.sandbox)
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
        serve(sandbox, config)  # until SIGTERM / SIGINT
    finally:
        sandbox.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
