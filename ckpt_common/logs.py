"""Logging set-up for entry points: one format, the rank in every line."""

from __future__ import annotations

import argparse
import logging

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"


def check_log_level(field: str, value: object) -> None:
    """ValueError unless ``value`` is a logging level name in any case (a config's ``log_level`` field)."""
    if not isinstance(value, str) or value.upper() not in logging.getLevelNamesMapping():
        raise ValueError(f"{field}={value!r} must be a logging level name, e.g. INFO or DEBUG")


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    """The one `--log-level` flag of every entry point (any case: `debug` is DEBUG)."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=DEFAULT_LOG_LEVEL,
        help="logging level of this process (default: %(default)s)",
    )


class RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(level: str | int = DEFAULT_LOG_LEVEL, rank: int | None = None) -> None:
    """Configure the root logger once, in ``main()``: one format everywhere, the rank where there is one."""
    handler = logging.StreamHandler()
    prefix = "%(asctime)s "
    if rank is not None:
        handler.addFilter(RankFilter(rank))
        prefix += "[rank %(rank)s] "
    handler.setFormatter(logging.Formatter(prefix + "%(name)s %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
