"""Train SFT models into the cache ahead of the tests that need them.

    python -m testing.sft_warm --cache-dir .cache/sft MODULE:ATTR [MODULE:ATTR ...]

Each ``MODULE:ATTR`` names an ``SFTConfig``, a function returning one, or a function that takes the
cache directory, trains into it (cached, under a lock: ``trainer.sft.cached_training``) and returns
the model directory; they are trained in order (a cached one is skipped). The suite starts this in the background
(tests/conftest.py) while the tests that need no SFT model run; a fixture asking for a model still in
training waits on ``run_sft``'s lock instead of training a second copy. SIGTERM ends it through
``SystemExit``, so the unfinished entry's temporary folder is removed.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Callable, Sequence


def resolve(spec: str) -> Callable[[str], object]:
    """What ``MODULE:ATTR`` names, as a function of the cache directory that trains (or finds) the model."""
    from ckpt_common.validate import import_qualname
    from trainer.sft import SFTConfig, run_sft

    obj = import_qualname("SFT config", spec)
    if callable(obj) and not isinstance(obj, SFTConfig) and inspect.signature(obj).parameters:
        return obj  # trains into the cache directory it is given
    config = obj if isinstance(obj, SFTConfig) else obj()
    if not isinstance(config, SFTConfig):
        raise TypeError(f"{spec} gave {type(config).__name__}, not an SFTConfig")
    return lambda cache_dir: run_sft(config, cache_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.sft_warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", required=True, help="the SFT cache root the tests read")
    parser.add_argument("specs", nargs="+", metavar="MODULE:ATTR", help="an SFTConfig, or a function returning one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")

    from ckpt_common.procs import exit_on_signals

    exit_on_signals()
    trainings = [resolve(spec) for spec in args.specs]  # every spec checked before the first training
    for spec, train in zip(args.specs, trainings):
        logging.getLogger(__name__).info("%s -> %s", spec, train(args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
