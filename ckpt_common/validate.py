"""Field checks for config dataclasses' `__post_init__` (one wording everywhere: `field=value must be ...`).

Used by every package's configs (orchestrator, sandbox, vllm_ext's tiny model); `name` is what the
message calls the field, e.g. "rl.num_threads" or "PartialRolloutConfig.segment_max_tokens".
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import types
import typing
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


def check_qualname(name: str, value: Any) -> tuple[str, str]:
    """ValueError unless `value` is a ``"module:attr"`` string; returns ``(module, attr)``."""
    module_name, sep, attr = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not (sep and module_name and attr):
        raise ValueError(f"{name}={value!r} must look like 'module:attr'")
    return module_name, attr


def import_qualname(name: str, value: Any) -> Any:
    """The object a ``"module:attr"`` string names (imported now); ValueError naming `name` if it cannot."""
    module_name, attr = check_qualname(name, value)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{name}={value!r} cannot be loaded: {e}") from None


def _literal_choices(hint: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` hint (also inside ``X | None``), else None."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            choices = _literal_choices(arg)
            if choices is not None:
                return (*choices, None) if type(None) in typing.get_args(hint) else choices
    return None


@functools.cache
def _literal_fields(cls: type) -> tuple[tuple[str, tuple], ...]:
    hints = typing.get_type_hints(cls)
    fields = ((f.name, _literal_choices(hints.get(f.name))) for f in dataclasses.fields(cls))
    return tuple((name, choices) for name, choices in fields if choices is not None)


def choices_text(choices: tuple) -> str:
    """'a', 'b' or 'c'"""
    names = [repr(c) for c in choices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_literals(config: Any, prefix: str = "") -> None:
    """ValueError naming the first field of a config dataclass whose value is not one its ``Literal``
    annotation allows: ``{prefix}{field}={value!r} must be 'a', 'b' or 'c'``. One check for every
    choice field, read from the annotations, so the allowed values are written once."""
    for name, choices in _literal_fields(type(config)):
        value = getattr(config, name)
        if value not in choices:
            raise ValueError(f"{prefix}{name}={value!r} must be {choices_text(choices)}")
