"""Train SFT models into the cache ahead of the tests that need them.

    python -m testing.sft_warm --cache-dir .cache/sft MODULE:ATTR [MODULE:ATTR ...]

Each ``MODULE:ATTR`` names an ``SFTConfig``, or a function returning one; they are trained in order
(``trainer.sft.run_sft``: a cached one is skipped). The suite starts this in the background
(tests/conftest.py) while the tests that need no SFT model run; a fixture asking for a model still in
training waits on ``run_sft``'s lock instead of training a second copy. SIGTERM ends it through
``SystemExit``, so the unfinished entry's temporary folder is removed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.sft import SFTConfig


def resolve(spec: str) -> SFTConfig:
    """The ``SFTConfig`` that ``MODULE:ATTR`` names (ATTR a config, or a function returning one)."""
    from ckpt_common.validate import import_qualname
    from trainer.sft import SFTConfig

    obj = import_qualname("SFT config", spec)
    config = obj if isinstance(obj, SFTConfig) else obj()
    if not isinstance(config, SFTConfig):
        raise TypeError(f"{spec} gave {type(config).__name__}, not an SFTConfig")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.sft_warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", required=True, help="the SFT cache root the tests read")
    parser.add_argument("specs", nargs="+", metavar="MODULE:ATTR", help="an SFTConfig, or a function returning one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")

    from ckpt_common.procs import exit_on_signals
    from trainer.sft import run_sft

    exit_on_signals()
    configs = [resolve(spec) for spec in args.specs]  # every spec checked before the first training
    for spec, config in zip(args.specs, configs):
        logging.getLogger(__name__).info("%s -> %s", spec, run_sft(config, args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
