"""Logging set-up for entry points: one format, the rank in every line."""

from __future__ import annotations

import logging


class RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(level: str | int = "INFO", rank: int | None = None) -> None:
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
