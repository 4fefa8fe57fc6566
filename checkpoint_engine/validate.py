"""Field checks for config dataclasses' `__post_init__` (one wording everywhere: `field=value must be ...`).

Used by every package's configs (orchestrator, sandbox, vllm_ext's tiny model); `name` is what the
message calls the field, e.g. "rl.num_threads" or "PartialRolloutConfig.segment_max_tokens".
"""

from __future__ import annotations

import math
from typing import Any


def check_int(name: str, value: Any, low: int = 1) -> None:
    """ValueError unless `value` is an int (not a bool) >= `low`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")


def check_number(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """ValueError unless `value` is a finite int or float (not a bool) > 0 (>= 0 with `allow_zero`)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r} must be a number {'>=' if allow_zero else '>'} 0")
